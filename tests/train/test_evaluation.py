"""Test-set metrics per case and region (MONAI's dice and HD95 in mm), checked against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from distmis.data.preprocess import PreprocessConfig, preprocessed_spacing
from distmis.train.evaluation import case_metrics, region_names


def cube(shape: tuple[int, int, int], start: tuple[int, int, int], size: int) -> np.ndarray:
    mask = np.zeros(shape, dtype=np.float32)
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
    truth = np.stack([cube(shape, (2, 2, 2), 4), np.zeros(shape), np.zeros(shape)], axis=-1)
    pred = np.stack([cube(shape, (2, 2, 2), 4), np.zeros(shape), cube(shape, (1, 1, 1), 2)], axis=-1)
    metrics = case_metrics(pred, truth, spacing=(1.0, 2.0, 1.0), names=region_names("regions", 3))
    assert metrics["dice_WT"] == 1.0 and metrics["hd95_WT"] == 0.0
    assert metrics["dice_TC"] == 1.0 and metrics["hd95_TC"] == 0.0  # absent from both: right
    diagonal = math.sqrt(10 ** 2 + 24 ** 2 + 14 ** 2)
    assert metrics["dice_ET"] == 0.0 and metrics["hd95_ET"] == pytest.approx(diagonal)  # predicted, not there


def test_region_names_match_the_channels():
    assert region_names("whole-tumour", 1) == ("WT",)
    with pytest.raises(ValueError, match="3 channel"):
        region_names("regions", 1)


def test_preprocessed_spacing_follows_crop_and_resize():
    config = PreprocessConfig("msd", crop=(100, 100, 50), resize=(50, 25, 50))
    assert preprocessed_spacing((240, 240, 155), (1.0, 1.0, 2.0), config) == (2.0, 4.0, 2.0)
    assert preprocessed_spacing((240, 240, 155), (1.0, 1.0, 2.0), PreprocessConfig("msd")) == (1.0, 1.0, 2.0)
