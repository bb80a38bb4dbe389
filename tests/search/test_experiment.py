"""Real Ray Tune searches on a local Ray, logging to a real sqlite MLflow store."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from distmis.data.fingerprint import FINGERPRINT_FILE, DatasetFingerprint, compute_fingerprint
from distmis.search.run import run_search
from distmis.search.state import SearchState, SearchStateError, refuse_unfinished
from distmis.trial.trainables import single_process_trial
from distmis.spec import validate_spec
from distmis.tracking.results import find_search_run, trial_runs
from tests.conftest import small_spec_tree


def metric_steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_grid_search_logs_every_trial_and_epoch(ray_local, tmp_path: Path):
    tree = small_spec_tree(tmp_path / "data")
    tree["search"]["space"] = {
        "training.optimizer.lr": {"grid": [1.0e-3, 5.0e-3]},
        "model.params.norm": {"grid": ["batch", "group"]},
    }
    tree["search"]["evaluate_top"] = 2
    spec = validate_spec(tree)
    outcome = run_search(spec, tmp_path / "out", progress=False)

    assert outcome.failed == 0
    assert (tmp_path / "data" / "dataset.json").is_file()  # the synthetic dataset was generated
    assert outcome.tracking_uri == f"sqlite:///{(tmp_path / 'out' / 'mlflow.db').resolve()}"
    client = MlflowClient(outcome.tracking_uri)
    parent = find_search_run(client, "tiny")
    assert parent.info.run_id == outcome.parent_run_id and parent.info.status == "FINISHED"
    children = trial_runs(client, parent)
    assert len(children) == 4
    # Four trials ran concurrently two at a time; not one metric may be lost.
    for child in children:
        assert child.info.status == "FINISHED"
        for key in ("train_loss", "val_loss", "val_dice", "epoch_seconds"):
            assert metric_steps(client, child.info.run_id, key) == [1, 2], key
        for key in ("startup_imports_s", "startup_data_s", "startup_total_s"):  # once, with the first epoch
            assert metric_steps(client, child.info.run_id, key) == [1], key
        params = child.data.params
        assert int(params["model.num_parameters"]) > 0
        assert params["training.optimizer.lr"] in ("0.001", "0.005")
        assert params["model.params.norm"] in ("batch", "group")
        assert child.data.metrics["elapsed_seconds"] > 0
        # what it cost: its one worker's time (experiment-parallel: one worker a trial)
        assert child.data.metrics["worker_seconds"] == pytest.approx(child.data.metrics["elapsed_seconds"])
        checkpoint = Path(child.data.tags["distmis.checkpoint"])  # its latest: the best weights at the root
        assert (checkpoint / "model.weights.h5").is_file() and (checkpoint / "resume" / "state.json").is_file()
    combos = {(c.data.params["training.optimizer.lr"], c.data.params["model.params.norm"]) for c in children}
    assert len(combos) == 4

    # The best trial was scored on the test split, per case, on its own run and on the search's.
    test_cases = outcome.data.split["test"]
    assert outcome.test is not None and sorted(outcome.test.cases["case"]) == sorted(test_cases)
    assert 0 <= parent.data.metrics["test_dice_WT"] <= 1 and parent.data.metrics["test_hd95_WT"] >= 0
    assert parent.data.metrics["test_dice_WT"] == pytest.approx(outcome.test.cases["dice_WT"].mean())
    best_run = next(c for c in children if c.data.tags["distmis.trial_id"] == parent.data.tags["distmis.test_trial"])
    assert best_run.data.metrics["best_val_dice"] == max(c.data.metrics["best_val_dice"] for c in children)
    assert best_run.data.metrics["test_dice_WT"] == parent.data.metrics["test_dice_WT"]
    csv = client.download_artifacts(parent.info.run_id, "test_cases.csv", str(tmp_path))
    assert sorted(pd.read_csv(csv)["case"]) == sorted(test_cases)
    scored = sorted((c for c in children if "test_dice_WT" in c.data.metrics),
                    key=lambda c: c.data.metrics["best_val_dice"], reverse=True)
    ranked = sorted(children, key=lambda c: c.data.metrics["best_val_dice"], reverse=True)
    assert [c.info.run_id for c in scored] == [c.info.run_id for c in ranked[:2]]  # evaluate_top: 2

    # The best trial's model: copied into the output folder, logged on its run, registered with its test metrics.
    model = outcome.model
    assert model is not None and model.folder == tmp_path / "out" / "model" and (model.folder / "MLmodel").is_file()
    assert (model.name, model.version, model.best) == ("tiny", "1", True)
    version = client.get_model_version("tiny", "1")
    assert version.run_id == best_run.info.run_id and "best" in version.aliases
    assert float(version.tags["test_dice_WT"]) == pytest.approx(parent.data.metrics["test_dice_WT"], rel=1e-5)
    assert parent.data.tags["distmis.registered_model"] == "models:/tiny/1"
    assert "preprocessing.json" in {a.path for a in client.list_artifacts(best_run.info.run_id)}
    from distmis.predict.model import SegmentationModel

    loaded = SegmentationModel.load(model.folder)
    assert loaded.recipe.window == (16, 16, 16) and loaded.recipe.framework == "tensorflow"

    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"spec.yaml", "split.json", "results.csv", "results.md", "val_dice_curves.png", "best_trial_overlay.png"} <= artifacts
    assert parent.data.metrics["failed_trials"] == 0 and parent.data.metrics["elapsed_seconds"] > 0
    # What the search cost: its trials' spans on the workers they held, and the schedule that ran, drawn
    assert "schedule.png" in artifacts
    spans = [(c.info.start_time / 1000, c.info.end_time / 1000) for c in children]
    assert parent.data.metrics["span_seconds"] == pytest.approx(max(e for _, e in spans) - min(s for s, _ in spans))
    assert parent.data.metrics["worker_hours"] == pytest.approx(sum(e - s for s, e in spans) / 3600)
    capacity = 2  # the 2-CPU local Ray: two 1-CPU trials at once
    assert parent.data.metrics["idle_fraction"] == pytest.approx(
        1 - parent.data.metrics["worker_hours"] * 3600 / (capacity * parent.data.metrics["span_seconds"]))
    assert 0 <= parent.data.metrics["idle_fraction"] < 1
    # The makespan model calibrated on this search: its workers' rate on its epochs, its trials' start-up, and its
    # own schedule (experiment-parallel on the 2 workers) predicted beside the span it measured
    from distmis.search.makespan_plan import calibrate, check_calibration

    calibration = calibrate(tmp_path / "out", device="cpu")
    assert (calibration.trials, calibration.degree, calibration.capacity) == (4, 1, capacity)
    assert calibration.device_flops > 0 and calibration.startup_seconds > 0
    predicted, measured = check_calibration(tmp_path / "out", calibration, device="cpu")
    assert predicted > 0 and measured == parent.data.metrics["span_seconds"]
    # The data set's fingerprint: kept in the output folder, and on the search's run
    kept = tmp_path / "out" / FINGERPRINT_FILE
    assert DatasetFingerprint.from_dict(json.loads(kept.read_text())) == compute_fingerprint(tmp_path / "data", "msd")
    logged = client.download_artifacts(parent.info.run_id, FINGERPRINT_FILE, str(tmp_path))
    assert json.loads(Path(logged).read_text()) == json.loads(kept.read_text())

    table = outcome.results
    assert len(table) == 4 and list(table["best_val_dice"]) == sorted(table["best_val_dice"], reverse=True)
    assert set(table.columns) >= {"trial", "status", "lr", "norm", "best_val_dice", "best_epoch", "elapsed_s",
                                  "worker_h"}
    assert (table["worker_h"] > 0).all()
    assert table["test_dice_WT"].notna().tolist() == [True, True, False, False]  # the 2 scored: the 2 best
    assert dict(zip(table["run_id"], table["test_dice_WT"]))[best_run.info.run_id] == best_run.data.metrics["test_dice_WT"]
    # Each trial's newest checkpoint (its last epoch's) holds the best epoch's weights and the state to resume from.
    states = list((tmp_path / "out" / "ray_results").rglob("checkpoint_*/resume/state.json"))
    by_trial: dict[Path, list[Path]] = {}
    for state in states:
        by_trial.setdefault(state.parents[2], []).append(state.parents[1])
    assert len(by_trial) == 4
    for checkpoints in by_trial.values():
        newest = max(checkpoints)
        assert (newest / "model.weights.h5").is_file() and (newest / "resume" / "optimizer.npz").is_file()
        assert json.loads((newest / "resume" / "state.json").read_text())["epoch"] == 2


def test_optuna_search_with_asha_samples_the_space(ray_local, tmp_path: Path):
    tree = small_spec_tree(tmp_path / "data")
    tree["model"]["framework"] = "torch"  # the searcher's matter: the lighter trial processes
    tree["training"]["epochs"] = 1
    tree["search"] = {
        "algorithm": "optuna",
        "scheduler": "asha",
        "num_samples": 2,
        "space": {"training.optimizer.lr": {"loguniform": [1.0e-4, 1.0e-2]}, "model.params.norm": {"choice": ["batch", "group"]}},
    }
    outcome = run_search(validate_spec(tree), tmp_path / "out", progress=False)
    assert outcome.failed == 0 and len(outcome.results) == 2
    lrs = [float(v) for v in outcome.results["lr"]]
    assert all(1e-4 <= lr <= 1e-2 for lr in lrs) and lrs[0] != lrs[1]


def flaky_trial(config, **kwargs):
    """The real U-Net trial, except that the high-lr trial diverges the way a real one would."""
    if config["training.optimizer.lr"] > 1e-2:
        from distmis.train.tf_unet import NonFiniteLossError

        raise NonFiniteLossError("training loss became nan at epoch 1")
    single_process_trial(config, **kwargs)


def diverging_trial(workdir: str, config, **kwargs):
    """:func:`flaky_trial` while ``workdir/diverges`` exists, else the real trial. First, each trial writes in
    ``workdir/lock-<lr>`` what it is told when it tries to take its search's output folder (from its own process)."""
    from distmis.search.output_lock import OutputInUse, output_locked

    lr = config["training.optimizer.lr"]
    try:
        with output_locked(Path(workdir, "out"), "a trial"):
            Path(workdir, f"lock-{lr}").write_text("free")
    except OutputInUse as exc:
        Path(workdir, f"lock-{lr}").write_text(str(exc))
    if Path(workdir, "diverges").exists():
        flaky_trial(config, **kwargs)
    else:
        single_process_trial(config, **kwargs)


