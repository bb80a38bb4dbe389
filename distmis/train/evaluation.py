"""Test-set metrics of one segmented case, per target channel: dice and the 95th-percentile Hausdorff distance
(HD95, in millimetres), computed by MONAI's metrics on the thresholded prediction.

The channels are the label mode's regions: ``whole-tumour`` -> WT; ``regions`` -> WT, TC, ET (BraTS reports each
apart, and their mean). Empty masks follow the BraTS convention: a region absent from both the prediction and the
truth scores dice 1 and HD95 0; absent from only one of them, dice 0 and HD95 the volume's diagonal in mm (the
largest distance there is), so a mean over cases stays finite and a missed region is penalised.
"""

from __future__ import annotations

import math
import warnings
from typing import Sequence

import numpy as np

REGION_NAMES: dict[str, tuple[str, ...]] = {"whole-tumour": ("WT",), "regions": ("WT", "TC", "ET")}


def region_names(label_mode: str, channels: int) -> tuple[str, ...]:
    """The names of a label mode's target channels; ValueError when the channel count does not match."""
    names = REGION_NAMES.get(label_mode)
    if names is None:
        raise ValueError(f"label mode must be one of {sorted(REGION_NAMES)}, got {label_mode!r}")
    if len(names) != channels:
        raise ValueError(f"label mode {label_mode!r} has {len(names)} channel(s) {list(names)}, the data has {channels}")
    return names


def case_metrics(prob: np.ndarray, label: np.ndarray, spacing: Sequence[float], names: Sequence[str], *,
                 threshold: float = 0.5) -> dict[str, float]:
    """``{"dice_<name>": ..., "hd95_<name>": ...}`` for one case: ``prob`` the predicted probabilities and ``label``
    the 0/1 truth, both channels-last ``(h, w, d, C)``; ``spacing`` the voxel size in mm along h, w, d."""
    import torch
    from monai.metrics import compute_dice, compute_hausdorff_distance

    if prob.shape != label.shape or prob.ndim != 4 or prob.shape[-1] != len(names):
        raise ValueError(f"prediction {prob.shape} and label {label.shape} must both be (h, w, d, {len(names)})")
    pred = torch.from_numpy(np.ascontiguousarray(np.moveaxis(prob >= threshold, -1, 0)))[None].float()
    truth = torch.from_numpy(np.ascontiguousarray(np.moveaxis(label > 0.5, -1, 0)))[None].float()
    dice = compute_dice(pred, truth, include_background=True, ignore_empty=False)[0]
    has_pred, has_truth = pred[0].flatten(1).any(1), truth[0].flatten(1).any(1)
    both = has_pred & has_truth
    hd95 = torch.zeros(len(names), dtype=torch.float64)
    if both.any():
        with warnings.catch_warnings():  # MONAI 1.6 warns about an argument its own HD95 code still passes
            warnings.filterwarnings("ignore", message=".*always_return_as_numpy.*", category=FutureWarning)
            distances = compute_hausdorff_distance(pred[:, both], truth[:, both], include_background=True,
                                                   percentile=95, spacing=[float(s) for s in spacing])[0]
        hd95[both] = distances.double()
    diagonal = math.sqrt(sum((n * float(s)) ** 2 for n, s in zip(prob.shape[:3], spacing)))
    hd95[has_pred ^ has_truth] = diagonal
    out: dict[str, float] = {}
    for index, name in enumerate(names):
        out[f"dice_{name}"] = float(dice[index])
        out[f"hd95_{name}"] = float(hd95[index])
    return out
