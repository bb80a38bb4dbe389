"""A 3-fold cross-validated search end to end through ``distmis run``, in TensorFlow and in PyTorch: 12 synthetic
cases (9 in the folds, 3 kept for test), 2 configurations, so 6 trials, one per (configuration, fold).

Checked against what the search wrote: the manifest's folds; the MLflow tree (a run per configuration with
``cv_val_dice`` and its std, three fold runs under each tagged ``distmis.fold``); ``cv_val_dice`` as the mean of the
folds' best ``val_dice`` recomputed from the fold runs' curves; the best configuration; and the registered model,
a fold ensemble whose prediction equals the thresholded mean of the three fold models' probabilities computed here
from each fold's own checkpoint, and of which ``distmis predict --folds 1`` is fold 1's own model.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlflow
import nibabel as nib
import numpy as np
import pandas as pd
import pytest
import yaml

from distmis import pyfunc_model
from distmis.cli.main import main
from distmis.predict.resolve import model_folder
from distmis.search.evaluate import BestModel, loaded_trainer
from distmis.search.prepare import prepare_data
from distmis.search.state import SearchState
from distmis.spec.load import load_spec
from distmis.tracking.mlflow_tracking import CHECKPOINT_TAG, PARENT_TAG, ROLE_TAG

pytestmark = pytest.mark.slow  # two searches of 6 trials each (32^3, 2 epochs), with their test evaluations

FOLDS = 3
LRS = [1.0e-3, 5.0e-3]


def spec_tree(data: Path, framework: str) -> dict:
    return {
        "name": f"cv-{framework}",
        "dataset": {"path": str(data), "layout": "msd", "labels": "whole-tumour",
                    "synthetic": {"cases": 12, "shape": [32, 32, 32], "seed": 0},
                    "split": {"folds": FOLDS, "test": 0.25, "seed": 0}},
        "model": {"name": "unet3d", "framework": framework, "params": {"base_filters": 4, "levels": 3}},
        "training": {"epochs": 2, "batch_size": 2, "optimizer": {"lr": 1.0e-3}, "seed": 0},
        "search": {"algorithm": "grid", "space": {"training.optimizer.lr": {"grid": LRS}}},
        "parallelism": {"resources_per_trial": {"cpu": 1}},
    }


@pytest.fixture(scope="module", params=["torch", "tensorflow"])
def cv_search(request, ray_local, tmp_path_factory) -> tuple[Path, SearchState]:
    folder = tmp_path_factory.mktemp(f"cv-{request.param}")
    spec = folder / "spec.yaml"
    spec.write_text(yaml.safe_dump(spec_tree(folder / "data", request.param)))
    assert main(["run", str(spec), "--output", str(folder / "out"), "--quiet"]) == 0
    state = SearchState.load(folder / "out")
    assert state is not None and state.status == "finished"
    return folder, state


def children(client: mlflow.MlflowClient, run: mlflow.entities.Run) -> list[mlflow.entities.Run]:
    return client.search_runs([run.info.experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{run.info.run_id}'")


def dataset_parts(run: mlflow.entities.Run) -> dict[str, str]:
    """The parts of the data a run records as MLflow dataset inputs, with the context of each."""
    parts = {}
    for item in run.inputs.dataset_inputs:
        tags = {tag.key: tag.value for tag in item.tags}
        parts[tags["distmis.part"]] = tags["mlflow.data.context"]
    return parts


def test_the_folds_cover_the_development_cases_once(cv_search) -> None:
    folder, state = cv_search
    spec = load_spec(folder / "spec.yaml")
    data = prepare_data(spec, folder / "out", progress=False)  # the conversion the search made, found again
    split = data.manifest.split
    folds, test = split["folds"], set(split["test"])
    assert len(folds) == FOLDS and len(test) == 3
    ids = sorted(path.name.split(".")[0] for path in (folder / "data" / "imagesTr").glob("*.nii.gz"))
    in_folds = [case for fold in folds for case in fold]
    assert sorted(in_folds) == sorted(set(ids) - test) and len(in_folds) == 9  # each non-test case once
    assert not test & set(in_folds)


def test_configurations_hold_their_folds_and_their_mean(cv_search) -> None:
    folder, state = cv_search
    client = mlflow.MlflowClient(state.tracking_store)
    search = client.get_run(state.run_id)
    configurations = children(client, search)
    assert len(configurations) == len(LRS)
    means = {}
    for configuration in configurations:
        assert configuration.data.tags[ROLE_TAG] == "configuration" and configuration.info.status == "FINISHED"
        folds = children(client, configuration)
        assert sorted(int(run.data.tags["distmis.fold"]) for run in folds) == list(range(FOLDS))
        best = []
        for run in folds:
            assert run.info.status == "FINISHED" and run.data.params["dataset.split.fold"] == run.data.tags["distmis.fold"]
            curve = client.get_metric_history(run.info.run_id, "val_dice")
            assert sorted(m.step for m in curve) == [1, 2]  # the per-epoch curve, as without folds
            best.append(max(m.value for m in curve))
        metrics = configuration.data.metrics
        assert metrics["cv_val_dice"] == pytest.approx(np.mean(best), abs=1e-9)
        assert metrics["cv_val_dice_std"] == pytest.approx(np.std(best, ddof=1), abs=1e-9)
        assert "dataset.split.fold" not in configuration.data.params
        means[configuration.data.tags["distmis.configuration"]] = metrics["cv_val_dice"]
    winner = max(means, key=means.get)
    assert search.data.tags["distmis.model_trial"] == winner
    folds = [f"fold{i}" for i in range(FOLDS)]
    assert dataset_parts(search) == {**{fold: fold for fold in folds}, "test": "test"}  # MLflow dataset inputs
    for configuration in configurations:  # search.evaluate_top 1: the best configuration's folds are scored
        scored = configuration.data.tags["distmis.configuration"] == winner
        test = {"test": "test"} if scored else {}
        assert ("test_dice_WT" in configuration.data.metrics) == scored  # the ensemble's scores
        assert dataset_parts(configuration) == {**{fold: fold for fold in folds}, **test}
        for run in children(client, configuration):  # each fold model's own scores on its own run
            assert ("test_dice_WT" in run.data.metrics) == scored
            own = f"fold{run.data.tags['distmis.fold']}"  # validated on, trained on the others
            assert dataset_parts(run) == {**{fold: "val" if fold == own else "train" for fold in folds}, **test}
    assert search.data.metrics["cv_val_dice"] == pytest.approx(means[winner])
    assert "test_dice_WT" in search.data.metrics  # the ensemble's test scores
    results = pd.read_csv(Path(client.download_artifacts(search.info.run_id, "results.csv")))
    assert results["configuration"].iloc[0].startswith(winner)
    assert {f"fold{i}_val_dice" for i in range(FOLDS)} <= set(results.columns)
    assert list(results["folds"]) == [FOLDS, FOLDS]


def fold_trainers(folder: Path, state: SearchState):
    """Each fold of the best configuration as its own model: its trial's best weights from its checkpoint."""
    from contextlib import ExitStack

    from distmis.trial.checkpoints import newest_complete

    client = mlflow.MlflowClient(state.tracking_store)
    search = client.get_run(state.run_id)
    configuration = next(run for run in children(client, search)
                         if run.data.tags["distmis.configuration"] == search.data.tags["distmis.model_trial"])
    spec = load_spec(folder / "spec.yaml")
    data = prepare_data(spec, folder / "out", progress=False)
    stack = ExitStack()
    trainers = {}
    for run in children(client, configuration):
        config = {"training.optimizer.lr": float(run.data.params["training.optimizer.lr"]),
                  "dataset.split.fold": int(run.data.tags["distmis.fold"])}
        model = BestModel(run.data.tags["distmis.trial_id"], config, math.nan,
                          newest_complete(run.data.tags[CHECKPOINT_TAG]))
        trainers[config["dataset.split.fold"]] = stack.enter_context(loaded_trainer(model, spec, data))
    return stack, trainers