def test_failing_trial_is_recorded_and_search_goes_on(ray_local, tmp_path: Path, monkeypatch, capsys):
    """Through ``distmis run``: it exits 1 naming the failed trial and what to do; a plain run into its folder then
    exits 2 and starts nothing; ``--resume`` runs the failed trial again."""
    import yaml

    import distmis.search.run as run_module
    from distmis.cli.main import main

    tree = small_spec_tree(tmp_path / "data")
    tree["training"]["epochs"] = 1
    tree["search"]["space"] = {"training.optimizer.lr": {"grid": [1.0e-3, 5.0e-2]}}
    (tmp_path / "diverges").touch()
    trainable = functools.partial(diverging_trial, str(tmp_path))
    outcomes = []

    def run_and_keep(*args, **kwargs):
        outcomes.append(run_search(*args, trainable=trainable, **kwargs))
        return outcomes[-1]

    monkeypatch.setattr(run_module, "run_search", run_and_keep)
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(yaml.safe_dump(tree))
    assert main(["run", str(spec_file), "--output", str(tmp_path / "out"), "--quiet"]) == 1
    printed = capsys.readouterr()
    assert "1 failed" in printed.out and "NonFiniteLossError" in printed.out
    assert "did not finish" in printed.err and "--resume runs them again" in printed.err
    [outcome] = outcomes

    assert outcome.failed == 1
    by_status = {row["status"]: row for row in outcome.results.to_dict("records")}
    assert set(by_status) == {"FINISHED", "FAILED"}
    assert "NonFiniteLossError" in by_status["FAILED"]["error"] and "nan" in by_status["FAILED"]["error"]
    assert by_status["FINISHED"]["best_val_dice"] >= 0
    assert outcome.best is not None and outcome.best["status"] == "FINISHED"
    client = MlflowClient(outcome.tracking_uri)
    failed_run = client.get_run(by_status["FAILED"]["run_id"])
    assert {a.path for a in client.list_artifacts(failed_run.info.run_id)} == {"error.txt"}
    assert client.get_run(outcome.parent_run_id).data.metrics["failed_trials"] == 1

    # The search held its output folder while its trials ran (issue 46, 8): a trial's process was refused it.
    for lr in (1.0e-3, 5.0e-2):
        assert f"in use by another distmis (pid {os.getpid()} " in (tmp_path / f"lock-{lr}").read_text()
    assert not (tmp_path / "out" / ".distmis.lock").exists()  # let go (and removed) at the end

    # It ended with a failed trial: recorded so, not "finished" (issue 46, 2). A plain run into the folder is
    # refused; --resume runs the failed trial again (its cause gone), in its own run, and ends as a search whose
    # trials all finished: scored, published, "finished".
    state = SearchState.load(tmp_path / "out")
    assert state.status == "trials_failed" and state.failed_trials == list(outcome.failed_trials)
    with pytest.raises(SearchStateError, match=r"ended with 1 failed trial\(s\).*--resume"):
        refuse_unfinished(tmp_path / "out")
    assert main(["run", str(spec_file), "--output", str(tmp_path / "out"), "--quiet"]) == 2  # and starts nothing
    err = capsys.readouterr().err
    assert "ended with 1 failed trial(s)" in err and "--resume" in err and "another --output" in err
    assert len(outcomes) == 1
    (tmp_path / "diverges").unlink()
    resumed = run_search(validate_spec(tree), tmp_path / "out", progress=False, trainable=trainable, resume=True)
    assert resumed.failed == 0 and resumed.parent_run_id == outcome.parent_run_id
    assert dict(zip(resumed.results["run_id"], resumed.results["status"])) == {
        by_status["FINISHED"]["run_id"]: "FINISHED", by_status["FAILED"]["run_id"]: "FINISHED"}
    assert "distmis run --resume" in (tmp_path / f"lock-{5.0e-2}").read_text()  # the failed trial ran again
    assert client.get_run(failed_run.info.run_id).info.status == "FINISHED"
    assert client.get_run(outcome.parent_run_id).data.metrics["failed_trials"] == 0
    assert resumed.test is not None and resumed.model is not None and not resumed.problems
    state = SearchState.load(tmp_path / "out")
    assert state.status == "finished" and state.failed_trials == []


