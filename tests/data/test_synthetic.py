"""Tests for distmis.data.synthetic."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

import distmis.data.synthetic as synthetic
from distmis.data import MODALITIES, DataError, discover_cases, read_case, synthesize_dataset

from .conftest import SHAPE


def test_msd_files_and_dataset_json(msd_root: Path) -> None:
    meta = json.loads((msd_root / "dataset.json").read_text())
    assert meta["numTraining"] == 4 and len(meta["training"]) == 4
    assert meta["modality"] == {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"}
    assert set(meta["labels"]) == {"0", "1", "2", "3"}
    assert meta["training"][0] == {"image": "./imagesTr/BRATS_001.nii.gz", "label": "./labelsTr/BRATS_001.nii.gz"}
    image = nib.load(str(msd_root / "imagesTr" / "BRATS_001.nii.gz"))
    label = nib.load(str(msd_root / "labelsTr" / "BRATS_001.nii.gz"))
    assert image.shape == SHAPE + (4,) and image.get_data_dtype() == np.float32
    assert label.shape == SHAPE and label.get_data_dtype() == np.uint8
    assert set(np.unique(np.asanyarray(label.dataobj))) == {0, 1, 2, 3}
    np.testing.assert_allclose(np.abs(np.diag(image.affine))[:3], 1.0)
    assert image.header.get_zooms()[:3] == (1.0, 1.0, 1.0)


def test_brats_files(brats_root: Path) -> None:
    folder = brats_root / "BraTS2021_00003"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        f"BraTS2021_00003_{part}.nii.gz" for part in (*MODALITIES, "seg")
    )
    for modality in MODALITIES:
        img = nib.load(str(folder / f"BraTS2021_00003_{modality}.nii.gz"))
        assert img.shape == SHAPE and img.get_data_dtype() == np.int16
        assert img.header.get_zooms() == (1.0, 1.0, 1.0)
    seg = np.asanyarray(nib.load(str(folder / "BraTS2021_00003_seg.nii.gz")).dataobj)
    assert set(np.unique(seg)) == {0, 1, 2, 4}


def test_brats2023_files(brats2023_root: Path) -> None:
    folder = brats2023_root / "BraTS-GLI-00001-000"
    assert sorted(p.name for p in brats2023_root.iterdir()) == [f"BraTS-GLI-{i:05d}-000" for i in range(3)]
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        f"BraTS-GLI-00001-000-{part}.nii.gz" for part in ("t1c", "t1n", "t2f", "t2w", "seg")
    )
    for part in ("t2f", "t1n", "t1c", "t2w"):
        img = nib.load(str(folder / f"BraTS-GLI-00001-000-{part}.nii.gz"))
        assert img.shape == SHAPE and img.get_data_dtype() == np.int16
    seg = np.asanyarray(nib.load(str(folder / "BraTS-GLI-00001-000-seg.nii.gz")).dataobj)
    assert set(np.unique(seg)) == {0, 1, 2, 3}


def test_brats2023_is_the_brats_data_relabelled(tmp_path: Path) -> None:
    """Same seed, same case: the images agree and only the enhancing label differs (4 -> 3)."""
    synthesize_dataset(tmp_path / "old", "brats", cases=1, shape=(12, 10, 8), seed=5, progress=False)
    synthesize_dataset(tmp_path / "new", "brats2023", cases=1, shape=(12, 10, 8), seed=5, progress=False)
    (old,) = discover_cases(tmp_path / "old", "brats")
    (new,) = discover_cases(tmp_path / "new", "brats2023")
    old_image, old_label, _ = read_case(old, "brats")
    new_image, new_label, _ = read_case(new, "brats2023")
    np.testing.assert_array_equal(old_image, new_image)  # t2f/t1n/t1c/t2w hold flair/t1/t1ce/t2
    np.testing.assert_array_equal(np.where(old_label == 4, 3, old_label), new_label)


@pytest.mark.parametrize("layout", ["msd", "brats", "brats2023"])
def test_round_trip_through_discover_and_read(layout: str, tmp_path: Path) -> None:
    ids = synthesize_dataset(tmp_path / layout, layout, cases=2, shape=(12, 10, 8), seed=6, progress=False)
    cases = discover_cases(tmp_path / layout, layout)
    assert [c.case_id for c in cases] == ids
    expected = {"msd": {0, 1, 2, 3}, "brats": {0, 1, 2, 4}, "brats2023": {0, 1, 2, 3}}[layout]
    for case in cases:
        image, label, spacing = read_case(case, layout)
        assert image.shape == (12, 10, 8, 4) and label.shape == (12, 10, 8) and spacing == (1.0, 1.0, 1.0)
        assert set(np.unique(label)) <= expected and label.any()


def test_no_temporary_folders_left(msd_root: Path, brats_root: Path, brats2023_root: Path) -> None:
    for root in (msd_root, brats_root, brats2023_root):
        assert [p.name for p in root.parent.iterdir()] == [root.name]


def test_deterministic_for_a_seed(tmp_path: Path) -> None:
    ids = synthesize_dataset(tmp_path / "a", "brats", cases=2, shape=(12, 12, 12), seed=7, progress=False)
    synthesize_dataset(tmp_path / "b", "brats", cases=2, shape=(12, 12, 12), seed=7, progress=False)
    synthesize_dataset(tmp_path / "c", "brats", cases=2, shape=(12, 12, 12), seed=8, progress=False)
    assert ids == ["BraTS2021_00000", "BraTS2021_00001"]
    read = {name: [read_case(c, "brats") for c in discover_cases(tmp_path / name, "brats")] for name in "abc"}
    for (img_a, lab_a, _), (img_b, lab_b, _), (img_c, _, _) in zip(read["a"], read["b"], read["c"]):
        np.testing.assert_array_equal(img_a, img_b)
        np.testing.assert_array_equal(lab_a, lab_b)
        assert not np.array_equal(img_a, img_c)
    assert not np.array_equal(read["a"][0][0], read["a"][1][0])  # cases differ from each other


def test_tumour_fraction_and_brain(tmp_path: Path) -> None:
    synthesize_dataset(tmp_path / "d", "msd", cases=6, shape=(24, 24, 24), seed=3, progress=False)
    fractions = []
    for case in discover_cases(tmp_path / "d", "msd"):
        image, label, _ = read_case(case, "msd")
        fractions.append(float((label > 0).mean()))
        brain = image[..., 0] > 0
        assert 0.25 < brain.mean() < 0.6  # an ellipsoid "brain" surrounded by zeros
        assert np.array_equal(brain, (image > 0).all(axis=-1))  # same brain mask in every modality
        assert not image[0, 0, 0].any()
        assert brain[label > 0].all()  # the tumour lies inside the brain
    assert all(0.02 <= f <= 0.15 for f in fractions), fractions
    assert max(fractions) - min(fractions) > 0.01  # sizes vary


def test_modality_contrast_inside_tumour(tmp_path: Path) -> None:
    synthesize_dataset(tmp_path / "e", "brats", cases=3, shape=(24, 24, 24), seed=4, progress=False)
    flair, t1, t1ce, t2 = range(4)
    for case in discover_cases(tmp_path / "e", "brats"):
        image, label, _ = read_case(case, "brats")
        healthy = (image[..., 0] > 0) & (label == 0)
        relative = image / np.median(image[healthy], axis=0)  # 1.0 = typical healthy tissue per modality
        edema, enhancing, core = label == 2, label == 4, label == 1

        def mean(region: np.ndarray, m: int) -> float:
            return float(relative[..., m][region].mean())

        assert mean(edema, flair) > 1.4  # FLAIR: edema bright
        assert mean(enhancing, t1ce) > 1.6  # T1gd: enhancing rim very bright
        assert mean(enhancing, t1ce) > 1.5 * mean(enhancing, t1)
        assert mean(edema | enhancing | core, t1) < 0.97  # T1: tumour slightly dark
        assert mean(edema, t2) > 1.4 and mean(core, t2) > 1.4  # T2: edema and core bright
        inside = label > 0
        assert not np.allclose(relative[inside][:, flair], relative[inside][:, t1ce], atol=0.2)


def test_existing_non_empty_root_is_an_error(tmp_path: Path) -> None:
    root = tmp_path / "data"
    root.mkdir()
    synthesize_dataset(root, "msd", cases=1, shape=(8, 8, 8), progress=False)  # an empty folder is fine
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    with pytest.raises(DataError, match="other.*not empty"):
        synthesize_dataset(tmp_path / "other", "msd", cases=1, shape=(8, 8, 8), progress=False)
    assert [p.name for p in (tmp_path / "other").iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("case_maker, layout, kind", [("synthesize_case", "brats", "brain"),
                                                      ("synthesize_ct_case", "nnunet", "ct")])
def test_interrupted_run_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case_maker: str, layout: str,
                                        kind: str) -> None:
    real = getattr(synthetic, case_maker)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(synthetic, case_maker, failing)
    with pytest.raises(KeyboardInterrupt):
        synthesize_dataset(tmp_path / "x", layout, kind=kind, cases=3, shape=(8, 8, 8), progress=False)
    assert calls == [1, 1]  # it was interrupted in its second case
    assert list(tmp_path.iterdir()) == []


def test_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cases"):
        synthesize_dataset(tmp_path / "a", "msd", cases=0, shape=(8, 8, 8), progress=False)
    with pytest.raises(ValueError, match="shape"):
        synthesize_dataset(tmp_path / "a", "msd", cases=1, shape=(8, 8), progress=False)
    with pytest.raises(ValueError, match="layout"):
        synthesize_dataset(tmp_path / "a", "nifti", cases=1, shape=(8, 8, 8), progress=False)
    assert list(tmp_path.iterdir()) == []


def test_progress_bar_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    synthesize_dataset(tmp_path / "p", "msd", cases=2, shape=(8, 8, 8), progress=True)
    captured = capsys.readouterr()
    assert "2/2" in captured.err and captured.out == ""


# --------------------------------------------------------------------------- brain kind: unchanged, nnU-Net layout


def test_brain_output_is_pinned(tmp_path: Path) -> None:
    """The quickstart's data: the brain kind's first case for seed 0, as made before the CT kind existed."""
    synthesize_dataset(tmp_path / "b", "msd", cases=2, shape=(16, 16, 16), seed=0, progress=False)
    image = np.asanyarray(nib.load(str(tmp_path / "b" / "imagesTr" / "BRATS_001.nii.gz")).dataobj)
    label = np.asanyarray(nib.load(str(tmp_path / "b" / "labelsTr" / "BRATS_001.nii.gz")).dataobj)
    assert np.bincount(label.ravel()).tolist() == [3939, 133, 4, 20]
    np.testing.assert_allclose(image.reshape(-1, 4).astype(np.float64).sum(axis=0),
                               [361521.7957458496, 783316.7483215332, 798280.9259338379, 514431.3988189697], rtol=1e-6)
    assert synthesize_dataset(tmp_path / "k", "msd", cases=1, shape=(8, 8, 8), seed=0, progress=False, kind="brain") \
        == ["BRATS_001"]


def test_brain_in_nnunet_layout_is_the_msd_data_one_file_per_channel(tmp_path: Path) -> None:
    ids = synthesize_dataset(tmp_path / "n", "nnunet", cases=2, shape=(12, 10, 8), seed=6, progress=False)
    synthesize_dataset(tmp_path / "m", "msd", cases=2, shape=(12, 10, 8), seed=6, progress=False)
    assert ids == ["BRATS_001", "BRATS_002"]
    meta = json.loads((tmp_path / "n" / "dataset.json").read_text())
    assert meta["channel_names"] == {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"}
    assert meta["labels"] == {"background": 0, "edema": 1, "non-enhancing tumor": 2, "enhancing tumour": 3}
    assert meta["numTraining"] == 2 and meta["file_ending"] == ".nii.gz"
    assert sorted(p.name for p in (tmp_path / "n" / "imagesTr").iterdir()) == [
        f"{c}_{i:04d}.nii.gz" for c in ids for i in range(4)]
    assert sorted(p.name for p in (tmp_path / "n" / "labelsTr").iterdir()) == [f"{c}.nii.gz" for c in ids]
    for case_id in ids:
        msd = nib.load(str(tmp_path / "m" / "imagesTr" / f"{case_id}.nii.gz"))
        for channel in range(4):
            img = nib.load(str(tmp_path / "n" / "imagesTr" / f"{case_id}_{channel:04d}.nii.gz"))
            assert img.shape == (12, 10, 8) and img.get_data_dtype() == np.float32
            np.testing.assert_array_equal(np.asanyarray(img.dataobj), np.asanyarray(msd.dataobj)[..., channel])
        np.testing.assert_array_equal(
            np.asanyarray(nib.load(str(tmp_path / "n" / "labelsTr" / f"{case_id}.nii.gz")).dataobj),
            np.asanyarray(nib.load(str(tmp_path / "m" / "labelsTr" / f"{case_id}.nii.gz")).dataobj))


def test_brain_lps_case_is_flipped_in_place(tmp_path: Path) -> None:
    synthesize_dataset(tmp_path / "ras", "brats", cases=2, shape=(12, 10, 8), seed=2, progress=False)
    synthesize_dataset(tmp_path / "lps", "brats", cases=2, shape=(12, 10, 8), seed=2, progress=False, lps_cases=1)
    for case_id, codes in (("BraTS2021_00000", ("R", "A", "S")), ("BraTS2021_00001", ("L", "P", "S"))):
        for part in ("flair", "seg"):
            ras = nib.load(str(tmp_path / "ras" / case_id / f"{case_id}_{part}.nii.gz"))
            lps = nib.load(str(tmp_path / "lps" / case_id / f"{case_id}_{part}.nii.gz"))
            assert nib.aff2axcodes(lps.affine) == codes
            canonical = nib.as_closest_canonical(lps)
            np.testing.assert_array_equal(np.asanyarray(canonical.dataobj), np.asanyarray(ras.dataobj))
            np.testing.assert_allclose(canonical.affine, ras.affine)


# --------------------------------------------------------------------------- CT kind

CT_SHAPE = (32, 32, 24)
CT_CASES = 4
CT_LABEL_NAMES = {"0": "background", "1": "liver", "2": "spleen", "3": "kidney"}


def _load(path: Path) -> tuple[np.ndarray, nib.Nifti1Image]:
    img = nib.load(str(path))
    return np.asanyarray(img.dataobj), img


@pytest.fixture(scope="module")
def ct_roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same CT data (seed 3, the last case in LPS) in both layouts, and in RAS only (read-only)."""
    base = tmp_path_factory.mktemp("ct")
    for name, layout, lps in (("msd", "msd", 1), ("nnunet", "nnunet", 1), ("ras", "msd", 0)):
        synthesize_dataset(base / name, layout, kind="ct", cases=CT_CASES, shape=CT_SHAPE, seed=3, progress=False,
                           lps_cases=lps)
    return {name: base / name for name in ("msd", "nnunet", "ras")}


