from __future__ import annotations

import numpy as np
import pytest

from distmis.train.metrics import dice_per_channel, dice_score


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
