"""The ViT trainer on real TFRecords (single process; the sequence-parallel path runs in
tests/search/test_sequence_parallel_search.py and tests/parallel/)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from distmis.models.vit_seg import ViTSeg
from distmis.search.prepare import prepare_data
from distmis.spec import validate_spec
from distmis.train.torch_vit import TorchViTTrainer
from tests.conftest import small_spec_tree

VIT = {"name": "vit-seg", "framework": "torch",
       "params": {"layers": 2, "embed_dim": 32, "heads": 4, "patch": 4, "decoder_features": 16}}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vit_trainer")
    tree = small_spec_tree(tmp / "data", model=VIT)
    tree["training"]["tile"] = [8, 8, 8]
    spec = validate_spec(tree)
    return spec, prepare_data(spec, tmp / "out", progress=False)


def test_epoch_trains_validates_and_saves(prepared, tmp_path: Path):
    spec, data = prepared
    trainer = TorchViTTrainer(spec, data.tfrecord_dir)
    assert isinstance(trainer.model, ViTSeg) and trainer.model.tile == (8, 8, 8)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.run_epoch(1)
    assert 0 <= metrics.train_loss <= 1 and 0 <= metrics.val_dice <= 1 and np.isfinite(metrics.val_loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    # Validation predicts whole 16^3 volumes from 8^3 tiles.
    _, image, label = trainer.val_cases[0]
    prob = trainer.predict_volume(image)
    assert prob.shape == label.shape and 0 <= prob.min() and prob.max() <= 1
    trainer.save(tmp_path)
    other = TorchViTTrainer(spec, data.tfrecord_dir)
    other.load(tmp_path)
    np.testing.assert_array_equal(other.predict_volume(image), prob)


def test_whole_volume_is_the_tile_when_none_is_set(prepared):
    spec, data = prepared
    tree = spec.model_dump(mode="json")
    tree["training"]["tile"] = None
    trainer = TorchViTTrainer(validate_spec(tree), data.tfrecord_dir)
    assert trainer.model.tile == (16, 16, 16)


def test_only_for_vit_seg(prepared):
    _, data = prepared
    with pytest.raises(ValueError, match="trains model 'vit-seg', got 'unet3d'"):
        TorchViTTrainer(validate_spec(small_spec_tree("/nonexistent")), data.tfrecord_dir)
