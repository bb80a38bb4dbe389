"""Both readers on real NIfTI files written with nibabel."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from distmis.data import LABEL_VALUES, DataError, Layout, discover_cases, read_case, synthesize_dataset


def save(array: np.ndarray, path: Path, affine: np.ndarray | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(array, np.eye(4) if affine is None else affine), str(path))
    return path


def write_msd(root: Path, cases: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    training = []
    for case_id, (image, label) in cases.items():
        save(image, root / "imagesTr" / f"{case_id}.nii.gz")
        save(label, root / "labelsTr" / f"{case_id}.nii.gz")
        training.append({"image": f"./imagesTr/{case_id}.nii.gz", "label": f"./labelsTr/{case_id}.nii.gz"})
    (root / "dataset.json").write_text(json.dumps({"name": "test", "training": training}))


@pytest.mark.parametrize("layout", ["msd", "brats"])
def test_read_synthetic_dataset(tmp_path, layout):
    ids = synthesize_dataset(tmp_path / layout, layout, cases=3, shape=(16, 20, 12), seed=0, progress=False)
    cases = discover_cases(tmp_path / layout, layout)
    assert [c.case_id for c in cases] == ids
    assert len(cases[0].images) == (1 if layout == "msd" else 4)
    for case in cases:
        image, label, spacing = read_case(case, layout)
        assert image.shape == (16, 20, 12, 4) and image.dtype == np.float32
        assert label.shape == (16, 20, 12)
        assert set(np.unique(label)) <= set(LABEL_VALUES[Layout(layout)])
        assert set(np.unique(label)) - {0}  # there is a tumour
        assert spacing == (1.0, 1.0, 1.0)


def test_brats_files_are_int16(tmp_path):
    synthesize_dataset(tmp_path / "b", "brats", cases=1, shape=(8, 8, 8), progress=False)
    case = discover_cases(tmp_path / "b", "brats")[0]
    assert [p.name.split("_")[-1] for p in case.images] == ["flair.nii.gz", "t1.nii.gz", "t1ce.nii.gz", "t2.nii.gz"]
    assert nib.load(case.images[0]).get_data_dtype() == np.int16
    assert case.label.name.endswith("_seg.nii.gz")


def test_int16_and_float_files_non_ras_affine_read_as_stored(tmp_path):
    rng = np.random.default_rng(0)
    image = rng.integers(0, 1000, size=(6, 5, 4, 4)).astype(np.int16)
    label = np.zeros((6, 5, 4), np.uint8)
    label[1:3, 2, 1] = 2
    flipped = np.diag([-1.0, 1.0, -2.0, 1.0])  # an LPS-like orientation with 2 mm slices
    save(image, tmp_path / "msd/imagesTr/a.nii.gz", flipped)
    save(label, tmp_path / "msd/labelsTr/a.nii.gz", flipped)
    save(image.astype(np.float64) / 7, tmp_path / "msd/imagesTr/b.nii.gz")
    save(label.astype(np.float32), tmp_path / "msd/labelsTr/b.nii.gz")
    entries = [{"image": f"./imagesTr/{c}.nii.gz", "label": f"./labelsTr/{c}.nii.gz"} for c in "ab"]
    (tmp_path / "msd/dataset.json").write_text(json.dumps({"training": entries}))
    a, b = discover_cases(tmp_path / "msd", "msd")
    img_a, lab_a, spacing_a = read_case(a, "msd")
    np.testing.assert_array_equal(img_a, image.astype(np.float32))  # no reorientation
    np.testing.assert_array_equal(lab_a, label)
    assert spacing_a == (1.0, 1.0, 2.0)
    img_b, lab_b, _ = read_case(b, "msd")
    np.testing.assert_allclose(img_b, image / 7, rtol=1e-6)
    np.testing.assert_array_equal(lab_b, label)


def test_bad_label_value_names_the_file(tmp_path):
    label = np.zeros((4, 4, 4), np.uint8)
    label[0, 0, 0] = 4  # a BraTS value in an MSD dataset
    write_msd(tmp_path, {"x": (np.ones((4, 4, 4, 4), np.float32), label)})
    with pytest.raises(DataError, match=r"labelsTr/x\.nii\.gz") as info:
        read_case(discover_cases(tmp_path, "msd")[0], "msd")
    assert "4" in str(info.value) and "0, 1, 2, 3" in str(info.value)


def test_shape_mismatch_names_the_file(tmp_path):
    write_msd(tmp_path, {"x": (np.ones((4, 4, 4, 4), np.float32), np.zeros((4, 4, 5), np.uint8))})
    with pytest.raises(DataError, match=r"x\.nii\.gz"):
        read_case(discover_cases(tmp_path, "msd")[0], "msd")


def test_wrong_channel_count(tmp_path):
    write_msd(tmp_path, {"x": (np.ones((4, 4, 4, 3), np.float32), np.zeros((4, 4, 4), np.uint8))})
    with pytest.raises(DataError, match=r"imagesTr/x\.nii\.gz.*4-D"):
        read_case(discover_cases(tmp_path, "msd")[0], "msd")


def test_corrupt_file_names_the_file(tmp_path):
    write_msd(tmp_path, {"x": (np.ones((4, 4, 4, 4), np.float32), np.zeros((4, 4, 4), np.uint8))})
    (tmp_path / "imagesTr/x.nii.gz").write_bytes(b"\x1f\x8b this is not a nifti file")
    with pytest.raises(DataError, match=r"imagesTr/x\.nii\.gz"):
        read_case(discover_cases(tmp_path, "msd")[0], "msd")


def test_missing_brats_modality(tmp_path):
    synthesize_dataset(tmp_path / "b", "brats", cases=2, shape=(8, 8, 8), progress=False)
    victim = next((tmp_path / "b").glob("*/*_t1ce.nii.gz"))
    victim.unlink()
    with pytest.raises(DataError, match="t1ce"):
        discover_cases(tmp_path / "b", "brats")


def test_discovery_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        discover_cases(tmp_path / "nope", "msd")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="dataset.json"):
        discover_cases(tmp_path / "empty", "msd")
    with pytest.raises(DataError, match="no cases"):
        discover_cases(tmp_path / "empty", "brats")
    (tmp_path / "listed").mkdir()
    (tmp_path / "listed/dataset.json").write_text(json.dumps(
        {"training": [{"image": "./imagesTr/gone.nii.gz", "label": "./labelsTr/gone.nii.gz"}]}))
    with pytest.raises(DataError, match="gone.nii.gz"):
        discover_cases(tmp_path / "listed", "msd")
    with pytest.raises(ValueError, match="'msd', 'brats'"):
        discover_cases(tmp_path, "nnunet")
