"""The driver's MLflow callback on a real sqlite store: one run per trial through restarts and resumes, one metric
point per epoch, the runs of an interrupted search taken over, and nothing secret pickled into Tune's folder."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from distmis.spec import validate_spec
from distmis.tracking.mlflow_tracking import (
    ATTEMPTS_TAG, RESUMES_TAG, SearchRun, TrialCallbackHandle, mark_interrupted,
)
from distmis.tracking.lineage import EXPLOITS_TAG, Exploit
from distmis.trial.record import HISTORY_KEY
from tests.conftest import small_spec_tree


@pytest.fixture
def search(tmp_path: Path):
    spec = validate_spec(small_spec_tree(tmp_path / "data"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = SearchRun(uri, "tiny", run_name="tiny", searched=["training.optimizer.lr"], metric="val_dice", mode="max")
    return spec, run


def trial(trial_id: str, lr: float = 1e-3) -> Any:
    return SimpleNamespace(trial_id=trial_id, config={"training.optimizer.lr": lr}, last_result={"time_total_s": 3.0},
                           error_file=None, get_error=lambda: None)


def result(epoch: int, attempt: str = "a", **extra: Any) -> dict[str, Any]:
    return {"epoch": epoch, "train_loss": 1.0 / epoch, "val_loss": 1.0 / epoch, "val_dice": epoch / 10,
            "epoch_seconds": 0.5, "num_parameters": 7, "attempt": attempt, **extra}


def steps(client: MlflowClient, run_id: str, key: str = "val_dice") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_a_restarted_trial_keeps_its_run_and_fills_the_epochs_it_missed(search):
    spec, run = search
    callback = run.trial_callback(spec)
    t = trial("t_00000")
    callback.on_trial_start(0, [], t)
    for epoch in (1, 2):
        callback.on_trial_result(0, [], t, result(epoch))
    # The process died after training epochs 3 and 4 (checkpointed, never reported); the restart replays them.
    history = json.dumps([result(e) for e in (1, 2, 3, 4)])
    callback.on_trial_result(0, [], t, result(5, attempt="b", **{HISTORY_KEY: history}))
    callback.on_trial_result(0, [], t, result(5, attempt="b"))  # a repeated epoch is not logged twice
    callback.on_trial_complete(0, [], t)
    assert callback.close()
    client = run.client
    run_id = callback.run_ids["t_00000"]
    finished = client.get_run(run_id)
    assert finished.info.status == "FINISHED"
    for key in ("train_loss", "val_loss", "val_dice", "epoch_seconds"):
        assert steps(client, run_id, key) == [1, 2, 3, 4, 5], key
    assert finished.data.tags[ATTEMPTS_TAG] == "2"
    assert finished.data.metrics["best_val_dice"] == 0.5 and finished.data.metrics["best_epoch"] == 5
    assert finished.data.metrics["epochs_completed"] == 5 and finished.data.params["model.num_parameters"] == "7"


def test_an_exploit_made_on_a_trials_replay_of_its_own_line_goes_on_from_the_donors_next_report(tmp_path: Path):
    """PBT pauses a trial while another waits; the trial's first report after it went on from its own checkpoint
    replays its own epochs. When that report makes PBT exploit (Tune asks the scheduler before the callback), its
    replay is the trial's own line, not the donor's: the exploit goes on after the donor's epoch its next report
    replays."""
    tree = small_spec_tree(tmp_path / "data")
    tree["search"].update(scheduler="pbt", pbt={"interval": 1, "quantile": 0.5, "resample_probability": 0.0})
    spec = validate_spec(tree)
    run = SearchRun(f"sqlite:///{tmp_path / 'mlflow.db'}", "tiny", run_name="tiny", searched=["training.optimizer.lr"],
                    metric="val_dice", mode="max")
    callback = run.trial_callback(spec)
    behind, donor = trial("t_00000"), trial("t_00001", 5e-3)
    for t in (behind, donor):
        callback.on_trial_start(0, [], t)
    for epoch in (1, 2, 3):
        callback.on_trial_result(0, [], behind, result(epoch))
    for epoch in (1, 2):
        callback.on_trial_result(0, [], donor, result(epoch))
    # `behind` paused at epoch 3 and went on from its own checkpoint: that report, epoch 4, makes PBT exploit
    own_line = json.dumps([result(e) for e in (1, 2, 3)])
    callback.exploited(Exploit(behind.trial_id, donor.trial_id, 4, 2, {"training.optimizer.lr": 5e-3}))
    callback.on_trial_result(0, [], behind, result(4, attempt="b", **{HISTORY_KEY: own_line}))
    # its next report is the donor's line: epochs 1-2 replayed, epoch 3 trained at the explored rate
    donor_line = json.dumps([result(e) for e in (1, 2)])
    callback.on_trial_result(0, [], behind, result(3, attempt="c", **{HISTORY_KEY: donor_line}))
    callback.on_trial_result(0, [], behind, result(4, attempt="c"))
    for t in (behind, donor):
        callback.on_trial_complete(0, [], t)
    assert callback.close()
    finished = run.client.get_run(callback.run_ids[behind.trial_id])
    (exploit,) = json.loads(finished.data.tags[EXPLOITS_TAG])
    assert exploit["went_on_after"] == 2 and exploit["from"] == donor.trial_id and exploit["epoch"] == 4
    history = run.client.get_metric_history(finished.info.run_id, "val_dice")
    assert [m.step for m in sorted(history, key=lambda m: (m.timestamp, m.step))] == [1, 2, 3, 4, 3, 4]


def test_a_resumed_search_takes_over_its_runs(search):
    spec, run = search
    first = run.trial_callback(spec)
    done, cut = trial("t_00000"), trial("t_00001", 2e-3)
    for t in (done, cut):
        first.on_trial_start(0, [], t)
        first.on_trial_result(0, [], t, result(1))
        first.on_trial_result(0, [], t, result(2))
    first.on_trial_complete(0, [], done)
    assert first.close()  # ... and the driver is killed: the search and `cut` stay RUNNING
    client = run.client
    done_id, cut_id = first.run_ids["t_00000"], first.run_ids["t_00001"]
    done_before = client.get_run(done_id)

    assert sorted(mark_interrupted(client, run.run_id)) == sorted([run.run_id, cut_id])
    assert client.get_run(cut_id).info.status == "KILLED"
    reopened = SearchRun.reopen(run.tracking_uri, run.run_id)
    assert client.get_run(run.run_id).info.status == "RUNNING"
    assert client.get_run(run.run_id).data.tags[RESUMES_TAG] == "1"
    second = reopened.trial_callback(spec)
    second.adopt_existing_runs()
    assert second.epochs == {"t_00000": 2, "t_00001": 2} and second.finished_before == {"t_00000"}

    for t in (done, cut):  # Tune restarts both (its state was older than MLflow's)
        second.on_trial_start(0, [], t)
        second.on_trial_result(0, [], t, result(2, attempt="b"))
        second.on_trial_result(0, [], t, result(3, attempt="b"))
        second.on_trial_complete(0, [], t)
    assert second.close()
    after = client.get_run(done_id)
    assert (after.info.status, after.info.end_time, after.data.metrics) == (
        done_before.info.status, done_before.info.end_time, done_before.data.metrics)  # untouched
    assert steps(client, done_id) == [1, 2]
    resumed = client.get_run(cut_id)
    assert resumed.info.status == "FINISHED" and steps(client, cut_id) == [1, 2, 3]
    assert resumed.data.tags[RESUMES_TAG] == "1" and resumed.data.tags[ATTEMPTS_TAG] == "2"
    assert len(client.search_runs([run.experiment_id])) == 3  # the search and its two trials: no new run


def test_tune_pickles_a_handle_that_holds_no_tracking_uri(tmp_path: Path):
    spec = validate_spec(small_spec_tree(tmp_path / "data"))
    secret_dir = tmp_path / "s3cr3t-store"
    secret_dir.mkdir()
    run = SearchRun(f"sqlite:///{secret_dir / 'mlflow.db'}", "tiny", run_name="tiny", searched=[], metric="val_dice",
                    mode="max")
    callback = run.trial_callback(spec)
    data = pickle.dumps(callback.handle())
    assert b"s3cr3t" not in data and run.run_id.encode() in data
    restored = pickle.loads(data)
    t = trial("t_00000")
    restored.on_trial_start(0, [], t)  # forwarded to the callback registered for the search run
    restored.on_trial_result(0, [], t, result(1))
    assert callback.close() and steps(run.client, callback.run_ids["t_00000"]) == [1]
    TrialCallbackHandle._registry.pop(run.run_id)
    pickle.loads(data).on_trial_result(0, [], t, result(2))  # no callback for it in this process: nothing happens


def test_runs_carry_mlflow_source_tags_and_the_working_tree_commit(search, monkeypatch, tmp_path: Path):
    import subprocess

    spec, _ = search
    repo = tmp_path / "project"
    repo.mkdir()
    for command in (["init", "-q"], ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty",
                                     "-m", "specs"]):
        subprocess.run(["git", *command], cwd=repo, check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    monkeypatch.chdir(repo)
    monkeypatch.setattr("sys.argv", ["distmis", "run", "spec.yaml", "--set", "tracking.uri=postgresql://u:pw@db/m"])
    run = SearchRun(f"sqlite:///{tmp_path / 'tags.db'}", "tiny", run_name="tiny", searched=[], metric="val_dice",
                    mode="max")
    callback = run.trial_callback(spec)
    callback.on_trial_start(0, [], trial("t_00000"))
    assert callback.close()
    for run_id in (run.run_id, callback.run_ids["t_00000"]):
        tags = run.client.get_run(run_id).data.tags
        assert tags["mlflow.source.name"] == "distmis run" and tags["mlflow.source.type"] == "LOCAL"
        assert tags["mlflow.source.git.commit"] == commit
        assert not any("pw" in value for value in tags.values())  # the arguments, and the password, are not kept


def test_each_class_dice_is_logged_every_epoch_and_the_table_shows_the_best_epochs(search):
    from distmis.tracking.results import results_frame

    spec, run = search
    callback = run.trial_callback(spec)
    t = trial("t_00000")
    callback.on_trial_start(0, [], t)
    per_epoch = {1: (0.2, 0.6), 2: (0.7, 0.5), 3: (0.4, 0.5)}  # val_dice = their mean: best at epoch 2
    for epoch, (liver, spleen) in per_epoch.items():
        callback.on_trial_result(0, [], t, result(epoch, val_dice=(liver + spleen) / 2, val_dice_liver=liver,
                                                  val_dice_spleen=spleen))
    callback.on_trial_complete(0, [], t)
    assert callback.close()
    client = run.client
    run_id = callback.run_ids["t_00000"]
    for key, index in (("val_dice_liver", 0), ("val_dice_spleen", 1)):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == [(epoch, values[index]) for epoch, values in per_epoch.items()], key
    table = results_frame(client, client.get_run(run.run_id))
    row = table.iloc[0]
    assert row["best_epoch"] == 2 and row["best_val_dice"] == pytest.approx(0.6)
    assert (row["val_dice_liver"], row["val_dice_spleen"]) == (0.7, 0.5)  # the best epoch's, not the last's
    columns = list(table.columns)
    assert columns.index("best_epoch") + 1 == columns.index("val_dice_liver")


def test_a_configuration_that_failed_for_a_fold_finishes_when_its_fold_runs_again(tmp_path: Path):
    """A cross-validated search that ended with a failed fold, resumed (issue 46, 2): the fold's trial runs again,
    and its configuration's run, FAILED at the first end, is reopened and summarized again: FINISHED, scored."""
    from distmis.spec.load import CONFIGURATION_KEY, FOLD_KEY

    tree = small_spec_tree(tmp_path / "data")
    tree["dataset"]["split"] = {"folds": 2, "test": 0.25, "seed": 0}
    spec = validate_spec(tree)
    run = SearchRun(f"sqlite:///{tmp_path / 'mlflow.db'}", "tiny", run_name="tiny", searched=["training.optimizer.lr"],
                    metric="val_dice", mode="max")
    folds = [trial(f"t_0000{fold}") for fold in (0, 1)]
    for fold, t in enumerate(folds):
        t.config.update({FOLD_KEY: fold, CONFIGURATION_KEY: "c000"})
    first = run.trial_callback(spec)
    for t in folds:
        first.on_trial_start(0, [], t)
        first.on_trial_result(0, [], t, result(1))
    first.on_trial_complete(0, [], folds[0])
    first.on_trial_error(0, [], folds[1])
    first.summarize_configurations(final=True)
    assert first.close()
    client = run.client
    configuration = first.configuration_runs["c000"]
    assert client.get_run(configuration).info.status == "FAILED"
    assert "fold(s) 1 did not finish" in client.get_run(configuration).data.tags["error"]

    second = SearchRun.reopen(run.tracking_uri, run.run_id).trial_callback(spec)
    second.adopt_existing_runs()
    second.on_trial_start(0, [], folds[1])  # Tune runs the failed fold again (resume_errored)
    second.on_trial_result(0, [], folds[1], result(2, attempt="b"))
    second.on_trial_complete(0, [], folds[1])
    second.summarize_configurations(final=True)
    assert second.close()
    after = client.get_run(configuration)
    assert after.info.status == "FINISHED" and after.data.metrics["cv_val_dice"] == pytest.approx((0.1 + 0.2) / 2)
    assert "error" not in after.data.tags and "fold(s) 1" in after.data.tags["distmis.previous_error"]
    assert client.get_run(second.run_ids["t_00001"]).info.status == "FINISHED"


