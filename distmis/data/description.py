"""What a data set holds: its image channels and label classes, from its own ``dataset.json``.

An MSD task (any of the ten, or one made like them) and an nnU-Net v2 raw data set describe themselves in a
``dataset.json``; the BraTS layouts have none, and are described by
:func:`~distmis.data.dataset_layouts.layout_description`.

MSD (``layout: msd``)::

    {"name": "Spleen",
     "modality": {"0": "CT"},                       # channel index -> name, "0".."n-1"
     "labels": {"0": "background", "1": "spleen"},  # label value -> class name; 0 is background
     "numTraining": 41,
     "training": [{"image": "./imagesTr/spleen_2.nii.gz", "label": "./labelsTr/spleen_2.nii.gz"}, ...],
     "test": ["./imagesTs/spleen_1.nii.gz", ...]}

nnU-Net v2 (``layout: nnunet``)::

    {"channel_names": {"0": "T2", "1": "ADC"},      # channel index -> name; files <case>_0000, <case>_0001
     "labels": {"background": 0, "PZ": 1, "TZ": 2},  # class name -> label value
     "numTraining": 32,
     "file_ending": ".nii.gz"}                      # NIfTI only: ".nii.gz" or ".nii"

    # region-based labels: a list of values is a region, painted back with its regions_class_order value
    {"labels": {"background": 0, "whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing tumor": [3]},
     "regions_class_order": [1, 2, 3], ...}

:func:`describe_msd` and :func:`describe_nnunet` read them (through
:func:`~distmis.data.dataset_layouts.describe_dataset`) into a :class:`DatasetDescription`; a missing or ill-typed
key is a :class:`~distmis.data.errors.DataError` naming the file, the key and what is expected.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from distmis.data.errors import DataError

__all__ = ["Layout", "NIFTI_SUFFIXES", "coerce_layout", "Region", "DatasetDescription",
           "describe_msd", "describe_nnunet", "dataset_json_layout"]

#: The largest label value a label map may hold (label maps are read as int16).
MAX_LABEL_VALUE = 2**15 - 1


class Layout(str, Enum):
    """How a data set is organised on disk (see :mod:`distmis.data.layouts`, which reads them)."""

    MSD = "msd"
    NNUNET = "nnunet"
    BRATS = "brats"
    BRATS2023 = "brats2023"


#: File name endings accepted for NIfTI files, preferred first.
NIFTI_SUFFIXES: tuple[str, ...] = (".nii.gz", ".nii")

E = TypeVar("E", bound=Enum)


def _coerce_enum(enum_cls: type[E], value: E | str, what: str) -> E:
    """Return ``value`` as a member of ``enum_cls``, or raise a ValueError listing the options."""
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_cls)  # type: ignore[attr-defined]
        raise ValueError(f"unknown {what} {value!r}; expected one of {allowed}") from None


def coerce_layout(layout: Layout | str) -> Layout:
    """Return ``layout`` as a :class:`Layout` (accepts ``"msd"`` / ``"nnunet"`` / ``"brats"`` / ``"brats2023"``)."""
    return _coerce_enum(Layout, layout, "layout")


@dataclass(frozen=True)
class Region:
    """One nnU-Net region-based label: a union of label values, predicted as one channel.

    Attributes:
        name: its name in ``dataset.json``'s ``labels``, e.g. ``"whole tumor"``.
        values: the label values it unites, e.g. ``(1, 2, 3)``.
        paint: the label value a predicted region is written back with (its ``regions_class_order`` entry);
            regions are painted in order, a later one over an earlier one.
    """

    name: str
    values: tuple[int, ...]
    paint: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(int(v) for v in self.values))
        object.__setattr__(self, "paint", int(self.paint))
        if not self.name:
            raise ValueError("a region needs a name")
        if not self.values:
            raise ValueError(f"region {self.name!r} unites no label value")


@dataclass(frozen=True)
class DatasetDescription:
    """The channels and classes of a data set (see the module docstring).

    Attributes:
        layout: how its files are organised.
        channels: channel names in file order: MSD ``modality``, nnU-Net ``channel_names``.
        classes: ``(name, value)`` of every label, background 0 included, sorted by value. For region-based
            nnU-Net data: background and every region as ``(name, paint value)``.
        regions: nnU-Net region-based labels, in ``regions_class_order``; ``()`` otherwise.
        file_ending: the image and label files' ending (nnU-Net's ``file_ending``).
        num_training: the number of training cases ``dataset.json`` states (``numTraining``), if any.
        name: the data set's name (``dataset.json``'s ``name``, else its folder's), "" for a layout's own.

    Lists are accepted and stored as tuples; the description is checked on construction (ValueError).
    """

    layout: Layout
    channels: tuple[str, ...]
    classes: tuple[tuple[str, int], ...]
    regions: tuple[Region, ...] = ()
    file_ending: str = ".nii.gz"
    num_training: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", coerce_layout(self.layout))
        object.__setattr__(self, "channels", tuple(str(c) for c in self.channels))
        classes = tuple(sorted(((str(n), int(v)) for n, v in self.classes), key=lambda nv: nv[1]))
        object.__setattr__(self, "classes", classes)
        object.__setattr__(self, "regions", tuple(
            r if isinstance(r, Region) else Region(**r) for r in self.regions))  # type: ignore[arg-type]
        if not self.channels:
            raise ValueError("a data set description needs at least one channel")
        values = [v for _, v in classes]
        if len(set(values)) != len(values):
            raise ValueError(f"class values must be unique, got {list(classes)}")
        names = [n for n, _ in classes]
        if len(set(names)) != len(names):
            raise ValueError(f"class names must be unique, got {list(classes)}")
        if 0 not in values:
            raise ValueError(f"the classes must include background, value 0; got {list(classes)}")
        if any(v < 0 or v > MAX_LABEL_VALUE for v in values + [v for r in self.regions for v in r.values]):
            raise ValueError(f"label values must lie in 0..{MAX_LABEL_VALUE}, got {list(classes)}")
        if self.file_ending not in NIFTI_SUFFIXES:
            raise ValueError(f"file_ending must be one of {list(NIFTI_SUFFIXES)} (NIfTI), got {self.file_ending!r}")
        if self.num_training is not None and int(self.num_training) < 0:
            raise ValueError(f"num_training must be >= 0, got {self.num_training}")

    @property
    def num_channels(self) -> int:
        return len(self.channels)

    @property
    def label_values(self) -> tuple[int, ...]:
        """The values a label map may hold, sorted: the classes' values, or, with regions, 0 and every value
        a region unites."""
        if self.regions:
            return tuple(sorted({0, *(v for r in self.regions for v in r.values)}))
        return tuple(v for _, v in self.classes)

    def value_names(self) -> dict[int, str]:
        """``{label value: what it is}`` for every allowed label value, for messages and summaries: a class's
        name, or, with regions, the regions that hold the value (``"in whole tumor, tumor core"``)."""
        by_value = {v: n for n, v in self.classes}
        if not self.regions:
            return {v: by_value[v] for v in self.label_values}
        names = {}
        for value in self.label_values:
            holders = [r.name for r in self.regions if value in r.values]
            names[value] = by_value[0] if value == 0 else "in " + ", ".join(holders)
        return names

    def describe_values(self) -> str:
        """The allowed label values with their names, e.g. ``"0 background, 1 spleen"``."""
        return ", ".join(f"{v} {name}" for v, name in self.value_names().items())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; :meth:`from_dict` reads it back."""
        return {
            "layout": self.layout.value,
            "name": self.name,
            "channels": list(self.channels),
            "classes": [{"name": n, "value": v} for n, v in self.classes],
            "regions": [{"name": r.name, "values": list(r.values), "paint": r.paint} for r in self.regions],
            "file_ending": self.file_ending,
            "num_training": self.num_training,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DatasetDescription:
        """The description :meth:`to_dict` wrote. ValueError naming the field when one is missing or ill-typed."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a data set description must be a dict, got {type(data).__name__}")
        missing = [k for k in ("layout", "channels", "classes") if k not in data]
        if missing:
            raise ValueError(f"data set description lacks {', '.join(map(repr, missing))}")
        try:
            classes = tuple((c["name"], c["value"]) for c in data["classes"])
            regions = tuple(Region(r["name"], tuple(r["values"]), r["paint"]) for r in data.get("regions") or ())
        except (KeyError, TypeError) as exc:
            raise ValueError(f"data set description: 'classes' must be a list of {{'name', 'value'}} and 'regions' "
                             f"a list of {{'name', 'values', 'paint'}} ({type(exc).__name__}: {exc})") from None
        num_training = data.get("num_training")
        return cls(layout=data["layout"], channels=tuple(data["channels"]), classes=classes, regions=regions,
                   file_ending=data.get("file_ending", ".nii.gz"),
                   num_training=None if num_training is None else int(num_training), name=str(data.get("name", "")))


# --------------------------------------------------------------------------- dataset.json


#: The two layouts described by a dataset.json: their names in messages, and what their roots hold.
_JSON_LAYOUTS: dict[Layout, tuple[str, str]] = {
    Layout.MSD: ("an MSD", "dataset.json (its 'training' list names the cases)"),
    Layout.NNUNET: ("an nnU-Net v2", "dataset.json, imagesTr/ and labelsTr/"),
}


def _read_json(path: Path, layout: Layout) -> dict[str, Any]:
    if not path.is_file():
        titled, holds = _JSON_LAYOUTS[layout]
        raise DataError(f"{str(path)!r} not found: {titled} data set root holds {holds}")
    return read_json_object(path)


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in the file at ``path``; DataError naming it when it is not valid JSON or not an object."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(meta, dict):
        raise DataError(f"{str(path)!r} must hold a JSON object, got {type(meta).__name__}")
    return meta


def dataset_json_layout(meta: Mapping[str, Any]) -> Layout:
    """The layout a parsed ``dataset.json`` follows: ``nnunet`` when it has ``channel_names``, else ``msd``."""
    return Layout.NNUNET if "channel_names" in meta else Layout.MSD


class _Keys:
    """Reads the keys of one parsed dataset.json, raising DataError naming the file, the key and what it needs."""

    def __init__(self, path: Path, meta: dict[str, Any], layout: Layout, required: tuple[str, ...]) -> None:
        self.path, self.meta, self.layout, self.required = path, meta, layout, required

    def fail(self, key: str, problem: str, expected: str) -> DataError:
        return DataError(f"{str(self.path)!r}: {problem} key {key!r}; {_JSON_LAYOUTS[self.layout][0]} dataset.json "
                         f"needs {expected}")

    def get(self, key: str, kind: type | tuple[type, ...], expected: str) -> Any:
        if key not in self.meta:
            other = Layout.MSD if self.layout is Layout.NNUNET else Layout.NNUNET
            hint = ""
            if dataset_json_layout(self.meta) is other:
                hint = f" (it looks like {_JSON_LAYOUTS[other][0]} dataset.json: use layout={other.value!r})"
            raise DataError(f"{str(self.path)!r} lacks the required key {key!r}: {expected}; "
                            f"{_JSON_LAYOUTS[self.layout][0]} dataset.json needs "
                            f"{', '.join(repr(k) for k in self.required)}{hint}")
        value = self.meta[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise DataError(f"{str(self.path)!r}: key {key!r} is {json.dumps(value)[:80]}, a "
                            f"{type(value).__name__}; expected {expected}")
        return value

    def channels(self, key: str) -> tuple[str, ...]:
        """A ``{"0": name, "1": name, ...}`` object as the names in index order."""
        expected = 'an object of channel index -> name, indices "0".."n-1", e.g. {"0": "CT"} or {"0": "T2", "1": "ADC"}'
        raw = self.get(key, dict, expected)
        if not raw:
            raise DataError(f"{str(self.path)!r}: key {key!r} lists no channel; expected {expected}")
        indexed = {}
        for index, name in raw.items():
            if not (isinstance(index, str) and index.strip().isdigit()):
                raise DataError(f"{str(self.path)!r}: key {key!r} has the channel index {index!r}, not a number; "
                                f"expected {expected}")
            if not isinstance(name, str) or not name.strip():
                raise DataError(f"{str(self.path)!r}: {key}[{index!r}] is {json.dumps(name)}; a channel's name must "
                                f"be a non-empty string")
            indexed[int(index)] = name
        if sorted(indexed) != list(range(len(indexed))):
            raise DataError(f"{str(self.path)!r}: key {key!r} has the channel indices {sorted(indexed)}; expected "
                            f"0..{len(indexed) - 1}, one per channel")
        return tuple(indexed[i] for i in range(len(indexed)))

    def name(self, root: Path) -> str:
        name = self.meta.get("name")
        return name if isinstance(name, str) and name.strip() else root.name

    def count(self, key: str, *, required: bool) -> int | None:
        if not required and key not in self.meta:
            return None
        value = self.get(key, int, "a non-negative whole number (the number of training cases)")
        if value < 0:
            raise DataError(f"{str(self.path)!r}: key {key!r} is {value}; expected a non-negative whole number")
        return int(value)


def _label_value(keys: _Keys, raw: Any, where: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= MAX_LABEL_VALUE:
        raise DataError(f"{str(keys.path)!r}: {where} is {json.dumps(raw)}; a label value is a whole number "
                        f"0..{MAX_LABEL_VALUE}")
    return int(raw)


def _check_classes(keys: _Keys, classes: list[tuple[str, int]]) -> None:
    values = [v for _, v in classes]
    if 0 not in values:
        raise DataError(f"{str(keys.path)!r}: key 'labels' has no background, value 0 ({keys.meta['labels']}); "
                        f"label 0 must be background")
    for value in set(values):
        named = [n for n, v in classes if v == value]
        if len(named) > 1:
            raise DataError(f"{str(keys.path)!r}: key 'labels' gives the value {value} to several classes "
                            f"({', '.join(map(repr, named))}); every class needs its own value")
    names = [n for n, _ in classes]
    for name in set(names):
        if names.count(name) > 1:
            raise DataError(f"{str(keys.path)!r}: key 'labels' names several values {name!r} "
                            f"({sorted(v for n, v in classes if n == name)}); every class needs its own name")


def describe_msd(root: Path) -> DatasetDescription:
    """An MSD data set's description, from its dataset.json's ``modality``, ``labels`` and ``training``."""
    path = root / "dataset.json"
    meta = _read_json(path, Layout.MSD)
    keys = _Keys(path, meta, Layout.MSD, ("modality", "labels", "training"))
    channels = keys.channels("modality")
    expected = 'an object of label value -> class name, e.g. {"0": "background", "1": "spleen"}'
    raw = keys.get("labels", dict, expected)
    classes = []
    for value, name in raw.items():
        if not (isinstance(value, str) and value.strip().isdigit()):
            raise DataError(f"{str(path)!r}: key 'labels' has the label value {value!r}, not a whole number; "
                            f"expected {expected}")
        if not isinstance(name, str) or not name.strip():
            raise DataError(f"{str(path)!r}: labels[{value!r}] is {json.dumps(name)}; a class name must be a "
                            "non-empty string")
        classes.append((name, _label_value(keys, int(value), f"labels[{value!r}]")))
    _check_classes(keys, classes)
    keys.get("training", list, "a list of {'image': ..., 'label': ...} entries, one per training case")
    return DatasetDescription(Layout.MSD, channels, tuple(classes), num_training=keys.count("numTraining",
                                                                                            required=False),
                              name=keys.name(root))


def describe_nnunet(root: Path) -> DatasetDescription:
    """An nnU-Net v2 data set's description, from its dataset.json's ``channel_names``, ``labels``,
    ``numTraining``, ``file_ending`` and ``regions_class_order``."""
    path = root / "dataset.json"
    meta = _read_json(path, Layout.NNUNET)
    keys = _Keys(path, meta, Layout.NNUNET, ("channel_names", "labels", "numTraining", "file_ending"))
    channels = keys.channels("channel_names")
    expected = ('an object of class name -> label value, or -> a list of values for a region, e.g. '
                '{"background": 0, "spleen": 1}')
    raw = keys.get("labels", dict, expected)
    plain: list[tuple[str, int]] = []
    lists: dict[str, tuple[int, ...]] = {}
    for name, value in raw.items():
        if not name.strip():
            raise DataError(f"{str(path)!r}: key 'labels' has an empty class name; expected {expected}")
        if isinstance(value, list):
            if not value:
                raise DataError(f"{str(path)!r}: labels[{name!r}] is an empty list; a region unites one or more "
                                "label values")
            lists[name] = tuple(sorted({_label_value(keys, v, f'labels[{name!r}]') for v in value}))
        else:
            plain.append((name, _label_value(keys, value, f"labels[{name!r}]")))
    num_training = keys.count("numTraining", required=True)
    ending = keys.get("file_ending", str, 'the files\' ending, ".nii.gz" or ".nii"')
    if ending not in NIFTI_SUFFIXES:
        raise DataError(f"{str(path)!r}: file_ending is {ending!r}; distmis reads NIfTI only: file_ending must be "
                        f"{' or '.join(map(repr, NIFTI_SUFFIXES))} (convert the images and labels to NIfTI)")
    if not lists:
        _check_classes(keys, plain)
        return DatasetDescription(Layout.NNUNET, channels, tuple(plain), file_ending=ending,
                                  num_training=num_training, name=keys.name(root))

    # region-based: every label but background is a region, painted back in regions_class_order
    background = [n for n, v in plain if v == 0]
    if not background:
        raise DataError(f"{str(path)!r}: key 'labels' has no background, value 0 ({raw}); label 0 must be "
                        "background, a plain 0 (not a list)")
    regions = [(n, (v,)) for n, v in plain if v != 0] + list(lists.items())
    order_names = [n for n in raw if n != background[0]]
    regions.sort(key=lambda nv: order_names.index(nv[0]))  # dataset.json's order
    order = keys.get("regions_class_order", list,
                     f"with region-based labels, a list of {len(regions)} label values, the value each region "
                     f"({', '.join(repr(n) for n, _ in regions)}) is painted with, in that order")
    if len(order) != len(regions):
        raise DataError(f"{str(path)!r}: key 'regions_class_order' has {len(order)} value(s) ({order}) but 'labels' "
                        f"has {len(regions)} region(s) besides background ({', '.join(repr(n) for n, _ in regions)}); "
                        "it needs one value per region")
    paints = [_label_value(keys, v, f"regions_class_order[{i}]") for i, v in enumerate(order)]
    region_objects = tuple(Region(n, values, paint) for (n, values), paint in zip(regions, paints))
    if len(set(paints)) != len(paints) or 0 in paints:
        raise DataError(f"{str(path)!r}: key 'regions_class_order' is {order}; every region needs its own "
                        "non-zero value")
    classes = ((background[0], 0), *((r.name, r.paint) for r in region_objects))
    return DatasetDescription(Layout.NNUNET, channels, classes, regions=region_objects, file_ending=ending,
                              num_training=num_training, name=keys.name(root))
