"""Tests for distmis.data.scans: finding and reading the scans to segment, labels optional."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from distmis.data import (
    MODALITIES,
    DataError,
    Layout,
    ScanFiles,
    discover_cases,
    discover_scans,
    labels_to_target,
    read_case,
    read_scan,
    read_scan_label,
    synthesize_dataset,
)
from distmis.data.scans import ACCEPTED_INPUTS

from .conftest import SHAPE, corrupt_gzip, write_nifti

SMALL = (12, 10, 8)
PARTS = {"brats": ("_", ("flair", "t1", "t1ce", "t2")), "brats2023": ("-", ("t2f", "t1n", "t1c", "t2w"))}


def _case_folder(root: Path, layout: str, case_id: str, *, seg: np.ndarray | None = None,
                 modalities: list[np.ndarray] | None = None, affine: np.ndarray | None = None) -> Path:
    """Write a BraTS-style case folder; modality m holds ``10 * (m + 1)`` unless given."""
    separator, parts = PARTS[layout]
    folder = root / case_id
    for m, part in enumerate(parts):
        data = modalities[m] if modalities is not None else np.full(SMALL, 10 * (m + 1), np.int16)
        write_nifti(folder / f"{case_id}{separator}{part}.nii.gz", data, affine)
    if seg is not None:
        write_nifti(folder / f"{case_id}{separator}seg.nii.gz", seg, affine)
    return folder


def _msd_image(path: Path, affine: np.ndarray | None = None) -> Path:
    return write_nifti(path, np.random.default_rng(0).uniform(1, 5, SMALL + (4,)).astype(np.float32), affine)


def _label(values: tuple[int, ...] = (0, 1, 2, 3)) -> np.ndarray:
    return np.resize(np.array(values, np.uint8), SMALL)


def _msd_root(root: Path, training: list[str], test: list) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for case_id in training:
        _msd_image(root / "imagesTr" / f"{case_id}.nii.gz")
        write_nifti(root / "labelsTr" / f"{case_id}.nii.gz", _label())
    for entry in test:
        name = entry["image"] if isinstance(entry, dict) else entry
        if isinstance(name, str):
            _msd_image(root / name)
    meta = {"training": [{"image": f"./imagesTr/{c}.nii.gz", "label": f"./labelsTr/{c}.nii.gz"} for c in training],
            "test": test}
    (root / "dataset.json").write_text(json.dumps(meta))
    return root


def _summary(scans: list[ScanFiles]) -> list[tuple[str, str, int, str | None]]:
    return [(s.case_id, s.layout.value, len(s.images), s.label.name if s.label else None) for s in scans]


# --------------------------------------------------------------------------- ScanFiles


def test_scan_files_normalises_and_checks_the_image_count(tmp_path: Path) -> None:
    scan = ScanFiles("c", "brats2023", [str(tmp_path / f"{m}.nii.gz") for m in range(4)], str(tmp_path / "s.nii.gz"))
    assert scan.layout is Layout.BRATS2023 and scan.images[0] == tmp_path / "0.nii.gz"
    assert isinstance(scan.images, tuple) and scan.label == tmp_path / "s.nii.gz"
    with pytest.raises(ValueError, match="MSD cases have 1 image file"):
        ScanFiles("c", "msd", scan.images, None)
    with pytest.raises(ValueError, match="unknown layout"):
        ScanFiles("c", "decathlon", scan.images[:1], None)
    assert ScanFiles("c", "nnunet", scan.images[:2]).images == scan.images[:2]  # one file per channel, any number
    with pytest.raises(ValueError, match="one image file per channel, got none"):
        ScanFiles("c", "nnunet", ())


# --------------------------------------------------------------------------- discovery: MSD


def test_one_msd_file_in_images_tr_has_its_label(msd_root: Path) -> None:
    (scan,) = discover_scans(msd_root / "imagesTr" / "BRATS_002.nii.gz")
    assert scan == ScanFiles("BRATS_002", Layout.MSD, (msd_root / "imagesTr" / "BRATS_002.nii.gz",),
                             msd_root / "labelsTr" / "BRATS_002.nii.gz")


def test_one_msd_file_elsewhere_has_no_label(tmp_path: Path) -> None:
    image = _msd_image(tmp_path / "scans" / "BRATS_777.nii")
    write_nifti(tmp_path / "labelsTr" / "BRATS_777.nii", _label())  # not beside an imagesTr folder: ignored
    assert _summary(discover_scans(image, "msd")) == [("BRATS_777", "msd", 1, None)]
    (tmp_path / "imagesTr").mkdir()
    moved = tmp_path / "imagesTr" / "BRATS_777.nii"
    image.rename(moved)
    assert discover_scans(moved)[0].label == tmp_path / "labelsTr" / "BRATS_777.nii"


def test_msd_root_lists_training_with_labels_and_test_without(tmp_path: Path) -> None:
    root = _msd_root(tmp_path / "Task01", ["BRATS_002", "BRATS_001"],
                     ["./imagesTs/BRATS_485.nii.gz", {"image": "imagesTs/BRATS_484.nii.gz"}])
    assert _summary(discover_scans(root)) == [
        ("BRATS_001", "msd", 1, "BRATS_001.nii.gz"),
        ("BRATS_002", "msd", 1, "BRATS_002.nii.gz"),
        ("BRATS_484", "msd", 1, None),
        ("BRATS_485", "msd", 1, None),
    ]
    scans = {s.case_id: s for s in discover_scans(root, Layout.MSD)}
    assert scans["BRATS_485"].images == (root / "imagesTs" / "BRATS_485.nii.gz",)  # normalised, no "./"
    assert scans["BRATS_001"].label == root / "labelsTr" / "BRATS_001.nii.gz"


def test_msd_root_of_synthetic_data_has_no_test_list_entries(msd_root: Path) -> None:
    scans = discover_scans(msd_root)
    assert [s.case_id for s in scans] == [c.case_id for c in discover_cases(msd_root, "msd")]
    assert all(s.label is not None for s in scans)


def test_msd_root_errors_name_the_entry(tmp_path: Path) -> None:
    root = _msd_root(tmp_path / "a", ["BRATS_001"], ["./imagesTs/BRATS_485.nii.gz"])
    (root / "imagesTs" / "BRATS_485.nii.gz").unlink()
    with pytest.raises(DataError, match=r"test entry 0 lists './imagesTs/BRATS_485.nii.gz'.*does not exist"):
        discover_scans(root)
    root = _msd_root(tmp_path / "b", ["BRATS_001"], [7])
    with pytest.raises(DataError, match=r"dataset\.json.*test entry 0 must be an image path.*got 7"):
        discover_scans(root)
    root = _msd_root(tmp_path / "c", ["BRATS_001"], ["./imagesTs/BRATS_001.nii.gz"])
    with pytest.raises(DataError, match=r"case id 'BRATS_001'.*imagesTr/BRATS_001.nii.gz.*imagesTs/BRATS_001.nii.gz"):
        discover_scans(root)
    root = _msd_root(tmp_path / "d", [], [])
    with pytest.raises(DataError, match=r"found no scans in .*/d': it is an MSD data set .*that lists no case"):
        discover_scans(root)


def test_folder_of_msd_files(tmp_path: Path) -> None:
    root = _msd_root(tmp_path / "Task01", ["BRATS_001", "BRATS_002"],
                     ["./imagesTs/BRATS_485.nii.gz", "./imagesTs/BRATS_486.nii.gz"])
    (root / "imagesTs" / ".BRATS_485.nii.gz").write_bytes(b"AppleDouble")  # hidden: skipped
    (root / "imagesTs" / "notes.txt").write_text("not an image")  # not NIfTI: skipped
    assert _summary(discover_scans(root / "imagesTs")) == [("BRATS_485", "msd", 1, None), ("BRATS_486", "msd", 1, None)]
    assert _summary(discover_scans(root / "imagesTr", "msd")) == [
        ("BRATS_001", "msd", 1, "BRATS_001.nii.gz"), ("BRATS_002", "msd", 1, "BRATS_002.nii.gz")]


def test_folder_of_msd_files_takes_labels_from_its_labels_sibling(tmp_path: Path) -> None:
    _msd_image(tmp_path / "imagesTs" / "a.nii.gz")
    _msd_image(tmp_path / "imagesTs" / "b.nii.gz")
    write_nifti(tmp_path / "labelsTs" / "b.nii.gz", _label())
    assert _summary(discover_scans(tmp_path / "imagesTs")) == [("a", "msd", 1, None), ("b", "msd", 1, "b.nii.gz")]


# --------------------------------------------------------------------------- discovery: case folders


@pytest.mark.parametrize("layout", ["brats", "brats2023"])
def test_one_case_folder_with_and_without_label(layout: str, tmp_path: Path) -> None:
    separator, parts = PARTS[layout]
    with_seg = _case_folder(tmp_path, layout, "case_a", seg=_label())
    (scan,) = discover_scans(with_seg)
    assert scan.layout is Layout(layout) and scan.case_id == "case_a"
    assert [p.name for p in scan.images] == [f"case_a{separator}{p}.nii.gz" for p in parts]  # MODALITIES order
    assert scan.label == with_seg / f"case_a{separator}seg.nii.gz"
    without = _case_folder(tmp_path, layout, "case_b")
    assert _summary(discover_scans(without, layout)) == [("case_b", layout, 4, None)]


@pytest.mark.parametrize("layout", ["brats", "brats2023"])
def test_data_set_of_case_folders(layout: str, tmp_path: Path) -> None:
    separator, _ = PARTS[layout]
    _case_folder(tmp_path, layout, "c2", seg=_label())
    _case_folder(tmp_path, layout, "c1")  # a validation case: no label
    _case_folder(tmp_path, layout, ".c0")  # hidden: skipped
    (tmp_path / "logs").mkdir()  # not a case folder: skipped
    (tmp_path / "README.txt").write_text("about the data")
    assert _summary(discover_scans(tmp_path)) == [("c1", layout, 4, None), ("c2", layout, 4, f"c2{separator}seg.nii.gz")]


def test_synthetic_data_sets_are_found_as_scans(brats_root: Path, brats2023_root: Path) -> None:
    for root, layout in ((brats_root, "brats"), (brats2023_root, "brats2023")):
        scans = discover_scans(root)
        cases = discover_cases(root, layout)
        assert [(s.case_id, s.images, s.label) for s in scans] == [(c.case_id, c.images, c.label) for c in cases]
        assert {s.layout for s in scans} == {Layout(layout)}


def test_case_folder_missing_a_modality_names_the_file(tmp_path: Path) -> None:
    folder = _case_folder(tmp_path, "brats2023", "BraTS-GLI-00007-000")
    (folder / "BraTS-GLI-00007-000-t1n.nii.gz").unlink()
    for path in (folder, tmp_path):
        with pytest.raises(DataError) as info:
            discover_scans(path)
        message = str(info.value)
        assert f"missing file {str(folder / 'BraTS-GLI-00007-000-t1n.nii.gz')!r}" in message
        assert "BraTS-GLI-00007-000-t2w.nii.gz" in message and "may hold BraTS-GLI-00007-000-seg.nii.gz" in message


def test_case_folders_of_two_layouts_are_an_error(tmp_path: Path) -> None:
    _case_folder(tmp_path, "brats", "BraTS2021_00000")
    _case_folder(tmp_path, "brats2023", "BraTS-GLI-00000-000")
    with pytest.raises(DataError, match=r"several layouts.*'BraTS2021_00000' is a BraTS 2018-2021 case folder; "
                                        r"'BraTS-GLI-00000-000' is a BraTS 2023 case folder"):
        discover_scans(tmp_path, "brats2023")  # the mix, not a layout mismatch, is reported


def test_case_folders_and_image_files_together_are_an_error(tmp_path: Path) -> None:
    _case_folder(tmp_path, "brats", "c1")
    _msd_image(tmp_path / "BRATS_001.nii.gz")
    with pytest.raises(DataError, match=r"both case folders \(e.g. 'c1'\) and NIfTI files \(e.g. 'BRATS_001.nii.gz'\)"):
        discover_scans(tmp_path)


def test_renamed_case_folder_is_named_in_the_error(tmp_path: Path) -> None:
    folder = _case_folder(tmp_path, "brats2023", "BraTS-GLI-00003-000")
    renamed = folder.rename(tmp_path / "my_case")
    with pytest.raises(DataError, match=r"modality files of BraTS 2023 case 'BraTS-GLI-00003-000'.*rename the folder"):
        discover_scans(renamed)


def test_one_modality_file_of_a_case_folder_is_an_error(brats2023_root: Path) -> None:
    path = brats2023_root / "BraTS-GLI-00000-000" / "BraTS-GLI-00000-000-t1c.nii.gz"
    with pytest.raises(DataError, match=r"one file of the BraTS 2023 case folder .*BraTS-GLI-00000-000'.*pass that folder"):
        discover_scans(path)


# --------------------------------------------------------------------------- discovery: layout and input errors


def test_a_given_layout_must_agree(msd_root: Path, brats_root: Path, brats2023_root: Path) -> None:
    with pytest.raises(DataError, match=r"is a BraTS 2023 data set \(layout 'brats2023'\), but layout 'brats' was given"):
        discover_scans(brats2023_root, "brats")
    with pytest.raises(DataError, match=r"is a BraTS 2018-2021 case folder \(layout 'brats'\), but layout 'brats2023'"):
        discover_scans(brats_root / "BraTS2021_00000", Layout.BRATS2023)
    with pytest.raises(DataError, match=r"is an MSD data set with dataset.json \(layout 'msd'\), but layout 'brats' was given"):
        discover_scans(msd_root, "brats")
    with pytest.raises(DataError, match=r"is an MSD image file \(layout 'msd'\), but layout 'brats2023'"):
        discover_scans(msd_root / "imagesTr" / "BRATS_001.nii.gz", "brats2023")
    with pytest.raises(DataError, match=r"is an MSD data set with dataset.json \(layout 'msd'\), but layout 'nnunet'"):
        discover_scans(msd_root, "nnunet")
    with pytest.raises(ValueError, match="unknown layout 'decathlon'"):
        discover_scans(msd_root, "decathlon")


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(DataError) as info:
        discover_scans(tmp_path / "nope")
    assert f"{str(tmp_path / 'nope')!r} does not exist" in str(info.value) and ACCEPTED_INPUTS in str(info.value)


def test_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"found no scans in .*/empty'.*no dataset.json, case folder or NIfTI file; accepted"):
        discover_scans(tmp_path / "empty")


def test_msd_root_without_dataset_json_points_at_its_images(tmp_path: Path) -> None:
    _msd_image(tmp_path / "imagesTr" / "BRATS_001.nii.gz")
    with pytest.raises(DataError, match=r"found no scans.*\(to read the MSD images in 'imagesTr', pass that folder\)"):
        discover_scans(tmp_path)


def test_non_nifti_file(tmp_path: Path) -> None:
    path = tmp_path / "scan.mha"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(DataError, match=r"scan\.mha' is not a NIfTI file \(\.nii or \.nii\.gz\); accepted inputs"):
        discover_scans(path)


def test_duplicate_ids_in_a_folder_of_files(tmp_path: Path) -> None:
    _msd_image(tmp_path / "a.nii")
    _msd_image(tmp_path / "a.nii.gz")
    with pytest.raises(DataError, match=r"case id 'a'.*a\.nii'.*a\.nii\.gz'.*unique"):
        discover_scans(tmp_path)


# --------------------------------------------------------------------------- reading


def test_read_msd_scan_returns_image_and_reference(tmp_path: Path) -> None:
    affine = np.array([[0, -2.0, 0, 10], [1.5, 0, 0, -4], [0, 0, -3.0, 7], [0, 0, 0, 1]])
    data = np.random.default_rng(1).integers(0, 300, SMALL + (4,)).astype(np.int16)
    (scan,) = discover_scans(write_nifti(tmp_path / "case.nii.gz", data, affine))
    image, reference = read_scan(scan)
    assert image.dtype == np.float32 and image.shape == SMALL + (4,)
    np.testing.assert_array_equal(image, data.astype(np.float32))  # as stored, no reorientation
    assert isinstance(reference, nib.Nifti1Image)
    np.testing.assert_allclose(reference.affine, affine)
    assert reference.shape == SMALL + (4,) and reference.get_filename() == str(scan.images[0])
    assert not reference.in_memory  # its voxel data was read once, not cached on the image


@pytest.mark.parametrize("layout", ["brats", "brats2023"])
def test_read_case_folder_scan_in_modality_order(layout: str, tmp_path: Path) -> None:
    affine = np.diag([-1.0, 1.0, 2.0, 1.0])
    modalities = [np.full(SMALL, 10 * (m + 1), np.int16) for m in range(3)] + [np.full(SMALL + (1,), 40, np.int16)]
    folder = _case_folder(tmp_path, layout, "c", modalities=modalities, affine=affine)
    (scan,) = discover_scans(folder)
    image, reference = read_scan(scan)
    assert image.shape == SMALL + (4,) and image.dtype == np.float32  # trailing singleton axis squeezed
    assert [float(image[1, 2, 3, m]) for m in range(4)] == [10.0, 20.0, 30.0, 40.0]  # flair, t1, t1ce, t2
    assert reference.get_filename() == str(scan.images[0]) and scan.images[0].name.endswith(
        ("_flair.nii.gz", "-t2f.nii.gz"))
    np.testing.assert_allclose(reference.affine, affine)


def test_read_scan_errors_name_the_file(tmp_path: Path) -> None:
    (scan,) = discover_scans(write_nifti(tmp_path / "flat.nii.gz", np.ones(SMALL, np.float32)))
    with pytest.raises(DataError, match=r"flat\.nii\.gz' has shape \(12, 10, 8\); an MSD image must be 4-D.*BraTS case"):
        read_scan(scan)

    folder = _case_folder(tmp_path / "b", "brats2023", "c", modalities=[np.ones(SMALL, np.int16)] * 3 + [
        np.ones((12, 10, 7), np.int16)])
    with pytest.raises(DataError, match=r"c-t2w\.nii\.gz' has shape \(12, 10, 7\).*all modality files must match"):
        read_scan(discover_scans(folder)[0])

    folder = _case_folder(tmp_path / "c", "brats", "c", modalities=[np.ones(SMALL + (2,), np.int16)] * 4)
    with pytest.raises(DataError, match=r"c_flair\.nii\.gz' has shape \(12, 10, 8, 2\); a BraTS 2018-2021 modality file must be 3-D"):
        read_scan(discover_scans(folder)[0])

    nan = np.ones(SMALL + (4,), np.float32)
    nan[0, 0, 0, 2] = np.inf
    (scan,) = discover_scans(write_nifti(tmp_path / "d" / "nan.nii.gz", nan))
    with pytest.raises(DataError, match=r"nan\.nii\.gz' contains NaN or infinite values"):
        read_scan(scan)


def test_read_scan_of_an_unreadable_file(tmp_path: Path) -> None:
    (tmp_path / "junk.nii.gz").write_bytes(b"this is not a NIfTI file")
    (scan,) = discover_scans(tmp_path / "junk.nii.gz")
    with pytest.raises(DataError, match=r"cannot read .*junk\.nii\.gz': it is not a readable NIfTI file"):
        read_scan(scan)
    folder = _case_folder(tmp_path / "b", "brats2023", "c",
                          modalities=[np.random.default_rng(0).uniform(0, 9, (24, 20, 12)).astype(np.float32)] * 4)
    corrupt_gzip(folder / "c-t1c.nii.gz")  # the header is whole, the voxel data is cut
    with pytest.raises(DataError, match=r"cannot read .*c-t1c\.nii\.gz': it is not a readable NIfTI file"):
        read_scan(discover_scans(folder)[0])


# --------------------------------------------------------------------------- labels


def test_read_scan_label_brats2023_and_its_regions(tmp_path: Path) -> None:
    seg = np.zeros(SMALL, np.uint8)
    seg[2:10, 2:8, 1:7] = 2  # edema
    seg[3:9, 3:7, 2:6] = 3  # enhancing
    seg[4:7, 4:6, 3:5] = 1  # necrotic core
    (scan,) = discover_scans(_case_folder(tmp_path, "brats2023", "c", seg=seg))
    image, _ = read_scan(scan)
    label = read_scan_label(scan, image.shape[:3])
    assert label.dtype == np.int16
    np.testing.assert_array_equal(label, seg)
    target = labels_to_target(label, scan.layout, "regions")
    np.testing.assert_array_equal(target[..., 0], seg > 0)  # WT: NCR, ED, ET
    np.testing.assert_array_equal(target[..., 1], np.isin(seg, (1, 3)))  # TC: NCR, ET
    np.testing.assert_array_equal(target[..., 2], seg == 3)  # ET


def test_read_scan_label_without_a_label(tmp_path: Path) -> None:
    (scan,) = discover_scans(_case_folder(tmp_path, "brats2023", "BraTS-GLI-00009-000"))
    with pytest.raises(DataError, match=r"case 'BraTS-GLI-00009-000' .* has no label file "
                                        r"\(its folder holds no BraTS-GLI-00009-000-seg\.nii\.gz\)"):
        read_scan_label(scan, SMALL)
    (scan,) = discover_scans(_msd_image(tmp_path / "imagesTs" / "BRATS_485.nii.gz"))
    with pytest.raises(DataError, match=r"case 'BRATS_485' .* has no label file \(an MSD label lies in labelsTr/"):
        read_scan_label(scan, SMALL)


def test_read_scan_label_validation(tmp_path: Path) -> None:
    old = _case_folder(tmp_path / "a", "brats2023", "c", seg=_label((0, 1, 2, 4)))  # a BraTS 2021 label
    with pytest.raises(DataError) as info:
        read_scan_label(discover_scans(old)[0], SMALL)
    assert "c-seg.nii.gz" in str(info.value) and "[4]" in str(info.value) and "'brats2023'" in str(info.value)

    (scan,) = discover_scans(_case_folder(tmp_path / "b", "brats", "c", seg=_label((0, 1, 2, 4))[:, :, :7]))
    with pytest.raises(DataError, match=r"c_seg\.nii\.gz' has shape \(12, 10, 7\).*spatial shape \(12, 10, 8\)"):
        read_scan_label(scan, SMALL)
    assert read_scan_label(scan, (12, 10, 7)).shape == (12, 10, 7)  # the shape asked for is what is checked
    with pytest.raises(ValueError, match=r"3 spatial sizes"):
        read_scan_label(scan, (12, 10))

    (tmp_path / "c" / "imagesTr").mkdir(parents=True)
    _msd_image(tmp_path / "c" / "imagesTr" / "x.nii.gz")
    (tmp_path / "c" / "labelsTr").mkdir()
    (tmp_path / "c" / "labelsTr" / "x.nii.gz").write_bytes(b"garbage")
    (scan,) = discover_scans(tmp_path / "c" / "imagesTr")
    with pytest.raises(DataError, match=r"cannot read .*labelsTr/x\.nii\.gz': it is not a readable NIfTI file"):
        read_scan_label(scan, SMALL)


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("layout", ["msd", "brats", "brats2023"])
def test_synthesize_discover_read_round_trip(layout: str, tmp_path: Path) -> None:
    root = tmp_path / layout
    ids = synthesize_dataset(root, layout, cases=2, shape=SMALL, seed=11, progress=False)
    scans = discover_scans(root)
    assert [s.case_id for s in scans] == ids and {s.layout for s in scans} == {Layout(layout)}
    for scan, case in zip(scans, discover_cases(root, layout)):
        image, reference = read_scan(scan)
        expected_image, expected_label, spacing = read_case(case, layout)
        np.testing.assert_array_equal(image, expected_image)
        np.testing.assert_array_equal(read_scan_label(scan, image.shape[:3]), expected_label)
        assert tuple(float(z) for z in reference.header.get_zooms()[:3]) == spacing
        assert image.shape == SMALL + (len(MODALITIES),)


def test_a_validation_set_reads_without_labels(brats2023_root: Path, tmp_path: Path) -> None:
    """A copy of a data set with its seg files removed, as a challenge's validation set is shipped."""
    root = tmp_path / "val"
    shutil.copytree(brats2023_root, root)
    for seg in root.glob("*/*-seg.nii.gz"):
        seg.unlink()
    scans = discover_scans(root, "brats2023")
    assert len(scans) == 3 and all(s.label is None for s in scans)
    assert read_scan(scans[0])[0].shape == SHAPE + (4,)


