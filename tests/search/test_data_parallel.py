"""Data-parallel and hybrid trials for real: Ray Train worker groups of 2 on this machine (gloo / MWMS)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from distmis.search.run import run_search
from distmis.spec import validate_spec
from distmis.tracking.results import trial_runs
from tests.conftest import small_spec_tree


def dp_tree(data: Path, framework: str, **parallelism) -> dict:
    tree = small_spec_tree(data)
    tree["model"]["framework"] = framework
    tree["training"]["epochs"] = 2
    tree["search"]["space"] = {"training.optimizer.lr": {"grid": [1.0e-3]}}
    tree["parallelism"] = parallelism
    return tree


@pytest.mark.parametrize("framework", ["tensorflow", "torch"])
def test_data_parallel_trial_with_two_workers(ray_local, tmp_path: Path, framework: str):
    spec = validate_spec(dp_tree(tmp_path / "data", framework, mode="data", workers=2))
    outcome = run_search(spec, tmp_path / "out", progress=False)
    assert outcome.failed == 0, outcome.results.get("error")
    client = MlflowClient(outcome.tracking_uri)
    [child] = trial_runs(client, client.get_run(outcome.parent_run_id))
    assert child.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(child.info.run_id, "val_dice")) == [1, 2]
    assert child.data.params["trial.workers"] == "2"
    assert float(child.data.params["training.optimizer.effective_lr"]) == pytest.approx(2e-3)  # linear scaling
    # Rank 0 kept a checkpoint of the best epoch: in the Ray Train run's storage, or (TensorFlow, on the search's
    # worker group) in the Tune trial's.
    name = "model.weights.h5" if framework == "tensorflow" else "model.pt"
    assert list((tmp_path / "out" / ("ray_results" if framework == "tensorflow" else "ray_train")).rglob(name))
    assert (Path(child.data.tags["distmis.checkpoint"]) / name).is_file()  # the latest, tagged on the trial's run
    assert 0 <= outcome.best["best_val_dice"] <= 1
    # Its start-up, part by part, logged once with the first epoch.
    parts = ["workers", "data"] if framework == "tensorflow" else ["workers", "imports", "data"]
    startup = {part: client.get_metric_history(child.info.run_id, f"startup_{part}_s") for part in parts + ["total"]}
    assert all(len(points) == 1 and points[0].step == 1 and points[0].value >= 0 for points in startup.values())
    assert startup["workers"][0].value > 0  # a worker group does not start in no time
    assert sum(startup[p][0].value for p in parts) == pytest.approx(startup["total"][0].value, abs=0.01)


def test_hybrid_two_concurrent_trials_of_two_workers(ray_local, tmp_path: Path):
    # Half a CPU per worker: the 2-CPU test cluster holds 4 workers, so two 2-worker trials run at once.
    tree = dp_tree(tmp_path / "data", "torch", mode="experiment", workers_per_trial=2,
                   resources_per_worker={"cpu": 0.5})
    tree["search"]["space"] = {"training.optimizer.lr": {"grid": [1.0e-3, 5.0e-3]}}
    tree["training"]["epochs"] = 1
    outcome = run_search(validate_spec(tree), tmp_path / "out", progress=False)
    assert outcome.failed == 0 and len(outcome.results) == 2
    client = MlflowClient(outcome.tracking_uri)
    parent = client.get_run(outcome.parent_run_id)
    assert "hybrid" in parent.data.tags["distmis.layout"]
    assert {r.data.params["trial.workers"] for r in trial_runs(client, parent)} == {"2"}
    runs = trial_runs(client, parent)
    assert max(r.info.start_time for r in runs) < min(r.info.end_time for r in runs)  # they overlapped
