"""A 3-fold cross-validated search with ``training.recipe: nnunet`` end to end through ``distmis run``, in TensorFlow
and in PyTorch: 12 synthetic CT cases (9 in the folds, 3 kept for test; one channel, three organ classes), 2
configurations, so 6 trials, one per (configuration, fold).

Checked against what the search wrote: the manifest's folds; the MLflow tree (a run per configuration with
``cv_ema_val_dice`` and its std, three fold runs under each tagged ``distmis.fold``); ``cv_ema_val_dice`` as the mean of the
folds' selected ``val_dice`` recomputed from the fold runs' curves; the best configuration; the choice made on the
out-of-fold predictions (the best configuration alone or a configuration ensemble, and the postprocessing); and the
registered model: the chosen configurations' fold ensembles, whose prediction equals the label map of the mean of
every fold model's mirrored probabilities computed here from each fold's own checkpoint, postprocessed as
cross-validation chose; of which ``distmis predict --folds 1`` is fold 1's own model; and which MLflow, in a process
that cannot import distmis, applies voxel for voxel as ``distmis predict`` does.
"""

from __future__ import annotations

import json
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

pytestmark = pytest.mark.slow  # two searches of 6 trials each (32^3, 8 epochs of 8 steps), with their test scores

FOLDS = 3
LRS = [3.0e-2, 5.0e-2]
CLASSES = ("liver", "spleen", "kidney")