# --------------------------------------------------------------------------- nnU-Net scans, one-channel MSD scans

from distmis.data import describe_dataset  # noqa: E402
from distmis.data.scans import check_scan, check_scan_data, detect_layout  # noqa: E402

from .test_description import BRATS_REGIONS_JSON, PROSTATE_NNUNET_JSON, write_nnunet_dataset  # noqa: E402


def _channels(count: int, shape: tuple[int, int, int] = SMALL) -> list[np.ndarray]:
    return [np.full(shape, 10 * (c + 1), np.int16) for c in range(count)]


def _nnunet_root(root: Path) -> Path:
    """Two training cases (T2, ADC; labels 0-2) and two test cases, one of them with a label in labelsTs."""
    write_nnunet_dataset(root, {"p_02": (_channels(2), _label((0, 1, 2))), "p_01": (_channels(2), _label((0, 1)))})
    write_nnunet_dataset(root, {"p_90": (_channels(2), _label((0, 2)))}, {**PROSTATE_NNUNET_JSON, "numTraining": 2},
                         folder="Ts")
    for c in range(2):
        write_nifti(root / "imagesTs" / f"p_91_{c:04d}.nii.gz", _channels(2)[c])
    return root


def test_nnunet_root_lists_its_training_and_test_cases(tmp_path: Path) -> None:
    root = _nnunet_root(tmp_path / "Dataset005_Prostate")
    assert detect_layout(root) is Layout.NNUNET
    assert _summary(discover_scans(root)) == [
        ("p_01", "nnunet", 2, "p_01.nii.gz"), ("p_02", "nnunet", 2, "p_02.nii.gz"),
        ("p_90", "nnunet", 2, "p_90.nii.gz"), ("p_91", "nnunet", 2, None)]
    scan = discover_scans(root, "nnunet")[3]
    assert scan.images == (root / "imagesTs" / "p_91_0000.nii.gz", root / "imagesTs" / "p_91_0001.nii.gz")
    with pytest.raises(DataError, match=r"is an nnU-Net v2 data set with dataset.json \(layout 'nnunet'\), but layout "
                                        r"'msd' was given"):
        discover_scans(root, "msd")


