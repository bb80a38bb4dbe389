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


def test_interrupted_run_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = synthetic.synthesize_case
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(synthetic, "synthesize_case", failing)
    with pytest.raises(KeyboardInterrupt):
        synthesize_dataset(tmp_path / "x", "brats", cases=3, shape=(8, 8, 8), progress=False)
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
