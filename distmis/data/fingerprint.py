"""A data set's fingerprint: what a plan needs to know of the data, computed once (nnU-Net's
``dataset_fingerprint.json``).

:func:`compute_fingerprint` reads every case (with the same checks as training) and returns a
:class:`DatasetFingerprint`:

* per case (:class:`CaseFingerprint`): its shape and spacing as stored, its orientation, its shape after cropping to
  the non-zero region of its image (any channel non-zero, as nnU-Net crops), the voxels of each label value, and per
  foreground label its objects (6-connected components): how many, and their volumes in mm^3;
* per channel (:class:`ChannelFingerprint`): the intensities over the foreground voxels (label > 0) of every case:
  mean, standard deviation, median, the 0.5 and 99.5 percentiles (over a seeded sample of at most
  :data:`FOREGROUND_SAMPLES_PER_CASE` voxels a case), minimum and maximum (over every foreground voxel), as nnU-Net's
  intensity properties;
* over the data set: the median spacing, the median cropped shape in voxels and at the median spacing, the
  anisotropy (the largest median spacing over the smallest), each label value's share of the voxels and its
  typical object (the median object's volume).

:func:`fingerprint_for` keeps it as ``dataset_fingerprint.json`` in a folder of distmis's own and reuses it until a
case's files change (their paths, sizes and modification times: :func:`files_key`). ``distmis data inspect --json``
prints it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from distmis.data.case_progress import case_progress
from distmis.data.dataset_layouts import describe_dataset
from distmis.data.layouts import (
    CaseFiles,
    Layout,
    case_orientation,
    check_cases,
    coerce_layout,
    discover_cases,
    label_counts,
    read_case,
)
from distmis.pyfunc_model import nonzero_box

__all__ = ["FINGERPRINT_FILE", "FINGERPRINT_VERSION", "FOREGROUND_SAMPLES_PER_CASE", "ANISOTROPY_THRESHOLD",
           "CaseFingerprint", "ChannelFingerprint", "ClassFingerprint", "DatasetFingerprint", "compute_fingerprint",
           "fingerprint_for", "files_key", "nonzero_box"]

#: The file name a fingerprint is kept under (nnU-Net's).
FINGERPRINT_FILE = "dataset_fingerprint.json"
#: Bumped whenever what a fingerprint holds changes: a kept fingerprint of another version is computed again.
FINGERPRINT_VERSION = 1
#: At most this many foreground voxels of a case enter a channel's percentiles, mean and deviation (a sample seeded
#: by the case id); nnU-Net samples 10^8 voxels over the whole data set.
FOREGROUND_SAMPLES_PER_CASE = 10_000
#: nnU-Net's rule: a data set whose largest median spacing is more than this times its smallest is anisotropic.
ANISOTROPY_THRESHOLD = 3.0

Shape = tuple[int, int, int]
Spacing = tuple[float, float, float]


@dataclass(frozen=True)
class CaseFingerprint:
    """One case. ``label_voxels``: voxels of each label value present (background 0 included); ``objects``: for
    each foreground label value present, the volumes (mm^3) of its 6-connected components, largest first."""

    case_id: str
    shape: Shape
    spacing: Spacing
    orientation: str
    cropped_shape: Shape
    label_voxels: dict[int, int]
    objects: dict[int, tuple[float, ...]]

    @property
    def voxels(self) -> int:
        return int(np.prod(self.shape))


@dataclass(frozen=True)
class ChannelFingerprint:
    """One channel's intensities over the foreground voxels of every case (None where no case has any)."""

    name: str
    mean: float | None
    std: float | None
    median: float | None
    percentile_00_5: float | None
    percentile_99_5: float | None
    min: float | None
    max: float | None


@dataclass(frozen=True)
class ClassFingerprint:
    """One label value over the data set: its name, its share of all voxels, the cases it is in, and its objects:
    the median number a case it is in holds, and the median object's volume (mm^3)."""

    value: int
    name: str
    voxel_fraction: float
    cases: int
    median_objects: float
    median_object_mm3: float | None


