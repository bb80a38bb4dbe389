"""A search's model as MLflow loads it, and the one implementation of its recipe: scan in, label map out.

This file is the code of the MLflow ``python_function`` model a search logs, saves to ``OUTPUT/model`` and registers
("models from code": MLflow copies it into the model folder and runs it when it loads the model, where it calls
``mlflow.models.set_model``). It is self-contained: it imports the standard library and numpy at the top, and
mlflow, scipy, MONAI, torch or TensorFlow/Keras inside the functions that need them - never ``distmis``, so
``mlflow.pyfunc.load_model("models:/<search>@best").predict(image)`` works where distmis is not installed.

The model folder's artifacts: ``recipe`` (``preprocessing.json``, the dict of
:class:`distmis.predict.recipe.ModelRecipe`) and ``network``: the weights in a form that needs only the framework
(torch: a ``torch.export`` program for a batch of windows of any size, ``network.pt2``; TensorFlow: the Keras model,
``model.keras``). A fold ensemble (the recipe's ``folds``: one network per cross-validation fold) has one network
artifact per fold instead, ``network_fold<i>`` for fold ``i`` (:func:`network_artifact`; files ``network_fold<i>.pt2``
or ``model_fold<i>.keras``), and its probabilities are the mean of its folds' (:meth:`SegmentationModel.probabilities`),
taken before they are thresholded or argmaxed; the ``folds`` parameter picks a subset of the folds. A configuration
ensemble (the recipe's ``configurations``: the configurations a cross-validated search found best together, each with
its own network, window and inference settings over the shared preprocessing) holds each configuration's networks as
``network_c<j>`` or ``network_c<j>_fold<i>`` (:func:`network_artifacts`), and its probabilities are the mean of its
configurations' (:func:`model_probabilities`).

:meth:`SegmentationModel.predict` takes ONE case's raw image ``(H, W, D, C)`` (channels in the recipe's
``modalities`` order; ``params``: the case's ``spacing`` and ``orientation`` where the recipe resamples or
reorients) and returns its label map ``(H, W, D)`` in the data set's label values: each channel normalised
(:func:`normalize_channels`: z-score over the non-zero voxels, or CT clipping and z-scoring with the training
foreground's statistics), cropped to its non-zero region, reoriented, resampled to the training spacing, centre
cropped / padded and resized as the recipe says (:func:`prepare_image`), probabilities by sliding windows of the
network's input (:func:`sliding_window`, MONAI's; each window test-time mirrored on the recipe's ``inference``
``mirror`` axes, or the ``mirror`` parameter's, as nnU-Net does: :func:`mirrored`), every geometric step undone
(:func:`restore_probabilities`),
then thresholded (sigmoid regions) or argmaxed (softmax classes) and painted in the data set's values
(:func:`probabilities_to_labels`, following the recipe's target scheme).

These functions are the only copy in distmis: :mod:`distmis.data.preprocess`, :mod:`distmis.data.postprocess`
and :mod:`distmis.train.inference` (training, validation) and ``distmis predict`` call them, so a label map from
the MLflow model and one from ``distmis predict`` are equal by construction.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import time
import types
import weakref
from typing import Any, Callable, Sequence

import numpy as np

__all__ = [
    "RECIPE_ARTIFACT", "NETWORK_ARTIFACT", "CORE_VALUES", "ENHANCING_VALUE", "EDEMA_VALUE", "CORE_ONLY_VALUE",
    "check_shape3", "zscore_nonzero", "center_crop_or_pad", "resize", "preprocess_image", "restore_geometry",
    "target_to_labels", "sliding_window", "predict_channels_last", "network_probabilities", "inference_memory_format",
    "segment",
    "load_network", "check_image", "check_params", "SegmentationModel", "pyfunc_class",
    "metric_key", "legacy_targets", "recipe_targets", "brain_tumour", "foreground", "labels_to_channels",
    "channel_masks", "probabilities_to_labels", "normalize_channels", "check_axcodes", "reorient",
    "reoriented_spacing", "resampled_shape", "ANISOTROPY_THRESHOLD", "separate_axis", "resample", "nonzero_box",
    "preprocess_geometry", "prepare_volume", "prepare_image",
    "restore_probabilities", "network_artifact", "recipe_folds", "recipe_configurations", "network_artifacts",
    "model_probabilities", "check_folds", "mean_probabilities",
    "keras_float16", "keras_float32", "keras_runnable_here", "largest_component", "check_postprocessing",
    "postprocess_masks", "MIRROR_AXES", "check_mirror", "mirrored",
    "recipe_mirror",
]

#: The model folder's artifacts (``artifacts/`` of the MLflow model): the recipe JSON and the network (a fold
#: ensemble: one network artifact per fold, :func:`network_artifact`).
RECIPE_ARTIFACT, NETWORK_ARTIFACT = "recipe", "network"


def _index(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{what} is an integer >= 0, got {value!r}")
    return int(value)


def network_artifact(fold: int | None = None, configuration: int | None = None) -> str:
    """The artifact name of a model's network: ``network`` for a single network (``fold`` None), ``network_fold<i>``
    for the network of fold ``i`` of a fold ensemble; in a configuration ensemble, configuration ``j``'s network
    ``network_c<j>`` or ``network_c<j>_fold<i>``."""
    name = NETWORK_ARTIFACT
    if configuration is not None:
        name = f"{name}_c{_index(configuration, 'a configuration')}"
    return name if fold is None else f"{name}_fold{_index(fold, 'a fold')}"


def recipe_configurations(recipe: dict[str, Any]) -> list[dict[str, Any]]:
    """The recipe of each configuration of a model: a configuration ensemble's (its recipe's ``configurations``,
    best ranked first), each the shared recipe with that configuration's own fields (``framework``, ``model``,
    ``window``, ``output``, ``inference``) over it; ``[recipe]`` for a model of one configuration (every recipe
    before version 7)."""
    members = recipe.get("configurations") or ()
    return [{**recipe, **member, "configurations": []} for member in members] or [recipe]


def network_artifacts(recipe: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every network artifact of a model, in the order of its networks (configuration by configuration, and within
    one fold by fold), each with the recipe of its configuration (:func:`recipe_configurations`)."""
    folds: Sequence[int | None] = recipe_folds(recipe) or (None,)
    members = recipe_configurations(recipe)
    indices: Sequence[int | None] = range(len(members)) if recipe.get("configurations") else (None,)
    return [(network_artifact(fold, index), member) for index, member in zip(indices, members) for fold in folds]


def recipe_folds(recipe: dict[str, Any]) -> tuple[int, ...]:
    """The folds of a fold ensemble, in the order of its networks; ``()`` for one network (every recipe written
    before folds were recorded)."""
    return tuple(int(f) for f in recipe.get("folds") or ())


# Label values, per layout ("msd", "brats" = BraTS 2018-2021, "brats2023"), of the tumour core (TC), the enhancing
# tumour (ET), and of each nested region's outermost part: whole tumour outside the core (edema), core outside the
# enhancing tumour. String keys: distmis's Layout members (a str Enum) look them up as well.
CORE_VALUES: dict[str, tuple[int, ...]] = {"msd": (2, 3), "brats": (1, 4), "brats2023": (1, 3)}
ENHANCING_VALUE: dict[str, int] = {"msd": 3, "brats": 4, "brats2023": 3}
EDEMA_VALUE: dict[str, int] = {"msd": 1, "brats": 2, "brats2023": 2}
CORE_ONLY_VALUE: dict[str, int] = {"msd": 2, "brats": 1, "brats2023": 1}
LABEL_MODES = ("whole-tumour", "regions")
MODES = ("gaussian", "constant")
#: The axes test-time mirroring can flip: the spatial axes 0, 1, 2 of a volume ``(H, W, D)`` on the preprocessed grid.
MIRROR_AXES = (0, 1, 2)


# --------------------------------------------------------------------------- geometry and intensity


def check_shape3(shape: Sequence[int], what: str) -> tuple[int, int, int]:
    """Validate a 3-D target shape of positive integers and return it as a tuple."""
    try:
        values = tuple(int(s) for s in shape)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be 3 positive integers, got {shape!r}") from None
    if len(values) != 3 or any(s <= 0 for s in values) or any(float(s) != float(o) for s, o in zip(values, shape)):
        raise ValueError(f"{what} must be 3 positive integers, got {shape!r}")
    return values  # type: ignore[return-value]


def _check_volume(array: np.ndarray, what: str) -> None:
    if array.ndim < 3:
        raise ValueError(f"{what} must have at least 3 (spatial) axes, got shape {array.shape}")