def spec_tree(data: Path, framework: str) -> dict:
    """nnU-Net's recipe (poly schedule, dice + CE, mirroring at test time, moving-average selection; deep
    supervision where the network has heads, none at 3 levels), made small: 8 epochs of 8 steps on whole 32^3
    volumes, with Adam in place of nnU-Net's SGD and without its augmentation, for in so few steps neither learns
    a CT organ (SGD itself: tests/train/test_optimizers.py; the augmentation: tests/data)."""
    return {
        "name": f"cv-{framework}",
        "dataset": {"path": str(data), "layout": "msd", "labels": "classes", "orientation": "RAS",
                    "spacing": "auto", "crop": [32, 32, 32],
                    "synthetic": {"cases": 12, "shape": [32, 32, 24], "seed": 1, "kind": "ct", "lps_cases": 2},
                    "split": {"folds": FOLDS, "test": 0.25, "seed": 0}},
        "model": {"name": "unet3d", "framework": framework,
                  "params": {"base_filters": 4, "levels": 3, "norm": "group"}},
        "training": {"recipe": "nnunet", "epochs": 8, "batch_size": 2, "steps_per_epoch": 8,
                     "optimizer": {"name": "adam", "lr": 5.0e-2}, "augment": {"enabled": False}, "seed": 0},
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
            assert sorted(m.step for m in curve) == list(range(1, 9))  # the per-epoch curve, as without folds
            assert run.data.params["training.lr_schedule.name"] == "poly"  # the recipe's, in every trial
            selected = client.get_metric_history(run.info.run_id, "ema_val_dice")  # the moving average selects
            best.append(max(m.value for m in selected))
        metrics = configuration.data.metrics
        assert metrics["cv_ema_val_dice"] == pytest.approx(np.mean(best), abs=1e-9)
        assert metrics["cv_ema_val_dice_std"] == pytest.approx(np.std(best, ddof=1), abs=1e-9)
        assert "dataset.split.fold" not in configuration.data.params
        means[configuration.data.tags["distmis.configuration"]] = metrics["cv_ema_val_dice"]
    winner = max(means, key=means.get)
    assert search.data.tags["distmis.model_trial"] == winner, means
    folds = [f"fold{i}" for i in range(FOLDS)]
    assert dataset_parts(search) == {**{fold: fold for fold in folds}, "test": "test"}  # MLflow dataset inputs
    for configuration in configurations:  # search.evaluate_top 1: the best configuration's folds are scored
        scored = configuration.data.tags["distmis.configuration"] == winner
        test = {"test": "test"} if scored else {}
        assert ("test_dice_liver" in configuration.data.metrics) == scored  # the fold ensemble's scores
        assert dataset_parts(configuration) == {**{fold: fold for fold in folds}, **test}
        for run in children(client, configuration):  # each fold model's own scores on its own run
            assert ("test_dice_liver" in run.data.metrics) == scored
            own = f"fold{run.data.tags['distmis.fold']}"  # validated on, trained on the others
            assert dataset_parts(run) == {**{fold: "val" if fold == own else "train" for fold in folds}, **test}
    assert search.data.metrics["cv_ema_val_dice"] == pytest.approx(means[winner])
    assert "test_dice_liver" in search.data.metrics  # the published model's test scores
    results = pd.read_csv(Path(client.download_artifacts(search.info.run_id, "results.csv")))
    assert results["configuration"].iloc[0].startswith(winner)
    assert {f"fold{i}_ema_val_dice" for i in range(FOLDS)} <= set(results.columns)
    assert list(results["folds"]) == [FOLDS, FOLDS]


def fold_trainers(folder: Path, state: SearchState, name: str | None = None):
    """Each fold of configuration ``name`` (default the best) as its own model: its trial's best weights from its
    checkpoint."""
    from contextlib import ExitStack

    from distmis.trial.checkpoints import newest_complete

    client = mlflow.MlflowClient(state.tracking_store)
    search = client.get_run(state.run_id)
    name = name or search.data.tags["distmis.model_trial"]
    configuration = next(run for run in children(client, search) if run.data.tags["distmis.configuration"] == name)
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


def test_the_search_chose_its_model_on_the_out_of_fold_predictions(cv_search) -> None:
    """Both configurations alone and their ensemble scored on the folds' out-of-fold predictions; the published
    model is their ensemble where it beats both, else the best configuration, postprocessed as the same
    predictions said."""
    folder, state = cv_search
    client = mlflow.MlflowClient(state.tracking_store)
    search = client.get_run(state.run_id)
    metrics, tags = search.data.metrics, search.data.tags
    names = sorted(run.data.tags["distmis.configuration"] for run in children(client, search))
    options = {f"cv_oof_dice_of_{name}": metrics[f"cv_oof_dice_of_{name}"] for name in names}
    best, other = tags["distmis.model_trial"], next(name for name in names if name != tags["distmis.model_trial"])
    together = metrics[f"cv_oof_dice_of_{best}-{other}"]
    ensembled = together > max(options.values())
    assert ensembled == ("distmis.model_configurations" in tags)
    assert metrics["cv_oof_dice_of_chosen"] == pytest.approx(together if ensembled else options[f"cv_oof_dice_of_{best}"])
    table = Path(client.download_artifacts(search.info.run_id, "configuration_ensemble.md")).read_text()
    assert f"{best}+{other}" in table and all(name in table for name in names)
    chosen = json.loads(Path(client.download_artifacts(search.info.run_id, "postprocessing.json")).read_text())
    assert chosen["configurations"] == ([best, other] if ensembled else [best]) and chosen["cases"] == 9
    before = {key: metrics[f"cv_oof_dice_{key}"] for key in CLASSES}  # each class's dice before and after
    after = {key: metrics[f"cv_oof_dice_{key}_postprocessed"] for key in CLASSES}
    if chosen["foreground"]:
        assert np.mean(list(after.values())) > np.mean(list(before.values()))
    else:  # a class's removal is kept only where it raised that class's dice
        for key in CLASSES:
            assert (key in chosen["channels"]) == (after[key] > before[key]), key
            assert key in chosen["channels"] or after[key] == before[key]


def test_the_registered_model_is_the_chosen_ensemble(cv_search, tmp_path) -> None:
    folder, state = cv_search
    spec = load_spec(folder / "spec.yaml")
    client = mlflow.MlflowClient(state.tracking_store)
    tags = client.get_run(state.run_id).data.tags
    members = tags.get("distmis.model_configurations", tags["distmis.model_trial"]).split("+")
    # the registered version, downloaded as `distmis predict` does (mlflow.set_tracking_uri would set the tracking
    # store of every later test of this process: it sets $MLFLOW_TRACKING_URI)
    with model_folder(f"models:/{spec.registered_model_name}@best", state.tracking_store) as path:
        registered = mlflow.pyfunc.load_model(str(path))
    inner = registered.unwrap_python_model()
    recipe = inner.recipe
    assert list(recipe["folds"]) == list(range(FOLDS)) and recipe["inference"]["mirror"] == [0, 1, 2]
    assert [member["name"] for member in recipe["configurations"]] == (members if len(members) > 1 else [])
    chosen = json.loads(Path(client.download_artifacts(state.run_id, "postprocessing.json")).read_text())
    applies = chosen["foreground"] or chosen["channels"]
    assert recipe["postprocessing"] == ({"foreground": chosen["foreground"], "channels": chosen["channels"]}
                                        if applies else None)
    stacks, configurations = zip(*(fold_trainers(folder, state, name) for name in members))
    mirror = (0, 1, 2)
    try:
        def mean_probabilities(volume: np.ndarray) -> np.ndarray:  # every network's mirrored probabilities
            return np.mean([trainers[fold].predict_volume(volume, mirror=mirror)
                            for trainers in configurations for fold in range(FOLDS)], axis=0)

        found = []  # the test cases the model finds an organ in
        for case in sorted(prepare_data(spec, folder / "out", progress=False).split["test"]):
            image = folder / "data" / "imagesTr" / f"{case}.nii.gz"
            scan = nib.load(str(image))
            raw = np.asarray(scan.dataobj, dtype=np.float32)[..., None]
            where = {"spacing": [float(z) for z in scan.header.get_zooms()[:3]],
                     "orientation": "".join(nib.aff2axcodes(scan.affine))}
            prepared, _ = pyfunc_model.prepare_image(raw, recipe, where["spacing"], where["orientation"])
            by_hand = mean_probabilities(prepared)
            assert np.allclose(inner.probabilities(prepared), by_hand, atol=1e-4)
            expected = pyfunc_model.segment(raw, recipe, mean_probabilities, spacing=where["spacing"],
                                            axcodes=where["orientation"])  # postprocessed as the recipe says
            assert np.array_equal(np.asarray(registered.predict(raw, params=where)), expected)
            if len(np.unique(expected)) > 1:
                found.append((image, raw, where, prepared))
        assert found, "the model finds no organ in any test case: the comparison decides nothing"
        image, raw, where, prepared = found[0]

        # distmis predict --folds 1: fold 1's own model of each configuration
        out = tmp_path / "fold1"
        assert main(["predict", f"models:/{spec.registered_model_name}@best", str(image), "--output", str(out),
                     "--tracking-uri", state.tracking_store, "--quiet", "--folds", "1"]) == 0
        written = np.asarray(nib.load(str(next(out.glob("*.nii.gz")))).dataobj)
        own = pyfunc_model.segment(raw, recipe, lambda volume: np.mean(
            [trainers[1].predict_volume(volume, mirror=mirror) for trainers in configurations], axis=0),
            spacing=where["spacing"], axcodes=where["orientation"])
        assert np.array_equal(written, own)
        # three different models: the folds trained on different cases
        first = configurations[0]
        assert not np.allclose(first[0].predict_volume(prepared), first[1].predict_volume(prepared))
    finally:
        for stack in stacks:
            stack.close()


def test_the_model_predicts_without_distmis_as_distmis_predict_does(cv_search, tmp_path: Path) -> None:
    """The registered model, mirrored and postprocessed, loaded by MLflow in a process that refuses distmis: the
    label maps ``distmis predict`` writes, voxel for voxel (the test cases, each given its spacing and
    orientation)."""
    from tests.predict.test_pyfunc import run_without_distmis

    folder, state = cv_search
    spec = load_spec(folder / "spec.yaml")
    uri = f"models:/{spec.registered_model_name}@best"
    cases = sorted(prepare_data(spec, folder / "out", progress=False).split["test"])
    scans = [folder / "data" / "imagesTr" / f"{case}.nii.gz" for case in cases]
    for scan in scans:
        assert main(["predict", uri, str(scan), "--output", str(tmp_path / "segs"),
                     "--tracking-uri", state.tracking_store, "--quiet"]) == 0
    (tmp_path / "elsewhere").mkdir()
    run_without_distmis(uri, state.tracking_store, [str(scan) for scan in scans], tmp_path / "labels",
                        tmp_path / "elsewhere")
    values: set[int] = set()
    for case in cases:
        written = np.asarray(nib.load(str(tmp_path / "segs" / f"{case}_seg.nii.gz")).dataobj)
        predicted = np.load(tmp_path / "labels" / f"{case}.npy")
        assert predicted.shape == written.shape and np.array_equal(predicted, written), case
        values.update(np.unique(written).tolist())
    assert len(values) > 1  # not a comparison of empty label maps alone


def test_both_configurations_publish_as_one_configuration_ensemble(cv_search, tmp_path: Path) -> None:
    """What the search's end publishes where an ensemble wins (here the model is published, not registered): both
    configurations' fold models in one model, whose probabilities are the mean of all six networks' mirrored ones
    (each configuration's folds' mean, then the configurations' mean) and whose test split is scored that way."""
    from distmis.data.tfrecord import iter_cases
    from distmis.predict.model import SegmentationModel
    from distmis.search.evaluate import Candidate, evaluate_ensemble_on_test, test_spacings
    from distmis.search.publish import publish_model
    from distmis.train.epoch import trainer_targets
    from distmis.train.metrics import foreground_indices, foreground_masks, mask_dice

    folder, state = cv_search
    spec = load_spec(folder / "spec.yaml")
    data = prepare_data(spec, folder / "out", progress=False)
    client = mlflow.MlflowClient(state.tracking_store)
    best = client.get_run(state.run_id).data.tags["distmis.model_trial"]
    names = [best, *sorted({f"c{i:03d}" for i in range(len(LRS))} - {best})]
    stacks, configurations = zip(*(fold_trainers(folder, state, name) for name in names))
    try:
        members = [(name, [trainers[fold] for fold in range(FOLDS)]) for name, trainers in zip(names, configurations)]
        published = publish_model(members[0][1], Candidate(best, math.nan, {}), spec, data, tracking_uri="",
                                  trial_run_id=None, search_run_id="", evaluation=None, folder=tmp_path / "model",
                                  register=False, folds=tuple(range(FOLDS)), configurations=members)
        model = SegmentationModel.load(published.folder)
        assert model.recipe.names == tuple(names) and len(model.networks) == 2 * FOLDS
        case_id, image, label = next(iter_cases(data.tfrecord_dir, "test"))
        mirror = (0, 1, 2)
        every = [trainer.predict_volume(image, mirror=mirror) for _, own in members for trainer in own]
        assert np.allclose(model.probabilities(image), np.mean(every, axis=0), atol=1e-4)
        networks = {(name, fold): trainer for name, own in members for fold, trainer in enumerate(own)}
        _, scored = evaluate_ensemble_on_test(networks, data, "+".join(names), test_spacings(spec, data))
        assert scored.trial_id == "+".join(names) and len(scored.cases) == len(data.split["test"])
        targets = trainer_targets(data.manifest, data.tfrecord_dir)
        truth = np.asarray(label)[..., foreground_indices(targets)] > 0.5
        dice = mask_dice(foreground_masks(np.mean(every, axis=0), targets), truth)
        row = scored.cases.set_index("case").loc[case_id]
        assert [row[f"dice_{key}"] for key in CLASSES] == pytest.approx(list(dice), abs=1e-6)
    finally:
        for stack in stacks:
            stack.close()