@dataclass(frozen=True)
class DatasetFingerprint:
    """What :func:`compute_fingerprint` found (see the module docstring). ``files_key``: the cases' files as they
    were (:func:`files_key`)."""

    version: int
    root: str
    layout: str
    files_key: str
    channels: tuple[ChannelFingerprint, ...]
    classes: tuple[ClassFingerprint, ...]
    cases: tuple[CaseFingerprint, ...]
    median_spacing: Spacing
    median_shape: Shape
    median_shape_at_median_spacing: Shape

    @property
    def anisotropy(self) -> float:
        """The largest median spacing over the smallest."""
        return max(self.median_spacing) / min(self.median_spacing)

    @property
    def anisotropic(self) -> bool:
        """nnU-Net's rule: :attr:`anisotropy` above :data:`ANISOTROPY_THRESHOLD`."""
        return self.anisotropy > ANISOTROPY_THRESHOLD

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the derived ``anisotropy`` and ``anisotropic`` included, for a person reading it)."""
        document = dataclasses.asdict(self)
        document["anisotropy"] = self.anisotropy
        document["anisotropic"] = self.anisotropic
        return document

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, document: dict[str, Any]) -> DatasetFingerprint:
        """The fingerprint :meth:`to_dict` wrote (JSON's string keys and lists turned back)."""
        cases = tuple(CaseFingerprint(
            case_id=c["case_id"], shape=_ints(c["shape"]), spacing=_floats(c["spacing"]),
            orientation=c["orientation"], cropped_shape=_ints(c["cropped_shape"]),
            label_voxels={int(k): int(v) for k, v in c["label_voxels"].items()},
            objects={int(k): tuple(float(x) for x in v) for k, v in c["objects"].items()},
        ) for c in document["cases"])
        return cls(
            version=int(document["version"]), root=document["root"], layout=document["layout"],
            files_key=document["files_key"],
            channels=tuple(ChannelFingerprint(**c) for c in document["channels"]),
            classes=tuple(ClassFingerprint(**c) for c in document["classes"]),
            cases=cases, median_spacing=_floats(document["median_spacing"]),
            median_shape=_ints(document["median_shape"]),
            median_shape_at_median_spacing=_ints(document["median_shape_at_median_spacing"]),
        )


def _ints(values: Sequence[Any]) -> Shape:
    a, b, c = (int(v) for v in values)
    return a, b, c


def _floats(values: Sequence[Any]) -> Spacing:
    a, b, c = (float(v) for v in values)
    return a, b, c


# --------------------------------------------------------------------------- one case
def _objects(label: np.ndarray, values: Sequence[int], voxel_mm3: float) -> dict[int, tuple[float, ...]]:
    """Per foreground label value: the volumes (mm^3) of its 6-connected components, largest first."""
    from scipy import ndimage

    found = {}
    for value in values:
        components, count = ndimage.label(label == value)
        sizes = np.bincount(components.ravel(), minlength=count + 1)[1:]
        found[value] = tuple(float(s) * voxel_mm3 for s in sorted(sizes.tolist(), reverse=True))
    return found


def _foreground_sample(image: np.ndarray, label: np.ndarray, case_id: str) -> np.ndarray:
    """``(n, C)`` float64 intensities of the case's foreground voxels, at most :data:`FOREGROUND_SAMPLES_PER_CASE`
    of them (a sample without replacement, seeded by the case id)."""
    values = image[label > 0]
    if len(values) > FOREGROUND_SAMPLES_PER_CASE:
        rng = np.random.default_rng(zlib.crc32(case_id.encode()))
        values = values[np.sort(rng.choice(len(values), FOREGROUND_SAMPLES_PER_CASE, replace=False))]
    return values.astype(np.float64)


# --------------------------------------------------------------------------- the data set
def compute_fingerprint(root: str | Path, layout: Layout | str, *, progress: bool = False) -> DatasetFingerprint:
    """Read every case of the data set at ``root`` and fingerprint it (see the module docstring).

    Raises:
        DataError: as :func:`~distmis.data.inspect.summarize_dataset` does, naming the bad file or key.
    """
    layout = coerce_layout(layout)
    root = Path(root)
    cases = discover_cases(root, layout)
    description = describe_dataset(root, layout)
    check_cases(cases, description)
    found: list[CaseFingerprint] = []
    samples: list[np.ndarray] = []
    lows = np.full(description.num_channels, np.inf)
    highs = np.full(description.num_channels, -np.inf)
    for case in case_progress(cases, "fingerprint", enabled=progress):
        image, label, spacing = read_case(case, description)
        counts = label_counts(label)
        box = nonzero_box(image)
        voxel_mm3 = float(np.prod(spacing))
        found.append(CaseFingerprint(
            case_id=case.case_id, shape=_ints(image.shape[:3]), spacing=_floats(spacing),
            orientation=case_orientation(case), cropped_shape=_ints([s.stop - s.start for s in box]),
            label_voxels=counts, objects=_objects(label, [v for v in counts if v != 0], voxel_mm3)))
        inside = image[label > 0]
        if len(inside):
            lows = np.minimum(lows, inside.min(axis=0))
            highs = np.maximum(highs, inside.max(axis=0))
        samples.append(_foreground_sample(image, label, case.case_id))
    foreground = np.concatenate(samples) if samples else np.empty((0, description.num_channels))
    channels = tuple(_channel(name, foreground[:, c], lows[c], highs[c]) for c, name in enumerate(description.channels))
    names = dict((value, name) for name, value in description.classes)
    median_spacing = _floats(np.median([c.spacing for c in found], axis=0))
    resampled = [np.array(c.cropped_shape) * np.array(c.spacing) / np.array(median_spacing) for c in found]
    return DatasetFingerprint(
        version=FINGERPRINT_VERSION, root=str(root.resolve()), layout=layout.value, files_key=files_key(cases),
        channels=channels, classes=_classes(found, names), cases=tuple(found), median_spacing=median_spacing,
        median_shape=_ints(np.round(np.median([c.cropped_shape for c in found], axis=0))),
        median_shape_at_median_spacing=_ints(np.round(np.median(resampled, axis=0))),
    )


def _channel(name: str, values: np.ndarray, low: float, high: float) -> ChannelFingerprint:
    if not len(values):
        return ChannelFingerprint(name, None, None, None, None, None, None, None)
    p005, median, p995 = np.percentile(values, [0.5, 50.0, 99.5])
    return ChannelFingerprint(name, float(values.mean()), float(values.std()), float(median), float(p005),
                              float(p995), float(low), float(high))


def _classes(cases: Sequence[CaseFingerprint], names: dict[int, str]) -> tuple[ClassFingerprint, ...]:
    """Each label value found in any case (and each one the description names), over the data set."""
    total = sum(c.voxels for c in cases)
    values = sorted(set(names) | {v for c in cases for v in c.label_voxels})
    found = []
    for value in values:
        holding = [c for c in cases if value in c.label_voxels]
        objects = [c.objects[value] for c in holding if value in c.objects]
        volumes = [v for per_case in objects for v in per_case]
        found.append(ClassFingerprint(
            value=value, name=names.get(value, f"label {value}"),
            voxel_fraction=sum(c.label_voxels[value] for c in holding) / total if total else 0.0,
            cases=len(holding), median_objects=float(np.median([len(o) for o in objects])) if objects else 0.0,
            median_object_mm3=float(np.median(volumes)) if volumes else None))
    return tuple(found)


# --------------------------------------------------------------------------- kept, and reused
def files_key(cases: Sequence[CaseFiles]) -> str:
    """A digest of every case file's path, size and modification time: a kept fingerprint is reused while it
    is the same (a file replaced, touched, added or removed changes it)."""
    digest = hashlib.sha256()
    for case in cases:
        for path in (*case.images, case.label):
            stat = os.stat(path)
            digest.update(f"{Path(path).resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def fingerprint_for(root: str | Path, layout: Layout | str, folder: str | Path, *,
                    progress: bool = False) -> DatasetFingerprint:
    """The fingerprint of the data set at ``root``, kept as :data:`FINGERPRINT_FILE` in ``folder`` (a folder of
    distmis's own, made if need be): the kept one while the cases' files are as they were (:func:`files_key`)
    and its version is this distmis's, else computed again and kept (written whole: a temporary file renamed)."""
    layout = coerce_layout(layout)
    path = Path(folder) / FINGERPRINT_FILE
    key = files_key(discover_cases(root, layout))
    if path.is_file():
        try:
            kept = DatasetFingerprint.from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):  # damaged, or another version's: computed again
            kept = None
        if kept is not None and kept.version == FINGERPRINT_VERSION and kept.files_key == key:
            return kept
    fingerprint = compute_fingerprint(root, layout, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{FINGERPRINT_FILE}.partial-{os.getpid()}")
    try:
        partial.write_text(fingerprint.to_json())
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    return fingerprint