def zscore_nonzero(image: np.ndarray) -> np.ndarray:
    """Z-score each modality (last axis) over its non-zero voxels.

    For every channel, the mean and standard deviation are computed over the voxels where that channel is non-zero
    (the brain); those voxels become ``(x - mean) / std`` and the background stays 0. A channel that is constant over
    the brain (std 0) becomes 0 there instead of dividing by zero, and an all-zero channel stays all zero.

    Args:
        image: ``(H, W, D, C)`` array.

    Returns:
        float32 array of the same shape.
    """
    if image.ndim != 4:
        raise ValueError(f"zscore_nonzero expects an (H, W, D, C) image, got shape {image.shape}")
    out = np.zeros(image.shape, dtype=np.float32)
    for c in range(image.shape[-1]):
        channel = image[..., c]
        mask = channel != 0
        if not mask.any():
            continue
        values = channel[mask].astype(np.float64)
        mean = values.mean()
        std = values.std()
        normalised = (values - mean) / std if std > 0 else np.zeros_like(values)
        out[..., c][mask] = normalised.astype(np.float32)
    return out


def center_crop_or_pad(array: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """Centre-crop the first three axes to ``shape``; zero-pad axes that are smaller.

    Cropping removes ``(size - target) // 2`` voxels at the start of an axis and the rest at the end; padding adds
    ``(target - size) // 2`` zeros at the start and the rest at the end. Trailing (channel) axes are untouched and
    the dtype is kept.
    """
    target = check_shape3(shape, "crop shape")
    _check_volume(array, "array")
    slices = []
    pads = []
    for size, want in zip(array.shape[:3], target):
        if size >= want:
            start = (size - want) // 2
            slices.append(slice(start, start + want))
            pads.append((0, 0))
        else:
            slices.append(slice(None))
            before = (want - size) // 2
            pads.append((before, want - size - before))
    out = array[tuple(slices)]
    if any(p != (0, 0) for p in pads):
        pads.extend([(0, 0)] * (array.ndim - 3))
        out = np.pad(out, pads, mode="constant", constant_values=0)
    return np.ascontiguousarray(out)


def resize(array: np.ndarray, shape: Sequence[int], *, order: int, grid_mode: bool = False) -> np.ndarray:
    """Resample the first three axes to exactly ``shape`` with ``scipy.ndimage.zoom``.

    Args:
        array: ``(H, W, D)`` or ``(H, W, D, C)``; channels are resampled one by one.
        shape: target ``(h, w, d)``.
        order: spline order: 1 (linear) for images, 0 (nearest) for label maps.
        grid_mode: False (``resize``): the first and last voxel centres stay where they are; True (resampling to a
            spacing): the voxels are cells and the volume's extent stays, so the new grid's spacing is exactly
            ``old spacing * old size / new size`` (scipy's ``grid_mode``).

    Returns:
        an array of shape ``(h, w, d, ...)`` and the input dtype.
    """
    from scipy import ndimage

    target = check_shape3(shape, "resize shape")
    _check_volume(array, "array")
    if order not in range(6):
        raise ValueError(f"order must be an integer spline order 0-5, got {order!r}")
    if tuple(array.shape[:3]) == target:
        return array.copy()
    factors = [want / size for want, size in zip(target, array.shape[:3])]
    if array.ndim == 3:
        out = ndimage.zoom(array, factors, order=order, mode="nearest", grid_mode=grid_mode)
    else:
        flat = array.reshape(array.shape[:3] + (-1,))
        out = np.stack(
            [ndimage.zoom(flat[..., i], factors, order=order, mode="nearest", grid_mode=grid_mode)
             for i in range(flat.shape[-1])],
            axis=-1,
        ).reshape(target + array.shape[3:])
    if tuple(out.shape[:3]) != target:  # zoom rounds the output size; guard against an off-by-one
        raise AssertionError(f"resize produced {out.shape[:3]} instead of {target}")
    return out


def preprocess_image(image: np.ndarray, crop: Sequence[int] | None = None,
                     resize_to: Sequence[int] | None = None) -> np.ndarray:
    """What a network's input is made of, in training and prediction: :func:`zscore_nonzero`, then the centre
    crop / pad to ``crop`` and the (linear) resize to ``resize_to`` where given. Returns float32 ``(h, w, d, C)``."""
    image = zscore_nonzero(image)
    if crop is not None:
        image = center_crop_or_pad(image, crop)
    if resize_to is not None:
        image = resize(image, resize_to, order=1).astype(np.float32, copy=False)
    return np.ascontiguousarray(image, dtype=np.float32)


def restore_geometry(prob: np.ndarray, shape: Sequence[int], crop: Sequence[int] | None = None,
                     resize_to: Sequence[int] | None = None) -> np.ndarray:
    """Per-channel values ``(h, w, d, C)`` on the preprocessed grid -> ``(H, W, D, C)`` on the scan's grid.

    ``shape``: the scan's spatial shape ``(H, W, D)`` before preprocessing; ``crop`` and ``resize_to``: the
    preprocessing's. The resize is undone first (linear interpolation of the values, from ``resize_to`` back to
    ``crop`` or ``shape``), then the centre crop / pad. :func:`center_crop_or_pad` is its own inverse: cropping an
    axis from ``n`` to ``m`` starts at ``(n - m) // 2``, the same offset at which padding from ``m`` back to ``n``
    places it, so a voxel returns exactly to where it came from; the cropped-away border comes back as 0.
    """
    original = check_shape3(tuple(shape), "scan shape")
    crop = check_shape3(crop, "crop shape") if crop is not None else None
    resize_to = check_shape3(resize_to, "resize shape") if resize_to is not None else None
    if prob.ndim != 4:
        raise ValueError(f"prob must be channels-last (h, w, d, C), got shape {prob.shape}")
    expected = resize_to or crop or original
    if tuple(prob.shape[:3]) != tuple(expected):
        steps = {"crop": list(crop) if crop else None, "resize": list(resize_to) if resize_to else None}
        raise ValueError(f"prob has spatial shape {prob.shape[:3]}, but preprocessing {steps} of a "
                         f"{list(original)} scan gives {list(expected)}")
    out = np.asarray(prob, dtype=np.float32)
    if resize_to is not None:
        out = resize(out, crop or original, order=1)
    if crop is not None:
        out = center_crop_or_pad(out, original)
    return np.ascontiguousarray(out, dtype=np.float32)


def target_to_labels(target: np.ndarray, layout: str, mode: str) -> np.ndarray:
    """Binary target channels ``(H, W, D, C)`` -> a uint8 label map ``(H, W, D)`` in ``layout``'s values.

    ``whole-tumour`` (one channel): 0 background, 1 tumour, whatever the layout. ``regions`` (WT, TC, ET): the
    nesting ET within TC within WT is imposed from the inside out, as BraTS defines the regions: an enhancing voxel is
    enhancing tumour, a core voxel that is not enhancing is the core's other label, a whole-tumour voxel outside the
    core is edema (BraTS 2018-2021: edema 2, necrotic core 1, enhancing 4; MSD: 1, 2, 3; BraTS 2023: 2, 1, 3).
    """
    if layout not in EDEMA_VALUE:
        raise ValueError(f"unknown layout {layout!r}; expected one of {list(EDEMA_VALUE)}")
    if mode not in LABEL_MODES:
        raise ValueError(f"unknown label mode {mode!r}; expected one of {list(LABEL_MODES)}")
    channels = 1 if mode == "whole-tumour" else 3
    if target.ndim != 4 or target.shape[-1] != channels:
        raise ValueError(f"target must be (H, W, D, {channels}) for labels {mode!r}, got shape {target.shape}")
    on = np.asarray(target) > 0
    if mode == "whole-tumour":
        return on[..., 0].astype(np.uint8)
    labels = np.zeros(target.shape[:3], dtype=np.uint8)
    labels[on[..., 0]] = EDEMA_VALUE[layout]
    labels[on[..., 1]] = CORE_ONLY_VALUE[layout]
    labels[on[..., 2]] = ENHANCING_VALUE[layout]
    return labels


# --------------------------------------------------------------------------- targets: what the output channels mean


def metric_key(name: str) -> str:
    """A label's name as it appears in metric names (``val_dice_<key>``): letters, digits, ``_``, ``.`` and ``-``
    kept, every other run of characters one ``_`` (``"non-enhancing tumor"`` -> ``"non-enhancing_tumor"``)."""
    key = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(name)).strip("_")
    return key or "label"


def _channel(name: str, values: Sequence[int], paint: int) -> dict[str, Any]:
    return {"name": str(name), "key": metric_key(name), "values": [int(v) for v in values], "paint": int(paint)}


