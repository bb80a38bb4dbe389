"""``search.budget`` on ``--resume`` with a real Ray Tune (the session's local Ray, a trivial function trainable):
a trial that was running when the driver was killed is restored by Tune as pending; with the budget already spent
it still reports once more, its checkpoint saved and known, before Tune ends the search (distmis.search.budget,
distmis.search.tune_state). The mechanism with stand-in trials: ``tests/search/test_budget.py``; a killed search end
to end: ``tests/search/test_budget_search.py``."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from ray import tune

from distmis.search.budget import (
    BudgetScheduler, BudgetSpent, BudgetStopper, LiveBudget, SearchBudget, register, unregister,
)
from distmis.search.tune_state import restored_trials, running_when_saved
from distmis.spec.schema import BudgetSpec

EPOCHS = 5


def epochs(config: dict) -> None:
    """Goes on from its checkpoint's epoch; reports each epoch (50 ms) with a checkpoint that holds it."""
    checkpoint = tune.get_checkpoint()
    done = json.loads((Path(checkpoint.path) / "epoch.json").read_text()) if checkpoint else 0
    for epoch in range(done + 1, EPOCHS + 1):
        time.sleep(0.05)  # the epoch: 50 worker-milliseconds
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "epoch.json").write_text(json.dumps(epoch))
            tune.report({"epoch": epoch}, checkpoint=tune.Checkpoint.from_directory(folder))


def budget(key: str, spent: BudgetSpent, stopped: list[str], owed: set[str]) -> LiveBudget:
    """3.6 worker-milliseconds of budget: spent at a trial's first report, or by ``spent``."""
    return register(key, LiveBudget(SearchBudget(BudgetSpec(worker_hours=1e-6), spent),
                                    workers=lambda trial_id, result: 1, stopped=stopped.append, owed=owed))


def killed_while_running(experiment: Path) -> str:
    """Tune's newest experiment state with its one trial RUNNING, as a driver killed during the trial's next epoch
    leaves it (Tune saves its state every few seconds). Returns the trial's id."""
    state_file = max(experiment.glob("experiment_state-*.json"))
    state = json.loads(state_file.read_text())
    [(json_state, metadata)] = state["trial_data"]
    trial = json.loads(json_state)
    trial["status"] = "RUNNING"
    state["trial_data"] = [[json.dumps(trial), metadata]]
    state_file.write_text(json.dumps(state))
    return trial["trial_id"]


def test_a_trial_running_at_the_kill_reports_once_on_resume_though_the_budget_is_spent(ray_local, tmp_path: Path):
    key, stopped = f"budget-resume-{tmp_path.name}", []
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    budget(key, BudgetSpent(), stopped, owed=set())
    try:
        first = tune.Tuner(
            epochs, param_space={"lr": 1e-3},
            tune_config=tune.TuneConfig(metric="epoch", mode="max", scheduler=BudgetScheduler(None, key)),
            run_config=tune.RunConfig(name="budget", storage_path=str(tmp_path / "ray_results"), verbose=0,
                                      stop=BudgetStopper(key))).fit()
        assert [result.metrics["epoch"] for result in first] == [1] and len(stopped) == 1  # spent at its 1st report
        experiment = tmp_path / "ray_results" / "budget"
        trial_id = killed_while_running(experiment)
        assert running_when_saved(str(experiment)) == {trial_id} and list(restored_trials(str(experiment))) == [trial_id]

        stopped.clear()
        live = budget(key, BudgetSpent(worker_s=10.0), stopped, owed=running_when_saved(str(experiment)))
        assert live.budget.spent()  # spent before the resumed run starts anything
        restored = tune.Tuner.restore(str(experiment), trainable=epochs, resume_unfinished=True).fit()
    finally:
        unregister(key)
    [result] = list(restored)
    # the resumed trial went on from its checkpoint, reported its next epoch and was stopped there by the budget
    assert stopped == [trial_id] and result.metrics["epoch"] == 2
    assert json.loads((Path(result.checkpoint.path) / "epoch.json").read_text()) == 2
    assert live.ended.endswith("of 1e-06 worker-hours") and not live.running()
