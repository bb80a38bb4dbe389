"""From a search to segmentations of scans it never saw: the registered model, applied by ``distmis predict``,
scored by reading the written NIfTI files back with nibabel, independently of distmis."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from distmis.cli.main import main
from distmis.data.synthetic import synthesize_dataset
from distmis.search.run import run_search
from distmis.spec import validate_spec


def quickstart_like(data: Path) -> dict:
    """search_spaces/quickstart.yaml's synthetic data (at 32^3, not 64^3, to keep the test short), model (one
    level fewer for the smaller volume) and training, with its best trial's values alone."""
    return {
        "name": "e2e",
        "dataset": {"path": str(data), "layout": "msd", "labels": "whole-tumour",
                    "split": {"train": 0.7, "val": 0.15, "test": 0.15, "seed": 0},
                    "synthetic": {"cases": 12, "shape": [32, 32, 32], "seed": 0}},
        "model": {"name": "unet3d", "framework": "tensorflow",
                  "params": {"base_filters": 8, "levels": 3, "norm": "group"}},
        "training": {"epochs": 8, "batch_size": 2, "optimizer": {"lr": 5.0e-3}, "seed": 0},
        "search": {"algorithm": "grid", "space": {"training.optimizer.lr": {"grid": [5.0e-3]}}},
        "parallelism": {"resources_per_trial": {"cpu": 1}},
    }


def dice_from_files(segmentations: Path, labels: Path) -> dict[str, float]:
    out = {}
    for label_file in sorted(labels.glob("*.nii.gz")):
        case = label_file.name.removesuffix(".nii.gz")
        truth = np.asarray(nib.load(str(label_file)).dataobj) > 0
        found = np.asarray(nib.load(str(segmentations / f"{case}_seg.nii.gz")).dataobj) > 0
        out[case] = 2 * float((truth & found).sum()) / float(truth.sum() + found.sum())
    return out


@pytest.mark.slow  # one trial (8 epochs of 32^3 volumes) and two predictions: about 2 minutes
def test_a_searched_model_segments_held_out_scans(ray_local, tmp_path: Path, capsys):
    outcome = run_search(validate_spec(quickstart_like(tmp_path / "data")), tmp_path / "out", progress=False)
    assert outcome.failed == 0 and outcome.model is not None and outcome.model.best
    synthesize_dataset(tmp_path / "heldout", "msd", cases=3, shape=(32, 32, 32), seed=7, progress=False)
    images, labels = tmp_path / "heldout" / "imagesTr", tmp_path / "heldout" / "labelsTr"

    # by the registry's alias, from the search's tracking store
    code = main(["predict", "models:/e2e@best", str(images), "--output", str(tmp_path / "by-alias"),
                 "--tracking-uri", outcome.tracking_uri, "--labels", "--quiet"])
    printed = capsys.readouterr().out
    assert code == 0 and "segmented 3 case(s)" in printed and "dice_WT" in printed
    dice = dice_from_files(tmp_path / "by-alias", labels)
    assert len(dice) == 3 and np.mean(list(dice.values())) >= 0.8, dice
    for case in dice:
        written, scan = (nib.load(str(p)) for p in (tmp_path / "by-alias" / f"{case}_seg.nii.gz", images / f"{case}.nii.gz"))
        assert written.shape == scan.shape[:3] and np.allclose(written.affine, scan.affine)

    # the same model from the search's output folder: the same segmentations
    assert main(["predict", str(tmp_path / "out"), str(images), "--output", str(tmp_path / "by-folder"), "--quiet"]) == 0
    for case in dice:
        same = [np.asarray(nib.load(str(tmp_path / d / f"{case}_seg.nii.gz")).dataobj) for d in ("by-alias", "by-folder")]
        np.testing.assert_array_equal(*same)
