"""The U-Net trainer on real TFRecords made from a tiny synthetic dataset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distmis.search.prepare import prepare_data
from distmis.spec import validate_spec
from distmis.train.tf_unet import NonFiniteLossError, UNetTrainer
from tests.conftest import small_spec_tree


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer")
    spec = validate_spec(small_spec_tree(tmp / "data"))
    return spec, prepare_data(spec, tmp / "out", progress=False)


def with_changes(spec, **training):
    tree = spec.model_dump(mode="json")
    tree["training"].update(training)
    return validate_spec(tree)


def test_epoch_metrics_and_checkpoint(prepared, tmp_path: Path):
    spec, data = prepared
    trainer = UNetTrainer(spec, data.tfrecord_dir)
    metrics = trainer.run_epoch(1)
    assert metrics.epoch == 1 and 0 <= metrics.val_dice <= 1 and 0 <= metrics.train_loss <= 1
    assert metrics.epoch_seconds > 0
    assert trainer.num_parameters == sum(int(np.prod(w.shape)) for w in trainer.model.trainable_weights)
    path = trainer.save(tmp_path)
    assert path.is_file() and path.stat().st_size > 0


def test_same_seed_same_start_whatever_the_learning_rate(prepared):
    spec, data = prepared
    a = UNetTrainer(with_changes(spec, optimizer={"lr": 1.0e-3}), data.tfrecord_dir)
    b = UNetTrainer(with_changes(spec, optimizer={"lr": 5.0e-3}), data.tfrecord_dir)
    for wa, wb in zip(a.model.get_weights(), b.model.get_weights()):
        np.testing.assert_array_equal(wa, wb)
    batches_a = [y.numpy().sum() for _, y in a.train_data]
    batches_b = [y.numpy().sum() for _, y in b.train_data]
    assert batches_a == batches_b  # same data order
    c = UNetTrainer(with_changes(spec, seed=1), data.tfrecord_dir)
    assert any(not np.array_equal(wa, wc) for wa, wc in zip(a.model.get_weights(), c.model.get_weights()))


def test_tiled_validation_covers_the_volume(prepared):
    spec, data = prepared
    trainer = UNetTrainer(with_changes(spec, tile=[8, 8, 8]), data.tfrecord_dir)
    _, image, label = trainer.val_cases[0]
    prob = trainer.predict_volume(image)
    assert prob.shape == label.shape and np.isfinite(prob).all()
    assert 0 <= prob.min() and prob.max() <= 1
    val_loss, val_dice = trainer.validate()
    assert np.isfinite(val_loss) and 0 <= val_dice <= 1


def test_nan_loss_raises(prepared):
    spec, data = prepared
    trainer = UNetTrainer(spec, data.tfrecord_dir)
    kernel = trainer.model.get_layer("down1_conv1").kernel
    kernel.assign(np.full(kernel.shape, np.nan, np.float32))
    with pytest.raises(NonFiniteLossError, match="epoch 3"):
        trainer.run_epoch(3)