def test_folder_of_nnunet_channel_files_groups_them_by_case(tmp_path: Path) -> None:
    root = _nnunet_root(tmp_path / "Dataset005_Prostate")
    assert detect_layout(root / "imagesTs") is Layout.NNUNET
    assert _summary(discover_scans(root / "imagesTs")) == [("p_90", "nnunet", 2, "p_90.nii.gz"),
                                                           ("p_91", "nnunet", 2, None)]
    (root / "imagesTs" / "p_91_0001.nii.gz").unlink()
    with pytest.raises(DataError) as info:
        discover_scans(root / "imagesTs")
    message = str(info.value)  # the channel names come from the data set's dataset.json
    assert f"missing channel file {str(root / 'imagesTs' / 'p_91_0001.nii.gz')!r} (channel 0001, 'ADC')" in message
    alone = tmp_path / "elsewhere"  # no dataset.json above: the other cases tell the channel count
    for case_id, count in (("a", 3), ("b", 2)):
        for c in range(count):
            write_nifti(alone / f"{case_id}_{c:04d}.nii.gz", _channels(3)[c])
    with pytest.raises(DataError, match=r"case 'b': missing channel file .*b_0002\.nii\.gz' \(channel 0002, "
                                        r"'channel 2'\); the cases in .*elsewhere' have 3 channel\(s\)"):
        discover_scans(alone)


