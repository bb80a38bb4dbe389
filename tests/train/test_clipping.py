"""Gradient clipping by the global norm (``training.clip_grad_norm``, distmis.train.clipping): torch's rule against
``torch.nn.utils.clip_grad_norm_``, TensorFlow's against it (one replica, under a loss scale, and two replicas whose
shares are summed), and each trainer's step, whose update is the clipped gradient. Across a pipeline's ranks:
``tests/parallel/test_precision_parallel.py``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from distmis.search.prepare import prepare_data
from distmis.spec import validate_spec
from distmis.train.clipping import clip_factor, clip_tf_gradients, clip_torch_gradients
from tests.conftest import small_spec_tree

GRADS = [np.array([3.0, -4.0, 1.0], np.float32), np.array([[2.0, 0.5], [-1.0, 6.0]], np.float32)]  # norm 8.66


def parameters(grads) -> list[torch.nn.Parameter]:
    out = []
    for grad in grads:
        p = torch.nn.Parameter(torch.zeros(grad.shape))
        p.grad = torch.tensor(grad)
        out.append(p)
    return out


@pytest.mark.parametrize("max_norm", [2.0, 100.0])  # clipped, and left as it is
def test_torch_clipping_is_clip_grad_norm(max_norm: float):
    ours, reference = parameters(GRADS), parameters(GRADS)
    norm = clip_torch_gradients(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(reference, max_norm)
    torch.testing.assert_close(norm, expected)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    total = np.sqrt(sum(float((g ** 2).sum()) for g in GRADS))
    assert clip_factor(total, max_norm) == pytest.approx(min(1.0, max_norm / total))


@pytest.mark.parametrize("loss_scale", [1.0, 1024.0])
def test_tensorflow_clipping_on_one_replica_is_torchs_rule(loss_scale: float):
    import tensorflow as tf

    reference = parameters(GRADS)
    torch.nn.utils.clip_grad_norm_(reference, 2.0)
    scaled = [tf.constant(g * loss_scale) for g in GRADS]  # fp16's gradients still carry the loss scale
    clipped = clip_tf_gradients([*scaled, None], 2.0, loss_scale=loss_scale)
    assert clipped[-1] is None
    for ours, theirs in zip(clipped, reference):
        np.testing.assert_allclose(ours.numpy() / loss_scale, theirs.grad.numpy(), rtol=1e-6)


@pytest.mark.slow  # a TensorFlow process of its own, with two logical CPUs
def test_tensorflow_replicas_clip_by_the_norm_of_their_summed_gradient(tmp_path: Path):
    script = textwrap.dedent("""
        import numpy as np, tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        from distmis.train.clipping import clip_tf_gradients
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        shares = tf.constant([[3.0, -4.0, 1.0], [1.0, 0.0, 2.0]])  # replica r's share: row r

        @tf.function
        def step():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            return clip_tf_gradients([tf.gather(shares, replica)], 2.0, replicas=2)[0]

        out = strategy.experimental_local_results(strategy.run(step))
        print(np.sum([o.numpy() for o in out], axis=0).tolist())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summed = np.array(eval(done.stdout.strip().splitlines()[-1]))  # noqa: S307 - a list this test printed
    whole = np.array([4.0, -4.0, 3.0])  # the trial's gradient, norm 6.4: clipped to 2
    np.testing.assert_allclose(summed, whole * 2.0 / (np.linalg.norm(whole) + 1e-6), rtol=1e-6)


# --------------------------------------------------------------------------- the trainers' steps
@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clipping")
    spec = validate_spec(small_spec_tree(tmp / "data"))
    return spec, prepare_data(spec, tmp / "out", progress=False).tfrecord_dir


def clipped_sgd(spec, framework: str):
    """Plain SGD at lr 1 (no momentum, no decay), the gradient clipped to 1e-3: a step moves the weights by
    exactly the clipped gradient, of norm 1e-3 (a loss's gradient at initialisation is far larger)."""
    tree = spec.model_dump(mode="json")
    tree["model"]["framework"] = framework
    tree["training"].update(optimizer={"name": "sgd", "lr": 1.0, "momentum": 0.0}, clip_grad_norm=1e-3,
                            steps_per_epoch=1)
    return validate_spec(tree)


def moved(before, after) -> float:
    return float(np.sqrt(sum(((np.asarray(a) - np.asarray(b)) ** 2).sum() for a, b in zip(before, after))))


def test_the_torch_trainers_step_is_the_clipped_gradient(prepared):
    from tests.train.torch_trainers import local_trainer

    spec, tfrecords = prepared
    trainer = local_trainer(clipped_sgd(spec, "torch"), tfrecords)
    before = [p.detach().clone().numpy() for p in trainer.model.parameters()]
    trainer.train_epoch()
    after = [p.detach().numpy() for p in trainer.model.parameters()]
    assert moved(before, after) == pytest.approx(1e-3, rel=1e-3)


def test_the_tensorflow_trainers_step_is_the_clipped_gradient(prepared):
    from distmis.spec.layout import resolve_layout
    from distmis.train.tf_unet import UNetTrainer

    spec, tfrecords = prepared
    sgd = clipped_sgd(spec, "tensorflow")
    trainer = UNetTrainer(sgd, tfrecords, layout=resolve_layout(sgd))
    x, y = next(iter(trainer.train_data))
    before = [np.asarray(v.numpy()) for v in trainer.model.trainable_variables]
    trainer._train_step(x, y)
    after = [np.asarray(v.numpy()) for v in trainer.model.trainable_variables]
    assert moved(before, after) == pytest.approx(1e-3, rel=1e-3)
