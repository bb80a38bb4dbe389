"""Any data set, not only brain tumours: a synthetic CT-like data set (one channel, three organ classes, anisotropic
spacings that differ between cases, cases stored LPS) searched end to end through ``distmis run``, in the nnU-Net
layout with the torch U-Net and in the MSD layout with the Keras one: per-class dice under the data set's names
every epoch, the test split scored per class, the model registered, and ``distmis predict`` writing label maps in
each scan's own geometry with the data set's label values."""

from __future__ import annotations

from pathlib import Path

import mlflow
import nibabel as nib
import numpy as np
import pytest
import yaml

from distmis.cli.main import main
from distmis.data.synthetic import synthesize_dataset
from distmis.data.tfrecord import read_manifest
from distmis.search.state import SearchState

CLASSES = ("liver", "spleen", "kidney")


def ct_spec(data: Path, layout: str, framework: str) -> dict:
    """search_spaces/quickstart_ct.yaml, smaller: 8 cases of 32 x 32 x 24, one trial of 2 epochs, with augmentation;
    the torch trial on a curriculum (a foreground-centred 16^3 tile, then the whole volume), the Keras one on tiles
    (half of them centred on an organ)."""
    training = {"tile": [16, 16, 16], "tile_sampling": 0.5}
    if framework == "torch":
        training = {"tile": None, "curriculum": [{"tile": [16, 16, 16], "epochs": 1, "tile_sampling": 1.0},
                                                 {"tile": None, "epochs": 1}]}
    return {
        "name": f"ct-{layout}-{framework}",
        "dataset": {"path": str(data), "layout": layout, "labels": "classes", "orientation": "RAS",
                    "spacing": "auto", "crop": [32, 32, 32],
                    "split": {"train": 0.5, "val": 0.25, "test": 0.25, "seed": 0},
                    "synthetic": {"cases": 8, "shape": [32, 32, 24], "seed": 1, "kind": "ct", "lps_cases": 2}},
        "model": {"name": "unet3d", "framework": framework, "params": {"base_filters": 4, "levels": 3,
                                                                       "norm": "group"}},
        "training": {"epochs": 2, "batch_size": 2, **training, "augment": {"enabled": True},
                     "optimizer": {"lr": 5.0e-3}, "loss": {"name": "dice-ce"}, "seed": 0},
        "search": {"algorithm": "grid", "space": {"training.optimizer.lr": {"grid": [5.0e-3]}}},
        "parallelism": {"resources_per_trial": {"cpu": 1}},
    }


def search(layout: str, framework: str, factory: pytest.TempPathFactory) -> tuple[Path, SearchState]:
    folder = factory.mktemp(f"ct-{layout}-{framework}")
    spec = folder / "spec.yaml"
    spec.write_text(yaml.safe_dump(ct_spec(folder / "data", layout, framework)))
    assert main(["run", str(spec), "--output", str(folder / "out")]) == 0
    synthesize_dataset(folder / "heldout", layout, cases=2, shape=(40, 36, 20), seed=9, kind="ct", lps_cases=1,
                       progress=False)
    state = SearchState.load(folder / "out")
    assert state is not None and state.status == "finished"
    return folder, state


@pytest.fixture(scope="module")
def ct_search(ray_local, tmp_path_factory):
    """``ct_search(layout, framework)``: that search, run once for the module (its folder and state)."""
    done: dict[tuple[str, str], tuple[Path, SearchState]] = {}

    def get(layout: str, framework: str) -> tuple[Path, SearchState]:
        if (layout, framework) not in done:
            done[layout, framework] = search(layout, framework, tmp_path_factory)
        return done[layout, framework]

    return get


def runs_of(state: SearchState) -> tuple[mlflow.entities.Run, list[mlflow.entities.Run]]:
    client = mlflow.MlflowClient(state.tracking_store)
    search_run = client.get_run(state.run_id)
    trials = client.search_runs([search_run.info.experiment_id],
                                filter_string=f"tags.mlflow.parentRunId = '{state.run_id}'")
    return search_run, trials


