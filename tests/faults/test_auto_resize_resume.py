"""An ``auto`` search whose driver is killed (SIGKILL) as its pool grows a trial, resumed with ``distmis run
--resume``: real processes, real Ray, sqlite.

Two trials on two workers, one of one epoch and one of many: when the short one ends, the pool grows the long one
at its next epoch's end (a whole epoch measured on one worker; the restart on two takes seconds here). The driver
and its local Ray are killed as soon as that epoch is in the store, while the long trial restarts on two workers. The
resumed search ends as an uninterrupted one does: the long trial is one run whose every epoch is logged once, on the
workers it ran on (one, then two: as the last trial of the search it resumes on both), restarted once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from distmis.tracking.mlflow_tracking import ATTEMPTS_TAG
from distmis.tracking.results import find_search_run, trial_runs
from tests.conftest import query
from tests.faults.test_kill_and_resume import distmis, finish, kill_driver_when
from tests.search.test_auto_search import auto_tree

pytestmark = pytest.mark.slow  # a search in its own process, killed and resumed

EPOCHS = 40


def growing(db: Path) -> bool:
    """The short trial finished, and the long one logged a whole epoch on one worker after it (the pool's moment to
    grow it), none yet on two."""
    ended = query(db, "SELECT r.end_time FROM runs r JOIN params p ON r.run_uuid = p.run_uuid WHERE "
                      "p.key = 'training.epochs' AND p.value = '1' AND r.status = 'FINISHED'")
    if not ended:
        return False
    after = query(db, "SELECT m.step, m.timestamp FROM metrics m JOIN params p ON m.run_uuid = p.run_uuid WHERE "
                      f"p.key = 'training.epochs' AND p.value = '{EPOCHS}' AND m.key = 'workers'")
    return (any(step >= 2 and stamp > ended[0][0] for step, stamp in after)
            and not any(value == 2 for value, in query(db, "SELECT value FROM metrics WHERE key = 'workers'")))


def test_a_search_killed_as_its_pool_grows_a_trial_resumes(tmp_path: Path) -> None:
    tree = auto_tree(tmp_path / "data")
    tree["dataset"]["synthetic"].update(cases=8, shape=[32, 32, 32])
    tree["search"]["space"] = {"training.epochs": {"grid": [1, EPOCHS]}}
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(tree))
    out = tmp_path / "out"
    db = out / "mlflow.db"

    kill_driver_when(distmis("run", str(spec), "--output", str(out)), lambda: growing(db))
    killed_at = max(step for step, in query(db, "SELECT step FROM metrics WHERE key = 'workers'"))
    finish(distmis("run", str(spec), "--output", str(out), "--resume"), db=db)

    client = MlflowClient(f"sqlite:///{db}")
    parent = find_search_run(client, "tiny")
    assert parent.info.status == "FINISHED"
    runs = {int(run.data.params["training.epochs"]): run for run in trial_runs(client, parent)}
    assert sorted(runs) == [1, EPOCHS] and all(run.info.status == "FINISHED" for run in runs.values())
    long = runs[EPOCHS]
    for key in ("val_dice", "epoch_seconds", "workers"):
        steps = sorted(m.step for m in client.get_metric_history(long.info.run_id, key))
        assert steps == list(range(1, EPOCHS + 1)), (key, steps)
    workers = [m.value for m in sorted(client.get_metric_history(long.info.run_id, "workers"), key=lambda m: m.step)]
    assert workers[:killed_at] == [1.0] * killed_at and workers[-1] == 2.0 and workers == sorted(workers)
    assert long.data.tags[ATTEMPTS_TAG] == "2"  # its run before the kill, and the resumed one
    assert long.data.metrics["worker_seconds"] > long.data.metrics["elapsed_seconds"]
