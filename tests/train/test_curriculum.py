"""A training.curriculum in both trainers, on real TFRecords: each epoch trains on its stage's tiles and batches,
reports its stage and tile, and validates on the last stage's input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distmis.search.prepare import prepare_data
from distmis.spec import validate_spec
from tests.conftest import small_spec_tree

STAGES = [
    {"tile": [8, 8, 8], "epochs": 1, "batch_size": 3, "tile_sampling": 1.0},  # small positive tiles
    {"tile": [12, 12, 8], "epochs": 1, "batch_size": 2},
    {"tile": None, "epochs": 1, "batch_size": 1},  # the whole 16^3 volume
]


def curriculum_spec(data, framework: str):
    tree = small_spec_tree(data, model={"name": "unet3d", "framework": framework,
                                        "params": {"base_filters": 4, "levels": 3}})
    tree["dataset"]["synthetic"]["cases"] = 8
    tree["training"].pop("epochs")
    tree["training"]["curriculum"] = STAGES
    return validate_spec(tree)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("curriculum")
    spec = curriculum_spec(tmp / "data", "torch")
    return tmp, prepare_data(spec, tmp / "out", progress=False)


def test_torch_trainer_follows_the_curriculum(prepared):
    from tests.train.torch_trainers import local_trainer

    tmp, data = prepared
    spec = curriculum_spec(tmp / "data", "torch")
    trainer = local_trainer(spec, data.tfrecord_dir)
    seen: list[tuple[tuple[int, ...], float]] = []  # (input shape, smallest foreground fraction of a tile)
    original = trainer._forward_backward

    def recording(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        foreground = y.flatten(1).amax(dim=1)  # per sample: does its tile hold any foreground?
        seen.append((tuple(x.shape), float(foreground.min())))
        return original(x, y)

    trainer._forward_backward = recording  # type: ignore[method-assign]
    assert trainer.window is None  # validation on the whole volume from the first epoch on
    reports = []
    for epoch in (1, 2, 3):
        seen.clear()
        reports.append(trainer.run_epoch(epoch).as_dict())
        shapes = {shape for shape, _ in seen}
        stage = STAGES[epoch - 1]
        tile = tuple(stage["tile"] or (16, 16, 16))
        batches = [shape[0] for shape, _ in seen]
        assert shapes <= {(b, 4, *tile) for b in range(1, stage["batch_size"] + 1)}, shapes
        assert batches[0] == stage["batch_size"] and len(batches) == -(-4 // stage["batch_size"])  # 4 cases
        if epoch == 1:  # every tile centred on foreground
            assert all(fraction > 0 for _, fraction in seen)
    assert [r["curriculum_stage"] for r in reports] == [1, 2, 3]
    assert [(r["tile_h"], r["tile_w"], r["tile_d"]) for r in reports] == [(8, 8, 8), (12, 12, 8), (16, 16, 16)]
    assert all(np.isfinite(r["val_dice"]) for r in reports)


def test_tensorflow_trainer_follows_the_curriculum(prepared):
    from distmis.spec.layout import resolve_layout
    from distmis.train.tf_unet import UNetTrainer

    tmp, data = prepared
    spec = curriculum_spec(tmp / "data", "tensorflow")
    trainer = UNetTrainer(spec, data.tfrecord_dir, layout=resolve_layout(spec))
    assert trainer.window is None
    reports = []
    for epoch in (1, 2, 3):
        reports.append(trainer.run_epoch(epoch).as_dict())
        stage = STAGES[epoch - 1]
        x_spec = trainer.train_data.element_spec[0]
        assert tuple(x_spec.shape[1:4]) == tuple(stage["tile"] or (16, 16, 16))
        assert trainer.steps_per_epoch == -(-4 // stage["batch_size"])
        first_batch = next(iter(trainer.train_data))[0]
        assert first_batch.shape[0] == stage["batch_size"]
    assert [r["curriculum_stage"] for r in reports] == [1, 2, 3]
    assert [(r["tile_h"], r["tile_w"], r["tile_d"]) for r in reports] == [(8, 8, 8), (12, 12, 8), (16, 16, 16)]
    assert all(np.isfinite(r["train_loss"]) for r in reports)


def test_without_a_curriculum_nothing_is_added(prepared):
    from tests.train.torch_trainers import local_trainer

    tmp, data = prepared
    tree = curriculum_spec(tmp / "data", "torch").model_dump(mode="json")
    tree["training"].update(curriculum=None, epochs=1, tile=[8, 8, 8])
    trainer = local_trainer(validate_spec(tree), data.tfrecord_dir)
    assert trainer.window == (8, 8, 8)
    assert not {"curriculum_stage", "tile_h"} & set(trainer.run_epoch(1).as_dict())


# --------------------------------------------------------------------------- whole volume against sliding windows
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_the_best_model_is_timed_and_scored_both_ways(prepared, tmp_path, framework):
    from distmis.trial.trainers import build_trainer
    from distmis.spec.layout import resolve_layout
    from distmis.train.inference_timing import compare_inference, inference_windows
    from distmis.train.metrics import dice_score

    tmp, data = prepared
    tree = curriculum_spec(tmp / "data", framework).model_dump(mode="json")
    tree["training"]["inference"]["compare"] = True
    spec = validate_spec(tree)
    assert inference_windows(spec, (16, 16, 16)) == {"whole_volume": None, "sliding_window": (8, 8, 8)}
    assert inference_windows(spec, (18, 16, 15))["whole_volume"] == (20, 16, 16)  # padded to the pooling factor
    trainer = build_trainer(spec, resolve_layout(spec), data.tfrecord_dir)
    trainer.run_epoch(1)
    (tmp_path / "best").mkdir()
    trainer.save(tmp_path / "best")
    trainer.run_epoch(2)  # the weights in the trainer move on from the saved ones
    before = trainer.predict_volume(trainer.val_cases[0][1])
    found = compare_inference(trainer, tmp_path / "best")
    assert set(found) == {"whole_volume_dice", "whole_volume_seconds", "sliding_window_dice", "sliding_window_seconds"}
    assert all(found[f"{way}_seconds"] > 0 for way in ("whole_volume", "sliding_window"))
    np.testing.assert_array_equal(trainer.predict_volume(trainer.val_cases[0][1]), before)  # its own weights back
    with trainer.weights_from(tmp_path / "best"):  # the scores are the saved model's, each way
        dices = {way: np.mean([dice_score(trainer.predict_with_window(image, window), label)
                               for _, image, label in trainer.val_cases])
                 for way, window in (("whole_volume", None), ("sliding_window", (8, 8, 8)))}
    for way, dice in dices.items():
        assert found[f"{way}_dice"] == pytest.approx(dice, rel=1e-6)


def test_a_vit_has_no_whole_volume_inference_to_compare(prepared):
    from distmis.spec import SpecError

    tmp, _ = prepared
    tree = small_spec_tree(tmp / "data", model={"name": "vit-seg", "framework": "torch",
                                                "params": {"patch": 4, "heads": 2, "embed_dim": 16}})
    tree["training"].update(tile=[8, 8, 8], inference={"compare": True})
    with pytest.raises(SpecError, match="training.inference.compare: vit-seg predicts only windows of its tile"):
        validate_spec(tree)
