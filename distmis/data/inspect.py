"""Summarise a raw data set before converting it.

:func:`summarize_dataset` checks every case against the data set's description
(:func:`~distmis.data.layouts.check_cases`, from the headers), reads every case
(with the same validation as training: a bad case raises
:class:`~distmis.data.errors.DataError`) and returns a :class:`DatasetSummary`:
the description (channels, classes), one row per case, and each channel's
intensity range. :func:`format_summary` turns it into the text
``distmis data inspect`` prints: channels, classes with voxel counts, shapes,
spacings (min / median / max per axis), orientations and intensity ranges.

:func:`inspect_dataset` returns the per-case table alone, and
:func:`format_inspection` a short summary of that table.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from distmis.data.case_progress import case_progress
from distmis.data.dataset_layouts import dataset_layout, describe_dataset
from distmis.data.description import DatasetDescription
from distmis.data.layouts import (
    Layout,
    case_orientation,
    check_cases,
    coerce_layout,
    discover_cases,
    label_counts,
    read_case,
)

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["INSPECTION_COLUMNS", "SAMPLES_PER_CASE", "ChannelRange", "DatasetSummary", "summarize_dataset",
           "inspect_dataset", "format_inspection", "format_summary"]

#: Columns of the per-case table (:func:`inspect_dataset`, :attr:`DatasetSummary.cases`).
INSPECTION_COLUMNS: tuple[str, ...] = (
    "case_id",
    "shape",
    "spacing",
    "orientation",
    "image_dtype",
    "label_dtype",
    "label_values",
    "label_counts",
    "foreground_fraction",
)

#: At most this many voxels per case and channel (and as many foreground voxels) enter the intensity
#: percentiles: a seeded uniform sample beyond that. Minimum and maximum are over every voxel.
SAMPLES_PER_CASE = 20_000


@dataclass(frozen=True)
class ChannelRange:
    """The intensities of one channel over a data set.

    Attributes:
        name: the channel's name.
        min, max: over every voxel of every case.
        low, high: the 0.5 and 99.5 percentiles (numpy's linear interpolation) over every case's voxels
            (sampled: :data:`SAMPLES_PER_CASE`).
        foreground_low, foreground_high: the same over the foreground (label > 0); None when no case has any.
    """

    name: str
    min: float
    low: float
    high: float
    max: float
    foreground_low: float | None = None
    foreground_high: float | None = None


@dataclass(frozen=True)
class DatasetSummary:
    """What :func:`summarize_dataset` found: the data set's description, one row per case
    (:data:`INSPECTION_COLUMNS`) and each channel's intensity range, in channel order."""

    root: Path
    description: DatasetDescription
    cases: pd.DataFrame
    intensities: tuple[ChannelRange, ...]


def _stored_dtype(path: Path) -> str:
    """Data type as stored in the NIfTI header (not the dtype after scaling)."""
    import nibabel as nib

    return str(nib.load(str(path)).get_data_dtype())


def _sample(values: np.ndarray, count: int, seed: int) -> np.ndarray:
    """``values`` (rows) as they are, or ``count`` of them drawn uniformly with a seeded generator."""
    if len(values) <= count:
        return values
    return values[np.random.default_rng(seed).integers(0, len(values), count)]


def summarize_dataset(root: str | Path, layout: Layout | str, *, progress: bool = False,
                      samples_per_case: int = SAMPLES_PER_CASE) -> DatasetSummary:
    """Describe, check and read every case of the data set at ``root``.

    Per case (:data:`INSPECTION_COLUMNS`): ``case_id``; ``shape`` (spatial ``(H, W, D)``); ``spacing`` (mm);
    ``orientation`` (axis codes, e.g. ``"RAS"``); ``image_dtype`` / ``label_dtype`` as stored in the files
    (several image files: their distinct dtypes joined by ``/``); ``label_values`` (sorted tuple);
    ``label_counts`` (``{value: voxels}``); ``foreground_fraction`` (share of voxels with a non-zero label).

    Raises:
        DataError: like :func:`~distmis.data.dataset_layouts.describe_dataset`,
            :func:`~distmis.data.layouts.discover_cases`, :func:`~distmis.data.layouts.check_cases` and
            :func:`~distmis.data.layouts.read_case`, naming the bad file or key.
    """
    import pandas as pd

    layout = coerce_layout(layout)
    root = Path(root)
    cases = discover_cases(root, layout)
    description = describe_dataset(root, layout)
    check_cases(cases, description)
    rows = []
    samples: list[list[np.ndarray]] = [[] for _ in description.channels]
    foreground: list[list[np.ndarray]] = [[] for _ in description.channels]
    lows = np.full(description.num_channels, np.inf)
    highs = np.full(description.num_channels, -np.inf)
    for case in case_progress(cases, "inspect", enabled=progress):
        image, label, spacing = read_case(case, description)
        counts = label_counts(label)
        image_dtypes = list(dict.fromkeys(_stored_dtype(p) for p in case.images))
        rows.append({
            "case_id": case.case_id,
            "shape": tuple(int(s) for s in image.shape[:3]),
            "spacing": tuple(round(float(s), 6) for s in spacing),
            "orientation": case_orientation(case),
            "image_dtype": "/".join(image_dtypes),
            "label_dtype": _stored_dtype(case.label),
            "label_values": tuple(sorted(counts)),
            "label_counts": counts,
            "foreground_fraction": float(sum(c for v, c in counts.items() if v != 0) / label.size),
        })
        voxels = image.reshape(-1, image.shape[-1])
        seed = zlib.crc32(case.case_id.encode())
        lows = np.minimum(lows, voxels.min(axis=0))
        highs = np.maximum(highs, voxels.max(axis=0))
        everywhere = _sample(voxels, samples_per_case, seed)
        inside = _sample(voxels[label.reshape(-1) > 0], samples_per_case, seed + 1)
        for c in range(description.num_channels):
            samples[c].append(everywhere[:, c])
            foreground[c].append(inside[:, c])
    ranges = []
    for c, name in enumerate(description.channels):
        if not rows:
            break
        low, high = np.percentile(np.concatenate(samples[c]), [0.5, 99.5])
        fg = np.concatenate(foreground[c])
        fg_low, fg_high = np.percentile(fg, [0.5, 99.5]) if fg.size else (None, None)
        ranges.append(ChannelRange(name, float(lows[c]), float(low), float(high), float(highs[c]),
                                   None if fg_low is None else float(fg_low),
                                   None if fg_high is None else float(fg_high)))
    table = pd.DataFrame(rows, columns=list(INSPECTION_COLUMNS))
    return DatasetSummary(root, description, table, tuple(ranges))


def inspect_dataset(root: str | Path, layout: Layout | str, *, progress: bool = False) -> pd.DataFrame:
    """One row per case of the data set at ``root`` (:data:`INSPECTION_COLUMNS`; see :func:`summarize_dataset`).

    Raises:
        DataError: as :func:`summarize_dataset` does, naming the bad file or key.
    """
    return summarize_dataset(root, layout, progress=progress).cases


def _tally(values: Sequence[object]) -> str:
    tally = Counter(values)
    return ", ".join(f"{value} x{count}" for value, count in sorted(tally.items(), key=lambda kv: (-kv[1], str(kv[0]))))


def _number(value: float) -> str:
    return f"{value:.4g}"


def format_inspection(df: pd.DataFrame) -> str:
    """Short summary of an :func:`inspect_dataset` table.

    Lists the number of cases, the distinct shapes, spacings and dtypes with
    their case counts, the label values over all cases with voxel totals and
    the number of cases that contain them, and the foreground-fraction range.
    """
    if len(df) == 0:
        return "0 cases"
    voxels: Counter[int] = Counter()
    cases_with: Counter[int] = Counter()
    for counts in df["label_counts"]:
        voxels.update(counts)
        cases_with.update(counts.keys())
    fractions = df["foreground_fraction"]
    lines = [
        f"{len(df)} cases",
        f"shapes: {_tally(list(df['shape']))}",
        f"spacings: {_tally(list(df['spacing']))}",
        f"image dtypes: {_tally(list(df['image_dtype']))}; label dtypes: {_tally(list(df['label_dtype']))}",
        "label values: " + ", ".join(f"{v} ({voxels[v]} voxels in {cases_with[v]} cases)" for v in sorted(voxels)),
        f"foreground fraction: min {fractions.min():.4f}, median {fractions.median():.4f}, max {fractions.max():.4f}",
    ]
    if len(set(df["shape"])) > 1:
        lines.append("note: shapes differ between cases; set crop or resize in the preprocessing config")
    return "\n".join(lines)


def _spacing_line(spacings: np.ndarray) -> str:
    def axes(values: np.ndarray) -> str:
        return " x ".join(f"{v:g}" for v in np.round(values, 4))

    return (f"spacing (mm): min {axes(spacings.min(axis=0))}, median {axes(np.median(spacings, axis=0))}, "
            f"max {axes(spacings.max(axis=0))}")


def _intensity_lines(ranges: Sequence[ChannelRange]) -> list[str]:
    labels = [f"{i} {r.name}" for i, r in enumerate(ranges)]
    width = max(len(label) for label in labels)
    header = (f"  {'':<{width}}  {'min':>10}  {'0.5%':>10}  {'99.5%':>10}  {'max':>10}   foreground 0.5% .. 99.5%")
    lines = ["intensities per channel:", header]
    for label, r in zip(labels, ranges):
        fg = ("-" if r.foreground_low is None or r.foreground_high is None
              else f"{_number(r.foreground_low)} .. {_number(r.foreground_high)}")
        lines.append(f"  {label:<{width}}  {_number(r.min):>10}  {_number(r.low):>10}  {_number(r.high):>10}  "
                     f"{_number(r.max):>10}   {fg}")
    return lines


def format_summary(summary: DatasetSummary) -> str:
    """The text ``distmis data inspect`` prints above its per-case table: the data set's name, layout and
    number of cases; channels; classes (or regions) with voxel counts and the cases that hold them; shapes;
    spacing min / median / max per axis; orientations; intensity range per channel; stored dtypes."""
    description, df = summary.description, summary.cases
    title = description.name or summary.root.name
    layout = description.layout
    lines = [f"{title}: {len(df)} cases, layout {layout.value} ({dataset_layout(layout).title})"]
    lines.append("channels: " + ", ".join(f"{i} {name}" for i, name in enumerate(description.channels)))
    if len(df) == 0:
        return "\n".join(lines)

    voxels: Counter[int] = Counter()
    cases_with: Counter[int] = Counter()
    for counts in df["label_counts"]:
        voxels.update(counts)
        cases_with.update(counts.keys())
    total = sum(voxels.values())
    names = description.value_names()
    lines.append("label values:" if description.regions else "classes:")
    width = max(len(f"{v} {n}") for v, n in names.items())
    for value, name in names.items():
        share = f"{100 * voxels[value] / total:.3g}%" if total else "0%"
        lines.append(f"  {f'{value} {name}':<{width}}  {voxels[value]:>12,} voxels ({share}) in "
                     f"{cases_with[value]}/{len(df)} cases")
    if description.regions:
        lines.append("regions (painted in this order):")
        for region in description.regions:
            count = sum(voxels[v] for v in region.values)
            holding = sum(any(v in counts for v in region.values) for counts in df["label_counts"])
            values = ", ".join(map(str, region.values))
            lines.append(f"  {region.name} = {{{values}}}, painted {region.paint}: {count:,} voxels in "
                         f"{holding}/{len(df)} cases")

    lines.append(f"shapes: {_tally(list(df['shape']))}")
    lines.append(_spacing_line(np.array([list(s) for s in df["spacing"]], dtype=np.float64)))
    lines.append(f"orientations: {_tally(list(df['orientation']))}")
    lines += _intensity_lines(summary.intensities)
    lines.append(f"image dtypes: {_tally(list(df['image_dtype']))}; label dtypes: {_tally(list(df['label_dtype']))}")
    fractions = df["foreground_fraction"]
    lines.append(f"foreground fraction: min {fractions.min():.4f}, median {fractions.median():.4f}, "
                 f"max {fractions.max():.4f}")
    if len(set(df["shape"])) > 1:
        lines.append("note: shapes differ between cases; set crop, resize or spacing in the spec's dataset section")
    return "\n".join(lines)
