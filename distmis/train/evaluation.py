"""Test-set metrics of one segmented case, per scored channel: dice and the 95th-percentile Hausdorff distance
(HD95, in millimetres), computed by MONAI's metrics on boolean masks.

The scored channels are the target scheme's foreground ones (:mod:`distmis.data.targets`), named by their keys:
``whole-tumour`` -> WT; ``regions`` -> WT, TC, ET on a brain-tumour data set (BraTS reports each apart, and their
mean) or an nnU-Net data set's own regions; ``classes`` -> every class but the background (``liver``, ``spleen``).
The callers make the masks: a prediction's with :func:`distmis.train.metrics.foreground_masks` (thresholded sigmoid
channels, or the softmax's argmax, the background dropped), the truth's from its target channels.

Empty masks follow the BraTS convention: a channel absent from both the prediction and the truth scores dice 1 and
HD95 0; absent from only one of them, dice 0 and HD95 the volume's diagonal in mm (the largest distance there is),
so a mean over cases stays finite and a missed class is penalised.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Mapping, Sequence

import numpy as np

#: The brain-tumour label modes' channel names (their target schemes' keys: distmis.pyfunc_model.legacy_targets).
REGION_NAMES: dict[str, tuple[str, ...]] = {"whole-tumour": ("WT",), "regions": ("WT", "TC", "ET")}


def region_names(label_mode: str, channels: int) -> tuple[str, ...]:
    """The names of a brain-tumour label mode's target channels (``whole-tumour``: WT; ``regions``: WT, TC, ET);
    ValueError when the channel count does not match. Any other data set: :func:`score_names` of its targets."""
    names = REGION_NAMES.get(label_mode)
    if names is None:
        raise ValueError(f"label mode must be one of {sorted(REGION_NAMES)}, got {label_mode!r}")
    if len(names) != channels:
        raise ValueError(f"label mode {label_mode!r} has {len(names)} channel(s) {list(names)}, the data has {channels}")
    return names


def score_names(targets: Mapping[str, Any]) -> tuple[str, ...]:
    """The names the scores of a target scheme carry (``dice_<name>``, ``test_hd95_<name>``): its foreground
    channels' keys, in channel order (WT, TC, ET for the BraTS modes)."""
    from distmis.data.targets import metric_keys

    names = tuple(metric_keys(dict(targets)))
    if not names:
        raise ValueError("the target scheme has no foreground channel to score")
    if len(set(names)) != len(names):
        raise ValueError(f"the target scheme's channel keys must differ, got {list(names)}")
    return names


def _masks(array: np.ndarray, what: str) -> np.ndarray:
    """``array`` as booleans: a boolean array, or one of only 0 and 1; ValueError otherwise (probabilities must be
    turned into masks first: :func:`distmis.train.metrics.foreground_masks`)."""
    array = np.asarray(array)
    if array.dtype == bool:
        return array
    if array.dtype.kind not in "iuf" or not ((array == 0) | (array == 1)).all():
        raise ValueError(f"{what} must be boolean masks (or 0/1 values), got dtype {array.dtype} with other values: "
                         "make masks of probabilities first (distmis.train.metrics.foreground_masks)")
    return array.astype(bool)


def case_metrics(pred_masks: np.ndarray, true_masks: np.ndarray, spacing: Sequence[float],
                 names: Sequence[str]) -> dict[str, float]:
    """``{"dice_<name>": ..., "hd95_<name>": ...}`` for one case: ``pred_masks`` the predicted and ``true_masks`` the
    true masks of the scored channels, both boolean (or 0/1) and channels-last ``(h, w, d, K)``, ``K = len(names)``
    (the background of a ``classes`` scheme left out); ``spacing`` the voxel size in mm along h, w, d."""
    import torch
    from monai.metrics import compute_dice, compute_hausdorff_distance

    pred_masks, true_masks = _masks(pred_masks, "pred_masks"), _masks(true_masks, "true_masks")
    if pred_masks.shape != true_masks.shape or pred_masks.ndim != 4 or pred_masks.shape[-1] != len(names):
        raise ValueError(f"prediction {pred_masks.shape} and truth {true_masks.shape} must both be "
                         f"(h, w, d, {len(names)}): one channel per name {list(names)}")
    pred = torch.from_numpy(np.ascontiguousarray(np.moveaxis(pred_masks, -1, 0)))[None].float()
    truth = torch.from_numpy(np.ascontiguousarray(np.moveaxis(true_masks, -1, 0)))[None].float()
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
    diagonal = math.sqrt(sum((n * float(s)) ** 2 for n, s in zip(pred_masks.shape[:3], spacing)))
    hd95[has_pred ^ has_truth] = diagonal
    out: dict[str, float] = {}
    for index, name in enumerate(names):
        out[f"dice_{name}"] = float(dice[index])
        out[f"hd95_{name}"] = float(hd95[index])
    return out
