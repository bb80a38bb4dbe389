"""Turn one raw case into network-ready arrays.

The pipeline applied by :func:`preprocess_case` is, in order (nnU-Net's order: normalise, then resample):

1. :func:`~distmis.pyfunc_model.normalize_channels` - each channel by its scheme: ``zscore`` over the channel's
   non-zero voxels (MRI; the background stays exactly 0), or ``ct``: clipped to the training split's foreground
   0.5 / 99.5 percentiles, then z-scored with its foreground mean and standard deviation.
2. the crop to the box of the image's non-zero voxels (any channel), when ``crop_to_nonzero`` asks (nnU-Net's crop;
   the label is cropped with the image's box).
3. reorientation to ``orientation`` (e.g. RAS), when asked.
4. resampling to the target ``spacing`` in mm, when asked (images linearly or by B-spline, labels by nearest
   neighbour).
5. :func:`center_crop_or_pad` - optional, to a fixed ``crop`` shape (cuts away
   empty background, pads with zeros where the volume is smaller).
6. :func:`resize` - optional, resample to a fixed ``resize`` shape (linear for
   the image, nearest-neighbour for the label).
7. the label map to target channels (:mod:`distmis.data.targets`): one whole-tumour channel, overlapping regions
   (BraTS WT, TC, ET or an nnU-Net data set's regions), or the one-hot classes with background.

What to do is described by a :class:`PreprocessConfig`, which is stored in the
TFRecord manifest so that a trained model knows how its inputs were made.

Steps 1-6 (and the target schemes) are implemented once, in the code of the
model a search registers (:mod:`distmis.pyfunc_model`, which does not import distmis):
training data and predictions are made by the same functions, re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

import numpy as np

from distmis.data.dataset_layouts import dataset_layout, layout_description
from distmis.data.description import _coerce_enum
from distmis.data.layouts import Layout, coerce_layout, label_counts
from distmis.pyfunc_model import (
    CORE_VALUES, ENHANCING_VALUE, center_crop_or_pad, check_axcodes, check_shape3, legacy_targets, prepare_image,
    prepare_volume, preprocess_geometry, resize, zscore_nonzero,
)

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
    """Which segmentation target to train on (:mod:`distmis.data.targets`).

    ``whole-tumour``: one channel, any non-zero label.
    ``regions``: overlapping region channels: the nested BraTS evaluation regions
    WT (whole tumour), TC (tumour core), ET (enhancing tumour), or an nnU-Net data set's region-based labels.
    ``classes``: mutually exclusive classes from the data set's labels, one-hot with background (softmax).
    """

    WHOLE_TUMOUR = "whole-tumour"
    REGIONS = "regions"
    CLASSES = "classes"


def coerce_label_mode(mode: LabelMode | str) -> LabelMode:
    """Return ``mode`` as a :class:`LabelMode` (accepts ``"whole-tumour"`` / ``"regions"``)."""
    return _coerce_enum(LabelMode, mode, "label mode")


_check_shape3 = check_shape3  # a 3-D shape of positive integers, or ValueError naming ``what``


# --------------------------------------------------------------------------- labels


def labels_to_target(label: np.ndarray, layout: Layout | str, mode: LabelMode | str) -> np.ndarray:
    """Map a label map with the layout's values to binary target channels.

    Args:
        label: integer ``(H, W, D)`` label map with the values of the layout's own description (``layout_description``).
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
    allowed = layout_description(layout).label_values
    bad = [v for v in found if v not in allowed]
    if bad:
        raise ValueError(
            f"label values {bad} are not allowed for layout {layout.value!r} "
            f"(found {found}, allowed {list(allowed)})"
        )
    whole = label > 0
    if mode is LabelMode.WHOLE_TUMOUR:
        return whole[..., None].astype(np.uint8)
    core = np.isin(label, CORE_VALUES[layout.value])
    enhancing = label == ENHANCING_VALUE[layout.value]
    return np.stack([whole, core, enhancing], axis=-1).astype(np.uint8)


# --------------------------------------------------------------------------- config


Interpolation = Literal["linear", "bspline"]


