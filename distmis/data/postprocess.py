"""Undo :mod:`~distmis.data.preprocess` for a prediction: back to the scan's own grid and label values.

A network predicts on the preprocessed grid (centre-cropped or padded to ``crop``, then resized to
``resize``). To write a segmentation that overlays the scan it came from:

1. :func:`restore_geometry` resamples the per-channel probabilities back from ``resize`` to the crop shape
   (linear, as the image was resized), then undoes the centre crop / pad: voxels the crop cut away are
   background (probability 0), voxels the pad added are dropped. The result has the scan's spatial shape.
2. :func:`target_to_labels` turns the thresholded target channels into one label map in a layout's
   convention: whole tumour as 0/1; the three nested BraTS regions (WT, TC, ET) recombined to the layout's
   label values (BraTS 2018-2021: edema 2, necrotic core 1, enhancing 4; MSD: 1, 2, 3; BraTS 2023: 2, 1, 3).

Both are implemented once, in the code of the model a search registers (:mod:`distmis.pyfunc_model`, which
does not import distmis); these take distmis's :class:`~distmis.data.preprocess.PreprocessConfig` and enums.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from distmis import pyfunc_model
from distmis.data.layouts import Layout, coerce_layout
from distmis.data.preprocess import LabelMode, PreprocessConfig, coerce_label_mode

__all__ = ["restore_geometry", "target_to_labels"]


def restore_geometry(prob: np.ndarray, shape: Sequence[int], config: PreprocessConfig) -> np.ndarray:
    """Per-channel values ``(h, w, d, C)`` on the preprocessed grid -> ``(H, W, D, C)`` on the scan's grid.

    ``shape``: the scan's spatial shape ``(H, W, D)`` before preprocessing. The resize is undone first
    (linear interpolation of the values, from ``config.resize`` back to ``config.crop`` or ``shape``),
    then the centre crop / pad. :func:`~distmis.data.preprocess.center_crop_or_pad` is its own inverse:
    cropping an axis from ``n`` to ``m`` starts at ``(n - m) // 2``, the same offset at which padding from
    ``m`` back to ``n`` places it, so a voxel returns exactly to where it came from; the cropped-away
    border comes back as 0. (:func:`distmis.pyfunc_model.restore_geometry`.)
    """
    return pyfunc_model.restore_geometry(prob, shape, config.crop, config.resize)


def target_to_labels(target: np.ndarray, layout: Layout | str, mode: LabelMode | str) -> np.ndarray:
    """Binary target channels ``(H, W, D, C)`` -> a uint8 label map ``(H, W, D)`` in ``layout``'s values.

    ``whole-tumour`` (one channel): 0 background, 1 tumour, whatever the layout. ``regions`` (WT, TC, ET):
    the nesting ET within TC within WT is imposed from the inside out, as BraTS defines the regions: an
    enhancing voxel is enhancing tumour, a core voxel that is not enhancing is the core's other label, a
    whole-tumour voxel outside the core is edema. This inverts
    :func:`~distmis.data.preprocess.labels_to_target` for any label map of the layout.
    (:func:`distmis.pyfunc_model.target_to_labels`.)
    """
    return pyfunc_model.target_to_labels(target, coerce_layout(layout).value, coerce_label_mode(mode).value)