def legacy_targets(layout: str, mode: str) -> dict[str, Any]:
    """The target scheme of the brain-tumour label modes on a brain-tumour layout (``msd`` meaning MSD Task01):
    ``whole-tumour``: one channel WT, every tumour label; ``regions``: the nested BraTS regions WT, TC, ET, painted
    back as edema, the core's other label and enhancing tumour. Both sigmoid. (Recipes written before the target
    scheme was recorded mean this.)"""
    if layout not in EDEMA_VALUE:
        raise ValueError(f"unknown layout {layout!r}; expected one of {list(EDEMA_VALUE)}")
    if mode not in LABEL_MODES:
        raise ValueError(f"unknown label mode {mode!r}; expected one of {list(LABEL_MODES)}")
    tumour = sorted({EDEMA_VALUE[layout], *CORE_VALUES[layout]})
    if mode == "whole-tumour":
        return {"mode": mode, "activation": "sigmoid", "channels": [_channel("WT", tumour, 1)]}
    return {"mode": mode, "activation": "sigmoid", "channels": [
        _channel("WT", tumour, EDEMA_VALUE[layout]),
        _channel("TC", CORE_VALUES[layout], CORE_ONLY_VALUE[layout]),
        _channel("ET", (ENHANCING_VALUE[layout],), ENHANCING_VALUE[layout]),
    ]}


def recipe_targets(recipe: dict[str, Any]) -> dict[str, Any]:
    """The target scheme a recipe (or a TFRecord manifest's ``preprocess``) records; for one written before it was
    recorded, :func:`legacy_targets` of its layout and label mode."""
    targets = recipe.get("targets")
    return targets if targets else legacy_targets(str(recipe["layout"]), str(recipe["labels"]))


def brain_tumour(recipe: dict[str, Any]) -> bool:
    """Whether a recipe's model predicts the BraTS whole tumour or regions of a brain-tumour layout (``msd`` meaning
    MSD Task01): only such a model can write another brain-tumour layout's label values."""
    layout, targets = str(recipe["layout"]), recipe_targets(recipe)
    return layout in EDEMA_VALUE and targets["mode"] in LABEL_MODES and targets == legacy_targets(layout, targets["mode"])


def foreground(targets: dict[str, Any]) -> list[dict[str, Any]]:
    """The channels that are scored: all of them, but the background channel of a softmax (``classes``) scheme."""
    channels = list(targets["channels"])
    return channels[1:] if targets["activation"] == "softmax" else channels


def labels_to_channels(label: np.ndarray, targets: dict[str, Any]) -> np.ndarray:
    """uint8 ``(H, W, D, C)``: channel ``c`` is 1 where the label map holds one of the channel's ``values``
    (``classes``: the one-hot encoding, background first; ``regions``: the overlapping regions)."""
    label = np.asarray(label)
    return np.stack([np.isin(label, channel["values"]) for channel in targets["channels"]], axis=-1).astype(np.uint8)


def channel_masks(prob: np.ndarray, targets: dict[str, Any], threshold: float = 0.5) -> np.ndarray:
    """Boolean ``(..., C)``: what a prediction's channels hold. Sigmoid: each channel at or above ``threshold``;
    softmax: the one-hot encoding of the argmax over the channels (the first of equal ones)."""
    prob = np.asarray(prob)
    if prob.shape[-1] != len(targets["channels"]):
        raise ValueError(f"the prediction has {prob.shape[-1]} channel(s), the target scheme "
                         f"{len(targets['channels'])}: {[c['name'] for c in targets['channels']]}")
    if targets["activation"] == "softmax":
        winner = np.argmax(prob, axis=-1)
        return winner[..., None] == np.arange(prob.shape[-1])
    return prob >= threshold


def largest_component(mask: np.ndarray) -> np.ndarray:
    """``mask`` (boolean, 3-D) with all but its largest connected component removed (26-connectivity: voxels
    touching at a face, an edge or a corner are connected; of equal largest ones the first in scan order); an empty
    mask or one of a single component is returned as a copy."""
    from scipy import ndimage

    mask = np.asarray(mask, dtype=bool)
    labelled, count = ndimage.label(mask, structure=np.ones((3, 3, 3), dtype=bool))
    if count <= 1:
        return mask.copy()
    sizes = np.bincount(labelled.ravel())[1:]
    return labelled == int(np.argmax(sizes)) + 1


def check_postprocessing(postprocessing: Any, targets: dict[str, Any]) -> dict[str, Any]:
    """A recipe's ``postprocessing``: ``{"foreground": bool, "channels": [key, ...]}``, the keys those of scored
    channels of ``targets``; ``None`` or ``{}``: none. ValueError naming what is wrong."""
    if not postprocessing:
        return {"foreground": False, "channels": []}
    if not isinstance(postprocessing, dict) or set(postprocessing) - {"foreground", "channels"}:
        raise ValueError(f"postprocessing must be {{'foreground': bool, 'channels': [key, ...]}}, got {postprocessing!r}")
    keys = [channel["key"] for channel in foreground(targets)]
    channels = list(postprocessing.get("channels") or [])
    unknown = [key for key in channels if key not in keys]
    if unknown:
        raise ValueError(f"postprocessing names channel(s) {unknown} the target scheme does not score; it scores {keys}")
    return {"foreground": bool(postprocessing.get("foreground", False)), "channels": channels}


def postprocess_masks(masks: np.ndarray, targets: dict[str, Any], postprocessing: dict[str, Any] | None) -> np.ndarray:
    """:func:`channel_masks`' ``(H, W, D, C)`` masks after nnU-Net's postprocessing as cross-validation chose it
    (``postprocessing``: :func:`check_postprocessing`): with ``foreground``, all but the largest connected component
    of the scored channels together (the foreground as a whole) removed from every scored channel; then, for each
    key of ``channels``, all but that channel's largest component removed from it. A softmax (``classes``) scheme's
    removed voxels become background, so that every voxel still holds exactly one class."""
    chosen = check_postprocessing(postprocessing, targets)
    if not chosen["foreground"] and not chosen["channels"]:
        return masks
    out = np.array(masks, dtype=bool, copy=True)
    scored = [i for i, channel in enumerate(targets["channels"]) if channel in foreground(targets)]
    if chosen["foreground"]:
        out[..., scored] &= largest_component(out[..., scored].any(axis=-1))[..., None]
    keys = [channel["key"] for channel in targets["channels"]]
    for key in chosen["channels"]:
        index = keys.index(key)
        out[..., index] = largest_component(out[..., index])
    if targets["activation"] == "softmax":
        out[..., 0] = ~out[..., 1:].any(axis=-1)
    return out


def probabilities_to_labels(prob: np.ndarray, targets: dict[str, Any], threshold: float = 0.5,
                            postprocessing: dict[str, Any] | None = None) -> np.ndarray:
    """A label map ``(H, W, D)`` in the data set's values from per-channel probabilities ``(H, W, D, C)``. Softmax:
    each voxel takes the ``paint`` value of its most probable channel. Sigmoid: 0, then each channel at or above
    ``threshold`` painted with its value in order, so a later (inner) region wins, as nnU-Net's
    ``regions_class_order``. ``postprocessing``: the largest-component removals cross-validation chose
    (:func:`postprocess_masks`), applied to the channels' masks before they are painted. uint8 when every value
    fits, else uint16."""
    masks = postprocess_masks(channel_masks(prob, targets, threshold), targets, postprocessing)
    paints = [int(channel["paint"]) for channel in targets["channels"]]
    dtype = np.uint8 if max(paints + [0]) <= 255 else np.uint16
    if targets["activation"] == "softmax":
        return np.asarray(paints, dtype=dtype)[np.argmax(masks, axis=-1)]
    labels = np.zeros(masks.shape[:-1], dtype=dtype)
    for index, paint in enumerate(paints):
        labels[masks[..., index]] = paint
    return labels


# --------------------------------------------------------------------------- intensities, orientation, spacing


def normalize_channels(image: np.ndarray, normalization: Sequence[dict[str, Any]] | None) -> np.ndarray:
    """Each channel of ``(H, W, D, C)`` normalised by its scheme: ``zscore`` (:func:`zscore_nonzero`, per case over
    the channel's non-zero voxels) or ``ct`` (clipped to ``[lower, upper]``, the training cases' foreground 0.5 and
    99.5 percentiles, then ``(x - mean) / std`` with their foreground mean and standard deviation, as nnU-Net's CT
    normalisation). ``None``: every channel ``zscore``. Returns float32."""
    if image.ndim != 4:
        raise ValueError(f"normalize_channels expects an (H, W, D, C) image, got shape {image.shape}")
    if normalization is None:
        return zscore_nonzero(image)
    if len(normalization) != image.shape[-1]:
        raise ValueError(f"the image has {image.shape[-1]} channel(s), the normalisation names {len(normalization)}")
    out = np.empty(image.shape, dtype=np.float32)
    for c, scheme in enumerate(normalization):
        channel = image[..., c:c + 1]
        if scheme["scheme"] == "zscore":
            out[..., c:c + 1] = zscore_nonzero(channel)
        elif scheme["scheme"] == "ct":
            std = max(float(scheme["std"]), 1e-8)
            clipped = np.clip(channel.astype(np.float64), float(scheme["lower"]), float(scheme["upper"]))
            out[..., c:c + 1] = ((clipped - float(scheme["mean"])) / std).astype(np.float32)
        else:
            raise ValueError(f"unknown normalisation scheme {scheme['scheme']!r}; expected 'zscore' or 'ct'")
    return out