def test_the_registered_model_is_the_fold_ensemble(cv_search, tmp_path) -> None:
    folder, state = cv_search
    spec = load_spec(folder / "spec.yaml")
    # the registered version, downloaded as `distmis predict` does (mlflow.set_tracking_uri would set the tracking
    # store of every later test of this process: it sets $MLFLOW_TRACKING_URI)
    with model_folder(f"models:/{spec.registered_model_name}@best", state.tracking_store) as path:
        registered = mlflow.pyfunc.load_model(str(path))
    inner = registered.unwrap_python_model()
    recipe = inner.recipe
    assert list(recipe["folds"]) == list(range(FOLDS))
    test_case = sorted(prepare_data(spec, folder / "out", progress=False).split["test"])[0]
    scan = nib.load(str(folder / "data" / "imagesTr" / f"{test_case}.nii.gz"))
    raw = np.asarray(scan.dataobj, dtype=np.float32)
    stack, trainers = fold_trainers(folder, state)
    with stack:
        def mean_probabilities(volume: np.ndarray) -> np.ndarray:
            return np.mean([trainers[fold].predict_volume(volume) for fold in range(FOLDS)], axis=0)

        prepared, _ = pyfunc_model.prepare_image(raw, recipe)
        by_hand = mean_probabilities(prepared)
        assert np.allclose(inner.probabilities(prepared), by_hand, atol=1e-4)
        assert (by_hand > 0.5).any() and (by_hand < 0.5).any()  # a threshold that decides something
        expected = pyfunc_model.segment(raw, recipe, mean_probabilities)
        assert np.array_equal(np.asarray(registered.predict(raw)), expected)

        # distmis predict --folds 1: fold 1's own model
        out = tmp_path / "fold1"
        image = folder / "data" / "imagesTr" / f"{test_case}.nii.gz"
        assert main(["predict", f"models:/{spec.registered_model_name}@best", str(image), "--output", str(out),
                     "--tracking-uri", state.tracking_store, "--quiet", "--folds", "1"]) == 0
        written = np.asarray(nib.load(str(next(out.glob("*.nii.gz")))).dataobj)
        own = pyfunc_model.segment(raw, recipe, trainers[1].predict_volume)
        assert np.array_equal(written, own)
        # three different models: the folds trained on different cases
        assert not np.allclose(trainers[0].predict_volume(prepared), trainers[1].predict_volume(prepared))
