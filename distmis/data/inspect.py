"""Summarise a raw data set before converting it.

:func:`inspect_dataset` reads every case (with the same validation as
training: a bad case raises :class:`~distmis.data.errors.DataError`) and returns
one row per case; :func:`format_inspection` turns that table into a short
human-readable summary, e.g. for ``distmis data inspect``.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from distmis.data.layouts import Layout, coerce_layout, discover_cases, label_counts, read_case

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["INSPECTION_COLUMNS", "inspect_dataset", "format_inspection"]

#: Columns of the table returned by :func:`inspect_dataset`.
INSPECTION_COLUMNS: tuple[str, ...] = (
    "case_id",
    "shape",
    "spacing",
    "image_dtype",
    "label_dtype",
    "label_values",
    "label_counts",
    "tumour_fraction",
)


def _stored_dtype(path: Path) -> str:
    """Data type as stored in the NIfTI header (not the dtype after scaling)."""
    import nibabel as nib

    return str(nib.load(str(path)).get_data_dtype())


def inspect_dataset(root: str | Path, layout: Layout | str, *, progress: bool = False) -> pd.DataFrame:
    """One row per case of the data set at ``root``.

    Columns (:data:`INSPECTION_COLUMNS`): ``case_id``; ``shape`` (spatial
    ``(H, W, D)``); ``spacing`` (mm); ``image_dtype`` / ``label_dtype`` as
    stored in the files (BraTS: the distinct dtypes of the four modality files
    joined by ``/``); ``label_values`` (sorted tuple); ``label_counts``
    (``{value: voxels}``); ``tumour_fraction`` (share of voxels with a non-zero label).

    Raises:
        DataError: like :func:`~distmis.data.layouts.discover_cases` and
            :func:`~distmis.data.layouts.read_case`, naming the bad file.
    """
    import pandas as pd
    from tqdm import tqdm

    layout = coerce_layout(layout)
    rows = []
    for case in tqdm(discover_cases(root, layout), desc="inspect", unit="case", disable=not progress, file=sys.stderr):
        image, label, spacing = read_case(case, layout)
        counts = label_counts(label)
        image_dtypes = list(dict.fromkeys(_stored_dtype(p) for p in case.images))
        rows.append(
            {
                "case_id": case.case_id,
                "shape": tuple(int(s) for s in image.shape[:3]),
                "spacing": tuple(round(float(s), 6) for s in spacing),
                "image_dtype": "/".join(image_dtypes),
                "label_dtype": _stored_dtype(case.label),
                "label_values": tuple(sorted(counts)),
                "label_counts": counts,
                "tumour_fraction": float(sum(c for v, c in counts.items() if v != 0) / label.size),
            }
        )
    return pd.DataFrame(rows, columns=list(INSPECTION_COLUMNS))


def format_inspection(df: pd.DataFrame) -> str:
    """Short summary of an :func:`inspect_dataset` table.

    Lists the number of cases, the distinct shapes, spacings and dtypes with
    their case counts, the label values over all cases with voxel totals and
    the number of cases that contain them, and the tumour-fraction range.
    """
    if len(df) == 0:
        return "0 cases"

    def _tally(column: str) -> str:
        tally = Counter(df[column])
        return ", ".join(f"{value} x{count}" for value, count in sorted(tally.items(), key=lambda kv: (-kv[1], str(kv[0]))))

    voxels: Counter[int] = Counter()
    cases_with: Counter[int] = Counter()
    for counts in df["label_counts"]:
        voxels.update(counts)
        cases_with.update(counts.keys())
    fractions = df["tumour_fraction"]
    lines = [
        f"{len(df)} cases",
        f"shapes: {_tally('shape')}",
        f"spacings: {_tally('spacing')}",
        f"image dtypes: {_tally('image_dtype')}; label dtypes: {_tally('label_dtype')}",
        "label values: " + ", ".join(f"{v} ({voxels[v]} voxels in {cases_with[v]} cases)" for v in sorted(voxels)),
        f"tumour fraction: min {fractions.min():.4f}, median {fractions.median():.4f}, max {fractions.max():.4f}",
    ]
    if len(set(df["shape"])) > 1:
        lines.append("note: shapes differ between cases; set crop or resize in the preprocessing config")
    return "\n".join(lines)