def _ct_case(root: Path, case_id: str) -> tuple[np.ndarray, np.ndarray, nib.Nifti1Image]:
    """(image, label, image header) of a CT case in either layout."""
    nnunet = (root / "imagesTr" / f"{case_id}_0000.nii.gz").exists()
    image, img = _load(root / "imagesTr" / (f"{case_id}_0000.nii.gz" if nnunet else f"{case_id}.nii.gz"))
    label, _ = _load(root / "labelsTr" / f"{case_id}.nii.gz")
    return image, label, img


CT_IDS = [f"ct_{i:03d}" for i in range(CT_CASES)]


def test_ct_msd_files_and_dataset_json(ct_roots: dict[str, Path]) -> None:
    root = ct_roots["msd"]
    meta = json.loads((root / "dataset.json").read_text())
    assert meta["modality"] == {"0": "CT"} and meta["labels"] == CT_LABEL_NAMES
    assert meta["numTraining"] == CT_CASES and meta["test"] == [] and meta["name"]
    assert meta["training"] == [{"image": f"./imagesTr/{c}.nii.gz", "label": f"./labelsTr/{c}.nii.gz"} for c in CT_IDS]
    assert sorted(p.name for p in root.iterdir()) == ["dataset.json", "imagesTr", "labelsTr"]
    assert sorted(p.name for p in (root / "imagesTr").iterdir()) == [f"{c}.nii.gz" for c in CT_IDS]
    assert sorted(p.name for p in (root / "labelsTr").iterdir()) == [f"{c}.nii.gz" for c in CT_IDS]
    for case_id in CT_IDS:
        image, label, img = _ct_case(root, case_id)
        assert image.shape == CT_SHAPE and img.get_data_dtype() == np.int16  # 3-D: one channel
        assert label.shape == CT_SHAPE and label.dtype == np.uint8