def test_bad_dataset_path_leaves_nothing_behind(tmp_path: Path):
    tree = small_spec_tree(tmp_path / "missing")
    del tree["dataset"]["synthetic"]
    from distmis.data.errors import DataError

    with pytest.raises(DataError, match="missing"):
        run_search(validate_spec(tree), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_trial_whose_values_clash_fails_alone_with_the_reason(ray_local, tmp_path: Path):
    """base_filters 6 and norm 'group' are each valid, but not together (4 groups): that trial fails, not the search."""
    tree = small_spec_tree(tmp_path / "data")
    tree["training"]["epochs"] = 1
    tree["search"]["space"] = {"model.params.base_filters": {"grid": [4, 6]}, "model.params.norm": {"grid": ["group"]}}
    outcome = run_search(validate_spec(tree), tmp_path / "out", progress=False)
    assert outcome.failed == 1 and len(outcome.results) == 2
    by_status = {row["status"]: row for row in outcome.results.to_dict("records")}
    assert set(by_status) == {"FINISHED", "FAILED"}
    assert "norm_groups (4) must divide base_filters (6)" in by_status["FAILED"]["error"]
    client = MlflowClient(outcome.tracking_uri)
    failed = client.get_run(by_status["FAILED"]["run_id"])
    assert failed.data.params["model.params.base_filters"] == "6" and failed.info.status == "FAILED"


def test_an_empty_test_split_is_stated_not_an_error(ray_local, tmp_path: Path):
    """On a generated BraTS 2023 data set, three regions (the layout's run path)."""
    tree = small_spec_tree(tmp_path / "data")
    tree["dataset"].update(layout="brats2023", labels="regions")
    tree["dataset"]["split"] = {"train": 0.67, "val": 0.33, "test": 0, "seed": 0}
    tree["search"]["space"] = {"training.optimizer.lr": {"grid": [1.0e-3]}}
    outcome = run_search(validate_spec(tree), tmp_path / "out", progress=False)
    assert outcome.failed == 0 and outcome.test is None
    assert outcome.test_note == "the test split is empty: nothing to evaluate"
    parent = MlflowClient(outcome.tracking_uri).get_run(outcome.parent_run_id)
    assert parent.data.tags["distmis.test"] == outcome.test_note
    assert not any(key.startswith("test_") for key in parent.data.metrics)
    # the model is registered all the same, scored by its validation dice
    version = MlflowClient(outcome.tracking_uri).get_model_version("tiny", outcome.model.version)
    assert version.tags["distmis.score_metric"] == "best_val_dice" and "test_dice_WT" not in version.tags
    assert (tmp_path / "data" / "BraTS-GLI-00000-000" / "BraTS-GLI-00000-000-t2f.nii.gz").is_file()
    from distmis.predict.model import SegmentationModel

    recipe = SegmentationModel.load(outcome.model.folder).recipe
    assert (recipe.layout, recipe.labels, recipe.num_classes) == ("brats2023", "regions", 3)
