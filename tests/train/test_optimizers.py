"""The optimizers of ``training.optimizer`` (distmis.train.optimizers): the registry against the schema, each update
rule against a hand computation in numpy on a tiny parameter vector with fixed gradients, in torch and in Keras, and
the optimizer each trainer builds, steps and resumes."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import numpy as np
import pytest
import torch

from distmis.search.prepare import prepare_data
from distmis.spec import validate_spec
from distmis.spec.schema import DEFAULT_WEIGHT_DECAY, OPTIMIZER_FIELDS, OptimizerName, OptimizerSpec
from distmis.train.optimizers import OPTIMIZERS, keras_optimizer, optimizer_entry, torch_optimizer, with_l2
from tests.conftest import small_spec_tree

W0 = np.array([0.5, -1.25, 2.0, 0.0, 3.0])
#: a gradient per step, fixed (the weights' own gradients would need a loss: these are what the optimizer is given)
GRADS = np.array([[0.1, -0.2, 0.3, 0.05, -0.4],
                  [0.2, 0.1, -0.3, 0.0, 0.1],
                  [-0.1, 0.3, 0.2, -0.05, 0.2]])
LR = 0.125  # exact in float32, as Keras keeps its learning rate


def f32(value: float) -> float:
    """``value`` rounded to float32: Keras casts some Python-float hyperparameters to the weights' float64 through
    float32 (SGD's momentum, the betas of Adam's bias corrections, the decoupled decay), so the hand computation of
    a Keras step uses them so rounded (1e-8 relative: nothing a float32 network would see)."""
    return float(np.float32(value))


# --------------------------------------------------------------------------- hand computation
def sgd_by_hand(w: np.ndarray, grads: np.ndarray, lr: float, momentum: float, nesterov: bool,
                weight_decay: float, *, decoupled: bool = False) -> np.ndarray:
    """torch's SGD (dampening 0): the L2 term in the gradient, the buffer b = mu b + g (b = g at the first step).
    ``decoupled``: the decay outside the momentum instead, w -= lr * wd * w (what Keras's own weight_decay does)."""
    w, b = w.copy(), None
    for g in grads:
        if decoupled:
            w = w - lr * weight_decay * w
        else:
            g = g + weight_decay * w
        b = g.copy() if b is None else momentum * b + g
        w = w - lr * (g + momentum * b if nesterov else b)
    return w


def adam_by_hand(w: np.ndarray, grads: np.ndarray, lr: float, *, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-7, weight_decay: float = 0.0, decoupled: bool = False,
                 keras: bool = False) -> np.ndarray:
    """Adam as torch steps it: weight decay as L2 in the gradient, or ``decoupled``, w -= lr * wd * w before the
    update (AdamW). ``keras``: as Keras steps it, epsilon added to sqrt(v) before v's bias correction (and its
    float32 roundings, :func:`f32`)."""
    w, m, v = w.copy(), np.zeros_like(w), np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        if decoupled:
            w = w - lr * (f32(weight_decay) if keras else weight_decay) * w
        else:
            g = g + weight_decay * w
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        if keras:
            w = w - lr * np.sqrt(1 - f32(beta2) ** t) / (1 - f32(beta1) ** t) * m / (np.sqrt(v) + eps)
        else:
            w = w - lr / (1 - beta1 ** t) * m / (np.sqrt(v) / np.sqrt(1 - beta2 ** t) + eps)
    return w


def torch_steps(spec: OptimizerSpec, grads: np.ndarray = GRADS, lr: float = LR) -> np.ndarray:
    """The weights after the torch optimizer of ``spec`` stepped ``grads`` from :data:`W0` (float64)."""
    weight = torch.nn.Parameter(torch.tensor(W0, dtype=torch.float64))
    optimizer = torch_optimizer([weight], spec, lr)
    for g in grads:
        weight.grad = torch.tensor(g, dtype=torch.float64)
        optimizer.step()
    return weight.detach().numpy()


def keras_steps(spec: OptimizerSpec, grads: np.ndarray = GRADS, lr: float = LR) -> np.ndarray:
    """The same with the Keras optimizer of ``spec``, its coupled L2 added as the TensorFlow trainer's step adds it."""
    import keras
    import tensorflow as tf

    weight = keras.Variable(W0, dtype="float64")
    optimizer = keras_optimizer(spec, lr)
    l2 = optimizer_entry(spec.name).gradient_l2(spec)
    for g in grads:
        [grad] = with_l2([tf.constant(g, dtype=tf.float64)], [weight], l2, optimizer=optimizer)
        optimizer.apply_gradients([(grad, weight)])
    return np.asarray(weight.numpy())


# --------------------------------------------------------------------------- the registry
def test_the_registry_and_the_schema_name_the_same_optimizers():
    names = set(get_args(OptimizerName))
    assert names == set(OPTIMIZERS) == set(OPTIMIZER_FIELDS) == set(DEFAULT_WEIGHT_DECAY) == {"adam", "adamw", "sgd"}
    assert all(entry.name == name for name, entry in OPTIMIZERS.items())
    every_field = {field for fields in OPTIMIZER_FIELDS.values() for field in fields}
    assert every_field | {"name", "lr"} == set(OptimizerSpec.model_fields)


def test_an_unknown_optimizer_names_the_registered_ones():
    with pytest.raises(ValueError, match="no optimizer 'rmsprop'; registered: adam, adamw, sgd"):
        optimizer_entry("rmsprop")


def test_only_the_coupled_optimizers_add_l2_to_keras_gradients():
    assert optimizer_entry("sgd").gradient_l2(OptimizerSpec(name="sgd", weight_decay=3e-5)) == 3e-5
    assert optimizer_entry("adam").gradient_l2(OptimizerSpec(weight_decay=1e-4)) == 1e-4
    assert optimizer_entry("adam").gradient_l2(OptimizerSpec()) == 0.0
    assert optimizer_entry("adamw").gradient_l2(OptimizerSpec(name="adamw", weight_decay=0.1)) == 0.0  # Keras's own


# --------------------------------------------------------------------------- the update rules, by hand
NNUNET_SGD = OptimizerSpec(name="sgd", weight_decay=3e-5)  # momentum 0.99 and Nesterov: the defaults


def test_torch_sgd_is_nesterov_momentum_with_l2_through_it():
    expected = sgd_by_hand(W0, GRADS, LR, momentum=0.99, nesterov=True, weight_decay=3e-5)
    np.testing.assert_allclose(torch_steps(NNUNET_SGD), expected, rtol=0, atol=1e-12)
    # the decay shows at this precision: without it, or with it outside the momentum, the weights differ
    without = sgd_by_hand(W0, GRADS, LR, momentum=0.99, nesterov=True, weight_decay=0.0)
    assert np.abs(expected - without).max() > 1e-6
    decoupled = sgd_by_hand(W0, GRADS, LR, momentum=0.99, nesterov=True, weight_decay=3e-5, decoupled=True)
    assert np.abs(expected - decoupled).max() > 1e-7
    plain = sgd_by_hand(W0, GRADS, LR, momentum=0.99, nesterov=False, weight_decay=3e-5)
    assert np.abs(expected - plain).max() > 1e-3


def test_keras_sgd_steps_the_same_weights_as_torch_at_a_constant_rate():
    expected = sgd_by_hand(W0, GRADS, LR, momentum=f32(0.99), nesterov=True, weight_decay=3e-5)
    np.testing.assert_allclose(keras_steps(NNUNET_SGD), expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(keras_steps(NNUNET_SGD), torch_steps(NNUNET_SGD), rtol=0, atol=1e-8)  # the rounding
    spec = OptimizerSpec(name="sgd", momentum=0.5, nesterov=False, weight_decay=1e-2)  # 0.5: no rounding
    np.testing.assert_allclose(keras_steps(spec), sgd_by_hand(W0, GRADS, LR, 0.5, False, 1e-2), rtol=0, atol=1e-12)
    np.testing.assert_allclose(keras_steps(spec), torch_steps(spec), rtol=0, atol=1e-12)
    spec = OptimizerSpec(name="sgd", momentum=0, weight_decay=1e-2)  # plain SGD (Nesterov off without momentum)
    np.testing.assert_allclose(keras_steps(spec), sgd_by_hand(W0, GRADS, LR, 0.0, False, 1e-2), rtol=0, atol=1e-12)
    np.testing.assert_allclose(torch_steps(spec), keras_steps(spec), rtol=0, atol=1e-12)


def test_adamw_decays_the_weights_apart_from_the_update_in_both_frameworks():
    spec = OptimizerSpec(name="adamw", weight_decay=0.05)
    torch_expected = adam_by_hand(W0, GRADS, LR, weight_decay=0.05, decoupled=True)
    np.testing.assert_allclose(torch_steps(spec), torch_expected, rtol=0, atol=1e-12)
    keras_expected = adam_by_hand(W0, GRADS, LR, weight_decay=0.05, decoupled=True, keras=True)
    np.testing.assert_allclose(keras_steps(spec), keras_expected, rtol=0, atol=1e-12)
    coupled = adam_by_hand(W0, GRADS, LR, weight_decay=0.05, decoupled=False)
    assert np.abs(torch_expected - coupled).max() > 1e-3  # decoupled is not L2
    # the default decay is torch's 0.01; with a negligible epsilon the frameworks step the same weights (to Keras's
    # float32 betas in the bias corrections)
    default = OptimizerSpec(name="adamw", epsilon=1e-12)
    assert default.effective_weight_decay == 0.01
    np.testing.assert_allclose(keras_steps(default), torch_steps(default), rtol=0, atol=1e-5)
    np.testing.assert_allclose(torch_steps(default),
                               adam_by_hand(W0, GRADS, LR, eps=1e-12, weight_decay=0.01, decoupled=True), atol=1e-12)


def test_adam_weight_decay_is_l2_in_the_gradient_in_both_frameworks():
    spec = OptimizerSpec(weight_decay=0.05)
    np.testing.assert_allclose(torch_steps(spec), adam_by_hand(W0, GRADS, LR, weight_decay=0.05), rtol=0, atol=1e-12)
    np.testing.assert_allclose(keras_steps(spec), adam_by_hand(W0, GRADS, LR, weight_decay=0.05, keras=True),
                               rtol=0, atol=1e-12)
    # the spec that has always been: Adam without decay
    np.testing.assert_allclose(torch_steps(OptimizerSpec()), adam_by_hand(W0, GRADS, LR), rtol=0, atol=1e-12)


def test_amsgrad_reaches_both_frameworks():
    spec = OptimizerSpec(name="adamw", amsgrad=True)
    assert torch_optimizer([torch.nn.Parameter(torch.zeros(2))], spec, 1e-3).param_groups[0]["amsgrad"] is True
    assert keras_optimizer(spec, 1e-3).amsgrad is True


def test_the_l2_term_under_a_loss_scale_is_the_unscaled_one():
    """fp16's LossScaleOptimizer: the gradients given to apply_gradients are scaled, and so must the L2 term be."""
    import keras
    import tensorflow as tf

    spec = OptimizerSpec(name="sgd", momentum=0.9, weight_decay=0.05)
    weight = keras.Variable(W0.astype(np.float32))
    optimizer = keras.optimizers.LossScaleOptimizer(keras_optimizer(spec, LR))
    optimizer.build([weight])
    scale = float(optimizer.dynamic_scale.numpy())
    assert scale > 1
    for g in GRADS:
        scaled = tf.constant(g * scale, dtype=tf.float32)  # what the tape gives for the scaled loss
        [grad] = with_l2([scaled], [weight], optimizer_entry("sgd").gradient_l2(spec), optimizer=optimizer)
        optimizer.apply_gradients([(grad, weight)])
    expected = sgd_by_hand(W0, GRADS, LR, momentum=0.9, nesterov=True, weight_decay=0.05)
    np.testing.assert_allclose(weight.numpy(), expected, rtol=1e-6, atol=1e-6)


def test_each_replica_adds_its_share_of_the_l2_term():
    import keras
    import tensorflow as tf

    weight = keras.Variable(np.float32([2.0, -4.0]))
    optimizer = keras.optimizers.SGD(learning_rate=0.1)
    [grad] = with_l2([tf.zeros(2)], [weight], 0.5, optimizer=optimizer, replicas=4)
    np.testing.assert_allclose(grad.numpy(), [0.25, -0.5])  # 0.5 * w / 4: the four replicas' sum is 0.5 * w
    assert with_l2([None], [weight], 0.5, optimizer=optimizer) == [None]


# --------------------------------------------------------------------------- the trainers' optimizers
@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("optimizers")
    spec = validate_spec(small_spec_tree(tmp / "data"))
    return spec, prepare_data(spec, tmp / "out", progress=False)


def with_optimizer(spec, framework: str, **optimizer):
    tree = spec.model_dump(mode="json")
    tree["model"]["framework"] = framework
    tree["training"]["optimizer"] = optimizer
    return validate_spec(tree)


def test_the_torch_trainer_steps_and_resumes_the_optimizer_of_its_spec(prepared, tmp_path: Path):
    from tests.train.torch_trainers import local_trainer

    spec, data = prepared
    sgd = with_optimizer(spec, "torch", name="sgd", lr=1.0e-2, weight_decay=3.0e-5)
    trainer = local_trainer(sgd, data.tfrecord_dir)
    assert type(trainer.optimizer) is torch.optim.SGD
    [group] = trainer.optimizer.param_groups
    assert (group["lr"], group["momentum"], group["nesterov"], group["weight_decay"], group["dampening"]) == (
        1.0e-2, 0.99, True, 3.0e-5, 0.0)
    assert len(group["params"]) == len(list(trainer.model.parameters()))
    trainer.train_epoch()
    buffers = [trainer.optimizer.state[p]["momentum_buffer"] for p in trainer.model.parameters()]
    assert all(b is not None for b in buffers) and trainer._training_state_bytes() > 0
    trainer.save_state(tmp_path)
    resumed = local_trainer(sgd, data.tfrecord_dir)
    resumed.load_state(tmp_path, epoch=1)
    for p, b in zip(resumed.model.parameters(), buffers):
        assert torch.equal(resumed.optimizer.state[p]["momentum_buffer"], b)

    adamw = local_trainer(with_optimizer(spec, "torch", name="adamw", lr=1.0e-3), data.tfrecord_dir)
    assert type(adamw.optimizer) is torch.optim.AdamW
    assert adamw.optimizer.param_groups[0]["weight_decay"] == 0.01
    adam = local_trainer(with_optimizer(spec, "torch", lr=1.0e-3), data.tfrecord_dir)
    assert type(adam.optimizer) is torch.optim.Adam
    assert (adam.optimizer.param_groups[0]["eps"], adam.optimizer.param_groups[0]["weight_decay"]) == (1e-7, 0.0)


def test_the_tensorflow_trainers_step_adds_the_l2_term_through_the_momentum(prepared, tmp_path: Path):
    """One step of the TensorFlow trainer's traced training step with SGD: w1 = w0 - lr (1 + mu) (g + wd w0) at the
    first step (Nesterov, the buffer starting at the gradient), g the loss's gradient at w0."""
    import keras
    import tensorflow as tf

    from distmis.spec.layout import resolve_layout
    from distmis.train.tf_unet import UNetTrainer

    spec, data = prepared
    sgd = with_optimizer(spec, "tensorflow", name="sgd", lr=1.0e-2, weight_decay=0.1)
    trainer = UNetTrainer(sgd, data.tfrecord_dir, layout=resolve_layout(sgd))
    optimizer = trainer.optimizer
    assert type(optimizer) is keras.optimizers.SGD
    assert (optimizer.momentum, optimizer.nesterov, optimizer.weight_decay) == (0.99, True, None)  # L2: the step's
    x, y = next(iter(trainer.train_data))
    model = trainer.model
    before = [np.asarray(v.numpy()) for v in model.trainable_variables]
    with tf.GradientTape() as tape:
        loss = trainer.loss_fn(y, model(x, training=True))
    grads = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    trainer._train_step(x, y)
    after = [np.asarray(v.numpy()) for v in model.trainable_variables]
    decay = [-1.0e-2 * 1.99 * 0.1 * w0 for w0 in before]  # what the L2 term alone moves
    assert max(np.abs(d).max() for d in decay) > 1e-4
    for w0, w1, g in zip(before, after, grads):
        np.testing.assert_allclose(w1, w0 - 1.0e-2 * 1.99 * (g + 0.1 * w0), rtol=1e-4, atol=1e-6)

    trainer.save_state(tmp_path)  # SGD's momentum among the optimizer's variables, and back
    resumed = UNetTrainer(sgd, data.tfrecord_dir, layout=resolve_layout(sgd))
    resumed.load_state(tmp_path, epoch=1)
    assert len(resumed.optimizer.variables) == len(optimizer.variables) > len(model.trainable_variables)
    for a, b in zip(optimizer.variables, resumed.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a.numpy()), np.asarray(b.numpy()))

    adamw = with_optimizer(spec, "tensorflow", name="adamw", lr=1.0e-3, weight_decay=0.02)
    built = UNetTrainer(adamw, data.tfrecord_dir, layout=resolve_layout(adamw)).optimizer
    assert type(built) is keras.optimizers.AdamW and built.weight_decay == 0.02


def test_a_kept_tensorflow_trainer_is_restarted_only_for_the_same_optimizer(tmp_path: Path):
    """The optimizer and its decay are part of the TensorFlow trainer's graphs (the L2 term is traced into the step):
    a kept trainer restarts for another learning rate, never for another optimizer or weight decay."""
    from distmis.train.tf_unet import graph_key

    def spec_of(**optimizer):
        tree = small_spec_tree(tmp_path / "data")
        tree["training"]["optimizer"] = optimizer
        return validate_spec(tree)

    sgd = graph_key(spec_of(name="sgd", lr=1e-2, weight_decay=3e-5))
    assert graph_key(spec_of(name="sgd", lr=1e-3, weight_decay=3e-5)) == sgd
    assert graph_key(spec_of(name="sgd", lr=1e-2)) != sgd
    assert graph_key(spec_of(name="adam", lr=1e-2, weight_decay=3e-5)) != sgd
    assert graph_key(spec_of(name="adamw", lr=1e-2)) != graph_key(spec_of(name="adam", lr=1e-2))
