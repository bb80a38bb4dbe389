"""What a user checks before a search: cases, shapes, spacing, dtypes, label values and counts."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import pandas as pd

from distmis.data.layouts import Layout, coerce_layout, discover_cases, label_counts, read_case

__all__ = ["inspect_dataset", "format_inspection"]


def inspect_dataset(root: str | Path, layout: Layout | str) -> pd.DataFrame:
    """One row per case. Reads every case (through :func:`read_case`, so bad files raise ``DataError``)."""
    layout = coerce_layout(layout)
    rows = []
    for case in discover_cases(root, layout):
        image, label, spacing = read_case(case, layout)
        counts = label_counts(label)
        rows.append({
            "case_id": case.case_id,
            "shape": tuple(int(s) for s in image.shape),
            "spacing": tuple(round(float(s), 3) for s in spacing),
            "image_dtype": str(nib.load(case.images[0]).get_data_dtype()),
            "label_dtype": str(nib.load(case.label).get_data_dtype()),
            "label_counts": counts,
            "tumour_fraction": round(sum(c for v, c in counts.items() if v != 0) / label.size, 4),
        })
    return pd.DataFrame(rows)


def format_inspection(frame: pd.DataFrame) -> str:
    """The per-case table and a summary: number of cases, distinct shapes and spacings, label values overall."""
    totals: dict[int, int] = {}
    for counts in frame["label_counts"]:
        for value, count in counts.items():
            totals[value] = totals.get(value, 0) + count
    shown = frame.assign(labels=[" ".join(f"{v}:{c}" for v, c in sorted(d.items())) for d in frame["label_counts"]])
    lines = [
        shown.drop(columns=["label_counts"]).to_string(index=False),
        "",
        f"cases: {len(frame)}",
        f"shapes: {sorted(set(frame['shape']))}",
        f"spacings: {sorted(set(frame['spacing']))}",
        f"image dtypes: {sorted(set(frame['image_dtype']))}; label dtypes: {sorted(set(frame['label_dtype']))}",
        "label values (voxels): " + ", ".join(f"{v}: {c}" for v, c in sorted(totals.items())),
        f"tumour fraction: mean {frame['tumour_fraction'].mean():.4f}, "
        f"min {frame['tumour_fraction'].min():.4f}, max {frame['tumour_fraction'].max():.4f}",
    ]
    return "\n".join(lines)
