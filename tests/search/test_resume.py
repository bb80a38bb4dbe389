"""A search whose driver is killed (SIGKILL) goes on with ``distmis run --resume``: real processes, real Ray, sqlite.

Finished trials are not run again and their runs are untouched; unfinished ones continue from their last epoch in
their own MLflow runs; every run ends with one metric point per epoch.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from mlflow.tracking import MlflowClient

from distmis.tracking.results import find_search_run, trial_runs
from tests.conftest import small_spec_tree

pytestmark = pytest.mark.slow  # whole searches in their own processes, each with its own local Ray

ROOT = Path(__file__).resolve().parents[2]
EPOCHS = 10  # on 32^3 volumes: about a second an epoch here, long enough to kill a search midway


def query(db: Path, sql: str) -> list[tuple]:
    try:
        with sqlite3.connect(db, timeout=1) as conn:
            return conn.execute(sql).fetchall()
    except sqlite3.Error:  # not created yet, or locked
        return []


def trial_statuses(db: Path) -> list[str]:
    return [row[0] for row in query(db, "SELECT r.status FROM runs r JOIN tags t ON r.run_uuid = t.run_uuid "
                                        "WHERE t.key = 'distmis.role' AND t.value = 'trial'")]


def running_trial_epochs(db: Path) -> list[int]:
    """The last epoch logged by each trial run still RUNNING."""
    rows = query(db, "SELECT max(m.step) FROM metrics m JOIN runs r ON m.run_uuid = r.run_uuid "
                     "WHERE m.key = 'epoch_seconds' AND r.status = 'RUNNING' GROUP BY r.run_uuid")
    return [int(row[0]) for row in rows]


def distmis(*args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.Popen([sys.executable, "-m", "distmis", *args, "--quiet"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def kill_driver_when(process: subprocess.Popen, ready: Callable[[], bool], timeout: float = 600) -> None:
    """SIGKILL the driver and everything it started (its local Ray) once ``ready()``: as a node loss would."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the search did not reach the point to kill it in time"
        time.sleep(0.5)
    os.killpg(process.pid, signal.SIGKILL)  # Tune's saved state may be up to 2 s old: the trials cope with that
    process.wait(timeout=60)


def finish(process: subprocess.Popen, timeout: float = 900) -> str:
    try:
        _, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, err[-4000:]
    return err


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


def write_spec(tmp_path: Path, **changes: Any) -> Path:
    tree = small_spec_tree(tmp_path / "data")
    tree["model"]["framework"] = "torch"
    tree["dataset"]["synthetic"]["shape"] = [32, 32, 32]
    tree["training"]["epochs"] = EPOCHS
    tree["search"]["space"] = {"training.optimizer.lr": {"grid": [1.0e-3, 2.0e-3, 3.0e-3, 4.0e-3]}}
    for section, value in changes.items():
        tree[section] = value
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_a_killed_grid_search_resumes_where_it_was(tmp_path: Path):
    spec, out = write_spec(tmp_path), tmp_path / "out"
    db = out / "mlflow.db"
    first = distmis("run", str(spec), "--output", str(out))
    # Two trials run at once (1 CPU each): kill when the first two finished and a later one has 2 epochs or more.
    kill_driver_when(first, lambda: trial_statuses(db).count("FINISHED") == 2
                     and max(running_trial_epochs(db), default=0) >= 2)
    client = MlflowClient(f"sqlite:///{db}")
    parent = find_search_run(client, "tiny")
    assert parent.info.status == "RUNNING"  # what a killed driver leaves behind
    before = {run.data.tags["distmis.trial_id"]: snapshot(client, run.info.run_id) for run in trial_runs(client, parent)}
    done = {tid for tid, snap in before.items() if snap["status"] == "FINISHED"}
    logged_before = {tid: max((s for s, _ in snap["history"]["epoch_seconds"]), default=0)
                     for tid, snap in before.items()}
    assert 2 <= len(done) < 4  # two finished (a third may have finished between two polls), one at least cut short

    finish(distmis("run", str(spec), "--output", str(out), "--resume"))

    parent = client.get_run(parent.info.run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["distmis.resumes"] == "1"
    runs = trial_runs(client, parent)
    assert len(runs) == 4  # one run per trial, no second run for a resumed one
    by_trial = {run.data.tags["distmis.trial_id"]: run for run in runs}
    assert set(by_trial) == set(before) | set(by_trial) and len(by_trial) == 4
    for tid, run in by_trial.items():
        assert run.info.status == "FINISHED"
        assert_one_point_per_epoch(client, run.info.run_id)
    for tid in done:  # untouched: same end time, same metrics, same tags
        assert snapshot(client, by_trial[tid].info.run_id) == before[tid]

    # Tune's result.json files: the killed driver may not have flushed its last results, the resumed one did.
    reports = reported_epochs(out)
    for tid, results in reports.items():
        attempts = list(dict.fromkeys(attempt for attempt, _ in results))
        if tid in done:
            assert len(attempts) == 1 and len(results) <= EPOCHS, results  # not run again
            continue
        if tid in before and logged_before[tid] >= 2:
            # continued from its last checkpoint, not from the start (the newest may be an epoch ahead of what the
            # killed driver had logged: the first report after the resume replays the epochs the run lacked)
            resumed_from = min(epoch for attempt, epoch in results if attempt == attempts[-1])
            assert 2 < resumed_from <= logged_before[tid] + 2, (results, logged_before[tid])
            assert by_trial[tid].data.tags["distmis.attempts"] == "2"
