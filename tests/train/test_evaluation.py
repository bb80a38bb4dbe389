"""Test-set metrics per case and scored channel (MONAI's dice and HD95 in mm), checked against hand-computed values
and against MONAI's own metric classes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from distmis.data.preprocess import PreprocessConfig, preprocessed_spacing
from distmis.data.targets import legacy_targets
from distmis.train.evaluation import case_metrics, region_names, score_names


def cube(shape: tuple[int, int, int], start: tuple[int, int, int], size: int) -> np.ndarray:
    mask = np.zeros(shape, dtype=bool)
    mask[tuple(slice(s, s + size) for s in start)] = 1
    return mask


def test_dice_and_hd95_of_a_shifted_cube_in_millimetres():
    shape = (20, 20, 20)
    truth = cube(shape, (5, 5, 5), 6)[..., None]
    pred = cube(shape, (7, 5, 5), 6)[..., None]  # shifted 2 voxels along the first axis
    metrics = case_metrics(pred, truth, spacing=(1.5, 1.0, 1.0), names=["WT"])
    assert metrics["dice_WT"] == pytest.approx(2 * 4 * 36 / (2 * 216))  # 4 of 6 slabs overlap
    assert metrics["hd95_WT"] == pytest.approx(2 * 1.5)  # 2 voxels of 1.5 mm


def test_empty_regions_follow_the_brats_convention():
    shape = (10, 12, 14)
    empty = np.zeros(shape, dtype=bool)
    truth = np.stack([cube(shape, (2, 2, 2), 4), empty, empty], axis=-1)
    pred = np.stack([cube(shape, (2, 2, 2), 4), empty, cube(shape, (1, 1, 1), 2)], axis=-1)
    metrics = case_metrics(pred, truth, spacing=(1.0, 2.0, 1.0), names=region_names("regions", 3))
    assert metrics["dice_WT"] == 1.0 and metrics["hd95_WT"] == 0.0
    assert metrics["dice_TC"] == 1.0 and metrics["hd95_TC"] == 0.0  # absent from both: right
    diagonal = math.sqrt(10 ** 2 + 24 ** 2 + 14 ** 2)
    assert metrics["dice_ET"] == 0.0 and metrics["hd95_ET"] == pytest.approx(diagonal)  # predicted, not there


def test_region_names_match_the_channels():
    assert region_names("whole-tumour", 1) == ("WT",)
    with pytest.raises(ValueError, match="3 channel"):
        region_names("regions", 1)


def test_scores_are_named_by_the_target_schemes_foreground_keys():
    assert score_names(legacy_targets("brats", "regions")) == ("WT", "TC", "ET")
    assert score_names(legacy_targets("msd", "whole-tumour")) == ("WT",)
    classes = {"mode": "classes", "activation": "softmax", "channels": [
        {"name": "background", "key": "background", "values": [0], "paint": 0},
        {"name": "left kidney", "key": "left_kidney", "values": [1], "paint": 1},
        {"name": "spleen", "key": "spleen", "values": [2], "paint": 2}]}
    assert score_names(classes) == ("left_kidney", "spleen")


def test_masks_only():
    truth = cube((8, 8, 8), (2, 2, 2), 3)[..., None]
    assert case_metrics(truth.astype(np.uint8), truth, (1, 1, 1), ["WT"])["dice_WT"] == 1.0  # 0/1 values pass
    with pytest.raises(ValueError, match="pred_masks must be boolean masks"):
        case_metrics(truth * 0.7, truth, (1, 1, 1), ["WT"])  # probabilities are not masks
    with pytest.raises(ValueError, match=r"must both be \(h, w, d, 2\)"):
        case_metrics(truth, truth, (1, 1, 1), ["liver", "spleen"])


@pytest.mark.filterwarnings("ignore:.*always_return_as_numpy.*:FutureWarning")  # MONAI 1.6's own HD95 code
def test_per_class_dice_and_hd95_are_monais_metrics_on_one_hot_tensors():
    """Three classes with spacing, against MONAI's DiceMetric and HausdorffDistanceMetric(percentile=95) on the one-hot
    encodings (background channel included, as MONAI takes them); the empty-mask conventions where MONAI has none."""
    import torch
    from monai.metrics import DiceMetric, HausdorffDistanceMetric

    shape, spacing = (24, 20, 16), (0.8, 1.2, 2.5)
    rng = np.random.default_rng(0)
    truth_map = np.zeros(shape, np.int64)
    pred_map = np.zeros(shape, np.int64)
    for value, (start, size) in enumerate((((3, 3, 2), 8), ((12, 10, 6), 6), ((4, 12, 9), 5)), start=1):
        truth_map[cube(shape, start, size)] = value
        moved = tuple(s + int(d) for s, d in zip(start, rng.integers(-2, 3, 3)))
        pred_map[cube(shape, moved, size + int(rng.integers(-1, 2)))] = value
    pred_map[rng.random(shape) < 0.01] = 2  # speckle: a long tail of distances that HD95 cuts
    truth = np.eye(4, dtype=bool)[truth_map]  # (h, w, d, 4) one-hot, background first
    pred = np.eye(4, dtype=bool)[pred_map]
    metrics = case_metrics(pred[..., 1:], truth[..., 1:], spacing, ["liver", "spleen", "kidney"])

    def monai_tensor(one_hot: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.moveaxis(one_hot, -1, 0)[None].astype(np.float32))  # (1, 4, h, w, d)

    y_pred, y = monai_tensor(pred), monai_tensor(truth)
    dice = DiceMetric(include_background=False, reduction="none")(y_pred, y)[0]
    hd95 = HausdorffDistanceMetric(include_background=False, percentile=95, reduction="none")(
        y_pred, y, spacing=list(spacing))[0]
    for index, name in enumerate(["liver", "spleen", "kidney"]):
        assert metrics[f"dice_{name}"] == pytest.approx(float(dice[index]), abs=1e-6)
        assert metrics[f"hd95_{name}"] == pytest.approx(float(hd95[index]), abs=1e-6)
    assert 0 < metrics["dice_spleen"] < metrics["dice_liver"] < 1 and metrics["hd95_spleen"] > 0

    # A class absent from both (MONAI: dice 1 with ignore_empty=False, no distance) and one missed altogether
    pred[..., 3] = False
    pred[..., 0] |= truth[..., 3]
    truth[..., 2], pred[..., 2] = False, False
    metrics = case_metrics(pred[..., 1:], truth[..., 1:], spacing, ["liver", "spleen", "kidney"])
    empty_ok = DiceMetric(include_background=False, reduction="none", ignore_empty=False)(
        monai_tensor(pred), monai_tensor(truth))[0]
    assert metrics["dice_spleen"] == float(empty_ok[1]) == 1.0 and metrics["hd95_spleen"] == 0.0
    assert metrics["dice_kidney"] == float(empty_ok[2]) == 0.0
    assert metrics["hd95_kidney"] == pytest.approx(math.sqrt(sum((n * s) ** 2 for n, s in zip(shape, spacing))))


def test_preprocessed_spacing_follows_crop_and_resize():
    config = PreprocessConfig("msd", crop=(100, 100, 50), resize=(50, 25, 50))
    assert preprocessed_spacing((240, 240, 155), (1.0, 1.0, 2.0), config) == (2.0, 4.0, 2.0)
    assert preprocessed_spacing((240, 240, 155), (1.0, 1.0, 2.0), PreprocessConfig("msd")) == (1.0, 1.0, 2.0)
