"""``distmis predict`` refuses bad input before it loads the model or writes a file (issue 32, item 7).

Real NIfTI files and a real saved model (:class:`tests.predict.nets.BrightFlair`); the command runs in-process
through :func:`distmis.cli.main.main`, as a user runs it.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from distmis.cli.main import main
from distmis.predict.registry import save_model
from tests.predict.test_segment import bright_model, write_msd_case


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    model = bright_model()
    return save_model([model.network], model.recipe, tmp_path / "model")


def msd_images(root: Path, count: int = 3, shape: tuple[int, int, int] = (12, 12, 12)) -> Path:
    for index in range(count):
        write_msd_case(root, f"BRATS_00{index + 1}", shape, np.eye(4), seed=index)
    return root / "imagesTr"


def written(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*")) if folder.exists() else []


# --------------------------------------------------------------------------- --output
@pytest.mark.parametrize("where", ["the folder itself", "a parent"])
def test_an_output_that_is_a_file_exits_2_naming_it(tmp_path: Path, model_dir: Path, capsys, where):
    images = msd_images(tmp_path / "data", count=1)
    blocker = tmp_path / "out.txt"
    blocker.write_text("not a folder")
    output = blocker if where == "the folder itself" else blocker / "segs"
    code = main(["predict", str(model_dir), str(images), "--output", str(output), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and str(blocker) in err and "--output" in err and "folder" in err
    assert blocker.read_text() == "not a folder"  # untouched


def test_an_output_under_a_read_only_folder_exits_2_naming_it(tmp_path: Path, model_dir: Path, capsys):
    """Read-only for every user, root included: mode 555 and the immutable attribute (``chattr +i``)."""
    import subprocess

    images = msd_images(tmp_path / "data", count=1)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    assert subprocess.run(["chattr", "+i", str(locked)]).returncode == 0, "chattr +i needs CAP_LINUX_IMMUTABLE"
    try:
        code = main(["predict", str(model_dir), str(images), "--output", str(locked / "segs"), "--quiet"])
        err = capsys.readouterr().err
        assert code == 2, err
        assert str(locked) in err and "writ" in err and "Traceback" not in err
        assert written(locked) == []
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=True)
        locked.chmod(0o755)


# --------------------------------------------------------------------------- voxel data
def truncate(path: Path, keep: float = 0.6) -> None:
    """Cut a .nii.gz file: nibabel still reads its header, its voxel data is short."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_a_truncated_third_scan_is_refused_before_the_first_segmentation(tmp_path: Path, model_dir: Path, capsys):
    images = msd_images(tmp_path / "data", count=3, shape=(24, 24, 24))
    cut = images / "BRATS_003.nii.gz"
    truncate(cut)
    nib.load(str(cut)).header.get_data_shape()  # the header is fine: only the voxel data is cut
    out = tmp_path / "out"
    code = main(["predict", str(model_dir), str(images), "--output", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert str(cut) in err and "Traceback" not in err
    assert written(out) == []


def test_a_scan_holding_nan_is_refused_before_the_first_segmentation(tmp_path: Path, model_dir: Path, capsys):
    images = msd_images(tmp_path / "data", count=2)
    bad = images / "BRATS_002.nii.gz"
    data = np.asarray(nib.load(str(bad)).dataobj).copy()
    data[3, 4, 5, 1] = np.nan
    nib.save(nib.Nifti1Image(data, np.eye(4)), str(bad))
    out = tmp_path / "out"
    code = main(["predict", str(model_dir), str(images), "--output", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and str(bad) in err and "NaN" in err, err
    assert written(out) == []


def test_a_corrupt_gzip_stream_is_refused_naming_the_file(tmp_path: Path, model_dir: Path, capsys):
    """The whole file is there but a byte of its compressed data is flipped: the gzip check (CRC) catches it."""
    images = msd_images(tmp_path / "data", count=2, shape=(24, 24, 24))
    bad = images / "BRATS_002.nii.gz"
    raw = bytearray(bad.read_bytes())
    raw[-12] ^= 0xFF  # inside the deflate stream, near its end
    bad.write_bytes(bytes(raw))
    out = tmp_path / "out"
    code = main(["predict", str(model_dir), str(images), "--output", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and str(bad) in err and "Traceback" not in err, err
    assert written(out) == []


def test_a_truncated_label_is_refused_before_scoring_starts(tmp_path: Path, model_dir: Path, capsys):
    images = msd_images(tmp_path / "data", count=2, shape=(24, 24, 24))
    label = tmp_path / "data" / "labelsTr" / "BRATS_002.nii.gz"
    # Incompressible label data, so that cutting the file cuts the voxels and not only the gzip trailer.
    shape = (24, 24, 24)
    nib.save(nib.Nifti1Image(np.random.default_rng(0).integers(0, 4, shape).astype(np.int16), np.eye(4)), str(label))
    truncate(label, keep=0.5)
    out = tmp_path / "out"
    code = main(["predict", str(model_dir), str(images), "--output", str(out), "--labels", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and str(label) in err and "Traceback" not in err, err
    assert written(out) == []


def test_an_uncompressed_scan_cut_short_is_refused(tmp_path: Path, model_dir: Path, capsys):
    images = msd_images(tmp_path / "data", count=1, shape=(12, 12, 12))
    plain = images / "BRATS_002.nii"
    nib.save(nib.load(str(images / "BRATS_001.nii.gz")), str(plain))
    plain.write_bytes(plain.read_bytes()[:-100])
    out = tmp_path / "out"
    code = main(["predict", str(model_dir), str(images), "--output", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and str(plain) in err and "Traceback" not in err, err
    assert written(out) == []


def test_good_scans_still_segment_after_the_checks(tmp_path: Path, model_dir: Path, capsys):
    images = msd_images(tmp_path / "data", count=2)
    with gzip.open(images / "BRATS_001.nii.gz") as f:  # a whole, valid gzip stream
        f.read()
    code = main(["predict", str(model_dir), str(images), "--output", str(tmp_path / "out"), "--quiet"])
    assert code == 0, capsys.readouterr().err
    assert written(tmp_path / "out") == ["BRATS_001_seg.nii.gz", "BRATS_002_seg.nii.gz"]
