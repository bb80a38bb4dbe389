from __future__ import annotations

import numpy as np
import pytest

from distmis.data.targets import legacy_targets
from distmis.train.epoch import EpochMetrics
from distmis.train.metrics import class_dice, dice_per_channel, dice_score, foreground_masks

CLASSES = {"mode": "classes", "activation": "softmax", "channels": [
    {"name": "background", "key": "background", "values": [0], "paint": 0},
    {"name": "left kidney", "key": "left_kidney", "values": [1], "paint": 1},
    {"name": "spleen", "key": "spleen", "values": [2], "paint": 2},
    {"name": "liver", "key": "liver", "values": [3], "paint": 3}]}


def test_hand_computed_dice():
    target = np.zeros((4, 4, 4, 1), np.float32)
    target[0, 0, :2] = 1  # 2 voxels
    pred = np.zeros_like(target)
    pred[0, 0, 1:4] = 0.9  # 3 voxels, 1 overlapping
    assert dice_score(pred, target) == pytest.approx(2 * 1 / (3 + 2))


def test_threshold_and_perfect():
    target = np.zeros((3, 3, 3, 1))
    target[1, 1, 1] = 1
    assert dice_score(target * 0.6, target) == 1.0
    assert dice_score(target * 0.4, target) == 0.0


def test_both_empty_is_one_and_per_channel_mean():
    target = np.zeros((2, 2, 2, 2))
    pred = np.zeros_like(target)
    target[0, 0, 0, 1] = 1
    pred[0, 0, 0, 1] = 1
    pred[1, 1, 1, 1] = 1  # channel 1: 2*1/(2+1)
    np.testing.assert_allclose(dice_per_channel(pred, target), [1.0, 2 / 3])
    assert dice_score(pred, target) == pytest.approx((1 + 2 / 3) / 2)


def test_shape_mismatch():
    with pytest.raises(ValueError, match="shape"):
        dice_score(np.zeros((2, 2, 2, 1)), np.zeros((2, 2, 2, 2)))


def test_softmax_classes_are_scored_by_the_argmax_without_the_background():
    label_map = np.zeros((4, 4, 4), np.int64)
    label_map[0, :, :2] = 1  # 8 voxels of class 1; class 2 absent; class 3 absent
    label = np.eye(4, dtype=np.float32)[label_map]  # one-hot (h, w, d, 4), background first
    prob = np.full((4, 4, 4, 4), 0.1, np.float32)
    prob[..., 0] = 0.7  # background wins everywhere ...
    prob[0, :, :1, 1] = 0.8  # ... but on 4 voxels of class 1 (the argmax, although below 0.5 nowhere else matters)
    prob[1, 0, 0, 3] = 0.75  # and one voxel of class 3, where there is none
    masks = foreground_masks(prob, CLASSES)
    assert masks.shape == (4, 4, 4, 3) and masks.sum() == 5
    dice = class_dice(prob, label, CLASSES)
    np.testing.assert_allclose(dice, [2 * 4 / (4 + 8), 1.0, 0.0])  # class 2: empty in both -> 1


def test_sigmoid_schemes_score_every_channel_as_before():
    rng = np.random.default_rng(0)
    prob = rng.random((6, 6, 6, 3)).astype(np.float32)
    label = (rng.random((6, 6, 6, 3)) > 0.5).astype(np.float32)
    targets = legacy_targets("brats", "regions")
    np.testing.assert_array_equal(class_dice(prob, label, targets), dice_per_channel(prob, label))
    assert float(class_dice(prob, label, targets).mean()) == dice_score(prob, label)


def test_epoch_metrics_report_each_class_after_val_dice():
    metrics = EpochMetrics(1, 0.5, 0.4, 0.6, 2.0, 1e-3, class_dice={"liver": 0.8, "spleen": 0.4})
    flat = metrics.as_dict()
    assert list(flat)[:6] == ["epoch", "train_loss", "val_loss", "val_dice", "val_dice_liver", "val_dice_spleen"]
    assert flat["val_dice_liver"] == 0.8 and "class_dice" not in flat
    assert "val_dice_liver" not in EpochMetrics(1, 0.5, 0.4, 0.6, 2.0, 1e-3).as_dict()


def test_the_driver_logs_every_number_an_epoch_reports():
    """The epoch's metrics are defined once (EpochMetrics): the names the driver logs are its fields."""
    from dataclasses import fields

    from distmis.tracking.mlflow_tracking import EPOCH_METRICS

    reported = set(EpochMetrics(1, 0.5, 0.4, 0.3, 1.0, 1e-3, step_seconds=0.1, peak_memory_mb=2.0, fom=3.0,
                                predicted_step_memory_mb=2.1, predicted_peak_memory_mb=2.5,
                                predicted_flops_per_step=1e9, curriculum_stage=1, tile_h=8, tile_w=8,
                                tile_d=8, validation_seconds=0.2, workers=2,
                                predicted_epoch_seconds=0.9, step_flop_rate=1e10, matmul_rate=1e11,
                                matmul_fraction=0.1, channels_last=1.0, format_step_seconds_contiguous=0.2,
                                format_step_seconds_channels_last=0.1, compiled=0.0, compile_step_seconds_eager=0.1,
                                compile_step_seconds_compiled=0.09, compile_seconds=20.0, compute_bits=32.0,
                                step_share=0.95).as_dict()) - {"epoch"}
    assert reported == set(EPOCH_METRICS)
    assert {f.name for f in fields(EpochMetrics)} == {*EPOCH_METRICS, "epoch", "class_dice"}
