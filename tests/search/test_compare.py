"""The experiment- vs data-parallel comparison, for real on a 2-CPU local Ray."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pandas as pd
import pytest
import yaml
from mlflow.tracking import MlflowClient

from distmis.cli.main import main
from distmis.search.compare import run_compare
from distmis.search.trainable import data_parallel_trial, data_parallel_worker, single_process_trial
from distmis.spec import SpecError, validate_spec
from distmis.tracking.results import speedup_table, trial_runs
from tests.conftest import small_spec_tree


def compare_tree(data: Path) -> dict:
    tree = small_spec_tree(data)
    tree["model"]["framework"] = "torch"
    tree["training"]["epochs"] = 1
    tree["parallelism"] = {"mode": "compare", "workers": [2]}
    return tree


def test_speedup_table_arithmetic():
    cells = [
        {"mode": "data", "workers": 2, "elapsed_s": 60.0, "best_val_dice": 0.8, "trials": 4, "failed_trials": 0, "status": "FINISHED"},
        {"mode": "experiment", "workers": 1, "elapsed_s": 100.0, "best_val_dice": 0.8, "trials": 4, "failed_trials": 0, "status": "FINISHED"},
        {"mode": "experiment", "workers": 2, "elapsed_s": 50.0, "best_val_dice": 0.8, "trials": 4, "failed_trials": 0, "status": "FINISHED"},
        {"mode": "data", "workers": 1, "elapsed_s": 90.0, "best_val_dice": 0.8, "trials": 4, "failed_trials": 0, "status": "FINISHED"},
        {"mode": "data", "workers": 4, "elapsed_s": math.nan, "best_val_dice": math.nan, "trials": 0, "failed_trials": 0, "status": "FAILED"},
    ]
    table = speedup_table(cells)
    assert list(zip(table["mode"], table["workers"])) == [("experiment", 1), ("experiment", 2), ("data", 1), ("data", 2), ("data", 4)]
    assert table["speedup"].tolist()[:4] == pytest.approx([1.0, 2.0, 1.0, 1.5])
    assert table["efficiency"].tolist()[:4] == pytest.approx([1.0, 1.0, 1.0, 0.75])
    assert math.isnan(table["speedup"].iloc[4])


def test_compare_command_records_the_table(ray_local, tmp_path: Path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(compare_tree(tmp_path / "data")))
    out = tmp_path / "out"
    code = main(["compare", str(spec), "--workers", "2", "--output", str(out), "--quiet"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "speedup" in printed and "efficiency" in printed

    client = MlflowClient(f"sqlite:///{(out / 'mlflow.db').resolve()}")
    [parent] = client.search_runs(client.get_experiment_by_name("tiny").experiment_id,
                                  filter_string="tags.`distmis.role` = 'compare'")
    assert {"speedup.csv", "speedup.md", "speedup.png"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    table = pd.read_csv(client.download_artifacts(parent.info.run_id, "speedup.csv", str(tmp_path)))
    assert sorted(zip(table["mode"], table["workers"])) == [("data", 1), ("data", 2), ("experiment", 1), ("experiment", 2)]
    assert (table["status"] == "FINISHED").all() and table["elapsed_s"].gt(0).all()
    assert table["best_val_dice"].between(0, 1).all()
    assert table.loc[table["workers"] == 1, "speedup"].tolist() == [1.0, 1.0]
    # Each cell is a search run under the comparison, with its two trials under it.
    cells = trial_runs(client, parent)
    assert len(cells) == 4
    for cell in cells:
        assert len(trial_runs(client, cell)) == 2
        workers = int(cell.data.tags["distmis.compare.workers"])
        expected = workers if cell.data.tags["distmis.compare.mode"] == "data" else 1
        assert {t.data.params["trial.workers"] for t in trial_runs(client, cell)} == {str(expected)}

    uri = f"sqlite:///{(out / 'mlflow.db').resolve()}"
    assert main(["results", "--tracking-uri", uri, "--experiment", "tiny", "--format", "csv"]) == 0
    again = capsys.readouterr().out
    assert again.splitlines()[0].startswith("mode,workers,elapsed_s,speedup,efficiency,best_val_dice")


def dying_worker(loop_config: dict) -> None:
    """A real worker whose process dies after its first epoch, as one killed by the OOM killer would."""
    import ray.train

    if ray.train.get_context().get_world_rank() == 1:
        report = ray.train.report

        def report_then_die(*args, **kwargs):
            report(*args, **kwargs)
            os._exit(3)

        ray.train.report = report_then_die  # in this worker process only
    data_parallel_worker(loop_config)


def trial_with_a_dying_worker(config, **kwargs):
    if "storage_path" in kwargs:
        return data_parallel_trial(config, worker_loop=dying_worker, **kwargs)
    return single_process_trial(config, **kwargs)


def test_a_dead_worker_fails_its_trial_and_the_comparison_names_the_cell(ray_local, tmp_path: Path):
    tree = compare_tree(tmp_path / "data")
    tree["search"]["space"] = {"training.optimizer.lr": {"grid": [1.0e-3]}}
    tree["training"]["epochs"] = 2
    outcome = run_compare(validate_spec(tree), tmp_path / "out", progress=False, trainable=trial_with_a_dying_worker)
    assert outcome.failed_cells == ["data x2"]
    row = outcome.table[(outcome.table["mode"] == "data") & (outcome.table["workers"] == 2)].iloc[0]
    assert row["status"] == "TRIALS_FAILED" and row["failed_trials"] == 1 and math.isnan(row["speedup"])
    # The failed trial's MLflow run says why.
    client = MlflowClient(outcome.tracking_uri)
    parent = client.get_run(outcome.parent_run_id)
    [cell] = [c for c in trial_runs(client, parent) if c.info.run_name == "data x2"]
    [trial] = trial_runs(client, cell)
    assert trial.info.status == "FAILED"
    assert "died" in trial.data.tags["error"].lower() or "worker" in trial.data.tags["error"].lower()


def test_compare_refuses_more_workers_than_the_cluster_holds(ray_local, tmp_path: Path):
    tree = compare_tree(tmp_path / "data")
    tree["parallelism"]["workers"] = [1, 8]
    with pytest.raises(SpecError, match=r"\[8\] worker\(s\) do not fit"):
        run_compare(validate_spec(tree), tmp_path / "out", progress=False)
