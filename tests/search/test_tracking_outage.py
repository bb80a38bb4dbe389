"""A tracking store that goes away mid-search does not take the trials with it (real Ray, real sqlite store)."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from distmis.search.run import run_search
from distmis.spec import validate_spec
from distmis.tracking.results import trial_runs
from tests.conftest import has_epoch_metric, small_spec_tree

LOCK_SECONDS = 25  # longer than MLflow's sqlite busy timeout (20 s): its writes fail while the lock is held


def lock_store_once_metrics_arrive(db: Path, held: dict) -> None:
    """Wait for the first epoch metric, then hold an exclusive lock on the store, as a long reader would."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not has_epoch_metric(db):
        time.sleep(0.2)
    conn = sqlite3.connect(db, timeout=60, isolation_level=None)
    conn.execute("BEGIN EXCLUSIVE")
    held["from"] = time.monotonic()
    time.sleep(LOCK_SECONDS)
    conn.execute("ROLLBACK")
    held["until"] = time.monotonic()
    conn.close()


def test_a_locked_store_delays_the_records_but_no_trial_dies(ray_local, tmp_path: Path):
    tree = small_spec_tree(tmp_path / "data")
    tree["training"]["epochs"] = 4
    spec = validate_spec(tree)
    held: dict = {}
    locker = threading.Thread(target=lock_store_once_metrics_arrive, args=(tmp_path / "out" / "mlflow.db", held),
                              daemon=True)
    locker.start()
    outcome = run_search(spec, tmp_path / "out", progress=False)
    locker.join(timeout=120)
    assert held.get("until"), "the store was never locked: the test did not test anything"
    assert outcome.failed == 0 and len(outcome.results) == 2
    client = MlflowClient(outcome.tracking_uri)
    runs = trial_runs(client, client.get_run(outcome.parent_run_id))
    assert len(runs) == 2
    for run in runs:
        assert run.info.status == "FINISHED"
        for key in ("train_loss", "val_loss", "val_dice", "epoch_seconds"):
            steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
            assert steps == [1, 2, 3, 4], (key, steps)  # every epoch, once
        assert run.data.metrics["epochs_completed"] == 4