def test_one_nnunet_channel_file_is_its_whole_case(tmp_path: Path) -> None:
    root = _nnunet_root(tmp_path / "d")
    for name in ("p_90_0001.nii.gz", "p_90_0000.nii.gz"):
        (scan,) = discover_scans(root / "imagesTs" / name)
        assert scan == ScanFiles("p_90", Layout.NNUNET, (root / "imagesTs" / "p_90_0000.nii.gz",
                                                         root / "imagesTs" / "p_90_0001.nii.gz"),
                                 root / "labelsTs" / "p_90.nii.gz")


def test_a_list_of_channel_files_is_their_case(tmp_path: Path) -> None:
    root = _nnunet_root(tmp_path / "d")
    files = [root / "imagesTr" / "p_02_0001.nii.gz", root / "imagesTr" / "p_02_0000.nii.gz"]
    (scan,) = discover_scans(files)
    assert scan.case_id == "p_02" and scan.images == tuple(reversed(files)) and scan.label.name == "p_02.nii.gz"
    (scan,) = discover_scans([str(files[1]), str(files[0])], "nnunet")  # strings too
    assert len(scan.images) == 2
    with pytest.raises(DataError, match=r"case 'p_01': missing channel file .*p_01_0001\.nii\.gz' \(channel 0001, "
                                        r"'ADC'\)"):
        discover_scans([root / "imagesTr" / "p_01_0000.nii.gz", *files])
    with pytest.raises(DataError, match="channel 0001 of case 'p_02' is given twice"):
        discover_scans([files[0], files[0]])
    two_msd = [_msd_image(tmp_path / "m" / "BRATS_001.nii.gz"), _msd_image(tmp_path / "m" / "BRATS_002.nii.gz")]
    assert _summary(discover_scans(two_msd)) == [("BRATS_001", "msd", 1, None), ("BRATS_002", "msd", 1, None)]


