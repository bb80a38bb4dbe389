"""Experiment-mode trials reuse their Tune actors (issue 37): a trial run on a reused actor trains exactly as one on a
fresh actor. Two trials of the same configuration (a one-point grid sampled twice), one at a time, so the second runs
on the first one's actor: the same per-epoch losses and dice, and for TensorFlow its traced trainer restarted."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from distmis.search.run import run_search
from distmis.spec import validate_spec
from distmis.tracking.results import find_search_run, trial_runs
from tests.conftest import small_spec_tree


def curve(client: MlflowClient, run_id: str, key: str) -> list[float]:
    return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


@pytest.mark.parametrize("framework", ["tensorflow", "torch"])
def test_a_trial_on_a_reused_actor_trains_as_on_a_fresh_one(ray_local, tmp_path: Path, framework: str) -> None:
    tree = small_spec_tree(tmp_path / "data")
    tree["model"]["framework"] = framework
    tree["search"] = {"algorithm": "grid", "num_samples": 2, "evaluate_top": 0,
                      "space": {"training.optimizer.lr": {"grid": [5.0e-3]}}}
    tree["parallelism"]["max_concurrent_trials"] = 1  # the second trial waits for the first one's actor
    tree["tracking"] = {"register_model": False}
    outcome = run_search(validate_spec(tree), tmp_path / "out", progress=False)
    assert outcome.failed == 0

    client = MlflowClient(outcome.tracking_uri)
    runs = sorted(trial_runs(client, find_search_run(client, "tiny")), key=lambda run: run.info.start_time)
    assert len(runs) == 2
    fresh, reused = (run.data.metrics for run in runs)
    assert (fresh["startup_process_reused"], reused["startup_process_reused"]) == (0.0, 1.0)
    if framework == "tensorflow":  # the same graphs: the second trial restarted the first one's trainer
        assert (fresh["startup_graphs_reused"], reused["startup_graphs_reused"]) == (0.0, 1.0)
    for key in ("train_loss", "val_loss", "val_dice"):
        first, second = (curve(client, run.info.run_id, key) for run in runs)
        assert len(first) == len(second) == 2, key
        assert second == pytest.approx(first, rel=1e-5, abs=1e-6), key
    losses = curve(client, runs[0].info.run_id, "train_loss")
    assert losses[1] != losses[0]  # it trained: the curves compared are not constants