def test_the_run_of_a_trial_tune_lost_is_set_aside_and_its_replacement_has_the_only_run_of_its_fold(tmp_path: Path):
    """A driver killed just after a fold's trial began, before Tune saved its state: the resumed search's Tune
    does not have that trial, and the fold searcher hands its fold out again as a new trial. The lost trial's run
    is deleted (tagged why), counts neither as failed nor as a run of its fold, and the search ends as an
    uninterrupted one: one FINISHED run per (configuration, fold)."""
    from distmis.spec.load import CONFIGURATION_KEY, FOLD_KEY
    from distmis.tracking.mlflow_tracking import LOST_TAG

    tree = small_spec_tree(tmp_path / "data")
    tree["dataset"]["split"] = {"folds": 2, "test": 0.25, "seed": 0}
    spec = validate_spec(tree)
    run = SearchRun(f"sqlite:///{tmp_path / 'mlflow.db'}", "tiny", run_name="tiny", searched=["training.optimizer.lr"],
                    metric="val_dice", mode="max")

    def fold_trial(trial_id: str, configuration: str, fold: int) -> Any:
        t = trial(trial_id, 1e-3 if configuration == "c000" else 2e-3)
        t.config.update({FOLD_KEY: fold, CONFIGURATION_KEY: configuration})
        return t

    first = run.trial_callback(spec)
    done, cut, lost = fold_trial("t0", "c000", 0), fold_trial("t1", "c000", 1), fold_trial("t2", "c001", 0)
    for t in (done, cut):
        first.on_trial_start(0, [], t)
        first.on_trial_result(0, [], t, result(1))
    first.on_trial_complete(0, [], done)
    first.on_trial_start(0, [], lost)  # its run is made; the driver is killed before Tune saves a state with it
    assert first.close()
    client = run.client
    lost_run = first.run_ids["t2"]
    mark_interrupted(client, run.run_id)

    second = SearchRun.reopen(run.tracking_uri, run.run_id).trial_callback(spec)
    second.adopt_existing_runs()
    assert second.set_aside_lost_runs({"t0": done.config, "t1": cut.config}) == ["t2"]
    replacement, other = fold_trial("t3", "c001", 0), fold_trial("t4", "c001", 1)
    for t in (cut, replacement, other):
        second.on_trial_start(0, [], t)
        second.on_trial_result(0, [], t, result(2, attempt="b"))
        second.on_trial_complete(0, [], t)
    cv = second.summarize_configurations(final=True)
    assert second.close()

    assert second.failed == [] and sorted(cv) == ["c000", "c001"]
    deleted = client.get_run(lost_run)
    assert deleted.info.lifecycle_stage == "deleted" and "Ray Tune" in deleted.data.tags[LOST_TAG]
    folds = {(r.data.tags["distmis.configuration"], r.data.tags["distmis.fold"]): r.info.status
             for r in client.search_runs([run.experiment_id], filter_string="tags.`distmis.role` = 'trial'")}
    assert folds == {(c, str(f)): "FINISHED" for c in ("c000", "c001") for f in (0, 1)}
    assert len(client.search_runs([run.experiment_id], filter_string="tags.`distmis.role` = 'trial'")) == 4
    c001 = client.get_run(second.configuration_runs["c001"])
    assert c001.info.status == "FINISHED" and c001.data.metrics["cv_val_dice"] == pytest.approx(0.2)


