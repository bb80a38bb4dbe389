"""The U-Net trainer on real TFRecords made from a tiny synthetic dataset."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from distmis.search.prepare import prepare_data
from distmis.spec import validate_spec
from distmis.spec.layout import resolve_layout
from distmis.train.compile_choice import CompileChoice
from distmis.train.tf_unet import NonFiniteLossError, UNetTrainer
from tests.conftest import small_spec_tree


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer")
    spec = validate_spec(small_spec_tree(tmp / "data"))
    return spec, prepare_data(spec, tmp / "out", progress=False)


def built(spec, tfrecord_dir, **kwargs) -> UNetTrainer:
    """The TensorFlow trainer of ``spec`` with the layout a trial of it resolves (the trainer takes no default)."""
    return UNetTrainer(spec, tfrecord_dir, layout=resolve_layout(spec), **kwargs)


def with_changes(spec, **training):
    tree = spec.model_dump(mode="json")
    tree["training"].update(training)
    return validate_spec(tree)


def test_epoch_metrics_and_checkpoint(prepared, tmp_path: Path):
    spec, data = prepared
    trainer = built(spec, data.tfrecord_dir)
    metrics = trainer.run_epoch(1)
    assert metrics.epoch == 1 and 0 <= metrics.val_dice <= 1 and 0 <= metrics.train_loss <= 1
    assert metrics.epoch_seconds > 0 and 0 < metrics.step_share <= 1  # the steps against the input pipeline's wait
    assert trainer.num_parameters == sum(int(np.prod(w.shape)) for w in trainer.model.trainable_weights)
    path = trainer.save(tmp_path)
    assert path.is_file() and path.stat().st_size > 0
    # the allocator's peak of the training steps, beside the traced step's prediction
    assert metrics.peak_memory_mb > 0 and metrics.predicted_peak_memory_mb > metrics.predicted_step_memory_mb > 0
    assert metrics.predicted_flops_per_step > 0
    assert trainer._train_step.experimental_get_tracing_count() == 1  # the prediction traced a step of its own
    again = trainer.run_epoch(2)  # traced once per input
    assert again.predicted_step_memory_mb == metrics.predicted_step_memory_mb
    # Adam's moments, there now, are counted as the first epoch made them (the meter: test_tf_metering.py); the two
    # peaks are not compared, since at these sizes the allocator sees the blocks of 256 KiB and over alone, and
    # which of them are alive at once depends on how TensorFlow schedules the step's ops over the machine's cores
    moments = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in trainer.optimizer.variables) / 2**20
    assert moments > 0 and again.peak_memory_mb >= moments


def test_one_trace_of_the_training_step_whatever_the_batch_size(prepared):
    spec, data = prepared
    trainer = built(spec, data.tfrecord_dir)
    assert sorted({int(x.shape[0]) for x, _ in trainer.train_data}) == [1, 2]  # 3 cases, batches of 2
    trainer.train_epoch()
    trainer.train_epoch()
    assert trainer._train_step.experimental_get_tracing_count() == 1


def test_the_schedule_sets_the_optimizers_rate_at_each_epoch_and_step(prepared):
    spec, data = prepared
    trainer = built(with_changes(spec, epochs=2, lr_schedule={"name": "poly", "power": 1.0}), data.tfrecord_dir)
    for epoch, rate in ((1, 1.0e-3), (2, 0.5e-3)):
        metrics = trainer.run_epoch(epoch)
        assert metrics.learning_rate == pytest.approx(rate)
        assert float(trainer.optimizer.learning_rate.numpy()) == pytest.approx(rate)
    stepped = built(with_changes(spec, epochs=2, lr_schedule={"name": "cosine", "interval": "step"}),
                          data.tfrecord_dir)
    stepped.train_epoch(1)  # 3 cases in batches of 2: the second step at a quarter of the 2 epochs
    assert float(stepped.optimizer.learning_rate.numpy()) == pytest.approx(1.0e-3 * 0.5 * (1 + math.cos(math.pi / 4)))
    stepped.train_epoch()  # the next epoch, 2
    assert float(stepped.optimizer.learning_rate.numpy()) == pytest.approx(1.0e-3 * 0.5 * (1 + math.cos(math.pi * 3 / 4)))
    assert stepped._train_step.experimental_get_tracing_count() == 1  # the rate is a variable: no new trace


def test_data_parallel_trainers_schedule_the_scaled_rate(prepared):
    from distmis.spec.layout import resolve_layout

    spec, data = prepared
    tree = with_changes(spec, epochs=2, lr_schedule={"name": "poly", "power": 1.0}).model_dump(mode="json")
    tree["parallelism"] = {"mode": "data", "workers": 2, "lr_scaling": "linear"}
    two = validate_spec(tree)
    trainer = UNetTrainer(two, data.tfrecord_dir, layout=resolve_layout(two))
    assert [trainer.run_epoch(e).learning_rate for e in (1, 2)] == pytest.approx([2.0e-3, 1.0e-3])


def test_same_seed_same_start_whatever_the_learning_rate(prepared):
    spec, data = prepared
    a = built(with_changes(spec, optimizer={"lr": 1.0e-3}), data.tfrecord_dir)
    b = built(with_changes(spec, optimizer={"lr": 5.0e-3}), data.tfrecord_dir)
    for wa, wb in zip(a.model.get_weights(), b.model.get_weights()):
        np.testing.assert_array_equal(wa, wb)
    batches_a = [y.numpy().sum() for _, y in a.train_data]
    batches_b = [y.numpy().sum() for _, y in b.train_data]
    assert batches_a == batches_b  # same data order
    c = built(with_changes(spec, seed=1), data.tfrecord_dir)
    assert any(not np.array_equal(wa, wc) for wa, wc in zip(a.model.get_weights(), c.model.get_weights()))


def test_tiled_validation_covers_the_volume(prepared):
    spec, data = prepared
    trainer = built(with_changes(spec, tile=[8, 8, 8]), data.tfrecord_dir)
    _, image, label = trainer.val_cases[0]
    prob = trainer.predict_volume(image)
    assert prob.shape == label.shape and np.isfinite(prob).all()
    assert 0 <= prob.min() and prob.max() <= 1
    scores = trainer.validate()
    assert np.isfinite(scores.loss) and 0 <= scores.dice <= 1
    assert scores.class_dice == {"WT": scores.dice}  # whole-tumour: one scored channel


def test_nan_loss_raises(prepared):
    spec, data = prepared
    trainer = built(spec, data.tfrecord_dir)
    kernel = trainer.model.get_layer("down1_conv1").kernel
    kernel.assign(np.full(kernel.shape, np.nan, np.float32))
    with pytest.raises(NonFiniteLossError, match="epoch 3"):
        trainer.run_epoch(3)


def test_a_restarted_trainer_is_a_new_trainer_of_the_other_trial(prepared):
    """restart keeps the traced graphs and nothing else: weights, optimizer state, learning rate and data order
    are those of a trainer built for the new trial, and its first epoch gives the same numbers."""
    from distmis.spec.layout import resolve_layout
    from distmis.train.tf_unet import graph_key

    spec, data = prepared
    first = with_changes(spec, optimizer={"lr": 1.0e-3}, seed=3)
    second = with_changes(spec, optimizer={"lr": 5.0e-3}, seed=4, epochs=1,
                          lr_schedule={"name": "cosine", "interval": "step"},
                          augment={"enabled": True, "flip": 0.5, "affine": 0.5, "noise": 0.5})
    assert graph_key(first) == graph_key(second)
    assert graph_key(first) != graph_key(with_changes(spec, batch_size=1))
    kept = built(first, data.tfrecord_dir)
    kept.run_epoch(1)  # trained: weights and Adam's moments moved, its step counted
    traced = kept._train_step
    kept.restart(second, resolve_layout(second))
    fresh = built(second, data.tfrecord_dir)
    for a, b in zip(kept.model.get_weights(), fresh.model.get_weights()):  # batch-norm statistics included
        np.testing.assert_array_equal(a, b)
    assert float(kept.optimizer.learning_rate.numpy()) == pytest.approx(5.0e-3)
    for a, b in zip(kept.optimizer.variables, fresh.optimizer.variables):  # step count and moments zero
        np.testing.assert_array_equal(np.asarray(a.numpy()), np.asarray(b.numpy()))
    kept_inputs, fresh_inputs = list(kept.train_data), list(fresh.train_data)  # augmented by the new trial's draws
    for (x, y), (u, v) in zip(kept_inputs, fresh_inputs):
        np.testing.assert_array_equal(x.numpy(), u.numpy())
        np.testing.assert_array_equal(y.numpy(), v.numpy())
    plain = built(with_changes(second, augment={"enabled": False}), data.tfrecord_dir)
    assert not all(np.array_equal(x.numpy(), u.numpy()) for (x, _), (u, _) in zip(kept_inputs, plain.train_data))
    a, b = kept.run_epoch(1), fresh.run_epoch(1)
    assert a.train_loss == pytest.approx(b.train_loss, rel=1e-5) and a.val_dice == pytest.approx(b.val_dice, rel=1e-5)
    # the new trial's schedule: its second step at half-way down the cosine of its one epoch
    assert float(kept.optimizer.learning_rate.numpy()) == pytest.approx(2.5e-3)
    assert float(fresh.optimizer.learning_rate.numpy()) == pytest.approx(2.5e-3)
    assert kept._train_step is traced  # the same traced function, not a new one
    with pytest.raises(ValueError, match="same model and training graphs"):
        kept.restart(with_changes(spec, batch_size=1), resolve_layout(spec))


def test_a_restart_on_the_same_seed_keeps_tensorflows_kernel_cache(prepared, monkeypatch):
    """Setting TensorFlow's seed clears its kernel cache (the kept graphs would be optimized again): a restart on
    the seed already in place does not set it, and still starts where a trainer built after a full reset does."""
    import keras
    import tensorflow as tf

    from distmis.spec.layout import resolve_layout

    spec, data = prepared
    first = with_changes(spec, optimizer={"lr": 1.0e-3}, seed=5)
    second = with_changes(spec, optimizer={"lr": 5.0e-3}, seed=5)
    kept = built(first, data.tfrecord_dir)
    kept.run_epoch(1)
    seeded = []
    real_set_seed = tf.random.set_seed
    monkeypatch.setattr(tf.random, "set_seed", lambda seed: (seeded.append(seed), real_set_seed(seed)))
    kept.restart(second, resolve_layout(second))
    assert seeded == []
    weights, order = kept.model.get_weights(), [y.numpy().sum() for _, y in kept.train_data]

    keras.utils.set_random_seed(99)  # another seed in place: the next trainer resets every seed
    fresh = built(second, data.tfrecord_dir)
    assert seeded == [99, 5]
    for a, b in zip(weights, fresh.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert order == [y.numpy().sum() for _, y in fresh.train_data]


def test_a_fixed_number_of_steps_per_epoch_goes_on_through_the_passes(prepared):
    """``training.steps_per_epoch``: each epoch takes that many batches from one endless, reshuffled stream."""
    spec, data = prepared
    trainer = built(with_changes(spec, steps_per_epoch=3), data.tfrecord_dir)  # 3 cases in batches of 2
    assert trainer.steps_per_epoch == 3
    trainer.train_epoch(1)
    assert int(trainer.optimizer.iterations.numpy()) == 3  # 3 steps: a pass and a half
    trainer.train_epoch(2)
    assert int(trainer.optimizer.iterations.numpy()) == 6


@pytest.mark.slow
def test_compile_auto_measures_xla_on_the_trials_own_steps_with_the_graphs_losses(prepared, monkeypatch, tmp_path):
    """``compile: auto`` in a trial long enough (the threshold set to 0 s here): the first epoch trains and times the
    graph, the next steps XLA's compiled step (``jit_compile``, what ``on`` trains throughout) until the verdict, and
    the trial goes on in the faster; every epoch's loss is the graph-only trainer's to float round-off (XLA fuses
    and reorders the arithmetic), and the epoch's metrics say what was measured. The measurement is cached: the
    next trainer of the same step decides from it after its first epoch, measuring nothing."""
    import distmis.train.compile_choice as compile_choice

    monkeypatch.setattr(compile_choice, "COMPILE_MIN_TRAINING_SECONDS", 0.0)
    monkeypatch.setenv("DISTMIS_CACHE", str(tmp_path / "cache"))
    spec, data = prepared
    graph = built(with_changes(spec, performance={"compile": "off"}, steps_per_epoch=6, epochs=3), data.tfrecord_dir)
    auto = built(with_changes(spec, performance={"compile": "auto"}, steps_per_epoch=6, epochs=3), data.tfrecord_dir)
    assert auto.compile.source == "not measured" and auto._xla_step is not None and graph._xla_step is None
    on = built(with_changes(spec, performance={"compile": "on"}), data.tfrecord_dir)
    assert on._train_step._jit_compile is True and not graph._train_step._jit_compile
    assert on.compile == CompileChoice(True, "set") and graph.compile == CompileChoice(False, "set")
    assert auto._xla_step._jit_compile is True and not auto._train_step._jit_compile
    assert auto.train_epoch(1) == graph.train_epoch(1)  # the same traced graph
    assert auto.compile.source == "not measured" and auto._xla_probe.phase == "xla"  # XLA is tried next
    assert auto.train_epoch(2) == pytest.approx(graph.train_epoch(2), rel=1e-4)
    assert auto.compile.source == "measured" and set(auto.compile.seconds) == {"eager", "compiled", "compiling"}
    assert auto._xla_step.experimental_get_tracing_count() == 1
    assert (auto._train_step is auto._xla_step) == auto.compile.compiled
    metrics = auto.run_epoch(3)
    assert metrics.compiled == float(auto.compile.compiled) and metrics.compile_step_seconds_compiled > 0
    assert metrics.compile_step_seconds_eager == auto.compile.seconds["eager"]
    assert metrics.train_loss == pytest.approx(graph.run_epoch(3).train_loss, rel=1e-4)
    cached = json.loads((tmp_path / "cache" / "step_settings.json").read_text())
    assert list(cached.values()) == [{"seconds": auto.compile.seconds}]
    again = built(with_changes(spec, performance={"compile": "auto"}, steps_per_epoch=6, epochs=3), data.tfrecord_dir)
    again.train_epoch(1)
    assert again.compile.source == "cached" and again.compile.seconds == auto.compile.seconds
    assert again._xla_step.experimental_get_tracing_count() == 0  # nothing measured
    assert (again._train_step is again._xla_step) == again.compile.compiled
