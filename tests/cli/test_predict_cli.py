"""``distmis predict`` on the command line: segmentations written, dice printed, bad input refused with exit 2."""

from __future__ import annotations

import gzip
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from distmis.cli.main import main
from distmis.predict.registry import save_model
from tests.predict.test_segment import ROTATED, bright_case, bright_model, write_msd_case


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    model = bright_model("regions")
    return save_model([model.network], model.recipe, tmp_path / "model")


def brats2023_case(root: Path, case_id: str, shape=(14, 12, 10), skip: str | None = None) -> Path:
    image, label = bright_case(shape, seed=5)
    folder = root / case_id
    folder.mkdir(parents=True)
    for index, name in enumerate(("t2f", "t1n", "t1c", "t2w")):
        if name != skip:
            nib.save(nib.Nifti1Image(image[..., index], ROTATED), str(folder / f"{case_id}-{name}.nii.gz"))
    nib.save(nib.Nifti1Image(label, ROTATED), str(folder / f"{case_id}-seg.nii.gz"))  # 1 ncr, 2 ed, 3 et: as MSD's
    return folder


def test_predict_a_brats2023_data_set_prints_dice_and_a_summary(tmp_path: Path, model_dir: Path, capsys):
    root = tmp_path / "brats2023"
    for index in range(2):
        brats2023_case(root, f"BraTS-GLI-0000{index}-000")
    code = main(["predict", str(model_dir), str(root), "--output", str(tmp_path / "out"), "--labels", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "BraTS-GLI-00000-000" in out and "dice_ET" in out and "segmented 2 case(s) in" in out
    seg = np.asarray(nib.load(str(tmp_path / "out" / "BraTS-GLI-00001-000_seg.nii.gz")).dataobj)
    truth = np.asarray(nib.load(str(root / "BraTS-GLI-00001-000" / "BraTS-GLI-00001-000-seg.nii.gz")).dataobj)
    # BraTS 2023's own values: 2 edema, 1 core, 3 enhancing (the synthetic labels swap 1 and 2 of MSD's)
    expected = np.select([truth == 3, truth == 2, truth == 1], [3, 1, 2], 0)
    np.testing.assert_array_equal(seg, expected)


def test_predict_one_msd_image_file(tmp_path: Path, model_dir: Path, capsys):
    write_msd_case(tmp_path / "data", "BRATS_042", (15, 13, 11), ROTATED, seed=6)
    image = tmp_path / "data" / "imagesTr" / "BRATS_042.nii.gz"
    assert main(["predict", str(model_dir), str(image), "--output", str(tmp_path / "out"), "--quiet"]) == 0
    written = nib.load(str(tmp_path / "out" / "BRATS_042_seg.nii.gz"))
    assert written.shape == (15, 13, 11) and np.allclose(written.affine, ROTATED)
    assert "segmented 1 case(s)" in capsys.readouterr().out


def bad_inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    missing = brats2023_case(tmp_path / "missing", "BraTS-GLI-00005-000", skip="t1c")
    not_nifti = tmp_path / "notnifti" / "scan.nii.gz"
    not_nifti.parent.mkdir()
    not_nifti.write_bytes(gzip.compress(b"this is not a NIfTI header at all" * 20))
    three_channels = tmp_path / "three" / "BRATS_003.nii.gz"
    three_channels.parent.mkdir()
    nib.save(nib.Nifti1Image(np.ones((8, 8, 8, 3), np.float32), np.eye(4)), str(three_channels))
    flat = tmp_path / "flat" / "BRATS_004.nii.gz"
    flat.parent.mkdir()
    nib.save(nib.Nifti1Image(np.ones((8, 8), np.float32), np.eye(4)), str(flat))
    mixed = tmp_path / "mixed"  # a good case first, then one whose image has 3 channels
    write_msd_case(mixed, "BRATS_001", (12, 12, 12), np.eye(4), seed=0)
    nib.save(nib.Nifti1Image(np.ones((12, 12, 12, 3), np.float32), np.eye(4)), str(mixed / "imagesTr" / "BRATS_002.nii.gz"))
    return {
        "one bad case of two": (mixed / "imagesTr", "BRATS_002.nii.gz"),
        "missing modality": (missing, "BraTS-GLI-00005-000-t1c.nii.gz"),
        "not NIfTI": (not_nifti, "scan.nii.gz"),
        "three channels": (three_channels, "BRATS_003.nii.gz"),
        "two dimensions": (flat, "BRATS_004.nii.gz"),
    }


@pytest.mark.parametrize("case", ["missing modality", "not NIfTI", "three channels", "two dimensions",
                                  "one bad case of two"])
def test_bad_input_exits_2_naming_the_culprit_and_writes_nothing(tmp_path: Path, model_dir: Path, capsys, case):
    path, culprit = bad_inputs(tmp_path)[case]
    code = main(["predict", str(model_dir), str(path), "--output", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert culprit in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("model,culprit", [
    ("models:/nobody@best", "does not resolve"),
    ("absent-folder", "no such folder"),
])
def test_a_model_that_does_not_resolve_exits_2(tmp_path: Path, capsys, model, culprit):
    write_msd_case(tmp_path / "data", "BRATS_001", (12, 12, 12), np.eye(4), seed=0)
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()  # an empty store
    code = main(["predict", model if model.startswith("models:") else str(tmp_path / model),
                 str(tmp_path / "data" / "imagesTr"), "--output", str(tmp_path / "out"), "--tracking-uri", uri])
    err = capsys.readouterr().err
    assert code == 2 and culprit in err and model.split("@")[0].removeprefix("models:/") in err
    assert not (tmp_path / "out").exists()