@dataclass(frozen=True)
class PreprocessConfig:
    """What :func:`preprocess_case` does, resolved for one data set (:func:`distmis.search.data_config.preprocess_config`).

    Attributes:
        layout: on-disk layout of the source data set.
        labels: target channels (see :class:`LabelMode`).
        crop: centre crop / pad of the spatial axes, applied after resampling and before ``resize``.
        crop_to_nonzero: crop each case to the box of its image's non-zero voxels first (any channel; nnU-Net's
            crop), before reorientation and resampling; ``crop`` then gives the cases one shape.
        resize: final spatial shape after resampling.
        channels: the image channels' names, in order (None: the four BraTS modalities).
        normalization: per channel, ``{"scheme": "zscore"}`` or ``{"scheme": "ct", "lower", "upper", "mean",
            "std"}`` (the training split's foreground statistics; :func:`distmis.data.statistics.ct_statistics`).
            None: every channel ``zscore``.
        orientation: ``"RAS"``: every case reoriented to it first; None: kept as stored.
        spacing: target voxel spacing (mm) every case is resampled to; None: kept.
        interpolation: how images are resampled to ``spacing``: ``linear`` or ``bspline`` (cubic); labels always by
            nearest neighbour.
        targets: the target scheme (:mod:`distmis.data.targets`); None: the BraTS scheme of ``layout`` and
            ``labels``.

    Strings are accepted for the enums and lists for the shapes; they are normalised on construction, so that
    ``from_dict(to_dict())`` round-trips.
    """

    layout: Layout
    labels: LabelMode = LabelMode.WHOLE_TUMOUR
    crop: tuple[int, int, int] | None = None
    resize: tuple[int, int, int] | None = None
    channels: tuple[str, ...] | None = None
    normalization: tuple[dict[str, Any], ...] | None = None
    orientation: str | None = None
    spacing: tuple[float, float, float] | None = None
    interpolation: Interpolation = "linear"
    targets: dict[str, Any] | None = field(default=None, compare=True)
    crop_to_nonzero: bool = False

    __hash__ = None  # type: ignore[assignment]  # holds dicts

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", coerce_layout(self.layout))
        object.__setattr__(self, "labels", coerce_label_mode(self.labels))
        for name in ("crop", "resize"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _check_shape3(value, f"PreprocessConfig.{name}"))
        if not isinstance(self.crop_to_nonzero, bool):
            raise ValueError(f"PreprocessConfig.crop_to_nonzero must be true or false, got {self.crop_to_nonzero!r}")
        if self.crop_to_nonzero and self.crop is None:
            raise ValueError("PreprocessConfig.crop_to_nonzero needs crop: the cases' non-zero regions differ in "
                             "shape, and crop gives them one")
        if self.channels is not None:
            object.__setattr__(self, "channels", tuple(str(c) for c in self.channels))
        if self.normalization is not None:
            schemes = tuple(dict(n) for n in self.normalization)
            for scheme in schemes:
                if scheme.get("scheme") not in ("zscore", "ct"):
                    raise ValueError(f"PreprocessConfig.normalization: scheme must be 'zscore' or 'ct', got {scheme!r}")
            if self.channels is not None and len(schemes) != len(self.channels):
                raise ValueError(f"PreprocessConfig.normalization names {len(schemes)} channel(s), channels "
                                 f"{list(self.channels)}")
            object.__setattr__(self, "normalization", schemes)
        if self.orientation is not None:
            object.__setattr__(self, "orientation", check_axcodes(self.orientation, "PreprocessConfig.orientation"))
        if self.spacing is not None:
            values = tuple(float(v) for v in self.spacing)
            if len(values) != 3 or not all(math.isfinite(v) and v > 0 for v in values):
                raise ValueError(f"PreprocessConfig.spacing must be 3 positive numbers (mm), got {self.spacing!r}")
            object.__setattr__(self, "spacing", values)
        if self.interpolation not in ("linear", "bspline"):
            raise ValueError(f"PreprocessConfig.interpolation must be 'linear' or 'bspline', got {self.interpolation!r}")
        if self.targets is None:
            if self.labels is LabelMode.CLASSES or dataset_layout(self.layout).own is None:
                raise ValueError(f"PreprocessConfig with labels {self.labels.value!r} on layout {self.layout.value!r} "
                                 "needs its targets (the data set's labels: distmis.data.targets.target_scheme)")
            object.__setattr__(self, "targets", legacy_targets(self.layout.value, self.labels.value))
        elif self.targets.get("mode") != self.labels.value:
            raise ValueError(f"PreprocessConfig.targets are for labels {self.targets.get('mode')!r}, not "
                             f"{self.labels.value!r}")

    @property
    def scheme(self) -> dict[str, Any]:
        """The target scheme (:mod:`distmis.data.targets`)."""
        assert self.targets is not None
        return self.targets

    @property
    def num_classes(self) -> int:
        """Number of target channels (1 for whole-tumour, 3 for the BraTS regions, classes + 1 for classes)."""
        return len(self.scheme["channels"])

    def to_dict(self, *, statistics: bool = True) -> dict[str, Any]:
        """JSON-friendly dict (enums as strings, shapes as lists): the ``preprocess`` of a TFRecord manifest, and
        what the model's code (:mod:`distmis.pyfunc_model`) reads. ``statistics=False`` leaves out the CT channels'
        intensity statistics, which follow from the files and the split (the conversion's fingerprint)."""
        normalization = None
        if self.normalization is not None:
            normalization = [dict(n) if statistics else {"scheme": n["scheme"]} for n in self.normalization]
        return {
            "layout": self.layout.value,
            "labels": self.labels.value,
            "crop": list(self.crop) if self.crop is not None else None,
            "crop_to_nonzero": self.crop_to_nonzero,
            "resize": list(self.resize) if self.resize is not None else None,
            "channels": list(self.channels) if self.channels is not None else None,
            "normalization": normalization,
            "orientation": self.orientation,
            "spacing": list(self.spacing) if self.spacing is not None else None,
            "interpolation": self.interpolation,
            "targets": self.scheme,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PreprocessConfig:
        """Inverse of :meth:`to_dict` (also reads the four-key dicts written before); unknown keys are an error."""
        known = {"layout", "labels", "crop", "crop_to_nonzero", "resize", "channels", "normalization", "orientation",
                 "spacing", "interpolation", "targets"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown PreprocessConfig field(s) {unknown}; allowed: {sorted(known)}")
        if "layout" not in data:
            raise ValueError("PreprocessConfig needs a 'layout' ('msd', 'nnunet', 'brats' or 'brats2023')")
        values = {key: value for key, value in dict(data).items() if value is not None}
        return cls(**values)


def preprocess_case(image: np.ndarray, label: np.ndarray, config: PreprocessConfig,
                    spacing: Sequence[float] | None = None,
                    axcodes: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Apply the pipeline of the module docstring to one case.

    Args:
        image: ``(H, W, D, C)`` image as returned by :func:`~distmis.data.layouts.read_case`.
        label: ``(H, W, D)`` integer label map in the data set's values.
        config: what to do.
        spacing: the case's voxel spacing (mm); needed when ``config.spacing`` resamples.
        axcodes: the case's orientation (e.g. ``"LPS"``); needed when ``config.orientation`` reorients.

    Returns:
        ``(image, target)``: float32 ``(h, w, d, C)`` and uint8 ``(h, w, d, K)``
        with ``K = config.num_classes``.
    """
    if image.ndim != 4:
        raise ValueError(f"image must be (H, W, D, C), got shape {image.shape}")
    if label.shape != image.shape[:3]:
        raise ValueError(f"label shape {label.shape} does not match image spatial shape {image.shape[:3]}")
    from distmis.data.targets import label_channels

    recipe = config.to_dict()
    prepared, geometry = prepare_image(image, recipe, spacing, axcodes)
    label = prepare_volume(label, recipe, geometry, label=True)
    target = label_channels(label, config.scheme)
    return prepared, np.ascontiguousarray(target, dtype=np.uint8)


def preprocess_image(image: np.ndarray, config: PreprocessConfig, spacing: Sequence[float] | None = None,
                     axcodes: str | None = None) -> np.ndarray:
    """The image half of :func:`preprocess_case`: what a model's input is made of, in training and in
    ``distmis predict`` (the model's own code, :func:`distmis.pyfunc_model.prepare_image`). Returns float32
    ``(h, w, d, C)``."""
    return prepare_image(image, config.to_dict(), spacing, axcodes)[0]


def preprocessed_spacing(shape: Sequence[int], spacing: Sequence[float], config: PreprocessConfig,
                         axcodes: str | None = None) -> tuple[float, float, float]:
    """The voxel spacing (mm) of a case after :func:`preprocess_case`: reoriented and resampled to
    ``config.spacing`` where asked; a crop or pad keeps it, a resize from ``n`` to ``m`` voxels along an axis
    multiplies it by ``n / m``."""
    geometry = preprocess_geometry(shape, config.to_dict(), spacing, axcodes)
    if config.spacing is not None:
        spacing = config.spacing
    elif config.orientation is not None and axcodes is not None:
        from distmis.pyfunc_model import reoriented_spacing

        spacing = reoriented_spacing(spacing, axcodes, config.orientation)
    before = config.crop if config.crop is not None else geometry["resampled"]
    after = preprocessed_shape(shape, config, spacing=spacing, axcodes=axcodes)
    return tuple(float(s) * b / a for s, b, a in zip(tuple(spacing)[:3], before, after))  # type: ignore[return-value]


def preprocessed_shape(shape: Sequence[int], config: PreprocessConfig, *, spacing: Sequence[float] | None = None,
                       axcodes: str | None = None) -> tuple[int, int, int]:
    """The spatial shape :func:`preprocess_case` gives a case whose image has spatial shape ``shape``.

    The pipeline's geometry only: reoriented (axes permuted) and resampled to ``config.spacing`` where asked (the
    case's ``spacing`` and ``axcodes`` needed then), the centre crop / pad makes it ``config.crop``, then the resize
    ``config.resize``. Needs no voxel data (e.g. ``shape`` from a header).
    """
    if config.resize is not None:
        return config.resize
    if config.crop is not None:
        return config.crop
    shape = _check_shape3(tuple(shape)[:3], "image spatial shape")
    if config.spacing is None and config.orientation is None:
        return shape
    geometry = preprocess_geometry(shape, config.to_dict(), spacing, axcodes)
    return tuple(geometry["resampled"])  # type: ignore[return-value]
