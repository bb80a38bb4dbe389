"""Four stopping schedulers end to end (issue 51): HyperBand under Optuna's TPE (the model-based multi-fidelity
search distmis offers in BOHB's place), median stopping, and ASHA and synchronous successive halving at the ends of
the curriculum's stages (the latter pausing every trial at a stage's end and restarting the best). A search of
six torch trials whose learning rates differ by factors of about 3 (HyperBand: drawn by TPE over that range), two at
a time. The scheduler stops some early; each stopped trial's run is FINISHED (not failed), tagged with its scheduler
and the epoch it was stopped at (a rung), and the results table says so; a trial that trained every epoch has no
such tag. The search's run holds the front of validation dice against worker-hours (``pareto.csv``,
``pareto.png``): exactly the trials no other beats on both, as computed here from their logged pairs. The
schedulers' own settings: ``tests/search/test_search_space.py``, ``tests/search/test_stage_rungs.py``."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from distmis.search.run import run_search
from distmis.spec import validate_spec
from distmis.tracking.mlflow_tracking import STOPPED_TAG
from distmis.tracking.results import trial_runs
from tests.conftest import small_spec_tree
from tests.tracking.test_pareto import swept_front

pytestmark = pytest.mark.slow  # whole searches on the local Ray

EPOCHS = 4
#: trials that learn at different speeds, so that their results differ at every rung (equal ones are never stopped)
LRS = [3.0e-2, 1.0e-2, 3.0e-3, 1.0e-3, 3.0e-4, 1.0e-4]


@pytest.mark.parametrize("name, settings, rungs", [
    # brackets s = 0 (rungs at 1 and 2 epochs) and s = 1 (a rung at 2): a trial stops at a rung of its bracket
    ("hyperband", {"grace_period": 1, "reduction_factor": 2, "brackets": 2}, {1, 2}),
    ("median", {"grace_period": 1, "min_samples": 2}, {1, 2, 3}),
    # rungs at the ends of the curriculum's first two stages (8^3 and 12^3 tiles, an epoch each)
    ("stage-asha", {"reduction_factor": 2}, {1, 2}),
    # the same rungs, every trial paused at each until all have reached it: 3 of 6 go on past the first, 2 past the
    # second, restarted from their checkpoints
    ("stage-halving", {"reduction_factor": 2}, {1, 2}),
])
def test_a_scheduler_stops_weak_trials_and_they_are_recorded_as_stopped(ray_local, tmp_path: Path, name: str,
                                                                         settings: dict, rungs: set[int]):
    tree = small_spec_tree(tmp_path / "data")
    tree["model"]["framework"] = "torch"
    tree["training"]["epochs"] = EPOCHS
    if name.startswith("stage-"):
        tree["training"]["curriculum"] = [{"tile": [8, 8, 8], "epochs": 1}, {"tile": [12, 12, 12], "epochs": 1},
                                          {"tile": None, "epochs": EPOCHS - 2}]
    tree["search"].update(scheduler=name, **{name.replace("-", "_"): settings},
                          space={"training.optimizer.lr": {"grid": LRS}})
    if name == "hyperband":  # the model-based multi-fidelity search distmis offers in BOHB's place: TPE under it
        tree["search"].update(algorithm="optuna", num_samples=len(LRS),
                              space={"training.optimizer.lr": {"loguniform": [min(LRS), max(LRS)]}})
    outcome = run_search(validate_spec(tree), tmp_path / "out", progress=False)
    assert outcome.failed == 0

    client = MlflowClient(outcome.tracking_uri)
    runs = trial_runs(client, client.get_run(outcome.parent_run_id))
    assert len(runs) == len(LRS) and all(run.info.status == "FINISHED" for run in runs)
    stopped = {}
    for run in runs:
        epochs = int(run.data.metrics["epochs_completed"])
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_dice"))
        assert steps == list(range(1, epochs + 1))  # every epoch it trained, logged
        if epochs < EPOCHS:
            assert run.data.tags[STOPPED_TAG] == f"{name} at epoch {epochs} of {EPOCHS}"
            assert epochs in rungs
            stopped[run.info.run_name] = epochs
        else:
            assert STOPPED_TAG not in run.data.tags
    assert stopped and len(stopped) < len(LRS), stopped
    if name == "stage-halving":  # synchronous: exactly ceil(n / 2) go on at each rung, whatever order they came in
        assert sorted(stopped.values()) == [1, 1, 1, 2], stopped
    table = outcome.results.set_index("trial")
    for run in runs:
        trial = run.info.run_name
        expected = f"{name} at epoch {stopped[trial]} of {EPOCHS}" if trial in stopped else ""
        assert table.loc[trial, "stopped"] == expected

    # the front of the logged (best val_dice, worker-hours) pairs, as the results table states them
    names = [run.info.run_name for run in runs]
    pairs = [(run.data.metrics["best_val_dice"], round(run.data.metrics["worker_seconds"] / 3600, 4)) for run in runs]
    expected = {names[i] for i in swept_front(pairs, "max")}
    artifacts = {item.path for item in client.list_artifacts(outcome.parent_run_id)}
    assert {"pareto.csv", "pareto.md", "pareto.png"} <= artifacts
    front = pd.read_csv(client.download_artifacts(outcome.parent_run_id, "pareto.csv", str(tmp_path)))
    assert set(front.loc[front["pareto"], "trial"]) == expected and len(front) == len(LRS)
