from __future__ import annotations

import pytest

from distmis.data import DataError, format_inspection, inspect_dataset, synthesize_dataset


def test_inspect_reports_cases_shapes_dtypes_and_labels(tmp_path):
    synthesize_dataset(tmp_path / "b", "brats", cases=3, shape=(12, 10, 8), seed=0, progress=False)
    frame = inspect_dataset(tmp_path / "b", "brats")
    assert list(frame["case_id"]) == ["BraTS2021_00000", "BraTS2021_00001", "BraTS2021_00002"]
    assert set(frame["shape"]) == {(12, 10, 8, 4)} and set(frame["image_dtype"]) == {"int16"}
    for counts, fraction in zip(frame["label_counts"], frame["tumour_fraction"]):
        assert sum(counts.values()) == 12 * 10 * 8 and set(counts) <= {0, 1, 2, 4}
        assert fraction == pytest.approx(1 - counts[0] / 960, abs=1e-4)
    text = format_inspection(frame)
    assert "cases: 3" in text and "(12, 10, 8, 4)" in text and "label values (voxels): 0:" in text


def test_inspect_bad_folder(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        inspect_dataset(tmp_path / "nope", "msd")
