"""Undo :mod:`~distmis.data.preprocess` for a prediction: back to the scan's own grid and label values.

A network predicts on the preprocessed grid (centre-cropped or padded to ``crop``, then resized to
``resize``). To write a segmentation that overlays the scan it came from:

1. :func:`restore_geometry` resamples the per-channel probabilities back from ``resize`` to the crop shape
   (linear, as the image was resized), then undoes the centre crop / pad: voxels the crop cut away are
   background (probability 0), voxels the pad added are dropped. The result has the scan's spatial shape.
2. :func:`target_to_labels` turns the thresholded target channels into one label map in a layout's
   convention: whole tumour as 0/1; the three nested BraTS regions (WT, TC, ET) recombined to the layout's
   label values (BraTS 2018-2021: edema 2, necrotic core 1, enhancing 4; MSD: 1, 2, 3; BraTS 2023: 2, 1, 3).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from distmis.data.layouts import Layout, coerce_layout
from distmis.data.preprocess import (
    _CORE_ONLY_VALUE, _EDEMA_VALUE, _ENHANCING_VALUE, LabelMode, PreprocessConfig, _check_shape3,
    center_crop_or_pad, coerce_label_mode, resize,
)

__all__ = ["restore_geometry", "target_to_labels"]


def restore_geometry(prob: np.ndarray, shape: Sequence[int], config: PreprocessConfig) -> np.ndarray:
    """Per-channel values ``(h, w, d, C)`` on the preprocessed grid -> ``(H, W, D, C)`` on the scan's grid.

    ``shape``: the scan's spatial shape ``(H, W, D)`` before preprocessing. The resize is undone first
    (linear interpolation of the values, from ``config.resize`` back to ``config.crop`` or ``shape``),
    then the centre crop / pad. :func:`~distmis.data.preprocess.center_crop_or_pad` is its own inverse:
    cropping an axis from ``n`` to ``m`` starts at ``(n - m) // 2``, the same offset at which padding from
    ``m`` back to ``n`` places it, so a voxel returns exactly to where it came from; the cropped-away
    border comes back as 0.
    """
    original = _check_shape3(tuple(shape), "scan shape")
    if prob.ndim != 4:
        raise ValueError(f"prob must be channels-last (h, w, d, C), got shape {prob.shape}")
    expected = config.resize or config.crop or original
    if tuple(prob.shape[:3]) != tuple(expected):
        raise ValueError(f"prob has spatial shape {prob.shape[:3]}, but preprocessing {config.to_dict()} of a "
                         f"{list(original)} scan gives {list(expected)}")
    out = np.asarray(prob, dtype=np.float32)
    if config.resize is not None:
        out = resize(out, config.crop or original, order=1)
    if config.crop is not None:
        out = center_crop_or_pad(out, original)
    return np.ascontiguousarray(out, dtype=np.float32)


def target_to_labels(target: np.ndarray, layout: Layout | str, mode: LabelMode | str) -> np.ndarray:
    """Binary target channels ``(H, W, D, C)`` -> a uint8 label map ``(H, W, D)`` in ``layout``'s values.

    ``whole-tumour`` (one channel): 0 background, 1 tumour, whatever the layout. ``regions`` (WT, TC, ET):
    the nesting ET within TC within WT is imposed from the inside out, as BraTS defines the regions: an
    enhancing voxel is enhancing tumour, a core voxel that is not enhancing is the core's other label, a
    whole-tumour voxel outside the core is edema. This inverts
    :func:`~distmis.data.preprocess.labels_to_target` for any label map of the layout.
    """
    layout = coerce_layout(layout)
    mode = coerce_label_mode(mode)
    channels = 1 if mode is LabelMode.WHOLE_TUMOUR else 3
    if target.ndim != 4 or target.shape[-1] != channels:
        raise ValueError(f"target must be (H, W, D, {channels}) for labels {mode.value!r}, got shape {target.shape}")
    on = np.asarray(target) > 0
    if mode is LabelMode.WHOLE_TUMOUR:
        return on[..., 0].astype(np.uint8)
    labels = np.zeros(target.shape[:3], dtype=np.uint8)
    labels[on[..., 0]] = _EDEMA_VALUE[layout]
    labels[on[..., 1]] = _CORE_ONLY_VALUE[layout]
    labels[on[..., 2]] = _ENHANCING_VALUE[layout]
    return labels