def test_ct_nnunet_files_and_dataset_json(ct_roots: dict[str, Path]) -> None:
    root = ct_roots["nnunet"]
    assert json.loads((root / "dataset.json").read_text()) == {
        "name": "SyntheticCT",
        "description": "Synthetic CT-like abdomen (liver, spleen, kidney) data in the nnU-Net v2 raw layout (distmis)",
        "channel_names": {"0": "CT"},
        "labels": {"background": 0, "liver": 1, "spleen": 2, "kidney": 3},
        "numTraining": CT_CASES,
        "file_ending": ".nii.gz",
    }
    assert sorted(p.name for p in (root / "imagesTr").iterdir()) == [f"{c}_0000.nii.gz" for c in CT_IDS]
    assert sorted(p.name for p in (root / "labelsTr").iterdir()) == [f"{c}.nii.gz" for c in CT_IDS]
    for case_id in CT_IDS:  # the same data as the MSD layout's, file by file
        image, label, img = _ct_case(root, case_id)
        msd_image, msd_label, msd_img = _ct_case(ct_roots["msd"], case_id)
        assert image.shape == CT_SHAPE and img.get_data_dtype() == np.int16
        np.testing.assert_array_equal(image, msd_image)
        np.testing.assert_array_equal(label, msd_label)
        np.testing.assert_array_equal(img.affine, msd_img.affine)


