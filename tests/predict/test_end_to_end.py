"""From a search to segmentations of scans it never saw: the registered model, applied by ``distmis predict``,
scored by reading the written NIfTI files back with nibabel, independently of distmis; and the same model loaded
by MLflow in a process that cannot import distmis, giving the same label maps (a TensorFlow search; a torch one:
tests/search/test_ct_dataset.py)."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from distmis.cli.main import main
from distmis.data.synthetic import synthesize_dataset
from distmis.predict.resolve import model_folder
from distmis.search.run import run_search
from distmis.spec import validate_spec
from tests.predict.test_pyfunc import assert_python_function_from_code, run_without_distmis


def quickstart_like(data: Path, framework: str = "tensorflow") -> dict:
    """search_spaces/quickstart.yaml's synthetic data (at 32^3, not 64^3, to keep the test short), model (one
    level fewer for the smaller volume) and training, with its best trial's values alone; ``framework``: the
    U-Net's."""
    return {
        "name": "e2e" if framework == "tensorflow" else f"e2e-{framework}",
        "dataset": {"path": str(data), "layout": "msd", "labels": "whole-tumour",
                    "split": {"train": 0.7, "val": 0.15, "test": 0.15, "seed": 0},
                    "synthetic": {"cases": 12, "shape": [32, 32, 32], "seed": 0}},
        "model": {"name": "unet3d", "framework": framework,
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


def search(framework: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, object]:
    """One tiny search (one trial of 32^3 volumes) and three held-out scans: ``(framework, folder, outcome)``, the
    held-out data in ``folder / "heldout"``."""
    folder = tmp_path_factory.mktemp(f"search-{framework}")
    outcome = run_search(validate_spec(quickstart_like(folder / "data", framework)), folder / "out", progress=False)
    assert outcome.failed == 0 and outcome.model is not None and outcome.model.best
    synthesize_dataset(folder / "heldout", "msd", cases=3, shape=(32, 32, 32), seed=7, progress=False)
    return framework, folder, outcome


@pytest.fixture(scope="module")
def tensorflow_search(ray_local, tmp_path_factory) -> tuple[str, Path, object]:
    return search("tensorflow", tmp_path_factory)


@pytest.mark.slow  # one trial (8 epochs of 32^3 volumes) and two predictions: about 2 minutes
def test_a_searched_model_segments_held_out_scans(tensorflow_search, tmp_path: Path, capsys):
    framework, folder, outcome = tensorflow_search
    images, labels = folder / "heldout" / "imagesTr", folder / "heldout" / "labelsTr"

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
    assert main(["predict", str(folder / "out"), str(images), "--output", str(tmp_path / "by-folder"), "--quiet"]) == 0
    for case in dice:
        same = [np.asarray(nib.load(str(tmp_path / d / f"{case}_seg.nii.gz")).dataobj) for d in ("by-alias", "by-folder")]
        np.testing.assert_array_equal(*same)


@pytest.mark.slow  # the search of the fixture, distmis predict, and a fresh Python loading the model: about 1 minute
def test_the_registered_model_predicts_without_distmis_as_distmis_predict_does(tensorflow_search, tmp_path: Path):
    """The Keras model (a torch one, multi-class, on scans stored LPS:
    tests/search/test_ct_dataset.py::test_the_ct_model_predicts_without_distmis_as_distmis_predict_does)."""
    framework, folder, outcome = tensorflow_search
    model_uri = "models:/e2e@best"
    with model_folder(model_uri, outcome.tracking_uri) as local:  # the registered model, as logged
        assert_python_function_from_code(local)
        assert (local / "artifacts" / "model.keras").is_file()
        requirements = {r.split("==")[0] for r in (local / "requirements.txt").read_text().split()}
        assert requirements >= {"tensorflow", "keras"}

    images = folder / "heldout" / "imagesTr"
    assert main(["predict", model_uri, str(images), "--output", str(tmp_path / "segs"),
                 "--tracking-uri", outcome.tracking_uri, "--quiet"]) == 0
    cases = sorted(images.glob("*.nii.gz"))
    (tmp_path / "elsewhere").mkdir()
    run_without_distmis(model_uri, outcome.tracking_uri, [str(c) for c in cases], tmp_path / "labels",
                        tmp_path / "elsewhere")
    found = 0
    for case in cases:
        stem = case.name.removesuffix(".nii.gz")
        written = np.asarray(nib.load(str(tmp_path / "segs" / f"{stem}_seg.nii.gz")).dataobj)
        predicted = np.load(tmp_path / "labels" / f"{stem}.npy")
        assert predicted.dtype == np.uint8 and predicted.shape == written.shape
        assert np.array_equal(predicted, written), f"{framework} {stem}: {(predicted != written).sum()} voxels differ"
        found += int(predicted.any())
    assert found >= 1  # some tumour found: the comparison is not of empty label maps alone
    assert found == len(cases)  # the quickstart's model finds every tumour