_AXIS_PAIRS = ("RL", "AP", "SI")


def check_axcodes(axcodes: str, what: str = "orientation") -> str:
    """``axcodes`` as three upper-case letters naming where each array axis points (nibabel's ``aff2axcodes``,
    e.g. ``"RAS"``, ``"LPS"``), one of R/L, one of A/P and one of S/I; ValueError otherwise."""
    codes = str(axcodes).upper()
    if len(codes) != 3 or sorted(next((i for i, pair in enumerate(_AXIS_PAIRS) if c in pair), 9) for c in codes) \
            != [0, 1, 2]:
        raise ValueError(f"{what} must be three axis codes, one of R/L, A/P and S/I (e.g. 'RAS', 'LPS'), "
                         f"got {axcodes!r}")
    return codes


def _orientation(source: str, target: str) -> tuple[list[int], list[bool]]:
    """For each target axis: the source axis it comes from, and whether it is flipped."""
    source, target = check_axcodes(source), check_axcodes(target)
    order, flips = [], []
    for code in target:
        pair = next(p for p in _AXIS_PAIRS if code in p)
        axis = next(i for i, c in enumerate(source) if c in pair)
        order.append(axis)
        flips.append(source[axis] != code)
    return order, flips


def reorient(array: np.ndarray, source: str, target: str) -> np.ndarray:
    """The first three axes of ``array`` (oriented ``source``, e.g. ``"LPS"``) permuted and flipped to ``target``
    (e.g. ``"RAS"``); trailing axes kept. ``reorient(reorient(a, s, t), t, s)`` is ``a``."""
    order, flips = _orientation(source, target)
    out = np.transpose(array, order + list(range(3, array.ndim)))
    for axis, flip in enumerate(flips):
        if flip:
            out = np.flip(out, axis=axis)
    return np.ascontiguousarray(out)


def reoriented_spacing(spacing: Sequence[float], source: str, target: str) -> tuple[float, float, float]:
    """The voxel spacing of an array after :func:`reorient` (the axes permuted alike)."""
    order, _ = _orientation(source, target)
    return tuple(float(spacing[axis]) for axis in order)  # type: ignore[return-value]


def resampled_shape(shape: Sequence[int], spacing: Sequence[float], target: Sequence[float]) -> tuple[int, int, int]:
    """The shape a volume of ``shape`` voxels at ``spacing`` mm has at ``target`` mm: ``round(n * s / t)``, at
    least 1 (the field of view kept, as nnU-Net computes it)."""
    return tuple(max(1, int(round(int(n) * float(s) / float(t))))  # type: ignore[return-value]
                 for n, s, t in zip(tuple(shape)[:3], spacing, target))


INTERPOLATION_ORDER = {"linear": 1, "bspline": 3}
#: nnU-Net's threshold: a grid whose coarsest axis is more than this many times its finest is resampled in two passes.
ANISOTROPY_THRESHOLD = 3.0


def separate_axis(spacing: Sequence[float] | None, target: Sequence[float] | None) -> int | None:
    """nnU-Net's rule for resampling anisotropic data: the axis resampled on its own (the out-of-plane axis), or None.

    The scan's own spacing decides first, then the target's: the grid whose coarsest axis is more than
    :data:`ANISOTROPY_THRESHOLD` times its finest has that axis resampled apart from the others, by nearest
    neighbour, so that the thick slices are not blended into each other (:func:`resample`). A grid with two equally
    coarse axes has none."""
    for grid in (spacing, target):
        if grid is None:
            continue
        values = [float(v) for v in grid]
        coarsest = max(values)
        if coarsest / min(values) > ANISOTROPY_THRESHOLD and values.count(coarsest) == 1:
            return values.index(coarsest)
    return None


def resample(array: np.ndarray, shape: Sequence[int], *, order: int, axis: int | None) -> np.ndarray:
    """Resample the first three axes to ``shape`` on the volume's extent (``grid_mode``), as to a voxel spacing: in
    one pass at spline ``order``, or, with a separate ``axis`` (:func:`separate_axis`), the other two axes at
    ``order`` first, then ``axis`` alone by nearest neighbour (nnU-Net's resampling of anisotropic data)."""
    target = check_shape3(shape, "resample shape")
    if axis is None or order == 0:
        return resize(array, target, order=order, grid_mode=True)
    in_plane = tuple(array.shape[i] if i == axis else target[i] for i in range(3))
    out = resize(array, in_plane, order=order, grid_mode=True)
    return resize(out, target, order=0, grid_mode=True)


def nonzero_box(image: np.ndarray) -> tuple[slice, slice, slice]:
    """The bounding box of the voxels where any channel of ``image`` (``(H, W, D, C)``) is non-zero: nnU-Net's crop.
    The whole volume when no voxel is (nothing to crop to)."""
    where = np.argwhere(np.any(image != 0, axis=-1))
    if not len(where):
        return tuple(slice(0, n) for n in image.shape[:3])  # type: ignore[return-value]
    low, high = where.min(axis=0), where.max(axis=0) + 1
    return tuple(slice(int(a), int(b)) for a, b in zip(low, high))  # type: ignore[return-value]


def _box_slices(geometry: dict[str, Any]) -> tuple[slice, slice, slice] | None:
    box = geometry.get("box")
    return None if box is None else tuple(slice(int(a), int(b)) for a, b in box)  # type: ignore[return-value]


def preprocess_geometry(shape: Sequence[int], preprocess: dict[str, Any], spacing: Sequence[float] | None = None,
                        axcodes: str | None = None, box: Sequence[slice] | None = None) -> dict[str, Any]:
    """Where each step of :func:`prepare_image` takes a scan of spatial ``shape`` (``spacing`` mm, oriented
    ``axcodes``): the box it is cropped to first (``box``, its non-zero region when the recipe's
    ``crop_to_nonzero`` says so: :func:`nonzero_box`), the shapes after reorientation and resampling, and what the
    restore needs to go back."""
    full = check_shape3(tuple(shape)[:3], "scan shape")
    shape = full
    if box is not None:
        if len(box) != 3 or not all(0 <= b.start < b.stop <= n for b, n in zip(box, full)):
            raise ValueError(f"box {box} is not a non-empty box inside a {list(full)} scan")
        shape = tuple(b.stop - b.start for b in box)  # type: ignore[assignment]
    orientation = preprocess.get("orientation")
    target_spacing = preprocess.get("spacing")
    if orientation and axcodes is None:
        raise ValueError(f"this model reorients every scan to {orientation}: give the scan's orientation "
                         f"(params={{'orientation': 'LPS'}}, nibabel.aff2axcodes of its affine)")
    if target_spacing and spacing is None:
        raise ValueError(f"this model resamples every scan to a {list(target_spacing)} mm grid: give the scan's "
                         "voxel spacing (params={'spacing': [x, y, z]}, in mm, along the array's axes)")
    oriented, oriented_spacing = shape, tuple(spacing) if spacing is not None else None
    if orientation:
        order, _ = _orientation(axcodes, orientation)  # type: ignore[arg-type]
        oriented = tuple(shape[axis] for axis in order)
        if oriented_spacing is not None:
            oriented_spacing = reoriented_spacing(oriented_spacing, axcodes, orientation)  # type: ignore[arg-type]
    resampled = resampled_shape(oriented, oriented_spacing, target_spacing) if target_spacing else oriented
    axis = separate_axis(oriented_spacing, target_spacing) if target_spacing else None
    return {"shape": list(full), "box": None if box is None else [[b.start, b.stop] for b in box],
            "axcodes": axcodes, "oriented": list(oriented), "resampled": list(resampled), "separate_axis": axis}


def prepare_volume(array: np.ndarray, preprocess: dict[str, Any], geometry: dict[str, Any], *, label: bool) -> np.ndarray:
    """The geometry steps of the preprocessing on an image ``(H, W, D, C)`` (already normalised) or a label map
    ``(H, W, D)``: the crop to the geometry's box (the image's non-zero region), reorientation, resampling to the
    target spacing (images linearly or by B-spline, labels by nearest neighbour; an anisotropic grid's out-of-plane
    axis apart, by nearest neighbour: :func:`resample`), centre crop / pad, resize (images linearly, labels by
    nearest neighbour)."""
    orientation, crop, resize_to = preprocess.get("orientation"), preprocess.get("crop"), preprocess.get("resize")
    order = 0 if label else INTERPOLATION_ORDER[preprocess.get("interpolation") or "linear"]
    out = array
    box = _box_slices(geometry)
    if box is not None:
        out = out[box]
    if orientation:
        out = reorient(out, geometry["axcodes"], orientation)
    if tuple(geometry["resampled"]) != tuple(out.shape[:3]):
        out = resample(out, geometry["resampled"], order=order, axis=geometry.get("separate_axis"))
    if crop is not None:
        out = center_crop_or_pad(out, crop)
    if resize_to is not None:
        out = resize(out, resize_to, order=0 if label else 1)
    return np.ascontiguousarray(out)


