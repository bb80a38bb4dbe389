"""A search whose driver is killed (SIGKILL) goes on with ``distmis run --resume`` and ends exactly as an
uninterrupted one does (issue 32, case 1): real processes, real Ray, sqlite.

One search (torch; a TensorFlow trial's restore in a search: ``tests/search/test_retries.py``) is killed three times, at three moments (a trial mid-way; a resumed trial just after its
first new epoch, when Tune's restored checkpoint index names folders older than the ones the trial went on from;
one trial finished and a later one mid-way), and resumed after each kill. It then exits 0; finished trials were not
run again and their runs are untouched; unfinished ones continued from their last epoch in their own MLflow runs;
every run has one metric point per epoch; every trial's newest checkpoint folder holds its best weights; the test
split is scored, ``OUTPUT/model`` exists and the model is registered.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from mlflow.tracking import MlflowClient

from distmis.tracking.results import find_search_run, trial_runs
from tests.conftest import query, small_spec_tree

pytestmark = pytest.mark.slow  # whole searches in their own processes, each with its own local Ray

ROOT = Path(__file__).resolve().parents[2]
EPOCHS = 8  # on 32^3 volumes: about a second an epoch here, long enough to kill a search midway


def trial_statuses(db: Path) -> list[str]:
    return [row[0] for row in query(db, "SELECT r.status FROM runs r JOIN tags t ON r.run_uuid = t.run_uuid "
                                        "WHERE t.key = 'distmis.role' AND t.value = 'trial'")]


def running_trial_epochs(db: Path) -> dict[str, int]:
    """The last epoch logged by each trial run still RUNNING, by run id."""
    rows = query(db, "SELECT r.run_uuid, max(m.step) FROM metrics m JOIN runs r ON m.run_uuid = r.run_uuid "
                     "WHERE m.key = 'epoch_seconds' AND r.status = 'RUNNING' GROUP BY r.run_uuid")
    return {row[0]: int(row[1]) for row in rows}


def logged_epochs(db: Path) -> dict[str, int]:
    """The last epoch logged by every trial run, by run id."""
    rows = query(db, "SELECT run_uuid, max(step) FROM metrics WHERE key = 'epoch_seconds' GROUP BY run_uuid")
    return {row[0]: int(row[1]) for row in rows}


def distmis(*args: str, quiet: bool = True) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.Popen([sys.executable, "-m", "distmis", *args, *(["--quiet"] * quiet)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def kill_driver_when(process: subprocess.Popen, ready: Callable[[], bool], timeout: float = 600, *,
                     kill: bool = True) -> None:
    """SIGKILL the driver and everything it started (its local Ray) once ``ready()``: as a node loss would
    (``kill`` False: only wait for that moment)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the search did not reach the point to kill it in time"
        time.sleep(0.2)
    if not kill:
        return
    os.killpg(process.pid, signal.SIGKILL)  # Tune's saved state may be up to 2 s old: the trials cope with that
    process.wait(timeout=60)


def finish(process: subprocess.Popen, timeout: float = 900, db: Path | None = None) -> tuple[str, str]:
    """The process's stdout and stderr, once it exited 0; else the failure says why, with the ``error`` tags of the
    runs in the MLflow store at ``db`` (what a failed trial recorded)."""
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    if process.returncode != 0 and db is not None:
        errors = query(db, "SELECT r.name, r.status, t.value FROM runs r JOIN tags t ON r.run_uuid = t.run_uuid "
                           "WHERE t.key IN ('error', 'distmis.previous_error')")
        err += "\nthe runs' errors:\n" + "\n".join(f"{name} {status}: {error}" for name, status, error in errors)
    assert process.returncode == 0, err[-6000:]
    return out, err


def snapshot(client: MlflowClient, run_id: str) -> dict[str, Any]:
    run = client.get_run(run_id)
    history = {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
               for key in ("train_loss", "val_dice", "epoch_seconds")}
    # What training recorded; the search's end adds the best trial's test-split scores (test_*), whichever it is.
    return {"status": run.info.status, "end_time": run.info.end_time, "history": history,
            "tags": {k: v for k, v in run.data.tags.items()},
            "metrics": {k: v for k, v in run.data.metrics.items() if not k.startswith("test_")}}


def assert_one_point_per_epoch(client: MlflowClient, run_id: str, epochs: int = EPOCHS) -> None:
    for key in ("train_loss", "val_loss", "val_dice", "epoch_seconds"):
        steps = sorted(m.step for m in client.get_metric_history(run_id, key))
        assert steps == list(range(1, epochs + 1)), (key, steps)


