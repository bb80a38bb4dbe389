"""What a network's output channels mean: the target scheme of a label mode on a data set.

A target scheme is a plain JSON dict, recorded in the TFRecord manifest (``preprocess.targets``) and in the model's
recipe, so that training, scoring and the registered model read the same one (the model's code,
:mod:`distmis.pyfunc_model`, applies it without distmis)::

    {"mode": "classes", "activation": "softmax",
     "channels": [{"name": "background", "key": "background", "values": [0], "paint": 0},
                  {"name": "liver", "key": "liver", "values": [1], "paint": 1}, ...]}

* ``classes`` (``dataset.labels: classes``): mutually exclusive classes from the data set's ``labels``; channel 0
  is the background; the target is their one-hot encoding, the network's output a softmax, a prediction the
  argmax painted with the class's value.
* ``whole-tumour``: one channel ``WT`` holding every non-zero label; sigmoid.
* ``regions``: overlapping regions, sigmoid, thresholded channels painted in order (a later one wins): the BraTS
  regions WT, TC, ET of a brain-tumour data set, or an nnU-Net data set's region-based labels in its
  ``regions_class_order``.

Each channel's ``key`` is its name as metric names carry it (``val_dice_<key>``, ``test_dice_<key>``,
``test_hd95_<key>``); the scored channels are the foreground ones (:func:`foreground`: all but a softmax scheme's
background).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from distmis.data.errors import DataError
from distmis.data.manifest import DataManifest
from distmis.pyfunc_model import (
    channel_masks, foreground, labels_to_channels, legacy_targets, metric_key, probabilities_to_labels,
    recipe_targets,
)

__all__ = [
    "LABEL_MODES", "target_scheme", "manifest_targets", "foreground", "metric_keys", "label_channels",
    "channel_masks", "probabilities_to_labels", "legacy_targets", "metric_key",
]

#: ``dataset.labels``: what the network is trained to predict.
LABEL_MODES = ("whole-tumour", "regions", "classes")

_BRAIN_TUMOUR_LAYOUTS = ("brats", "brats2023")


def _layout(description: Any) -> str:
    return str(getattr(description.layout, "value", description.layout))


def _brain_tumour_layout(description: Any) -> str | None:
    """The layout whose BraTS label tables the data set follows: a BraTS layout, or an MSD data set labelled as
    MSD Task01 (4 channels, labels 0-3); None for any other data set."""
    layout = _layout(description)
    if layout in _BRAIN_TUMOUR_LAYOUTS:
        return layout
    if layout == "msd" and tuple(description.label_values) == (0, 1, 2, 3) and description.num_channels == 4:
        return "msd"
    return None


def _unique_keys(channels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Make the channels' metric keys unique (``liver``, ``liver_2``) where two names differ only in punctuation."""
    seen: dict[str, int] = {}
    for channel in channels:
        key = channel["key"]
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 1:
            channel["key"] = f"{key}_{seen[key]}"
    return channels


def target_scheme(description: Any, mode: str) -> dict[str, Any]:
    """The target scheme of ``mode`` (``whole-tumour``, ``regions`` or ``classes``) on the data set ``description``
    (a :class:`~distmis.data.description.DatasetDescription`).

    Raises:
        DataError: naming the data set's labels, when the mode does not fit them: ``classes`` on region-based
            (overlapping) labels, ``regions`` on a data set that has none.
    """
    if mode not in LABEL_MODES:
        raise ValueError(f"unknown label mode {mode!r}; expected one of {list(LABEL_MODES)}")
    regions = tuple(getattr(description, "regions", ()) or ())
    brain = _brain_tumour_layout(description)
    described = ", ".join(f"{name!r}: {value}" for name, value in description.classes)
    if mode == "classes":
        if regions:
            names = ", ".join(repr(r.name) for r in regions)
            raise DataError(f"dataset.labels 'classes' needs mutually exclusive labels, but this data set's labels are "
                            f"region-based (overlapping: {names}); use labels: regions")
        classes = sorted(description.classes, key=lambda item: item[1])
        if not classes or classes[0][1] != 0:
            raise DataError(f"the data set's labels ({described}) have no background 0")
        channels = [{"name": str(name), "key": metric_key(name), "values": [int(value)], "paint": int(value)}
                    for name, value in classes]
        return {"mode": "classes", "activation": "softmax", "channels": _unique_keys(channels)}
    if brain is not None:
        return legacy_targets(brain, mode)
    if mode == "whole-tumour":
        values = [int(v) for v in description.label_values if int(v) != 0]
        return {"mode": mode, "activation": "sigmoid",
                "channels": [{"name": "WT", "key": "WT", "values": values, "paint": 1}]}
    if not regions:
        raise DataError(f"dataset.labels 'regions' means overlapping regions: the BraTS regions (WT, TC, ET) of a "
                        f"brain-tumour data set, or an nnU-Net data set's region-based labels; this data set's labels "
                        f"({described}) have none: use labels: classes (one channel per label) or whole-tumour")
    channels = [{"name": r.name, "key": metric_key(r.name), "values": [int(v) for v in r.values],
                 "paint": int(r.paint)} for r in regions]
    return {"mode": "regions", "activation": "sigmoid", "channels": _unique_keys(channels)}


def manifest_targets(manifest: DataManifest) -> dict[str, Any]:
    """The target scheme of a TFRecord folder's ``manifest`` (its ``preprocess.targets``; for a folder written before
    the scheme was recorded, the BraTS one of its layout and label mode)."""
    return recipe_targets(dict(manifest.preprocess))


def metric_keys(targets: Mapping[str, Any]) -> list[str]:
    """The keys of the scored (foreground) channels, in order: ``val_dice_<key>`` and so on."""
    return [channel["key"] for channel in foreground(dict(targets))]


def label_channels(label: np.ndarray, targets: Mapping[str, Any]) -> np.ndarray:
    """uint8 ``(H, W, D, C)`` target channels of an integer label map (:func:`distmis.pyfunc_model.labels_to_channels`);
    ValueError naming the values no channel covers (a label map of another data set)."""
    label = np.asarray(label)
    if label.ndim != 3:
        raise ValueError(f"label must be a 3-D (H, W, D) array, got shape {label.shape}")
    if label.dtype.kind not in "iub":
        raise ValueError(f"label must be an integer array, got dtype {label.dtype}")
    known = {0} | {int(v) for channel in targets["channels"] for v in channel["values"]}
    found = [int(v) for v in np.unique(label)]
    unknown = [v for v in found if v not in known]
    if unknown:
        raise ValueError(f"label values {unknown} are not in the target scheme's labels (found {found}, allowed "
                         f"{sorted(known)})")
    return labels_to_channels(label, dict(targets))