def prepare_image(image: np.ndarray, preprocess: dict[str, Any], spacing: Sequence[float] | None = None,
                  axcodes: str | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """What a network's input is made of, in training and prediction: each channel normalised
    (:func:`normalize_channels`), then :func:`prepare_volume` (first cropped to the image's non-zero region when
    the recipe's ``crop_to_nonzero`` says so). Returns the float32 ``(h, w, d, C)`` input and the geometry
    (:func:`preprocess_geometry`) that :func:`restore_probabilities` undoes."""
    box = nonzero_box(image) if preprocess.get("crop_to_nonzero") else None
    geometry = preprocess_geometry(image.shape[:3], preprocess, spacing, axcodes, box)
    normalised = normalize_channels(image, preprocess.get("normalization"))
    out = prepare_volume(normalised, preprocess, geometry, label=False)
    return np.ascontiguousarray(out, dtype=np.float32), geometry


def restore_probabilities(prob: np.ndarray, preprocess: dict[str, Any], geometry: dict[str, Any]) -> np.ndarray:
    """Per-channel values ``(h, w, d, C)`` on the network's grid -> ``(H, W, D, C)`` on the scan's own grid: the
    resize and crop undone (:func:`restore_geometry`), the values resampled linearly back (an anisotropic grid's
    out-of-plane axis apart, by nearest neighbour, as :func:`resample` does) to the scan's shape before
    resampling, the reorientation undone, and the values placed back in the box the scan was cropped to (0
    outside it: no region; for a softmax, whose all-zero voxels argmax to the first channel, the background)."""
    orientation = preprocess.get("orientation")
    out = restore_geometry(prob, geometry["resampled"], preprocess.get("crop"), preprocess.get("resize"))
    if tuple(geometry["oriented"]) != tuple(out.shape[:3]):
        out = resample(out, geometry["oriented"], order=1, axis=geometry.get("separate_axis"))
    if orientation:
        out = reorient(out, orientation, geometry["axcodes"])
    box = _box_slices(geometry)
    if box is not None:
        whole = np.zeros(tuple(geometry["shape"]) + out.shape[3:], dtype=np.float32)
        whole[box] = out
        out = whole
    return np.ascontiguousarray(out, dtype=np.float32)


# --------------------------------------------------------------------------- sliding windows


def _window(window: int | Sequence[int]) -> tuple[int, int, int]:
    triple = (window,) * 3 if isinstance(window, int) else tuple(window)
    if len(triple) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in triple):
        raise ValueError(f"window must be a positive int or three positive ints, got {window!r}")
    return triple  # type: ignore[return-value]


def check_mirror(mirror: Any, what: str = "mirror") -> tuple[int, ...]:
    """``mirror`` as the sorted axes test-time mirroring flips: distinct spatial axes of the volume, each 0, 1 or 2
    (:data:`MIRROR_AXES`), in a list, tuple or numpy array (one int: that axis alone); ``()`` (empty): no mirroring.
    ValueError naming ``what`` and the value otherwise."""
    allowed = "a list of distinct spatial axes 0, 1, 2 (e.g. [0, 1, 2]; [] for none)"
    if isinstance(mirror, np.ndarray) and mirror.ndim <= 1:
        values: Any = mirror.tolist() if mirror.ndim else [mirror.item()]
    elif isinstance(mirror, (int, np.integer)) and not isinstance(mirror, bool):
        values = [mirror]
    elif isinstance(mirror, (list, tuple)):
        values = list(mirror)
    else:
        raise ValueError(f"{what} must be {allowed}, got {mirror!r}")
    if any(isinstance(a, bool) or not isinstance(a, (int, np.integer)) or int(a) not in MIRROR_AXES for a in values):
        raise ValueError(f"{what} must be {allowed}, got {mirror!r}")
    axes = [int(a) for a in values]
    repeated = sorted({a for a in axes if axes.count(a) > 1})
    if repeated:
        raise ValueError(f"{what} {axes} names axis(es) {repeated} more than once; it must be {allowed}")
    return tuple(sorted(axes))


def recipe_mirror(recipe: dict[str, Any]) -> tuple[int, ...]:
    """The axes a recipe's model mirrors at test time (its ``inference`` ``mirror``); ``()`` for a recipe written
    before test-time mirroring was recorded (no mirroring)."""
    return check_mirror((recipe.get("inference") or {}).get("mirror") or (), "the recipe's inference mirror")


def mirrored(predictor: Callable[[Any], Any], mirror: Sequence[int], *, channels_last: bool = False
             ) -> Callable[[Any], Any]:
    """``predictor`` with nnU-Net's test-time mirroring: a batch of windows is predicted ``2**k`` times, once for
    every subset ``S`` of the ``k`` axes of ``mirror`` (the empty subset, the windows as they are, included), as
    ``flip(predictor(flip(windows, S)), S)``, and the mean of those ``2**k`` predictions (in float32) is returned.
    ``predictor``'s output is averaged as it gives it: probabilities (after the activation) where it returns
    probabilities, as the predictors of :func:`network_probabilities` and the trainers do. The subsets are visited in
    a fixed order (subset ``m`` holds the ``i``-th axis where bit ``i`` of ``m`` is set, ``m = 0 .. 2**k - 1``), so
    ranks that call a collective-running predictor run the same passes in the same order. Empty ``mirror``:
    ``predictor`` itself.

    The axes of ``mirror`` are the SPATIAL axes ``0, 1, 2`` of the volume ``(H, W, D)`` on the preprocessed grid (the
    network's input grid: reoriented, resampled, cropped and resized as the recipe says), whatever the windows'
    memory layout: for channels-first torch windows ``(n, C, H, W, D)`` (``channels_last=False``: inside
    :func:`sliding_window`) axis ``a`` is tensor dimension ``a + 2``; for channels-last numpy windows
    ``(n, H, W, D, C)`` (``channels_last=True``: :func:`predict_channels_last` predicting a whole volume) dimension
    ``a + 1``. The output is flipped back along the same dimensions, so it must be laid out like the input (the
    predictions ``(n, K, H, W, D)``, or ``(n, H, W, D, K)``).
    """
    axes = check_mirror(mirror)
    if not axes:
        return predictor
    first = 1 if channels_last else 2
    # subset m holds the i-th axis where bit i of m is set: m = 0 is the empty subset, the windows as they are
    subsets = [tuple(a + first for i, a in enumerate(axes) if m >> i & 1) for m in range(2 ** len(axes))]

    def predict(windows: Any) -> Any:
        numpy = isinstance(windows, np.ndarray)
        if numpy:
            def flip(array: Any, dims: tuple[int, ...]) -> Any:
                return np.ascontiguousarray(np.flip(array, dims)) if dims else array
        else:
            import torch

            def flip(array: Any, dims: tuple[int, ...]) -> Any:
                return torch.flip(array, dims) if dims else array
        total = None
        for dims in subsets:
            out = predictor(flip(windows, dims))
            if numpy:
                out = np.asarray(out)
            elif not isinstance(out, torch.Tensor):
                raise ValueError(f"predictor must return a torch tensor of windows, got {type(out).__name__}")
            if out.ndim != windows.ndim:
                raise ValueError(f"predictor must map windows {tuple(windows.shape)} to windows laid out alike, "
                                 f"got shape {tuple(out.shape)}")
            out = flip(out, dims)
            if total is None:  # a copy of our own to add to: the output may be a view of the input
                total = np.array(out, dtype=np.float32) if numpy else out.to(torch.float32, copy=True)
            else:
                total += out
        total /= len(subsets)
        return total

    return predict