def test_ct_every_case_has_every_class(ct_roots: dict[str, Path]) -> None:
    for case_id in CT_IDS:
        _, label, _ = _ct_case(ct_roots["msd"], case_id)
        counts = np.bincount(label.ravel(), minlength=4)
        assert len(counts) == 4 and (counts[1:] >= 20).all(), (case_id, counts)
        assert counts[1] > counts[2] and counts[1] > counts[3]  # the liver is the large organ


def test_ct_intensities_are_hounsfield_like(ct_roots: dict[str, Path]) -> None:
    from scipy import ndimage

    in_plane = np.zeros((3, 3, 1), dtype=bool)
    in_plane[1, :, 0] = in_plane[:, 1, 0] = True
    medians = []
    for case_id in CT_IDS:
        image, label, _ = _ct_case(ct_roots["ras"], case_id)
        corners = image[:2, :2, :]  # air, outside the body
        assert -1010 <= np.median(corners) <= -990 and 5 <= corners.std() <= 18  # noise of 8-15 HU
        assert image.min() >= -1024 and image.max() >= 400  # bone
        body = image > -500
        assert 0.2 < body.mean() < 0.8
        assert ((image[body] > -150) & (image[body] < -50)).mean() > 0.03  # fat
        assert ((image[body] >= 20) & (image[body] <= 60)).mean() > 0.1  # soft tissue
        interior = [np.median(image[ndimage.binary_erosion(label == k, in_plane)]) for k in (1, 2, 3)]
        medians.append(interior)
        # contrast-enhanced, portal venous phase: liver about 105, spleen about 125, kidney about 160 HU
        assert 85 <= interior[0] <= 125 and 105 <= interior[1] <= 145 and 135 <= interior[2] <= 190, (case_id, interior)
        assert np.percentile(image[label == 3], 90) > 180  # the kidney's brighter cortex
    liver, spleen, kidney = np.mean(medians, axis=0)
    assert liver + 10 < spleen < kidney - 10