def test_with_a_moving_average_selection_the_run_ranks_by_it_and_a_resume_reads_it_back(tmp_path: Path):
    """``search.selection: moving-average``: the trials report ``ema_val_dice`` beside ``val_dice``; the run logs it
    and its best value and epoch are by it (as the loop keeps the weights), also for a resumed search's driver."""
    tree = small_spec_tree(tmp_path / "data")
    tree["search"]["selection"] = "moving-average"
    spec = validate_spec(tree)
    run = SearchRun(f"sqlite:///{tmp_path / 'mlflow.db'}", "tiny", run_name="tiny", searched=[],
                    metric=spec.search.selected_metric, mode="max")
    callback = run.trial_callback(spec)
    t = trial("t_00000")
    callback.on_trial_start(0, [], t)
    for epoch, (dice, ema) in enumerate([(0.8, 0.8), (0.9, 0.81), (0.1, 0.739)], start=1):
        callback.on_trial_result(0, [], t, {**result(epoch), "val_dice": dice, "ema_val_dice": ema})
    callback.on_trial_complete(0, [], t)
    assert callback.close()
    run_id = callback.run_ids["t_00000"]
    finished = run.client.get_run(run_id)
    assert steps(run.client, run_id, "ema_val_dice") == [1, 2, 3]
    assert finished.data.metrics["best_ema_val_dice"] == 0.81 and finished.data.metrics["best_epoch"] == 2
    assert "best_val_dice" not in finished.data.metrics
    again = run.trial_callback(spec)
    again.adopt_existing_runs()
    assert again.best == {"t_00000": (0.81, 2)}
