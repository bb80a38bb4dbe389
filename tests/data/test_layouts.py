"""Tests for distmis.data.layouts: discovery and reading of MSD / BraTS cases."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from distmis.data import MODALITIES, layout_description, CaseFiles, DataError, Layout, discover_cases, read_case
from distmis.data.layouts import case_file_stems, case_spatial_shape, coerce_layout, label_counts

from .conftest import SHAPE, corrupt_gzip, write_nifti


def _copy(root: Path, tmp_path: Path) -> Path:
    target = tmp_path / root.name
    shutil.copytree(root, target)
    return target


def _brats_case(folder: Path, case_id: str, modalities: list[np.ndarray], seg: np.ndarray, affine=None) -> None:
    for name, data in zip(MODALITIES, modalities):
        write_nifti(folder / case_id / f"{case_id}_{name}.nii.gz", data, affine)
    write_nifti(folder / case_id / f"{case_id}_seg.nii.gz", seg, affine)


def _brats2023_case(folder: Path, case_id: str, modalities: list[np.ndarray], seg: np.ndarray, affine=None) -> None:
    for name, data in zip(("t2f", "t1n", "t1c", "t2w"), modalities):  # MODALITIES order: flair, t1, t1ce, t2
        write_nifti(folder / case_id / f"{case_id}-{name}.nii.gz", data, affine)
    write_nifti(folder / case_id / f"{case_id}-seg.nii.gz", seg, affine)


def _msd_dataset(root: Path, images: dict[str, np.ndarray], labels: dict[str, np.ndarray], affine=None) -> None:
    training = []
    for case_id in images:
        write_nifti(root / "imagesTr" / f"{case_id}.nii.gz", images[case_id], affine)
        write_nifti(root / "labelsTr" / f"{case_id}.nii.gz", labels[case_id], affine)
        training.append({"image": f"./imagesTr/{case_id}.nii.gz", "label": f"./labelsTr/{case_id}.nii.gz"})
    (root / "dataset.json").write_text(json.dumps({"training": training}))


# --------------------------------------------------------------------------- constants


def test_constants() -> None:
    assert MODALITIES == ("flair", "t1", "t1ce", "t2")
    assert layout_description(Layout.MSD).label_values == (0, 1, 2, 3)
    assert layout_description(Layout.BRATS).label_values == (0, 1, 2, 4)
    assert layout_description(Layout.BRATS2023).label_values == (0, 1, 2, 3)
    assert Layout("msd") is Layout.MSD and Layout.BRATS == "brats" and Layout("brats2023") is Layout.BRATS2023


def test_coerce_layout_rejects_unknown() -> None:
    assert coerce_layout("brats") is Layout.BRATS
    assert coerce_layout("brats2023") is Layout.BRATS2023
    assert coerce_layout("nnunet") is Layout.NNUNET
    with pytest.raises(ValueError, match="'msd', 'nnunet', 'brats', 'brats2023'"):
        coerce_layout("decathlon")


def test_case_file_stems() -> None:
    assert case_file_stems("brats", "B_1") == (("B_1_flair", "B_1_t1", "B_1_t1ce", "B_1_t2"), "B_1_seg")
    assert case_file_stems(Layout.BRATS2023, "BraTS-GLI-00000-000") == (
        ("BraTS-GLI-00000-000-t2f", "BraTS-GLI-00000-000-t1n", "BraTS-GLI-00000-000-t1c", "BraTS-GLI-00000-000-t2w"),
        "BraTS-GLI-00000-000-seg",
    )
    with pytest.raises(ValueError, match="'msd' has no case folders"):
        case_file_stems("msd", "BRATS_001")


def test_label_counts() -> None:
    label = np.array([[[0, 0, 4], [2, 2, 2]]], dtype=np.int16)
    assert label_counts(label) == {0: 2, 2: 3, 4: 1}
    assert label_counts(np.array([-1, 5, 5], dtype=np.int32)) == {-1: 1, 5: 2}
    with pytest.raises(TypeError):
        label_counts(np.zeros(3, dtype=np.float32))


# --------------------------------------------------------------------------- discovery


def test_discover_msd(msd_root: Path) -> None:
    cases = discover_cases(msd_root, "msd")
    assert [c.case_id for c in cases] == ["BRATS_001", "BRATS_002", "BRATS_003", "BRATS_004"]
    for case in cases:
        assert isinstance(case, CaseFiles)
        assert len(case.images) == 1 and case.images[0].is_file()
        assert case.images[0].parent.name == "imagesTr" and case.label.parent.name == "labelsTr"
        assert case.label.name == f"{case.case_id}.nii.gz"


def test_discover_brats(brats_root: Path) -> None:
    cases = discover_cases(str(brats_root), Layout.BRATS)
    assert [c.case_id for c in cases] == [f"BraTS2021_{i:05d}" for i in range(5)]
    for case in cases:
        assert [p.name for p in case.images] == [f"{case.case_id}_{m}.nii.gz" for m in MODALITIES]
        assert case.label.name == f"{case.case_id}_seg.nii.gz"


def test_discover_brats2023(brats2023_root: Path) -> None:
    cases = discover_cases(brats2023_root, "brats2023")
    assert [c.case_id for c in cases] == [f"BraTS-GLI-{i:05d}-000" for i in range(3)]
    for case in cases:  # t2f -> flair, t1n -> t1, t1c -> t1ce, t2w -> t2
        assert [p.name for p in case.images] == [f"{case.case_id}-{m}.nii.gz" for m in ("t2f", "t1n", "t1c", "t2w")]
        assert case.label.name == f"{case.case_id}-seg.nii.gz"


def test_discover_sorts_msd_cases(tmp_path: Path) -> None:
    image = np.ones(SHAPE + (4,), np.float32)
    label = np.zeros(SHAPE, np.uint8)
    _msd_dataset(tmp_path, {"BRATS_010": image, "BRATS_002": image}, {"BRATS_010": label, "BRATS_002": label})
    assert [c.case_id for c in discover_cases(tmp_path, "msd")] == ["BRATS_002", "BRATS_010"]


def test_discover_missing_root(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist") as info:
        discover_cases(tmp_path / "nope", "msd")
    assert "nope" in str(info.value)


def test_discover_missing_dataset_json(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="dataset.json"):
        discover_cases(tmp_path, "msd")


def test_discover_msd_listed_file_missing(msd_root: Path, tmp_path: Path) -> None:
    root = _copy(msd_root, tmp_path)
    (root / "labelsTr" / "BRATS_003.nii.gz").unlink()
    with pytest.raises(DataError, match=r"labelsTr/BRATS_003\.nii\.gz"):
        discover_cases(root, "msd")


def test_discover_brats_missing_modality(brats_root: Path, tmp_path: Path) -> None:
    root = _copy(brats_root, tmp_path)
    (root / "BraTS2021_00001" / "BraTS2021_00001_t1ce.nii.gz").unlink()
    with pytest.raises(DataError, match=r"BraTS2021_00001_t1ce\.nii\.gz") as info:
        discover_cases(root, "brats")
    assert "missing" in str(info.value)


def test_discover_brats2023_missing_file_names_it(brats2023_root: Path, tmp_path: Path) -> None:
    root = _copy(brats2023_root, tmp_path)
    (root / "BraTS-GLI-00001-000" / "BraTS-GLI-00001-000-t1c.nii.gz").unlink()
    with pytest.raises(DataError, match=r"missing file .*BraTS-GLI-00001-000/BraTS-GLI-00001-000-t1c\.nii\.gz") as info:
        discover_cases(root, "brats2023")
    assert "BraTS-GLI-00001-000-t2f.nii.gz" in str(info.value)  # the files a case folder needs
    (root / "BraTS-GLI-00002-000" / "BraTS-GLI-00002-000-seg.nii.gz").unlink()
    shutil.rmtree(root / "BraTS-GLI-00001-000")
    with pytest.raises(DataError, match=r"missing file .*BraTS-GLI-00002-000-seg\.nii\.gz"):
        discover_cases(root, "brats2023")  # training cases need their label


def test_discover_hints_at_the_other_brats_layout(brats_root: Path, brats2023_root: Path) -> None:
    with pytest.raises(DataError, match=r"BraTS-GLI-00000-000_flair\.nii\.gz.*BraTS 2023 files .*use layout='brats2023'"):
        discover_cases(brats2023_root, "brats")
    with pytest.raises(DataError, match=r"BraTS2021_00000-t2f\.nii\.gz.*BraTS 2018-2021 files .*use layout='brats'"):
        discover_cases(brats_root, "brats2023")
    with pytest.raises(DataError, match=r"dataset\.json.*sub-folder 'BraTS-GLI-00000-000'.*layout='brats2023'"):
        discover_cases(brats2023_root, "msd")


def test_discover_hints_at_a_case_folder_given_as_the_root(brats2023_root: Path) -> None:
    with pytest.raises(DataError, match=r"no cases found.*itself a BraTS 2023 case folder: pass the folder that holds"):
        discover_cases(brats2023_root / "BraTS-GLI-00000-000", "brats2023")


def test_discover_no_cases(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no cases found"):
        discover_cases(tmp_path, "brats")
    (tmp_path / "dataset.json").write_text(json.dumps({"training": []}))
    with pytest.raises(DataError, match="no cases found"):
        discover_cases(tmp_path, "msd")
    with pytest.raises(DataError, match="layout='msd'"):  # hint for the wrong layout
        discover_cases(tmp_path, "brats")


# --------------------------------------------------------------------------- reading generated files


@pytest.mark.parametrize("layout", ["msd", "brats", "brats2023"])
def test_read_generated_cases(layout: str, msd_root: Path, brats_root: Path, brats2023_root: Path) -> None:
    root = {"msd": msd_root, "brats": brats_root, "brats2023": brats2023_root}[layout]
    for case in discover_cases(root, layout):
        image, label, spacing = read_case(case, layout)
        assert image.shape == SHAPE + (4,) and image.dtype == np.float32
        assert label.shape == SHAPE and label.dtype == np.int16
        assert spacing == (1.0, 1.0, 1.0)
        assert set(np.unique(label)) == set(layout_description(layout).label_values)  # every compartment present
        assert (image >= 0).all() and (image[label > 0] > 0).all()  # tumour lies inside the brain


# --------------------------------------------------------------------------- reading hand-written files


def test_read_msd_int16_non_ras_affine_as_stored(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 500, size=(6, 7, 5, 4)).astype(np.int16)
    label = rng.choice(np.array([0, 1, 2, 3], dtype=np.uint8), size=(6, 7, 5))
    affine = np.array([[0, -2.0, 0, 10], [1.5, 0, 0, -4], [0, 0, -3.0, 7], [0, 0, 0, 1]])  # permuted + flipped
    _msd_dataset(tmp_path, {"BRATS_001": image}, {"BRATS_001": label}, affine)
    (case,) = discover_cases(tmp_path, "msd")
    got_image, got_label, spacing = read_case(case, "msd")
    np.testing.assert_array_equal(got_image, image.astype(np.float32))  # no reorientation
    np.testing.assert_array_equal(got_label, label)
    assert got_image.dtype == np.float32 and got_label.dtype == np.int16
    assert spacing == pytest.approx((1.5, 2.0, 3.0))  # column norms of the affine


def test_read_brats_float_data_and_float_label(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    modalities = [rng.uniform(0, 1, (5, 6, 7)).astype(np.float32) * (m + 1) for m in range(4)]
    seg = rng.choice(np.array([0.0, 1.0, 2.0, 4.0], dtype=np.float32), size=(5, 6, 7))
    affine = np.diag([-1.0, -1.0, 1.0, 1.0])
    _brats_case(tmp_path, "case_a", modalities, seg, affine)
    (case,) = discover_cases(tmp_path, "brats")
    image, label, _ = read_case(case, "brats")
    for m in range(4):  # channel order follows MODALITIES
        np.testing.assert_array_equal(image[..., m], modalities[m])
    np.testing.assert_array_equal(label, seg.astype(np.int16))


def test_read_brats2023_maps_modalities_and_keeps_labels(tmp_path: Path) -> None:
    shape = (12, 10, 8)
    modalities = [np.full(shape, 10 * (m + 1), np.int16) for m in range(4)]  # flair 10, t1 20, t1ce 30, t2 40
    seg = np.zeros(shape, np.uint8)
    seg[2:9, 2:8, 2:6] = 2  # edema
    seg[3:8, 3:7, 3:5] = 3  # enhancing
    seg[4:6, 4:6, 3:5] = 1  # necrotic core
    affine = np.diag([1.0, 1.2, 2.5, 1.0])
    _brats2023_case(tmp_path, "BraTS-GLI-00042-001", modalities, seg, affine)
    (case,) = discover_cases(tmp_path, "brats2023")
    image, label, spacing = read_case(case, "brats2023")
    assert image.shape == shape + (4,) and image.dtype == np.float32
    assert [float(image[0, 0, 0, m]) for m in range(4)] == [10.0, 20.0, 30.0, 40.0]  # t2f, t1n, t1c, t2w
    np.testing.assert_array_equal(label, seg.astype(np.int16))
    assert label.dtype == np.int16 and spacing == pytest.approx((1.0, 1.2, 2.5))


def test_read_brats2023_rejects_a_brats_2021_label(tmp_path: Path) -> None:
    seg = np.zeros((4, 4, 4), np.uint8)
    seg[0, 0, 0] = 4  # BraTS 2018-2021's enhancing value
    _brats2023_case(tmp_path, "c1", [np.ones((4, 4, 4), np.int16)] * 4, seg)
    with pytest.raises(DataError) as info:
        read_case(discover_cases(tmp_path, "brats2023")[0], "brats2023")
    message = str(info.value)
    assert "c1-seg.nii.gz" in message and "[4]" in message and "[0, 1, 2, 3]" in message and "'brats2023'" in message


def test_read_brats_accepts_trailing_singleton_label_axis(tmp_path: Path) -> None:
    modalities = [np.ones((4, 4, 4), np.int16)] * 4
    _brats_case(tmp_path, "c", modalities, np.zeros((4, 4, 4, 1), np.uint8))
    _, label, _ = read_case(discover_cases(tmp_path, "brats")[0], "brats")
    assert label.shape == (4, 4, 4)


# --------------------------------------------------------------------------- reading errors


def test_read_bad_label_value_names_file_and_values(tmp_path: Path) -> None:
    modalities = [np.ones((4, 4, 4), np.int16)] * 4
    seg = np.zeros((4, 4, 4), np.uint8)
    seg[0, 0, 0] = 3  # an MSD value in a BraTS data set
    _brats_case(tmp_path, "c1", modalities, seg)
    with pytest.raises(DataError) as info:
        read_case(discover_cases(tmp_path, "brats")[0], "brats")
    message = str(info.value)
    assert "c1_seg.nii.gz" in message and "[3]" in message and "[0, 1, 2, 4]" in message


def test_read_non_integer_label(tmp_path: Path) -> None:
    modalities = [np.ones((4, 4, 4), np.float32)] * 4
    seg = np.zeros((4, 4, 4), np.float32)
    seg[1, 1, 1] = 0.5
    _brats_case(tmp_path, "c1", modalities, seg)
    with pytest.raises(DataError, match="c1_seg.nii.gz.*non-integer"):
        read_case(discover_cases(tmp_path, "brats")[0], "brats")


def test_read_msd_image_must_be_4d_with_4_channels(tmp_path: Path) -> None:
    _msd_dataset(tmp_path, {"BRATS_001": np.ones((4, 4, 4, 3), np.float32)}, {"BRATS_001": np.zeros((4, 4, 4), np.uint8)})
    with pytest.raises(DataError, match=r"imagesTr/BRATS_001\.nii\.gz.*\(4, 4, 4, 3\)"):
        read_case(discover_cases(tmp_path, "msd")[0], "msd")


def test_read_image_label_shape_mismatch(tmp_path: Path) -> None:
    _msd_dataset(tmp_path, {"BRATS_001": np.ones((4, 4, 4, 4), np.float32)}, {"BRATS_001": np.zeros((4, 4, 5), np.uint8)})
    with pytest.raises(DataError, match=r"labelsTr/BRATS_001\.nii\.gz.*\(4, 4, 5\)"):
        read_case(discover_cases(tmp_path, "msd")[0], "msd")


def test_read_brats_modalities_differ_in_shape(tmp_path: Path) -> None:
    modalities = [np.ones((4, 4, 4), np.int16)] * 3 + [np.ones((4, 4, 3), np.int16)]
    _brats_case(tmp_path, "c1", modalities, np.zeros((4, 4, 4), np.uint8))
    with pytest.raises(DataError, match=r"c1_t2\.nii\.gz.*\(4, 4, 3\)"):
        read_case(discover_cases(tmp_path, "brats")[0], "brats")


def test_read_corrupt_file_names_it(brats_root: Path, tmp_path: Path) -> None:
    root = _copy(brats_root, tmp_path)
    corrupt_gzip(root / "BraTS2021_00002" / "BraTS2021_00002_t1.nii.gz")
    case = discover_cases(root, "brats")[2]
    with pytest.raises(DataError, match=r"cannot read.*BraTS2021_00002_t1\.nii\.gz"):
        read_case(case, "brats")


def test_read_garbage_file_names_it(tmp_path: Path) -> None:
    _msd_dataset(tmp_path, {"BRATS_001": np.ones((4, 4, 4, 4), np.float32)}, {"BRATS_001": np.zeros((4, 4, 4), np.uint8)})
    (tmp_path / "labelsTr" / "BRATS_001.nii.gz").write_bytes(b"not a nifti file")
    with pytest.raises(DataError, match=r"cannot read.*labelsTr/BRATS_001\.nii\.gz"):
        read_case(discover_cases(tmp_path, "msd")[0], "msd")


def test_read_nan_image(tmp_path: Path) -> None:
    image = np.ones((4, 4, 4, 4), np.float32)
    image[1, 2, 3, 0] = np.nan
    _msd_dataset(tmp_path, {"BRATS_001": image}, {"BRATS_001": np.zeros((4, 4, 4), np.uint8)})
    with pytest.raises(DataError, match=r"imagesTr/BRATS_001\.nii\.gz.*NaN"):
        read_case(discover_cases(tmp_path, "msd")[0], "msd")


# --------------------------------------------------------------------------- shapes from headers


def test_case_spatial_shape_of_every_layout(msd_root: Path, brats_root: Path, brats2023_root: Path) -> None:
    for root, layout in ((msd_root, "msd"), (brats_root, "brats"), (brats2023_root, "brats2023")):
        for case in discover_cases(root, layout):
            assert case_spatial_shape(case) == SHAPE == read_case(case, layout)[0].shape[:3]


def test_case_spatial_shape_reads_the_header_only(tmp_path: Path) -> None:
    image = np.random.default_rng(0).uniform(0, 100, (24, 20, 12, 4)).astype(np.float32)  # incompressible
    _msd_dataset(tmp_path, {"BRATS_001": image}, {"BRATS_001": np.zeros((24, 20, 12), np.uint8)})
    corrupt_gzip(tmp_path / "imagesTr" / "BRATS_001.nii.gz")  # the voxel data is cut, the header is whole
    case = discover_cases(tmp_path, "msd")[0]
    assert case_spatial_shape(case) == (24, 20, 12)
    with pytest.raises(DataError, match="cannot read"):  # reading the data does fail
        read_case(case, "msd")


def test_case_spatial_shape_names_a_bad_file(tmp_path: Path) -> None:
    _msd_dataset(tmp_path, {"BRATS_001": np.ones((4, 4, 4, 4), np.float32)},
                 {"BRATS_001": np.zeros((4, 4, 4), np.uint8)})
    (tmp_path / "imagesTr" / "BRATS_001.nii.gz").write_bytes(b"not a nifti file")
    with pytest.raises(DataError, match=r"NIfTI header of .*imagesTr/BRATS_001\.nii\.gz"):
        case_spatial_shape(discover_cases(tmp_path, "msd")[0])
    write_nifti(tmp_path / "imagesTr" / "BRATS_001.nii.gz", np.ones((4, 4), np.float32))
    with pytest.raises(DataError, match=r"BRATS_001\.nii\.gz' has shape \(4, 4\); an image needs 3 spatial axes"):
        case_spatial_shape(discover_cases(tmp_path, "msd")[0])


# --------------------------------------------------------------------------- any MSD task, nnU-Net v2 data sets

from distmis.data import check_cases, describe_dataset  # noqa: E402
from distmis.data.layouts import case_affine, case_orientation, case_spacing  # noqa: E402

from .test_description import (  # noqa: E402
    BRATS_REGIONS_JSON,
    SPLEEN_JSON,
    write_msd_task,
    write_nnunet_dataset,
)

CT = (6, 5, 4)
LPS = np.diag([-0.8, -0.8, 2.5, 1.0])


def _ct_case(seed: int, shape: tuple[int, int, int] = CT,
             values: tuple[int, ...] = (0, 1)) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(-1000, 1000, shape).astype(np.int16),
            rng.choice(np.array(values, np.uint8), size=shape))


def _prostate_case(seed: int, shape: tuple[int, int, int] = CT) -> tuple[list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    return ([np.full(shape, 100 + seed, np.int16), rng.uniform(0, 3, shape).astype(np.float32)],
            rng.choice(np.array([0, 1, 2], np.uint8), size=shape))


def test_msd_one_channel_task_reads_3d_images(tmp_path: Path) -> None:
    cases = {"spleen_10": _ct_case(0), "spleen_2": _ct_case(1)}
    root = write_msd_task(tmp_path / "Task09_Spleen", cases, affines={"spleen_2": LPS})
    description = describe_dataset(root, "msd")
    found = discover_cases(root, "msd")
    assert [c.case_id for c in found] == ["spleen_10", "spleen_2"]
    check_cases(found, description)
    for case in found:
        image, label, spacing = read_case(case, description)
        assert image.shape == CT + (1,) and image.dtype == np.float32
        np.testing.assert_array_equal(image[..., 0], cases[case.case_id][0])
        np.testing.assert_array_equal(label, cases[case.case_id][1])
        assert label.dtype == np.int16
    assert read_case(found[1], description)[2] == pytest.approx((0.8, 0.8, 2.5))
    assert [case_orientation(c) for c in found] == ["RAS", "LPS"]
    np.testing.assert_allclose(case_affine(found[1]), LPS)
    assert case_spatial_shape(found[1]) == CT and case_spacing(found[1]) == pytest.approx((0.8, 0.8, 2.5))


def test_msd_4d_task_with_its_own_channels(tmp_path: Path) -> None:
    meta = {"modality": {"0": "T2", "1": "ADC"}, "labels": {"0": "background", "1": "PZ", "2": "TZ"}}
    image = np.stack([np.full(CT, 7, np.int16), np.full(CT, 9, np.int16)], axis=-1)
    label = np.resize(np.array([0, 1, 2], np.uint8), CT)
    root = write_msd_task(tmp_path / "Task05_Prostate", {"prostate_00": (image, label)}, meta)
    description = describe_dataset(root, "msd")
    (case,) = discover_cases(root, "msd")
    check_cases([case], description)
    got, got_label, _ = read_case(case, description)
    assert got.shape == CT + (2,) and [float(got[0, 0, 0, c]) for c in range(2)] == [7.0, 9.0]
    np.testing.assert_array_equal(got_label, label)


def test_msd_channel_count_mismatch_is_refused(tmp_path: Path) -> None:
    two = {"modality": {"0": "T2", "1": "ADC"}, "labels": SPLEEN_JSON["labels"]}
    root = write_msd_task(tmp_path / "a", {"p_1": _ct_case(0)}, two)  # a 3-D image: one channel
    description = describe_dataset(root, "msd")
    (case,) = discover_cases(root, "msd")
    with pytest.raises(DataError) as info:
        check_cases([case], description)
    message = str(info.value)
    assert "imagesTr/p_1.nii.gz" in message and "(6, 5, 4)" in message and "1 channel(s)" in message
    assert "2 channel(s) (T2, ADC)" in message
    with pytest.raises(DataError, match=r"p_1\.nii\.gz' has shape \(6, 5, 4\); an MSD image must be 4-D "
                                        r"\(H, W, D, 2\) with channels T2, ADC"):
        read_case(case, description)
    three = np.zeros(CT + (3,), np.float32)
    root = write_msd_task(tmp_path / "b", {"s_1": (three, np.zeros(CT, np.uint8))})  # the spleen task: one channel
    (case,) = discover_cases(root, "msd")
    with pytest.raises(DataError, match=r"s_1\.nii\.gz' has shape \(6, 5, 4, 3\), 3 channel\(s\), but the data set "
                                        r"has 1 channel\(s\) \(CT\)"):
        check_cases([case], describe_dataset(root, "msd"))
    with pytest.raises(DataError, match=r"an MSD image of one channel \(CT\) must be 3-D"):
        read_case(case, describe_dataset(root, "msd"))


def test_label_value_not_in_labels_names_file_values_and_classes(tmp_path: Path) -> None:
    image, label = _ct_case(0)
    label[0, 0, 0] = 5
    root = write_msd_task(tmp_path, {"spleen_1": (image, label)})
    (case,) = discover_cases(root, "msd")
    check_cases([case], describe_dataset(root, "msd"))  # the headers hold no label values
    with pytest.raises(DataError) as info:
        read_case(case, describe_dataset(root, "msd"))
    message = str(info.value)
    assert "labelsTr/spleen_1.nii.gz" in message and "values [5]" in message
    assert "allowed [0, 1]: 0 background, 1 spleen" in message and "dataset.json" in message


def test_image_and_label_spacing_and_shape_mismatch(tmp_path: Path) -> None:
    image, label = _ct_case(0)
    root = write_msd_task(tmp_path, {"spleen_1": (image, label)})
    write_nifti(root / "labelsTr" / "spleen_1.nii.gz", label, np.diag([1.0, 1.0, 3.0, 1.0]))
    description = describe_dataset(root, "msd")
    (case,) = discover_cases(root, "msd")
    with pytest.raises(DataError) as info:
        check_cases([case], description)
    message = str(info.value)
    assert "labelsTr/spleen_1.nii.gz" in message and "voxel spacing (1, 1, 3) mm" in message
    assert "imagesTr/spleen_1.nii.gz" in message and "has (1, 1, 1) mm" in message
    write_nifti(root / "labelsTr" / "spleen_1.nii.gz", label[:, :, :3])
    with pytest.raises(DataError, match=r"labelsTr/spleen_1\.nii\.gz' has shape \(6, 5, 3\) but the image of case "
                                        r"'spleen_1' .* has spatial shape \(6, 5, 4\)"):
        check_cases([case], description)


def test_nnunet_discover_and_read_stacks_the_channel_files(tmp_path: Path) -> None:
    cases = {"prostate_16": _prostate_case(0), "prostate_02": _prostate_case(1)}
    root = write_nnunet_dataset(tmp_path / "Dataset005_Prostate", cases, affines={"prostate_02": LPS})
    description = describe_dataset(root, "nnunet")
    found = discover_cases(root, "nnunet")
    assert [c.case_id for c in found] == ["prostate_02", "prostate_16"]
    assert [p.name for p in found[0].images] == ["prostate_02_0000.nii.gz", "prostate_02_0001.nii.gz"]
    assert found[0].label == root / "labelsTr" / "prostate_02.nii.gz"
    check_cases(found, description)
    for case in found:
        image, label, spacing = read_case(case, description)
        channels, expected = cases[case.case_id]
        assert image.shape == CT + (2,) and image.dtype == np.float32
        for c in range(2):  # channel order: T2, ADC
            np.testing.assert_array_equal(image[..., c], channels[c])
        np.testing.assert_array_equal(label, expected)
    assert case_orientation(found[0]) == "LPS" and case_orientation(found[1]) == "RAS"
    assert case_spacing(found[0]) == pytest.approx((0.8, 0.8, 2.5)) and case_spatial_shape(found[0]) == CT
    with pytest.raises(ValueError, match="described by its dataset.json"):
        read_case(found[0], "nnunet")


def test_nnunet_with_nii_files(tmp_path: Path) -> None:
    meta = {"channel_names": {"0": "CT"}, "labels": {"background": 0, "liver": 1}, "file_ending": ".nii"}
    root = write_nnunet_dataset(tmp_path, {"liver_0": ([_ct_case(0)[0]], _ct_case(0)[1])}, meta, ending=".nii")
    (case,) = discover_cases(root, "nnunet")
    assert case.images == (root / "imagesTr" / "liver_0_0000.nii",)
    assert read_case(case, describe_dataset(root, "nnunet"))[0].shape == CT + (1,)


def test_nnunet_region_based_labels_read(tmp_path: Path) -> None:
    label = np.resize(np.array([0, 1, 2, 3], np.uint8), CT)
    channels = [np.full(CT, c, np.float32) for c in range(4)]
    root = write_nnunet_dataset(tmp_path / "a", {"BraTS_0": (channels, label)}, BRATS_REGIONS_JSON)
    description = describe_dataset(root, "nnunet")
    (case,) = discover_cases(root, "nnunet")
    image, got, _ = read_case(case, description)
    assert image.shape == CT + (4,) and [float(image[0, 0, 0, c]) for c in range(4)] == [0, 1, 2, 3]
    np.testing.assert_array_equal(got, label)
    label[0, 0, 0] = 4
    root = write_nnunet_dataset(tmp_path / "b", {"BraTS_0": (channels, label)}, BRATS_REGIONS_JSON)
    with pytest.raises(DataError) as info:
        read_case(discover_cases(root, "nnunet")[0], describe_dataset(root, "nnunet"))
    message = str(info.value)
    assert "labelsTr/BraTS_0.nii.gz" in message and "values [4]" in message and "allowed [0, 1, 2, 3]" in message
    assert "3 in whole tumor, tumor core, enhancing tumor" in message


def test_nnunet_missing_channel_or_label_is_named(tmp_path: Path) -> None:
    root = write_nnunet_dataset(tmp_path, {"p_1": _prostate_case(0), "p_2": _prostate_case(1)})
    (root / "imagesTr" / "p_2_0001.nii.gz").unlink()
    with pytest.raises(DataError) as info:
        discover_cases(root, "nnunet")
    message = str(info.value)
    assert f"missing channel file {str(root / 'imagesTr' / 'p_2_0001.nii.gz')!r}" in message
    assert "(channel 0001, 'ADC')" in message and "2 channel(s): 0000 T2, 0001 ADC" in message
    write_nifti(root / "imagesTr" / "p_2_0001.nii.gz", np.zeros(CT, np.float32))
    (root / "labelsTr" / "p_1.nii.gz").unlink()
    with pytest.raises(DataError, match=r"case 'p_1': missing label file .*labelsTr/p_1\.nii\.gz'"):
        discover_cases(root, "nnunet")
    write_nifti(root / "labelsTr" / "p_1.nii.gz", np.zeros(CT, np.uint8))
    write_nifti(root / "labelsTr" / "p_3.nii.gz", np.zeros(CT, np.uint8))
    with pytest.raises(DataError, match=r"label file .*labelsTr/p_3\.nii\.gz' has no image: missing channel file "
                                        r".*imagesTr/p_3_0000\.nii\.gz'"):
        discover_cases(root, "nnunet")
    (root / "labelsTr" / "p_3.nii.gz").unlink()
    write_nifti(root / "imagesTr" / "p_1_0002.nii.gz", np.zeros(CT, np.float32))
    with pytest.raises(DataError, match=r"p_1_0002\.nii\.gz' has the channel index 0002, but .*dataset\.json' lists "
                                        r"2 channel\(s\)"):
        discover_cases(root, "nnunet")
    (root / "imagesTr" / "p_1_0002.nii.gz").unlink()
    write_nifti(root / "imagesTr" / "p_1.nii.gz", np.zeros(CT, np.float32))
    with pytest.raises(DataError, match=r"image file .*imagesTr/p_1\.nii\.gz' is not named <case>_XXXX\.nii\.gz"):
        discover_cases(root, "nnunet")
    (root / "imagesTr" / "p_1.nii.gz").unlink()
    (root / "imagesTr" / ".p_1_0000.nii.gz").write_bytes(b"AppleDouble")  # hidden: skipped
    (root / "imagesTr" / "notes.txt").write_text("not an image")  # another ending: skipped
    assert [c.case_id for c in discover_cases(root, "nnunet")] == ["p_1", "p_2"]


def test_nnunet_num_training_mismatch_names_both_numbers(tmp_path: Path) -> None:
    meta = {"channel_names": {"0": "T2", "1": "ADC"}, "labels": {"background": 0, "PZ": 1, "TZ": 2},
            "file_ending": ".nii.gz", "numTraining": 3}
    root = write_nnunet_dataset(tmp_path, {"p_1": _prostate_case(0), "p_2": _prostate_case(1)}, meta)
    with pytest.raises(DataError, match=r"dataset\.json' states numTraining 3, but .*imagesTr' holds 2 case\(s\)"):
        discover_cases(root, "nnunet")


def test_nnunet_wrong_ending_or_layout_is_pointed_at(tmp_path: Path, msd_root: Path, brats_root: Path) -> None:
    meta = {"channel_names": {"0": "CT"}, "labels": {"background": 0, "liver": 1}, "file_ending": ".nii"}
    root = write_nnunet_dataset(tmp_path / "a", {"liver_0": ([_ct_case(0)[0]], _ct_case(0)[1])}, meta)  # .nii.gz files
    with pytest.raises(DataError, match=r"file_ending is '\.nii', but the files there end with '\.nii\.gz'"):
        discover_cases(root, "nnunet")
    with pytest.raises(DataError, match=r"has no 'training' list.*channel_names.*use layout='nnunet'"):
        discover_cases(root, "msd")
    with pytest.raises(DataError, match=r"dataset\.json' not found: an nnU-Net v2 data set root .*sub-folder "
                                        r"'BraTS2021_00000' is a BraTS 2018-2021 case folder"):
        discover_cases(brats_root, "nnunet")
    with pytest.raises(DataError, match=r"lacks the required key 'channel_names'.*use layout='msd'"):
        discover_cases(msd_root, "nnunet")


def test_check_cases_nnunet_channel_files(tmp_path: Path) -> None:
    root = write_nnunet_dataset(tmp_path, {"p_1": _prostate_case(0)})
    description = describe_dataset(root, "nnunet")
    (case,) = discover_cases(root, "nnunet")
    check_cases([case], description)
    with pytest.raises(DataError, match=r"case 'p_1' has 1 image file\(s\) \(p_1_0000\.nii\.gz\) but the data set has "
                                        r"2 channel\(s\) \(T2, ADC\)"):
        check_cases([CaseFiles("p_1", case.images[:1], case.label)], description)
    write_nifti(root / "imagesTr" / "p_1_0001.nii.gz", np.zeros((6, 5, 3), np.float32))
    with pytest.raises(DataError, match=r"channel file .*p_1_0001\.nii\.gz' has shape \(6, 5, 3\) but "
                                        r".*p_1_0000\.nii\.gz' has shape \(6, 5, 4\); all channel files must match"):
        check_cases([case], description)
    with pytest.raises(DataError, match=r"p_1_0001\.nii\.gz' has shape \(6, 5, 3\) but .*all channel files must match"):
        read_case(case, description)
    write_nifti(root / "imagesTr" / "p_1_0001.nii.gz", np.zeros(CT, np.float32), np.diag([1.0, 1.0, 2.0, 1.0]))
    with pytest.raises(DataError, match=r"channel file .*p_1_0001\.nii\.gz' has voxel spacing \(1, 1, 2\) mm but "
                                        r".*p_1_0000\.nii\.gz' has \(1, 1, 1\) mm"):
        check_cases([case], description)
    write_nifti(root / "imagesTr" / "p_1_0001.nii.gz", np.zeros(CT + (2,), np.float32))
    with pytest.raises(DataError, match=r"p_1_0001\.nii\.gz' has shape \(6, 5, 4, 2\); an nnU-Net v2 channel file must be "
                                        r"3-D"):
        check_cases([case], description)


def test_check_cases_reads_headers_only(tmp_path: Path) -> None:
    image = np.random.default_rng(0).uniform(0, 100, (24, 20, 12)).astype(np.float32)  # incompressible
    root = write_msd_task(tmp_path, {"s_1": (image, np.zeros((24, 20, 12), np.uint8))})
    corrupt_gzip(root / "imagesTr" / "s_1.nii.gz")  # the voxel data is cut, the header is whole
    (case,) = discover_cases(root, "msd")
    check_cases([case], describe_dataset(root, "msd"))
    assert case_orientation(case) == "RAS" and case_affine(case).shape == (4, 4)
    (root / "imagesTr" / "s_1.nii.gz").write_bytes(b"not a nifti file")
    with pytest.raises(DataError, match=r"cannot read .*imagesTr/s_1\.nii\.gz'"):
        check_cases([case], describe_dataset(root, "msd"))
    with pytest.raises(DataError, match=r"cannot read .*imagesTr/s_1\.nii\.gz'"):
        case_orientation(case)


def test_check_cases_of_the_brain_tumour_layouts(msd_root: Path, brats_root: Path, brats2023_root: Path) -> None:
    for root, layout in ((msd_root, "msd"), (brats_root, "brats"), (brats2023_root, "brats2023")):
        check_cases(discover_cases(root, layout), layout)
        check_cases(discover_cases(root, layout), describe_dataset(root, layout))