def test_msd_files_named_like_channel_files(tmp_path: Path) -> None:
    path = write_nifti(tmp_path / "scans" / "ct_0000.nii.gz", np.ones(SMALL, np.float32))
    assert _summary(discover_scans(path)) == [("ct", "nnunet", 1, None)]  # nnU-Net's naming wins by default
    assert _summary(discover_scans(path, "msd")) == [("ct_0000", "msd", 1, None)]
    assert _summary(discover_scans(tmp_path / "scans", "msd")) == [("ct_0000", "msd", 1, None)]
    numbered = tmp_path / "numbered"  # no case has a channel 0000: MSD images that end in 4 digits
    for name in ("BRATS_0001.nii.gz", "BRATS_0002.nii.gz"):
        _msd_image(numbered / name)
    assert _summary(discover_scans(numbered)) == [("BRATS_0001", "msd", 1, None), ("BRATS_0002", "msd", 1, None)]
    assert detect_layout(numbered) is Layout.MSD
    assert _summary(discover_scans(numbered / "BRATS_0001.nii.gz")) == [("BRATS_0001", "msd", 1, None)]


def test_read_scan_with_the_models_channels(tmp_path: Path) -> None:
    affine = np.diag([-0.7, -0.7, 3.0, 1.0])
    data = np.random.default_rng(0).integers(-1000, 1000, SMALL).astype(np.int16)
    (scan,) = discover_scans(write_nifti(tmp_path / "ct" / "spleen_1.nii.gz", data, affine))
    image, reference = read_scan(scan, ["CT"])
    assert image.shape == SMALL + (1,) and image.dtype == np.float32
    np.testing.assert_array_equal(image[..., 0], data)
    np.testing.assert_allclose(reference.affine, affine)
    assert check_scan(scan, 1) == SMALL
    with pytest.raises(DataError, match=r"spleen_1\.nii\.gz' has shape \(12, 10, 8\), 1 channel\(s\), but the model "
                                        r"takes 2 channel\(s\) \(T2, ADC\)"):
        check_scan(scan, ["T2", "ADC"])
    with pytest.raises(DataError, match=r"spleen_1\.nii\.gz' has shape \(12, 10, 8\); an MSD image must be 4-D "
                                        r"\(H, W, D, 2\)"):
        read_scan(scan, 2)

    root = _nnunet_root(tmp_path / "d")
    scan = discover_scans(root / "imagesTs" / "p_91_0000.nii.gz")[0]
    image, reference = read_scan(scan, ("T2", "ADC"))
    assert [float(image[0, 0, 0, c]) for c in range(2)] == [10.0, 20.0]
    assert reference.get_filename() == str(scan.images[0]) and read_scan(scan)[0].shape == SMALL + (2,)
    assert check_scan(scan, 2) == SMALL
    for call in (read_scan, check_scan):
        with pytest.raises(DataError, match=r"case 'p_91' has 2 channel file\(s\) \('p_91_0000\.nii\.gz', "
                                            r"'p_91_0001\.nii\.gz'\) but the model takes 3 channel\(s\) \(T2, ADC, "
                                            r"PD\): one file each, p_91_0000\.nii\.gz to p_91_0002\.nii\.gz"):
            call(scan, ["T2", "ADC", "PD"])
    with pytest.raises(ValueError, match="channels must be a positive number"):
        read_scan(scan, 0)