def sliding_window(predictor: Callable[[Any], Any], volume: Any, window: int | Sequence[int], *,
                   overlap: float = 0.5, mode: str = "gaussian", sigma_scale: float = 0.125,
                   batch_size: int = 1, mirror: Sequence[int] = ()) -> Any:
    """Float32 predictions ``(B, K, *spatial)`` of a ``(B, C, *spatial)`` torch volume from ``window``-sized windows.

    ``predictor`` maps windows ``(n, C, *window)`` to ``(n, K, *window)`` (logits or probabilities; they are averaged
    as given); it runs under ``torch.no_grad()`` on up to ``batch_size`` windows at a time (windows of different
    volumes of the batch may share a call). A volume smaller than the window along an axis is zero-padded on both
    sides (MONAI's centred padding) and the prediction cropped back to its shape. When ``window`` equals the volume's
    shape the result is ``predictor(volume)`` (one window; the weights cancel).

    ``mirror``: the spatial axes (0, 1, 2 of ``*spatial``, i.e. dimensions 2, 3, 4 of the volume) each window is
    test-time mirrored on (:func:`mirrored`: the mean of ``2**len(mirror)`` flipped predictions per window, before
    the windows are blended); ``()``: none.

    Windows are visited in a fixed order that depends only on the shapes and the arguments (volume by volume,
    row-major over window positions, last axis fastest), so the ranks of a sequence-parallel group calling this with
    a collective-running predictor run the same windows in the same order.
    """
    import torch  # here, not at the top: a TensorFlow trial that predicts whole volumes never loads it

    if not isinstance(volume, torch.Tensor) or volume.dim() != 5:
        raise ValueError(f"volume must be a 5-D tensor (B, C, *3 spatial), got shape {tuple(np.shape(volume))}")
    window = _window(window)
    if not 0.0 <= overlap < 1.0:
        raise ValueError(f"overlap must lie in [0, 1), got {overlap!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not (math.isfinite(sigma_scale) and sigma_scale > 0):
        raise ValueError(f"sigma_scale must be a positive number, got {sigma_scale!r}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    mirror = check_mirror(mirror)

    def checked(windows: torch.Tensor) -> torch.Tensor:
        out = predictor(windows)
        if not isinstance(out, torch.Tensor) or out.dim() != 5 or out.shape[0] != windows.shape[0] \
                or tuple(out.shape[2:]) != window:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"predictor must map windows {tuple(windows.shape)} to (n, K, *window) = "
                             f"({windows.shape[0]}, K, {', '.join(map(str, window))}), got {shape}")
        # MONAI weights the output in place: never let that write into the input (a predictor returning a view)
        if out.untyped_storage().data_ptr() == windows.untyped_storage().data_ptr():
            out = out.clone()
        return out

    from monai.inferers import sliding_window_inference  # imported here: importing MONAI takes seconds

    # MONAI accumulates in the input's dtype and returns the input's type (a MetaTensor for a MetaTensor)
    inputs = volume.as_subclass(torch.Tensor).to(torch.float32)
    with torch.no_grad():
        out = sliding_window_inference(inputs, roi_size=window, sw_batch_size=batch_size,
                                       predictor=mirrored(checked, mirror), overlap=overlap, mode=mode,
                                       sigma_scale=sigma_scale)
    return out.as_subclass(torch.Tensor).to(torch.float32)


def predict_channels_last(predict: Callable[[np.ndarray], np.ndarray], image: np.ndarray,
                          window: int | Sequence[int] | None, *, inference: Any, batch_size: int,
                          mirror: Sequence[int] = ()) -> np.ndarray:
    """Float32 probabilities ``(H, W, D, K)`` of ONE channels-last volume ``image`` ``(H, W, D, C)``.

    ``predict`` maps a numpy batch of channels-last windows ``(n, h, w, d, C)`` to ``(n, h, w, d, K)``;
    ``batch_size`` windows go through it at once, and ``inference`` (anything with ``overlap``, ``mode`` and
    ``sigma_scale``: a spec's ``InferenceSpec``, a recipe's inference settings) sets those of :func:`sliding_window`.
    ``window=None`` means the whole volume is the network input: one ``predict`` call (``2**len(mirror)`` with
    mirroring). ``mirror``: the axes (0, 1, 2 of ``(H, W, D)``) each window, or the whole volume, is test-time
    mirrored on (:func:`mirrored`); ``()``: none.
    """
    image = np.asarray(image)
    if image.ndim != 4:
        raise ValueError(f"image must be one channels-last volume (H, W, D, C), got shape {image.shape}")
    if window is None:
        whole = mirrored(predict, mirror, channels_last=True)
        return np.asarray(whole(image[None])[0], dtype=np.float32)
    import torch

    def predictor(windows: torch.Tensor) -> torch.Tensor:
        out = np.asarray(predict(np.ascontiguousarray(windows.cpu().numpy().transpose(0, 2, 3, 4, 1))))
        if out.ndim != 5:
            raise ValueError(f"predict must return (n, h, w, d, K) windows, got shape {out.shape}")
        return torch.from_numpy(np.array(np.moveaxis(out, -1, 1), dtype=np.float32, order="C"))  # a writable copy

    volume = torch.from_numpy(np.ascontiguousarray(np.moveaxis(image, -1, 0)[None], dtype=np.float32))
    prob = sliding_window(predictor, volume, window, overlap=inference.overlap, mode=inference.mode,
                          sigma_scale=inference.sigma_scale, batch_size=batch_size, mirror=mirror)
    return np.ascontiguousarray(prob[0].numpy().transpose(1, 2, 3, 0))


# --------------------------------------------------------------------------- a recipe applied with a network


def _settings(recipe: dict[str, Any]) -> types.SimpleNamespace:
    defaults = {"overlap": 0.5, "mode": "gaussian", "sigma_scale": 0.125, "batch_size": 1, "mirror": []}
    return types.SimpleNamespace(**{**defaults, **(recipe.get("inference") or {})})


def network_probabilities(network: Any, image: np.ndarray, recipe: dict[str, Any], device: str = "cpu",
                          mirror: Sequence[int] | None = None) -> np.ndarray:
    """Float32 probabilities ``(h, w, d, K)`` of one preprocessed channels-last volume ``(h, w, d, C)``, predicted by
    windows of ``recipe["window"]`` with its ``inference`` settings. ``network``: a Keras model (channels-last) when
    ``recipe["framework"]`` is ``tensorflow``, else a torch module (channels-first, on ``device``); its ``logits``
    (``recipe["output"]``) go through the target scheme's activation (sigmoid, or softmax over the channels).
    ``mirror``: the axes (0, 1, 2 of ``(h, w, d)``) every window is test-time mirrored on, the mean of its flipped
    windows' probabilities (:func:`mirrored`); None: the recipe's (:func:`recipe_mirror`), ``()``: none."""
    channels = len(recipe["modalities"])
    if image.ndim != 4 or image.shape[-1] != channels:
        raise ValueError(f"image must be (h, w, d, {channels}), got shape {image.shape}")
    settings, window = _settings(recipe), tuple(int(v) for v in recipe["window"])
    mirror = recipe_mirror(recipe) if mirror is None else check_mirror(mirror)
    if recipe["framework"] == "tensorflow":
        def predict(batch: np.ndarray) -> np.ndarray:
            return np.asarray(network(batch, training=False))

        return predict_channels_last(predict, image, window, inference=settings, batch_size=settings.batch_size,
                                     mirror=mirror)
    import torch

    logits = recipe["output"] == "logits"
    softmax = recipe_targets(recipe)["activation"] == "softmax"
    channels_last = inference_memory_format(network, (settings.batch_size, channels, *window),
                                            device) == "channels_last"

    def predictor(windows: torch.Tensor) -> torch.Tensor:
        if channels_last:
            windows = windows.contiguous(memory_format=torch.channels_last_3d)
        out = network(windows)
        if not logits:
            return out
        return torch.softmax(out, dim=1) if softmax else torch.sigmoid(out)

    volume = torch.from_numpy(np.ascontiguousarray(np.moveaxis(image, -1, 0)[None], dtype=np.float32))
    with torch.no_grad():
        prob = sliding_window(predictor, volume.to(device), window, overlap=settings.overlap, mode=settings.mode,
                              sigma_scale=settings.sigma_scale, batch_size=settings.batch_size, mirror=mirror)
    return np.ascontiguousarray(prob[0].cpu().numpy().transpose(1, 2, 3, 0))


#: each torch network's measured inference layout, by the shape of its window batches and its device
_INFERENCE_LAYOUTS: Any = None


def inference_memory_format(network: Any, batch_shape: Sequence[int], device: str = "cpu", *,
                            timer: Callable[[], float] | None = None, repeats: int = 2) -> str:
    """The layout a torch ``network`` predicts batches of ``batch_shape`` (``(n, C, *window)``) fastest in on
    ``device``: ``contiguous`` or ``channels_last`` (``torch.channels_last_3d``, which oneDNN's CPU kernels and the
    tensor cores favour), measured once per network, shape and device (a warm-up and ``repeats`` forwards of
    zeros in each, the median; channels-last taken where it is at least 5% faster, as the trainer's
    ``training.performance.memory_format: auto`` does). The network's 5-D weights are left in the layout chosen,
    in place. Either layout computes the same probabilities to float round-off."""
    global _INFERENCE_LAYOUTS
    import torch

    if not isinstance(network, torch.nn.Module):
        return "contiguous"  # a function of windows (a test's, a wrapper): nothing to lay out
    if _INFERENCE_LAYOUTS is None:
        _INFERENCE_LAYOUTS = weakref.WeakKeyDictionary()
    known = _INFERENCE_LAYOUTS.setdefault(network, {})
    key = (tuple(int(v) for v in batch_shape), str(device))
    if key in known:
        return known[key]
    timer = timer or time.perf_counter

    def laid_out(layout: torch.memory_format) -> None:
        for tensor in [*network.parameters(), *network.buffers()]:
            if tensor.dim() == 5:
                tensor.data = tensor.data.contiguous(memory_format=layout)

    def seconds(layout: torch.memory_format) -> float:
        laid_out(layout)
        batch = torch.zeros(key[0], device=device).contiguous(memory_format=layout)
        times = []
        with torch.no_grad():
            for index in range(repeats + 1):
                if device != "cpu":
                    torch.cuda.synchronize()
                start = timer()
                network(batch)
                if device != "cpu":
                    torch.cuda.synchronize()
                elapsed = timer() - start
                if index:  # the first is the warm-up
                    times.append(elapsed)
        return statistics.median(times)

    if len(key[0]) != 5:
        chosen = "contiguous"
    else:
        contiguous, channels_last = seconds(torch.contiguous_format), seconds(torch.channels_last_3d)
        chosen = "channels_last" if channels_last * 1.05 <= contiguous else "contiguous"
    laid_out(torch.channels_last_3d if chosen == "channels_last" else torch.contiguous_format)
    known[key] = chosen
    return chosen


def segment(image: np.ndarray, recipe: dict[str, Any], probabilities: Callable[[np.ndarray], np.ndarray],
            layout: str | None = None, spacing: Sequence[float] | None = None,
            axcodes: str | None = None, postprocess: bool = True) -> np.ndarray:
    """The label map ``(H, W, D)`` of a raw image ``(H, W, D, C)`` in the data set's label values: preprocessed as the
    recipe says (:func:`prepare_image`: normalisation, reorientation, resampling to the target spacing, crop / pad,
    resize), ``probabilities`` (a preprocessed volume -> its ``(h, w, d, K)`` probabilities), every geometric step
    undone on the probabilities (:func:`restore_probabilities`), then thresholded or argmaxed and painted in the
    data set's label values (:func:`probabilities_to_labels`). ``spacing`` (mm) and ``axcodes`` (e.g. ``"LPS"``) describe
    the scan; a recipe that resamples or reorients needs them. ``layout``: for the brain-tumour label modes, whose
    label values to write (default the training data's). ``postprocess``: the recipe's ``postprocessing`` (the
    largest-component removals its cross-validation chose, :func:`postprocess_masks`; none in a recipe without
    one) applied to the label map's masks on the scan's grid."""
    inputs, geometry = prepare_image(image, recipe, spacing, axcodes)
    prob = restore_probabilities(probabilities(inputs), recipe, geometry)
    targets = recipe_targets(recipe)
    if layout and layout != recipe.get("layout"):
        if not brain_tumour(recipe):
            raise ValueError(f"layout {layout!r}: only a brain-tumour model writes another layout's label values")
        targets = legacy_targets(str(layout), str(targets["mode"]))
    return probabilities_to_labels(prob, targets, float(recipe.get("threshold", 0.5)),
                                   recipe.get("postprocessing") if postprocess else None)


def load_network(path: str, framework: str) -> tuple[Any, str]:
    """The network saved at ``path`` and the device it runs on: a ``torch.export`` program's module (on the GPU
    when torch sees one) or a Keras model (``keras.saving.load_model``, not compiled: inference only; one that
    computes in float16 rebuilt in float32 where TensorFlow sees no GPU, :func:`keras_runnable_here`)."""
    if framework == "torch":
        import torch

        program = torch.export.load(path)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device != "cpu":
            from torch.export.passes import move_to_device_pass

            program = move_to_device_pass(program, device)
        return program.module(), device
    if framework != "tensorflow":
        raise ValueError(f"framework must be 'tensorflow' or 'torch', got {framework!r}")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    return keras_runnable_here(keras.saving.load_model(path, compile=False)), "cpu"


def _keras_layers(model: Any) -> list[Any]:
    """Every layer of a Keras model, those of the models inside it too."""
    found = []
    for layer in getattr(model, "layers", ()):
        found.append(layer)
        found += _keras_layers(layer)
    return found


def keras_float16(model: Any) -> bool:
    """Whether a Keras model computes in float16 somewhere: a layer whose dtype policy's compute dtype is float16
    (``mixed_float16``: a model trained with ``training.precision: fp16``)."""
    return any(getattr(getattr(layer, "dtype_policy", None), "compute_dtype", None) == "float16"
               for layer in _keras_layers(model))


def keras_float32(model: Any) -> Any:
    """``model`` rebuilt with every layer's dtype policy float32 (``keras.models.clone_model``, each layer from its
    configuration) and given its weights. Under a mixed policy the weights are float32 already (the master
    weights the optimizer updated) and only the computation is 16-bit: this is the float32 network trained."""
    import keras

    def float32_layer(layer: Any) -> Any:
        config = layer.get_config()
        if "dtype" in config:
            config["dtype"] = "float32"
        return type(layer).from_config(config)

    rebuilt = keras.models.clone_model(model, clone_function=float32_layer)
    rebuilt.set_weights(model.get_weights())
    return rebuilt


def keras_runnable_here(model: Any) -> Any:
    """``model``, or, where it computes in float16 and TensorFlow sees no GPU, the same network in float32
    (:func:`keras_float32`). TensorFlow has no CPU kernel of float16 3-D max pooling (``MaxPool3D``), so a model
    trained with ``mixed_float16`` on a GPU cannot predict on a CPU as it was saved; in float32 its probabilities
    differ from the GPU's float16 ones by float16's rounding only. ValueError, saying why, when it cannot be
    rebuilt."""
    if not keras_float16(model):
        return model
    import keras

    if keras.distribution.list_devices("gpu"):  # the backend's (TensorFlow's) GPUs
        return model
    try:
        return keras_float32(model)
    except Exception as exc:  # noqa: BLE001  (whatever Keras refuses)
        raise ValueError(
            "this Keras model computes in float16 (dtype policy mixed_float16: trained with training.precision "
            "fp16), which TensorFlow cannot run on a CPU (it has no float16 kernel of 3-D max pooling); there is no "
            f"GPU here, and it could not be rebuilt in float32 ({type(exc).__name__}: {exc}): predict with it on a "
            "machine with a GPU") from exc


def check_image(model_input: Any, modalities: Sequence[str]) -> np.ndarray:
    """``model_input`` as one case's float32 image ``(H, W, D, C)``; a batch of one ``(1, H, W, D, C)`` is taken as
    that case. ValueError naming what is expected otherwise."""
    channels, names = len(modalities), ", ".join(modalities)
    expected = (f"ONE case's raw image as a numpy array (H, W, D, {channels}), channels {names} in that order "
                f"(or a batch of one, (1, H, W, D, {channels}))")
    try:
        array = np.asarray(model_input)
    except Exception as exc:  # noqa: BLE001  (whatever np.asarray refuses)
        raise ValueError(f"the model takes {expected}; got {type(model_input).__name__} ({exc})") from None
    if array.ndim == 5 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 4:
        raise ValueError(f"the model takes {expected}; got shape {array.shape}")
    if array.shape[-1] != channels:
        raise ValueError(f"the model takes {channels} channels ({names}) on the last axis; got shape {array.shape} "
                         f"({array.shape[-1]} channel(s))")
    if min(array.shape[:3]) < 1:
        raise ValueError(f"the image is empty: shape {array.shape}")
    if array.dtype.kind not in "biuf":
        raise ValueError(f"the image must hold numbers (intensities), got dtype {array.dtype}")
    array = array.astype(np.float32, copy=False)
    if not np.isfinite(array).all():
        raise ValueError("the image holds NaN or infinite values")
    return array


def check_folds(folds: Any, recipe: dict[str, Any]) -> tuple[int, ...] | None:
    """The folds a prediction averages: ``folds`` (fold numbers of the recipe's fold ensemble, distinct, in any
    order) checked, or None (``None`` or empty: all of them). ValueError naming the folds the model holds for a fold
    it does not hold, and saying so for a model that is not a fold ensemble."""
    if folds is None or (not isinstance(folds, (str, bytes)) and np.size(folds) == 0):  # MLflow's default: []
        return None
    held = recipe_folds(recipe)
    if isinstance(folds, (int, np.integer)) and not isinstance(folds, bool):
        folds = [folds]
    values = list(folds) if isinstance(folds, (list, tuple, np.ndarray)) else None
    if values is None or any(isinstance(f, bool) or not isinstance(f, (int, np.integer)) or f < 0 for f in values):
        raise ValueError(f"folds must be a list of fold numbers (integers >= 0), got {folds!r}")
    chosen = tuple(int(f) for f in values)
    if not held:
        raise ValueError(f"folds {list(chosen)}: this model is not a fold ensemble: it holds one "
                         "network and takes no folds")
    repeated = sorted({f for f in chosen if chosen.count(f) > 1})
    if repeated:
        raise ValueError(f"folds {list(chosen)} name fold(s) {repeated} more than once")
    missing = [f for f in chosen if f not in held]
    if missing:
        raise ValueError(f"fold(s) {missing} not in this model: it is a fold ensemble of folds {list(held)}")
    return chosen


def check_params(params: dict[str, Any] | None, recipe: dict[str, Any]) -> dict[str, Any]:
    """The prediction's parameters: ``spacing`` (the case's voxel spacing in mm along the array's axes, three positive
    numbers; needed when the recipe resamples to a target spacing), ``orientation`` (where the array's axes point,
    e.g. ``"LPS"``: nibabel's ``aff2axcodes`` of the scan's affine; needed when the recipe reorients), ``layout``
    (brain-tumour label modes only: whose label values to write; default the recipe's), ``folds`` (a fold
    ensemble only: the folds whose probabilities are averaged, :func:`check_folds`; default all) and ``mirror``
    (the spatial axes 0, 1, 2 of the preprocessed volume every sliding window is test-time mirrored on,
    :func:`check_mirror`: a list of distinct axes, ``[]`` for none; default, or None, the recipe's,
    :func:`recipe_mirror`). ValueError for anything else."""
    params = dict(params or {})
    unknown = sorted(set(params) - {"spacing", "layout", "orientation", "folds", "mirror"})
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown}; the model takes 'spacing' (3 numbers, mm), 'orientation' "
                         "(axis codes such as 'LPS'), 'layout', 'folds' (a fold ensemble's fold numbers) and "
                         "'mirror' (the axes to mirror at test time, e.g. [0, 1, 2])")
    spacing = params.get("spacing")
    if spacing is not None and np.size(spacing) == 0:  # MLflow's default for a spacing not given: []
        spacing = None
    if spacing is not None:
        try:
            values = np.asarray(spacing, dtype=np.float64)
        except (TypeError, ValueError):
            values = np.empty(0)
        if values.shape != (3,) or not (np.isfinite(values).all() and (values > 0).all()):
            raise ValueError(f"spacing must be the case's voxel spacing: 3 positive numbers (mm), got {spacing!r}")
        spacing = tuple(float(v) for v in values)
    orientation = params.get("orientation") or None  # MLflow's default for a string not given: ""
    if orientation is not None:
        orientation = check_axcodes(orientation, "the orientation parameter")
    layout = params.get("layout") or recipe["layout"]
    if layout != recipe["layout"]:
        if not brain_tumour(recipe):
            raise ValueError(f"layout {layout!r}: the layout parameter picks the label values of a brain-tumour "
                             f"layout; this model writes its data set's own label values")
        if layout not in EDEMA_VALUE:
            raise ValueError(f"layout must be one of {list(EDEMA_VALUE)}, got {layout!r}")
    mirror = params.get("mirror")
    mirror = recipe_mirror(recipe) if mirror is None else check_mirror(mirror, "the mirror parameter")
    return {"spacing": spacing, "layout": str(layout), "orientation": orientation,
            "folds": check_folds(params.get("folds"), recipe), "mirror": mirror}


