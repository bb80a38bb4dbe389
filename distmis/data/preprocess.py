"""Turn one raw case into network-ready arrays.

The pipeline applied by :func:`preprocess_case` is, in order:

1. :func:`zscore_nonzero` - normalise every modality over the brain (its
   non-zero voxels); the background stays exactly 0.
2. :func:`center_crop_or_pad` - optional, to a fixed ``crop`` shape (cuts away
   empty background around the brain, pads with zeros where the volume is smaller).
3. :func:`resize` - optional, resample to a fixed ``resize`` shape (linear for
   the image, nearest-neighbour for the label).
4. :func:`labels_to_target` - map the layout's label values to binary target
   channels: one whole-tumour channel, or the three nested BraTS regions
   (whole tumour, tumour core, enhancing tumour).

What to do is described by a :class:`PreprocessConfig`, which is stored in the
TFRecord manifest so that a trained model knows how its inputs were made.

Steps 1-3 (and the layouts' label values) are implemented once, in the code of the
model a search registers (:mod:`distmis.pyfunc_model`, which does not import distmis):
training data and predictions are made by the same functions, re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from distmis.data.layouts import LABEL_VALUES, Layout, _coerce_enum, coerce_layout, label_counts
from distmis.pyfunc_model import (
    CORE_VALUES, ENHANCING_VALUE, center_crop_or_pad, check_shape3, resize, zscore_nonzero,
)
from distmis.pyfunc_model import preprocess_image as _preprocess_image

__all__ = [
    "LabelMode",
    "zscore_nonzero",
    "center_crop_or_pad",
    "resize",
    "labels_to_target",
    "PreprocessConfig",
    "preprocess_case",
    "preprocess_image",
    "preprocessed_shape",
]


class LabelMode(str, Enum):
    """Which segmentation target to train on.

    ``whole-tumour``: one channel, any tumour label.
    ``regions``: three channels, the nested BraTS evaluation regions
    WT (whole tumour), TC (tumour core), ET (enhancing tumour).
    """

    WHOLE_TUMOUR = "whole-tumour"
    REGIONS = "regions"


def coerce_label_mode(mode: LabelMode | str) -> LabelMode:
    """Return ``mode`` as a :class:`LabelMode` (accepts ``"whole-tumour"`` / ``"regions"``)."""
    return _coerce_enum(LabelMode, mode, "label mode")


_check_shape3 = check_shape3  # a 3-D shape of positive integers, or ValueError naming ``what``


# --------------------------------------------------------------------------- labels


def labels_to_target(label: np.ndarray, layout: Layout | str, mode: LabelMode | str) -> np.ndarray:
    """Map a label map with the layout's values to binary target channels.

    Args:
        label: integer ``(H, W, D)`` label map with values from ``LABEL_VALUES[layout]``.
        layout: which label convention ``label`` uses.
        mode: ``whole-tumour`` -> 1 channel (label > 0); ``regions`` -> 3 channels
            WT (any tumour), TC (core + enhancing: BraTS {1, 4}, MSD {2, 3}, BraTS 2023 {1, 3}) and
            ET (enhancing: BraTS 4, MSD 3, BraTS 2023 3).

    Returns:
        uint8 ``(H, W, D, C)`` array of 0/1.

    Raises:
        ValueError: if ``label`` holds a value not allowed for ``layout``.
    """
    layout = coerce_layout(layout)
    mode = coerce_label_mode(mode)
    if label.ndim != 3:
        raise ValueError(f"label must be a 3-D (H, W, D) array, got shape {label.shape}")
    if label.dtype.kind not in "iub":
        raise ValueError(f"label must be an integer array, got dtype {label.dtype}")
    found = sorted(label_counts(label))
    bad = [v for v in found if v not in LABEL_VALUES[layout]]
    if bad:
        raise ValueError(
            f"label values {bad} are not allowed for layout {layout.value!r} "
            f"(found {found}, allowed {list(LABEL_VALUES[layout])})"
        )
    whole = label > 0
    if mode is LabelMode.WHOLE_TUMOUR:
        return whole[..., None].astype(np.uint8)
    core = np.isin(label, CORE_VALUES[layout.value])
    enhancing = label == ENHANCING_VALUE[layout.value]
    return np.stack([whole, core, enhancing], axis=-1).astype(np.uint8)


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class PreprocessConfig:
    """What :func:`preprocess_case` does.

    Attributes:
        layout: label convention of the source data set.
        labels: target channels (see :class:`LabelMode`).
        crop: centre crop / pad of the spatial axes, applied before ``resize``.
        resize: final spatial shape after resampling.

    Strings are accepted for the enums and lists for the shapes; they are
    normalised on construction, so that ``from_dict(to_dict())`` round-trips.
    """

    layout: Layout
    labels: LabelMode = LabelMode.WHOLE_TUMOUR
    crop: tuple[int, int, int] | None = None
    resize: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", coerce_layout(self.layout))
        object.__setattr__(self, "labels", coerce_label_mode(self.labels))
        for name in ("crop", "resize"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _check_shape3(value, f"PreprocessConfig.{name}"))

    @property
    def num_classes(self) -> int:
        """Number of target channels: 1 for whole-tumour, 3 for regions."""
        return 1 if self.labels is LabelMode.WHOLE_TUMOUR else 3

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (enums as strings, shapes as lists)."""
        return {
            "layout": self.layout.value,
            "labels": self.labels.value,
            "crop": list(self.crop) if self.crop is not None else None,
            "resize": list(self.resize) if self.resize is not None else None,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PreprocessConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        known = {"layout", "labels", "crop", "resize"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown PreprocessConfig field(s) {unknown}; allowed: {sorted(known)}")
        if "layout" not in data:
            raise ValueError("PreprocessConfig needs a 'layout' ('msd', 'brats' or 'brats2023')")
        return cls(**dict(data))


def preprocess_case(image: np.ndarray, label: np.ndarray, config: PreprocessConfig) -> tuple[np.ndarray, np.ndarray]:
    """Apply the pipeline of the module docstring to one case.

    Args:
        image: ``(H, W, D, 4)`` image as returned by :func:`~distmis.data.layouts.read_case`.
        label: ``(H, W, D)`` integer label map with values of ``config.layout``.
        config: what to do.

    Returns:
        ``(image, target)``: float32 ``(h, w, d, 4)`` and uint8 ``(h, w, d, C)``
        with ``C = config.num_classes``.
    """
    if image.ndim != 4:
        raise ValueError(f"image must be (H, W, D, C), got shape {image.shape}")
    if label.shape != image.shape[:3]:
        raise ValueError(f"label shape {label.shape} does not match image spatial shape {image.shape[:3]}")
    image = preprocess_image(image, config)
    if config.crop is not None:
        label = center_crop_or_pad(label, config.crop)
    if config.resize is not None:
        label = resize(label, config.resize, order=0)
    target = labels_to_target(label, config.layout, config.labels)
    return image, np.ascontiguousarray(target, dtype=np.uint8)


def preprocess_image(image: np.ndarray, config: PreprocessConfig) -> np.ndarray:
    """The image half of :func:`preprocess_case` (z-score, crop / pad, resize): what a model's input is made of,
    in training and in ``distmis predict`` (the model's own code, :func:`distmis.pyfunc_model.preprocess_image`).
    Returns float32 ``(h, w, d, C)``."""
    return _preprocess_image(image, config.crop, config.resize)


def preprocessed_spacing(shape: Sequence[int], spacing: Sequence[float],
                         config: PreprocessConfig) -> tuple[float, float, float]:
    """The voxel spacing (mm) of a case after :func:`preprocess_case`: a crop or pad keeps the spacing, a resize
    from ``n`` to ``m`` voxels along an axis multiplies it by ``n / m``."""
    before = config.crop if config.crop is not None else _check_shape3(tuple(shape)[:3], "image spatial shape")
    after = preprocessed_shape(shape, config)
    return tuple(float(s) * b / a for s, b, a in zip(tuple(spacing)[:3], before, after))  # type: ignore[return-value]


def preprocessed_shape(shape: Sequence[int], config: PreprocessConfig) -> tuple[int, int, int]:
    """The spatial shape :func:`preprocess_case` gives a case whose image has spatial shape ``shape``.

    The pipeline's geometry only: the centre crop / pad makes it ``config.crop``, then the resize
    ``config.resize``; with neither it stays ``shape``. Needs no voxel data (e.g. ``shape`` from a header).
    """
    if config.resize is not None:
        return config.resize
    if config.crop is not None:
        return config.crop
    return _check_shape3(tuple(shape)[:3], "image spatial shape")
