"""Tests for distmis.data.inspect."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from distmis.data import DataError, format_inspection, format_summary, inspect_dataset, summarize_dataset
from distmis.data.inspect import INSPECTION_COLUMNS

from .conftest import SHAPE, write_nifti
from .test_description import BRATS_REGIONS_JSON, write_msd_task, write_nnunet_dataset

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
    assert set(df["orientation"]) == {"RAS"}
    for counts, fraction in zip(df["label_counts"], df["foreground_fraction"]):
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


# --------------------------------------------------------------------------- the data set's summary


def _ct_task(root: Path) -> tuple[Path, list[np.ndarray], list[np.ndarray]]:
    """A one-channel CT-like MSD task with 3 organ classes: spacings differ between cases, one case is LPS."""
    rng = np.random.default_rng(0)
    shape = (8, 7, 6)
    images, labels = [], []
    for index in range(3):
        image = rng.integers(-1000, 1500, shape).astype(np.int16)
        label = np.zeros(shape, np.uint8)
        label[1:4, 1:4, 1:3] = 1
        label[5:7, 1:3, 1:4] = 2
        if index != 1:
            label[1:3, 5:7, 4:6] = 3  # the case ct_1 has no kidney
        images.append(image)
        labels.append(label)
    affines = {"ct_0": np.diag([0.8, 0.8, 2.5, 1.0]), "ct_1": np.diag([0.7, 0.7, 5.0, 1.0]),
               "ct_2": np.diag([-0.9, -0.9, 1.5, 1.0])}  # ct_2: LPS
    meta = {"name": "Organs", "modality": {"0": "CT"},
            "labels": {"0": "background", "1": "liver", "2": "spleen", "3": "kidney"}}
    write_msd_task(root, {f"ct_{i}": (images[i], labels[i]) for i in range(3)}, meta, affines)
    return root, images, labels


def test_summary_of_a_ct_task(tmp_path: Path) -> None:
    root, images, labels = _ct_task(tmp_path / "Task99_Organs")
    summary = summarize_dataset(root, "msd")
    assert summary.description.channels == ("CT",)
    assert summary.cases["orientation"].tolist() == ["RAS", "RAS", "LPS"]
    assert summary.cases["spacing"].tolist() == [(0.8, 0.8, 2.5), (0.7, 0.7, 5.0), (0.9, 0.9, 1.5)]
    (ct,) = summary.intensities
    voxels = np.concatenate([i.ravel() for i in images]).astype(np.float64)  # fewer than the sample: exact
    foreground = np.concatenate([i[l > 0] for i, l in zip(images, labels)]).astype(np.float64)
    assert (ct.name, ct.min, ct.max) == ("CT", voxels.min(), voxels.max())
    assert (ct.low, ct.high) == pytest.approx(tuple(np.percentile(voxels, [0.5, 99.5])))
    assert (ct.foreground_low, ct.foreground_high) == pytest.approx(tuple(np.percentile(foreground, [0.5, 99.5])))

    text = format_summary(summary)
    lines = text.splitlines()
    assert lines[0] == "Organs: 3 cases, layout msd (MSD)"
    assert "channels: 0 CT" in lines
    kidney = sum(int((l == 3).sum()) for l in labels)
    assert any(line.split() == ["3", "kidney", f"{kidney:,}", "voxels", f"({100 * kidney / voxels.size:.3g}%)", "in",
                                "2/3", "cases"] for line in lines), text
    assert all(any(line.strip().startswith(f"{v} {name} ") for line in lines)
               for v, name in ((0, "background"), (1, "liver"), (2, "spleen")))
    assert "spacing (mm): min 0.7 x 0.7 x 1.5, median 0.8 x 0.8 x 2.5, max 0.9 x 0.9 x 5" in lines
    assert "orientations: RAS x2, LPS x1" in lines
    row = next(line for line in lines if line.strip().startswith("0 CT"))
    assert row.split()[2:6] == [f"{v:.4g}" for v in (voxels.min(), ct.low, ct.high, voxels.max())]


def test_summary_of_an_nnunet_region_based_data_set(tmp_path: Path) -> None:
    label = np.resize(np.array([0, 1, 2, 3, 0, 0], np.uint8), (6, 5, 4))
    channels = [np.full((6, 5, 4), 100 * (c + 1), np.float32) for c in range(4)]
    root = write_nnunet_dataset(tmp_path / "Dataset137_BraTS", {"b_0": (channels, label), "b_1": (channels, label)},
                                BRATS_REGIONS_JSON)
    summary = summarize_dataset(root, "nnunet")
    assert [(r.name, r.min, r.max) for r in summary.intensities] == [("T1", 100, 100), ("T1ce", 200, 200),
                                                                      ("T2", 300, 300), ("FLAIR", 400, 400)]
    text = format_summary(summary)
    assert "channels: 0 T1, 1 T1ce, 2 T2, 3 FLAIR" in text and "layout nnunet (nnU-Net v2)" in text
    counts = {v: 2 * int((label == v).sum()) for v in range(4)}
    whole = counts[1] + counts[2] + counts[3]
    assert f"whole tumor = {{1, 2, 3}}, painted 1: {whole:,} voxels in 2/2 cases" in text
    assert f"enhancing tumor = {{3}}, painted 3: {counts[3]:,} voxels in 2/2 cases" in text
    assert "3 in whole tumor, tumor core, enhancing tumor" in text


def test_summary_refuses_what_the_dataset_json_does_not_allow(tmp_path: Path) -> None:
    root, _, _ = _ct_task(tmp_path / "a")
    write_nifti(root / "labelsTr" / "ct_1.nii.gz", np.full((8, 7, 6), 4, np.uint8), np.diag([0.7, 0.7, 5.0, 1.0]))
    with pytest.raises(DataError, match=r"labelsTr/ct_1\.nii\.gz' contains values \[4\].*0 background, 1 liver, "
                                        r"2 spleen, 3 kidney"):
        summarize_dataset(root, "msd")
    write_nifti(root / "labelsTr" / "ct_1.nii.gz", np.zeros((8, 7, 6), np.uint8))  # a spacing of 1 mm
    with pytest.raises(DataError, match=r"labelsTr/ct_1\.nii\.gz' has voxel spacing \(1, 1, 1\) mm but the image"):
        summarize_dataset(root, "msd")
    meta = json.loads((root / "dataset.json").read_text())
    del meta["labels"]
    (root / "dataset.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"dataset\.json' lacks the required key 'labels'"):
        summarize_dataset(root, "msd")