def mean_probabilities(networks: Sequence[Any], image: np.ndarray, recipe: dict[str, Any],
                       device: str = "cpu", mirror: Sequence[int] | None = None) -> np.ndarray:
    """The mean of ``networks``' float32 probabilities (:func:`network_probabilities`) of one preprocessed volume
    ``(h, w, d, C)``: a fold ensemble's prediction, before it is thresholded or argmaxed. One network: its own.
    ``mirror``: the axes every network's windows are mirrored on (None: the recipe's)."""
    if not networks:
        raise ValueError("no network to predict with")
    first = network_probabilities(networks[0], image, recipe, device, mirror)
    if len(networks) == 1:
        return first
    total = np.array(first, dtype=np.float32)  # a copy of our own to add to (the first may be a framework's buffer)
    for network in networks[1:]:
        total += network_probabilities(network, image, recipe, device, mirror)
    total /= np.float32(len(networks))
    return total


def model_probabilities(networks: Sequence[Any], image: np.ndarray, recipe: dict[str, Any], device: str = "cpu",
                        folds: Sequence[int] | None = None, mirror: Sequence[int] | None = None) -> np.ndarray:
    """A model's float32 probabilities ``(h, w, d, K)`` of one preprocessed volume ``(h, w, d, C)``: ``networks``
    in the order of :func:`network_artifacts`; each configuration's probabilities the mean of its folds' (those of
    ``folds``, default all: :func:`check_folds`), and a configuration ensemble's the mean of its configurations'.
    ``mirror``: the axes every window is mirrored on (None: each configuration's recipe's)."""
    chosen = check_folds(folds, recipe)
    held = recipe_folds(recipe)
    members = recipe_configurations(recipe)
    per_member = len(held) or 1
    if len(networks) != per_member * len(members):
        raise ValueError(f"{len(networks)} network(s) for a model of {len(members)} configuration(s) of "
                         f"{per_member} network(s) each")
    total: np.ndarray | None = None
    for index, member in enumerate(members):
        own = list(networks[index * per_member:(index + 1) * per_member])
        if chosen is not None:
            own = [own[held.index(fold)] for fold in chosen]
        prob = mean_probabilities(own, image, member, device, mirror)
        if len(members) == 1:
            return prob
        total = np.array(prob, dtype=np.float32) if total is None else total + prob
    assert total is not None
    total /= np.float32(len(members))
    return total