@pytest.mark.slow  # two tiny searches (one trial of 2 epochs each) and their predictions
# Each layout once, each framework once: the data's preparation does not depend on the framework, nor the trainers
# on the layout the cases came in (every layout's discovery, description and scans: tests/data/).
@pytest.mark.parametrize(("layout", "framework"), [("nnunet", "torch"), ("msd", "tensorflow")])
def test_a_ct_search_trains_scores_registers_and_predicts_per_class(layout, framework, ct_search, tmp_path: Path):
    folder, state = ct_search(layout, framework)
    search_run, trials = runs_of(state)
    client = mlflow.MlflowClient(state.tracking_store)

    # the data: one channel, the data set's classes, resampled to one spacing and reoriented
    manifest = read_manifest(next((folder / "out" / "tfrecords").iterdir()))
    assert manifest.channels == ("CT",) and manifest.image_shape[-1] == 1
    assert [c["name"] for c in manifest.targets["channels"]] == ["background", *CLASSES]
    assert manifest.preprocess["orientation"] == "RAS" and len(manifest.preprocess["spacing"]) == 3
    assert manifest.preprocess["normalization"][0]["scheme"] == "ct"  # by the channel's name

    # every trial logs per-class dice under the data set's names every epoch; val_dice is their mean
    assert len(trials) == 1 and trials[0].info.status == "FINISHED"
    for key in CLASSES:
        history = client.get_metric_history(trials[0].info.run_id, f"val_dice_{key}")
        assert [m.step for m in history] == [1, 2]
    last = {key: client.get_metric_history(trials[0].info.run_id, f"val_dice_{key}")[-1].value for key in CLASSES}
    val_dice = client.get_metric_history(trials[0].info.run_id, "val_dice")[-1].value
    assert val_dice == pytest.approx(np.mean(list(last.values())), abs=1e-6)

    # the test split is scored per class, and the model registered
    scored = {**search_run.data.metrics, **trials[0].data.metrics}
    for key in CLASSES:
        assert 0.0 <= scored[f"test_dice_{key}"] <= 1.0 and scored[f"test_hd95_{key}"] >= 0.0
    name = f"ct-{layout}-{framework}"
    version = client.get_model_version_by_alias(name, "best")
    assert version.run_id == trials[0].info.run_id

    # distmis predict: each scan's own shape, affine and orientation, in the data set's label values
    images = folder / "heldout" / "imagesTr"
    out = tmp_path / "segs"
    assert main(["predict", str(folder / "out"), str(images), "--output", str(out), "--quiet"]) == 0
    scans = sorted(images.glob("*.nii.gz"))
    assert len(scans) == 2
    orientations = set()
    for scan_file in scans:
        case = scan_file.name.removesuffix(".nii.gz").removesuffix("_0000")
        scan, written = nib.load(str(scan_file)), nib.load(str(out / f"{case}_seg.nii.gz"))
        assert written.shape == scan.shape[:3] and np.allclose(written.affine, scan.affine)
        assert set(np.unique(np.asarray(written.dataobj)).tolist()) <= {0, 1, 2, 3}
        orientations.add("".join(nib.aff2axcodes(scan.affine)))
    assert orientations == {"RAS", "LPS"}


@pytest.mark.slow  # a fresh Python importing mlflow, torch and MONAI: about 30 s
def test_the_ct_model_predicts_without_distmis_as_distmis_predict_does(ct_search, tmp_path: Path):
    """The registered CT model, loaded by MLflow in a process that refuses distmis and given each scan's spacing
    and orientation, writes the label maps distmis predict writes (an LPS case among them)."""
    from tests.predict.test_pyfunc import run_without_distmis

    from distmis.predict.resolve import model_folder
    from tests.predict.test_pyfunc import read_mlmodel

    folder, state = ct_search("nnunet", "torch")
    with model_folder("models:/ct-nnunet-torch@best", state.tracking_store) as local:  # the model as logged
        conf = read_mlmodel(local)["flavors"]
        assert set(conf) == {"python_function"} and "python_model" not in conf["python_function"]
        assert not list(local.rglob("*.pkl"))  # its code a file of the folder, the network an exported program
        assert (local / "artifacts" / "network.pt2").is_file()
        assert "torch" in {r.split("==")[0] for r in (local / "requirements.txt").read_text().split()}
    images = folder / "heldout" / "imagesTr"
    assert main(["predict", "models:/ct-nnunet-torch@best", str(images), "--output", str(tmp_path / "segs"),
                 "--tracking-uri", state.tracking_store, "--quiet"]) == 0
    (tmp_path / "elsewhere").mkdir()
    scans = sorted(images.glob("*_0000.nii.gz"))
    run_without_distmis("models:/ct-nnunet-torch@best", state.tracking_store, [str(s) for s in scans],
                        tmp_path / "labels", tmp_path / "elsewhere")
    values: set[int] = set()
    for scan in scans:
        case = scan.name.removesuffix("_0000.nii.gz")
        written = np.asarray(nib.load(str(tmp_path / "segs" / f"{case}_seg.nii.gz")).dataobj)
        predicted = np.load(tmp_path / "labels" / f"{case}_0000.npy")
        assert predicted.shape == written.shape and np.array_equal(predicted, written), case
        values.update(np.unique(written).tolist())
    assert len(values) > 1  # not a comparison of empty label maps alone