def test_ct_spacings_are_anisotropic_and_differ_between_cases(ct_roots: dict[str, Path]) -> None:
    spacings = []
    for case_id in CT_IDS:
        _, _, img = _ct_case(ct_roots["ras"], case_id)
        zooms = img.header.get_zooms()
        assert zooms[0] == zooms[1] and 0.7 <= zooms[0] <= 1.0 and 1.5 <= zooms[2] <= 3.0
        np.testing.assert_allclose(np.linalg.norm(img.affine[:3, :3], axis=0), zooms, rtol=1e-6)
        assert img.header["qform_code"] == img.header["sform_code"] == 1
        spacings.append(zooms)
    assert len(set(spacings)) == CT_CASES


def _world_centroids(label: np.ndarray, affine: np.ndarray) -> np.ndarray:
    """World (mm) centroid of each class 1-3, as rows."""
    return np.array([(affine @ np.append(np.argwhere(label == k).mean(axis=0), 1.0))[:3] for k in (1, 2, 3)])


def test_ct_lps_case_keeps_its_world_anatomy(ct_roots: dict[str, Path]) -> None:
    for case_id in CT_IDS:
        image, label, img = _ct_case(ct_roots["msd"], case_id)
        ras_image, ras_label, ras_img = _ct_case(ct_roots["ras"], case_id)
        assert nib.aff2axcodes(ras_img.affine) == ("R", "A", "S")
        if case_id != CT_IDS[-1]:
            np.testing.assert_array_equal(image, ras_image)
            continue
        assert nib.aff2axcodes(img.affine) == ("L", "P", "S")
        np.testing.assert_array_equal(image, ras_image[::-1, ::-1])
        np.testing.assert_allclose(_world_centroids(label, img.affine), _world_centroids(ras_label, ras_img.affine),
                                   atol=1e-4)  # mm; the header stores the affine as float32
        # every RAS voxel centre lands, through the LPS file's affine, on a voxel with the same label
        ijk = np.indices(CT_SHAPE).reshape(3, -1)
        world = ras_img.affine @ np.vstack([ijk, np.ones(ijk.shape[1])])
        lps_ijk = np.rint(np.linalg.solve(img.affine, world)[:3]).astype(int)
        np.testing.assert_array_equal(label[tuple(lps_ijk)], ras_label[tuple(ijk)])
        canonical = nib.as_closest_canonical(img)
        np.testing.assert_array_equal(np.asanyarray(canonical.dataobj), ras_image)
        np.testing.assert_allclose(canonical.affine, ras_img.affine)