class SegmentationModel:
    """The recipe applied with its network, or its fold ensemble's networks: what MLflow's ``predict`` runs (see the
    module docstring).

    A plain class, so that importing this module does not import MLflow (distmis's training imports it for the
    functions above); :func:`pyfunc_class` makes it an ``mlflow.pyfunc.PythonModel``.
    """

    recipe: dict[str, Any]
    networks: list[Any]  # one; a fold ensemble's or a configuration ensemble's, in network_artifacts(recipe)'s order
    device: str

    @property
    def folds(self) -> tuple[int, ...]:
        """The folds of a fold ensemble, in the order of :attr:`networks`; ``()`` for one network."""
        return recipe_folds(self.recipe)

    def load_context(self, context: Any) -> None:
        """Read the recipe and load the network (a fold ensemble: every fold's; a configuration ensemble: every
        configuration's) from the model's ``artifacts`` (``context.artifacts``)."""
        with open(context.artifacts[RECIPE_ARTIFACT], encoding="utf-8") as handle:
            self.recipe = json.load(handle)
        wanted = network_artifacts(self.recipe)
        missing = [name for name, _ in wanted if name not in context.artifacts]
        if missing:
            raise ValueError(f"the model's artifacts lack {missing}: its recipe names folds {list(self.folds)} and "
                             f"{len(recipe_configurations(self.recipe))} configuration(s), its artifacts are "
                             f"{sorted(context.artifacts)}")
        self.networks, self.device = [], "cpu"
        for name, member in wanted:
            network, device = load_network(context.artifacts[name], member["framework"])
            self.networks.append(network)
            self.device = device if member["framework"] == "torch" else self.device

    def probabilities(self, image: np.ndarray, folds: Sequence[int] | None = None,
                      mirror: Sequence[int] | None = None) -> np.ndarray:
        """Float32 probabilities ``(h, w, d, K)`` of one preprocessed volume ``(h, w, d, C)``: a fold ensemble's
        the mean of its ``folds``' (default all; :func:`check_folds`), a configuration ensemble's the mean of its
        configurations' (:func:`model_probabilities`); each window mirrored on the axes ``mirror`` (default the
        recipe's; :func:`mirrored`)."""
        return model_probabilities(self.networks, image, self.recipe, self.device, folds, mirror)

    def predict(self, context, model_input, params=None):  # no type hints: MLflow would read a signature from them
        """The uint8 label map ``(H, W, D)`` of ONE case's raw image ``model_input`` ``(H, W, D, C)``.

        ``params``: ``spacing`` (the case's voxel spacing, 3 numbers in mm; needed where the recipe resamples),
        ``orientation`` (its axis codes; needed where the recipe reorients), ``layout`` (``msd``, ``brats`` or
        ``brats2023``: whose label values to return; default the training data's), ``folds`` (a fold ensemble:
        the folds whose probabilities are averaged; default all) and ``mirror`` (the axes 0, 1, 2 of the
        preprocessed volume each sliding window is mirrored on; default the recipe's, ``[]``: none)."""
        image = check_image(model_input, self.recipe["modalities"])
        settings = check_params(params, self.recipe)
        folds, mirror = settings["folds"], settings["mirror"]
        return segment(image, self.recipe, lambda volume: self.probabilities(volume, folds, mirror),
                       settings["layout"], settings["spacing"], settings["orientation"])


def pyfunc_class() -> type:
    """:class:`SegmentationModel` as a subclass of ``mlflow.pyfunc.PythonModel`` (imports MLflow)."""
    from mlflow.pyfunc import PythonModel

    return type("SegmentationPyfunc", (SegmentationModel, PythonModel), {"__module__": __name__,
                                                                         "__doc__": SegmentationModel.__doc__})


# MLflow runs this file as the model's code under a module name of its own (code_model_<hex>): there, and only
# there (distmis imports it as distmis.pyfunc_model), the model is set.
if __name__ != "distmis.pyfunc_model":
    import mlflow.models

    mlflow.models.set_model(pyfunc_class()())
