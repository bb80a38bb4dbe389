"""``distmis data synth``: the kinds, layouts and LPS cases, and the combinations it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from distmis.cli.main import main


@pytest.mark.parametrize("layout, image_names", [
    ("nnunet", ["ct_000_0000.nii.gz", "ct_001_0000.nii.gz", "ct_002_0000.nii.gz"]),
    ("msd", ["ct_000.nii.gz", "ct_001.nii.gz", "ct_002.nii.gz"]),
])
def test_synth_ct(tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str, image_names: list[str]) -> None:
    out = tmp_path / "ct"
    code = main(["data", "synth", str(out), "--layout", layout, "--kind", "ct", "--cases", "3", "--shape", "16,16,12",
                 "--seed", "1", "--lps-cases", "1", "--quiet"])
    assert code == 0
    assert capsys.readouterr().out.strip() == (f"wrote 3 synthetic ct cases in the {layout} layout to {out}, "
                                               f"the last 1 in LPS orientation")
    meta = json.loads((out / "dataset.json").read_text())
    assert (meta["channel_names"] if layout == "nnunet" else meta["modality"]) == {"0": "CT"}
    assert sorted(p.name for p in (out / "imagesTr").iterdir()) == image_names
    codes = [nib.aff2axcodes(nib.load(str(out / "imagesTr" / name)).affine) for name in image_names]
    assert codes == [("R", "A", "S"), ("R", "A", "S"), ("L", "P", "S")]
    label = np.asanyarray(nib.load(str(out / "labelsTr" / "ct_002.nii.gz")).dataobj)
    assert set(np.unique(label)) == {0, 1, 2, 3}


def test_synth_brain_is_the_default_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "brain"
    assert main(["data", "synth", str(out), "--layout", "nnunet", "--cases", "1", "--shape", "8,8,8", "--quiet"]) == 0
    assert "1 synthetic brain cases in the nnunet layout" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "imagesTr").iterdir()) == [f"BRATS_001_{i:04d}.nii.gz" for i in range(4)]


@pytest.mark.parametrize("argv, message", [
    (["--layout", "brats", "--kind", "ct"], "kind 'ct' cannot be written in layout 'brats'; kind 'ct' is written in "
                                            "layouts 'msd', 'nnunet'"),
    (["--layout", "brats2023", "--kind", "ct"], "layout 'brats2023'"),
    (["--kind", "ct", "--cases", "3", "--lps-cases", "4"], "--lps-cases 4 is more than --cases 3"),
])
def test_synth_bad_combination_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                       message: str) -> None:
    out = tmp_path / "out"
    assert main(["data", "synth", str(out), "--shape", "8,8,8", "--quiet", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, culprit", [
    (["--lps-cases", "-1"], "--lps-cases"),
    (["--kind", "mri"], "--kind"),
])
def test_synth_bad_argument_values_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                          culprit: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["data", "synth", str(tmp_path / "out"), *argv])
    assert exit_info.value.code == 2
    assert culprit in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
