"""Tests for distmis.data.inspect."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from distmis.data import DataError, format_inspection, inspect_dataset
from distmis.data.inspect import INSPECTION_COLUMNS

from .conftest import SHAPE, write_nifti

VOXELS = int(np.prod(SHAPE))


def test_inspect_brats(brats_root: Path) -> None:
    df = inspect_dataset(brats_root, "brats")
    assert isinstance(df, pd.DataFrame)
    assert list(df.columns) == list(INSPECTION_COLUMNS) and len(df) == 5
    assert df["case_id"].tolist() == [f"BraTS2021_{i:05d}" for i in range(5)]
    row = df.iloc[0]
    assert row["shape"] == SHAPE and row["spacing"] == (1.0, 1.0, 1.0)
    assert row["image_dtype"] == "int16" and row["label_dtype"] == "uint8"
    assert row["label_values"] == (0, 1, 2, 4)
    for counts, fraction in zip(df["label_counts"], df["tumour_fraction"]):
        assert sum(counts.values()) == VOXELS
        assert fraction == pytest.approx((VOXELS - counts[0]) / VOXELS)
        assert 0.0 < fraction < 0.2


def test_inspect_brats2023(brats2023_root: Path) -> None:
    df = inspect_dataset(brats2023_root, "brats2023")
    assert df["case_id"].tolist() == [f"BraTS-GLI-{i:05d}-000" for i in range(3)]
    assert set(df["image_dtype"]) == {"int16"} and set(df["label_values"]) == {(0, 1, 2, 3)}
    assert "3 cases" in format_inspection(df)


def test_inspect_msd_dtypes(msd_root: Path) -> None:
    df = inspect_dataset(msd_root, "msd")
    assert set(df["image_dtype"]) == {"float32"} and set(df["label_dtype"]) == {"uint8"}
    assert set(df["label_values"]) == {(0, 1, 2, 3)}


def test_format_inspection(brats_root: Path) -> None:
    df = inspect_dataset(brats_root, "brats")
    text = format_inspection(df)
    assert text.splitlines()[0] == "5 cases"
    assert "shapes: (16, 16, 16) x5" in text
    total_edema = sum(c[2] for c in df["label_counts"])
    assert f"2 ({total_edema} voxels in 5 cases)" in text
    assert "label values: 0 (" in text and "4 (" in text
    assert "shapes differ" not in text
    mixed = pd.concat([df, df.iloc[:1].assign(case_id="x", shape=[(8, 8, 8)])], ignore_index=True)
    assert "shapes differ" in format_inspection(mixed)
    assert format_inspection(df.iloc[:0]) == "0 cases"


def test_inspect_errors_name_the_file(brats_root: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        inspect_dataset(tmp_path / "missing", "brats")
    root = tmp_path / "copy"
    shutil.copytree(brats_root, root)
    seg = np.zeros(SHAPE, np.uint8)
    seg[0, 0, 0] = 7
    write_nifti(root / "BraTS2021_00004" / "BraTS2021_00004_seg.nii.gz", seg)
    with pytest.raises(DataError, match=r"BraTS2021_00004_seg\.nii\.gz.*\[7\]"):
        inspect_dataset(root, "brats")
