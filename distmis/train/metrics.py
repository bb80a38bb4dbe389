"""Dice on hard (thresholded) segmentations, in numpy: the validation metric.

Dice is computed per case (and per channel for region labels), then averaged over cases, never
over one flattened batch: one big tumour must not hide a missed small one.
"""

from __future__ import annotations

import numpy as np


def dice_per_channel(pred: np.ndarray, target: np.ndarray, *, threshold: float = 0.5) -> np.ndarray:
    """Dice of one case for every channel: arrays (..., C) of probabilities and {0, 1} targets.

    A channel where both prediction and target are empty scores 1 (nothing to find, nothing found).
    """
    if pred.shape != target.shape:
        raise ValueError(f"prediction shape {pred.shape} differs from target shape {target.shape}")
    p = pred >= threshold
    g = target > 0.5
    axes = tuple(range(p.ndim - 1))
    intersection = np.logical_and(p, g).sum(axis=axes, dtype=np.float64)
    total = p.sum(axis=axes, dtype=np.float64) + g.sum(axis=axes, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        dice = np.where(total > 0, 2.0 * intersection / total, 1.0)
    return dice


def dice_score(pred: np.ndarray, target: np.ndarray, *, threshold: float = 0.5) -> float:
    """Mean over channels of :func:`dice_per_channel` for one case."""
    return float(dice_per_channel(pred, target, threshold=threshold).mean())