def test_check_scan_refuses_channel_files_that_differ(tmp_path: Path) -> None:
    folder = tmp_path / "imagesTs"
    write_nifti(folder / "c_0000.nii.gz", np.ones(SMALL, np.float32))
    write_nifti(folder / "c_0001.nii.gz", np.ones(SMALL, np.float32), np.diag([1.0, 1.0, 2.0, 1.0]))
    (scan,) = discover_scans(folder)
    with pytest.raises(DataError, match=r"c_0001\.nii\.gz' has voxel spacing \(1, 1, 2\) mm but .*c_0000\.nii\.gz' "
                                        r"has \(1, 1, 1\) mm"):
        check_scan(scan, 2)
    write_nifti(folder / "c_0001.nii.gz", np.ones((12, 10, 7), np.float32))
    with pytest.raises(DataError, match=r"c_0001\.nii\.gz' has shape \(12, 10, 7\) but .* all channel files "
                                        r"must match"):
        check_scan(scan, 2)


def test_read_scan_label_with_the_models_classes(tmp_path: Path) -> None:
    label = _label((0, 1, 2, 3))
    write_nnunet_dataset(tmp_path / "d", {"b_1": (_channels(4), label)}, BRATS_REGIONS_JSON)
    description = describe_dataset(tmp_path / "d", "nnunet")
    (scan,) = discover_scans(tmp_path / "d" / "imagesTr")
    np.testing.assert_array_equal(read_scan_label(scan, SMALL, description), label)
    check_scan_data(scan, label=True, dataset=description)
    with pytest.raises(ValueError, match="nnU-Net v2 case: its label values come from its data set's description"):
        read_scan_label(scan, SMALL)
    with pytest.raises(DataError) as info:
        read_scan_label(scan, SMALL, "brats")  # BraTS 2018-2021 has no 3
    assert "b_1.nii.gz" in str(info.value) and "values [3]" in str(info.value)
    with pytest.raises(DataError, match=r"b_1\.nii\.gz' contains values \[3\]"):
        check_scan_data(scan, label=True, dataset="brats")
    check_scan_data(scan)  # the images alone need no description
    (tmp_path / "d" / "labelsTr" / "b_1.nii.gz").unlink()
    (scan,) = discover_scans(tmp_path / "d" / "imagesTr")
    with pytest.raises(DataError, match=r"has no label file \(an nnU-Net v2 label lies in labelsTr/ beside imagesTr/, "
                                        r"named b_1\.nii\.gz\)"):
        read_scan_label(scan, SMALL, description)


def test_one_channel_msd_task_round_trip(tmp_path: Path) -> None:
    """A spleen-like MSD task: its training cases and test images are found and read with the task's description."""
    from .test_description import write_msd_task

    ct = np.random.default_rng(3).integers(-1000, 1000, SMALL).astype(np.int16)
    root = write_msd_task(tmp_path / "Task09_Spleen", {"spleen_1": (ct, _label((0, 1)))})
    description = describe_dataset(root, "msd")
    (scan,) = discover_scans(root)
    (case,) = discover_cases(root, "msd")
    image, _ = read_scan(scan, description.channels)
    expected, label, _ = read_case(case, description)
    np.testing.assert_array_equal(image, expected)
    np.testing.assert_array_equal(read_scan_label(scan, SMALL, description), label)