def reported_epochs(output: Path) -> dict[str, list[tuple[str, int]]]:
    """Per trial id, the (attempt, epoch) of every result Tune recorded (its result.json files)."""
    found: dict[str, list[tuple[str, int]]] = {}
    for path in (output / "ray_results").rglob("result.json"):
        for line in path.read_text().splitlines():
            result = json.loads(line)
            found.setdefault(result["trial_id"], []).append((result["attempt"], int(result["epoch"])))
    return found


def write_spec(tmp_path: Path, framework: str) -> Path:
    tree = small_spec_tree(tmp_path / "data")
    tree["model"]["framework"] = framework
    tree["dataset"]["synthetic"]["shape"] = [32, 32, 32]
    tree["training"]["epochs"] = EPOCHS
    # Three trials, two at a time (1 CPU each): the third starts when one has finished.
    tree["search"]["space"] = {"training.optimizer.lr": {"grid": [1.0e-3, 2.0e-3, 3.0e-3]}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def trial_snapshots(client: MlflowClient, parent_id: str) -> dict[str, dict[str, Any]]:
    parent = client.get_run(parent_id)
    return {run.data.tags["distmis.trial_id"]: snapshot(client, run.info.run_id) for run in trial_runs(client, parent)}


def checkpoint_folders(out: Path) -> dict[str, list[tuple[int, Path]]]:
    """Per trial folder of the Tune experiment: its complete checkpoint folders ``(epoch held, folder)``, newest
    first."""
    from pyarrow.fs import LocalFileSystem

    from distmis.trial.record import complete_folders

    trials = [p for p in (out / "ray_results").glob("*/*") if p.is_dir() and any(p.glob("checkpoint_*"))]
    return {trial.name: [(epoch, Path(folder)) for epoch, folder in complete_folders(LocalFileSystem(), str(trial))]
            for trial in trials}



def test_a_search_killed_three_times_ends_as_an_uninterrupted_one(tmp_path: Path):
    spec, out = write_spec(tmp_path, "torch"), tmp_path / "out"
    db = out / "mlflow.db"
    client = MlflowClient(f"sqlite:///{db}")

    # 1. A trial mid-way, none finished yet.
    process = distmis("run", str(spec), "--output", str(out))
    kill_driver_when(process, lambda: max(running_trial_epochs(db).values(), default=0) >= 2
                     and "FINISHED" not in trial_statuses(db))
    parent_id = find_search_run(client, "tiny").info.run_id
    assert client.get_run(parent_id).info.status == "RUNNING"  # what a killed driver leaves behind
    at_kill = logged_epochs(db)

    # 2. Just after a resumed trial's first new epoch: Tune's restored index is older than the trial's folders.
    process = distmis("run", str(spec), "--output", str(out), "--resume")
    kill_driver_when(process, lambda: any(epoch > at_kill.get(run, 0) for run, epoch in running_trial_epochs(db).items()))

    # 3. One trial finished and a later one mid-way.
    process = distmis("run", str(spec), "--output", str(out), "--resume")
    kill_driver_when(process, lambda: trial_statuses(db).count("FINISHED") >= 1
                     and max(running_trial_epochs(db).values(), default=0) >= 1
                     and len(trial_statuses(db)) == 3)
    before = trial_snapshots(client, parent_id)
    done = {tid for tid, snap in before.items() if snap["status"] == "FINISHED"}
    assert 1 <= len(done) < 3

    console, err = finish(distmis("run", str(spec), "--output", str(out), "--resume", quiet=False), db=db)
    assert "could not be loaded" not in err, err[-3000:]

    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["distmis.resumes"] == "3"
    runs = trial_runs(client, parent)
    by_trial = {run.data.tags["distmis.trial_id"]: run for run in runs}
    assert len(runs) == 3 and len(by_trial) == 3  # one run per trial, no second run for a resumed one
    for run in runs:
        assert run.info.status == "FINISHED"
        assert_one_point_per_epoch(client, run.info.run_id)
    for tid in done:  # untouched by the last resume: same end time, same metrics, same tags
        assert snapshot(client, by_trial[tid].info.run_id) == before[tid]

    # Issue 46, finding 10: the last resume's "finished" lines give each trial's best over every epoch it trained,
    # before the kills too, as its run records it; its last progress line counts the trials that ended before it.
    by_label = {run.info.run_name.split(" ", 1)[1]: run.data.metrics for run in runs}
    ended = re.findall(r"^\s+(lr=\S+)\s+finished: best val_dice (\d\.\d{4}) at epoch (\d+), ", console, re.M)
    assert ended, console
    for label, value, epoch in ended:
        assert (value, int(epoch)) == (f"{by_label[label]['best_val_dice']:.4f}", by_label[label]["best_epoch"])
    label, best = max(by_label.items(), key=lambda item: item[1]["best_val_dice"])
    progress = [line.strip() for line in console.splitlines() if line.strip().startswith("progress: ")]
    assert progress[-1] == (f"progress: 3/3 trials finished, 0 running, 0 to start; best val_dice "
                            f"{best['best_val_dice']:.4f} ({label}, epoch {int(best['best_epoch'])})"), console

    # Resumed trials continued from their last checkpoint, not from the start.
    reports = reported_epochs(out)
    continued = [tid for tid in by_trial if int(by_trial[tid].data.tags["distmis.attempts"]) >= 2]
    assert continued, {tid: run.data.tags["distmis.attempts"] for tid, run in by_trial.items()}
    for tid in continued:
        attempts = list(dict.fromkeys(attempt for attempt, _ in reports[tid]))
        first_epochs = [min(e for a, e in reports[tid] if a == attempt) for attempt in attempts[1:]]
        assert all(epoch > 1 for epoch in first_epochs), reports[tid]

    # Every trial's newest checkpoint holds its last epoch and its best weights; each folder is named by its epoch.
    weights = "model.pt"
    folders = checkpoint_folders(out)
    assert len(folders) == 3
    from distmis.train.checkpoint import read_state

    best_by_trial = {tid: run.data.metrics["best_val_dice"] for tid, run in by_trial.items()}
    for trial, complete in folders.items():
        tid = next(t for t in by_trial if t in trial)
        epoch, newest = complete[0]
        assert epoch == EPOCHS and (newest / weights).is_file(), (trial, complete)
        state = read_state(newest)
        assert state is not None and state.best_value == pytest.approx(best_by_trial[tid], abs=1e-6)
        assert all(int(folder.name.removeprefix("checkpoint_")) == held for held, folder in complete)

    # The test split scored, the model saved and registered.
    assert "test_dice_WT" in parent.data.metrics and parent.data.tags["distmis.test_trial"] in by_trial
    assert (out / "model" / "MLmodel").is_file()
    version = client.get_model_version_by_alias("tiny", "best")
    assert version.run_id == by_trial[parent.data.tags["distmis.model_trial"]].info.run_id



def chattr(flag: str, path: Path) -> None:
    subprocess.run(["chattr", flag, str(path)], check=True)


def test_a_trial_whose_finished_write_was_held_back_at_the_kill_finishes_on_resume(tmp_path: Path):
    """Issue 32, item 8: the driver is killed after Tune saved a trial as ended but before the store took its last
    epoch and its FINISHED status (the store is made read-only for that while: ``chattr +i``, real sqlite). A resumed
    search does not run the trial again; its run gets the missing epoch from the trial's checkpoint and ends
    FINISHED, and the trial is scored and published."""
    tree = yaml.safe_load(write_spec(tmp_path, "torch").read_text())
    tree["training"]["epochs"] = 4
    tree["search"]["space"] = {"training.optimizer.lr": {"grid": [2.0e-3]}}
    spec, out = tmp_path / "spec.yaml", tmp_path / "out"
    spec.write_text(yaml.safe_dump(tree))
    db = out / "mlflow.db"
    client = MlflowClient(f"sqlite:///{db}")

    def tune_saved_it_ended() -> bool:  # the one trial's status in Tune's saved experiment state
        return any("TERMINATED" in path.read_text(errors="ignore")
                   for path in (out / "ray_results").glob("*/experiment_state-*.json"))

    process = distmis("run", str(spec), "--output", str(out))
    try:
        kill_driver_when(process, lambda: max(running_trial_epochs(db).values(), default=0) >= 2, kill=False)
        chattr("+i", db)  # the last epoch's metrics and the FINISHED status wait in the driver's writer
        kill_driver_when(process, tune_saved_it_ended)
    finally:
        chattr("-i", db)
    (run,) = trial_runs(client, find_search_run(client, "tiny"))
    assert run.info.status == "RUNNING"
    assert len(client.get_metric_history(run.info.run_id, "epoch_seconds")) < 4  # the last epoch never reached it

    finish(distmis("run", str(spec), "--output", str(out), "--resume"), db=out / "mlflow.db")
    run = client.get_run(run.info.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["epochs_completed"] == 4
    assert_one_point_per_epoch(client, run.info.run_id, epochs=4)
    reports = reported_epochs(out)[run.data.tags["distmis.trial_id"]]
    assert len({attempt for attempt, _ in reports}) == 1  # not run again
    parent = find_search_run(client, "tiny")
    assert "test_dice_WT" in parent.data.metrics and (out / "model" / "MLmodel").is_file()
