"""Dice on hard segmentations, in numpy: the validation metric.

Dice is computed per case (and per channel), then averaged over cases, never over one flattened batch: one big
tumour must not hide a missed small one.

What a prediction's channels hold depends on the target scheme (:mod:`distmis.data.targets`): sigmoid channels
are thresholded each on its own, softmax ones give the one-hot encoding of the argmax
(:func:`distmis.pyfunc_model.channel_masks`). The scored channels are the foreground ones: every channel of a
sigmoid scheme, all but the background of a softmax one (:func:`class_dice`).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np


def mask_dice(pred: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Dice of boolean masks ``(..., K)`` for each of their ``K`` channels (float64). A channel where both are
    empty scores 1 (nothing to find, nothing found)."""
    if pred.shape != truth.shape:
        raise ValueError(f"prediction shape {pred.shape} differs from target shape {truth.shape}")
    p, g = np.asarray(pred, dtype=bool), np.asarray(truth, dtype=bool)
    axes = tuple(range(p.ndim - 1))
    intersection = np.logical_and(p, g).sum(axis=axes, dtype=np.float64)
    total = p.sum(axis=axes, dtype=np.float64) + g.sum(axis=axes, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, 2.0 * intersection / total, 1.0)


def dice_per_channel(pred: np.ndarray, target: np.ndarray, *, threshold: float = 0.5) -> np.ndarray:
    """Dice of one case for every channel: arrays (..., C) of (sigmoid) probabilities and {0, 1} targets, each
    channel thresholded on its own. A channel where both prediction and target are empty scores 1."""
    if pred.shape != target.shape:
        raise ValueError(f"prediction shape {pred.shape} differs from target shape {target.shape}")
    return mask_dice(pred >= threshold, target > 0.5)


def dice_score(pred: np.ndarray, target: np.ndarray, *, threshold: float = 0.5) -> float:
    """Mean over channels of :func:`dice_per_channel` for one case (sigmoid channels)."""
    return float(dice_per_channel(pred, target, threshold=threshold).mean())


def foreground_indices(targets: Mapping[str, Any]) -> list[int]:
    """The indices of the target scheme's scored channels: all of a sigmoid scheme's, all but channel 0 (the
    background) of a softmax one."""
    count = len(targets["channels"])
    return list(range(1, count)) if targets["activation"] == "softmax" else list(range(count))


def foreground_masks(prob: np.ndarray, targets: Mapping[str, Any], *, threshold: float = 0.5) -> np.ndarray:
    """Boolean ``(..., K)`` masks of the foreground channels a prediction ``prob`` ``(..., C)`` holds
    (:func:`distmis.pyfunc_model.channel_masks`, the background dropped): what :func:`class_dice` and the test
    scores (:func:`distmis.train.evaluation.case_metrics`) compare."""
    from distmis.pyfunc_model import channel_masks

    return channel_masks(prob, dict(targets), threshold)[..., foreground_indices(targets)]


def class_dice(prob: np.ndarray, label: np.ndarray, targets: Mapping[str, Any], *,
               threshold: float = 0.5) -> np.ndarray:
    """Dice of one case for each foreground channel of the target scheme (float64 ``(K,)``, in the order of
    :func:`distmis.data.targets.metric_keys`): ``prob`` the predicted probabilities and ``label`` the {0, 1}
    target channels, both ``(..., C)``. Empty in both: 1. For a sigmoid scheme this is :func:`dice_per_channel`."""
    if prob.shape != label.shape:
        raise ValueError(f"prediction shape {prob.shape} differs from target shape {label.shape}")
    truth = np.asarray(label) > 0.5
    return mask_dice(foreground_masks(prob, targets, threshold=threshold), truth[..., foreground_indices(targets)])