def test_ct_anatomy_is_laid_out_in_world_coordinates(ct_roots: dict[str, Path]) -> None:
    """Whatever a case's spacing, its organs sit at about the same place in the world (in units of the frame)."""
    frame = np.array(CT_SHAPE) * np.array(synthetic.CT_FRAME_SPACING)
    centroids = []
    for case_id in CT_IDS:
        _, label, img = _ct_case(ct_roots["msd"], case_id)
        liver, spleen, kidney = _world_centroids(label, img.affine) / frame
        assert liver[0] > 0.05 and spleen[0] < -0.1  # RAS world: the liver on the patient's right (+x)
        assert kidney[1] < liver[1] and kidney[2] < liver[2]  # kidneys behind and below the liver
        centroids.append((liver, spleen))
    spread = np.ptp(np.array(centroids), axis=0)
    assert spread.max() < 0.12, spread  # about the same place in every case, in spite of their spacings


def test_ct_deterministic_for_a_seed(ct_roots: dict[str, Path], tmp_path: Path) -> None:
    synthesize_dataset(tmp_path / "same", "msd", kind="ct", cases=2, shape=CT_SHAPE, seed=3, progress=False)
    synthesize_dataset(tmp_path / "other", "msd", kind="ct", cases=2, shape=CT_SHAPE, seed=4, progress=False)
    for case_id in CT_IDS[:2]:
        image, label, img = _ct_case(ct_roots["ras"], case_id)
        same_image, same_label, same_img = _ct_case(tmp_path / "same", case_id)
        other_image, _, other_img = _ct_case(tmp_path / "other", case_id)
        np.testing.assert_array_equal(image, same_image)
        np.testing.assert_array_equal(label, same_label)
        np.testing.assert_array_equal(img.affine, same_img.affine)
        assert not np.array_equal(image, other_image)
        assert img.header.get_zooms() != other_img.header.get_zooms()


@pytest.mark.parametrize("layout", ["msd", "nnunet"])
def test_ct_reads_back_through_its_dataset_json(ct_roots: dict[str, Path], layout: str) -> None:
    from distmis.data.dataset_layouts import describe_dataset

    description = describe_dataset(ct_roots[layout], layout)
    assert description.channels == ("CT",)
    assert description.classes == (("background", 0), ("liver", 1), ("spleen", 2), ("kidney", 3))
    cases = discover_cases(ct_roots[layout], layout)
    assert [c.case_id for c in cases] == CT_IDS
    for case in cases:
        image, label, spacing = read_case(case, description)
        raw_image, raw_label, img = _ct_case(ct_roots[layout], case.case_id)
        assert image.shape == CT_SHAPE + (1,)
        np.testing.assert_array_equal(image[..., 0], raw_image)
        np.testing.assert_array_equal(label, raw_label)
        np.testing.assert_allclose(spacing, img.header.get_zooms(), rtol=1e-6)


@pytest.mark.parametrize("layout", ["brats", "brats2023"])
def test_ct_in_a_brats_layout_is_refused(layout: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=rf"kind 'ct' cannot be written in layout '{layout}'.*'msd', 'nnunet'"):
        synthesize_dataset(tmp_path / "x", layout, kind="ct", cases=1, shape=(8, 8, 8), progress=False)
    assert list(tmp_path.iterdir()) == []


def test_kind_and_lps_cases_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kind 'mri'.*'brain', 'ct'"):
        synthesize_dataset(tmp_path / "x", "msd", kind="mri", cases=1, shape=(8, 8, 8), progress=False)
    for lps_cases in (-1, 3):
        with pytest.raises(ValueError, match=rf"lps_cases must be between 0 and cases \(2\), got {lps_cases}"):
            synthesize_dataset(tmp_path / "x", "msd", kind="ct", cases=2, shape=(8, 8, 8), progress=False,
                               lps_cases=lps_cases)
    assert list(tmp_path.iterdir()) == []


def test_ct_tiny_volume_still_has_every_class(tmp_path: Path) -> None:
    synthesize_dataset(tmp_path / "t", "nnunet", kind="ct", cases=2, shape=(8, 8, 8), seed=0, progress=False)
    for case_id in ("ct_000", "ct_001"):
        _, label, _ = _ct_case(tmp_path / "t", case_id)
        assert set(np.unique(label)) == {0, 1, 2, 3}
