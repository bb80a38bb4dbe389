"""The experiment- vs data-parallel comparison, for real on a 2-CPU local Ray."""

from __future__ import annotations

import math
import os
import re
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import yaml
from mlflow.tracking import MlflowClient

import distmis.search.compare as compare
from distmis.cli.main import main
from distmis.search.compare import cell_sequence, run_compare
from distmis.search.run import run_search
from distmis.search.state import SearchState
from distmis.trial.trainables import data_parallel_trial, resolve_trial, single_process_trial
from distmis.spec import SpecError, validate_spec
from distmis.tracking.results import format_comparison, format_results, speedup_table, trial_runs
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


def cell_row(mode: str, workers: int, repeat: int, elapsed: float, status: str = "FINISHED", **extra) -> dict:
    failed = extra.pop("failed_trials", 0)
    return {"mode": mode, "workers": workers, "repeat": repeat, "elapsed_s": elapsed, "best_val_dice": 0.8,
            "trials": 2, "failed_trials": failed, "status": status, **extra}


def test_repeated_cells_give_means_stds_and_speedups_paired_within_a_repeat():
    cells = [
        cell_row("experiment", 1, 1, 100.0), cell_row("experiment", 2, 1, 50.0), cell_row("data", 2, 1, 60.0),
        cell_row("data", 1, 1, 90.0),
        cell_row("experiment", 1, 2, 120.0), cell_row("experiment", 2, 2, 40.0), cell_row("data", 2, 2, 45.0),
        cell_row("data", 1, 2, 90.0),
        cell_row("experiment", 1, 3, 110.0), cell_row("experiment", 2, 3, 55.0), cell_row("data", 2, 3, 30.0),
        cell_row("data", 1, 3, 60.0),
    ]
    table = speedup_table(cells).set_index(["mode", "workers"])
    assert list(table.columns[:7]) == ["repeats", "elapsed_s", "elapsed_s_std", "speedup", "speedup_std",
                                       "efficiency", "efficiency_std"]
    assert list(table.index) == [("experiment", 1), ("experiment", 2), ("data", 1), ("data", 2)]
    assert table["repeats"].tolist() == [3, 3, 3, 3]
    assert table.loc[("experiment", 2), "elapsed_s"] == pytest.approx(48.33, abs=0.01)
    assert table.loc[("experiment", 2), "elapsed_s_std"] == pytest.approx(pd.Series([50.0, 40.0, 55.0]).std(), abs=0.01)
    # Each repeat against its own 1-worker time: 100/50, 120/40, 110/55 -- not mean(T1) / mean(TN).
    paired = pd.Series([2.0, 3.0, 2.0])
    assert table.loc[("experiment", 2), "speedup"] == pytest.approx(paired.mean())
    assert table.loc[("experiment", 2), "speedup_std"] == pytest.approx(paired.std(ddof=1))
    assert table.loc[("experiment", 2), "efficiency"] == pytest.approx(paired.mean() / 2)
    assert table.loc[("experiment", 2), "efficiency_std"] == pytest.approx(paired.std(ddof=1) / 2)
    paired = pd.Series([90 / 60, 90 / 45, 60 / 30])
    assert table.loc[("data", 2), "speedup"] == pytest.approx(paired.mean())
    assert table.loc[("data", 2), "speedup_std"] == pytest.approx(paired.std(ddof=1))
    assert table.loc[("data", 1), "speedup"] == 1.0 and table.loc[("data", 1), "speedup_std"] == 0.0
    assert table["trials"].tolist() == [6, 6, 6, 6] and (table["status"] == "FINISHED").all()


def test_a_failed_or_resumed_repeat_is_left_out_of_the_time_statistics():
    cells = [
        cell_row("experiment", 1, 1, 100.0), cell_row("experiment", 2, 1, 50.0), cell_row("data", 1, 1, 90.0),
        cell_row("data", 2, 1, 60.0),
        cell_row("experiment", 1, 2, 80.0), cell_row("experiment", 2, 2, 10.0, "TRIALS_FAILED", failed_trials=1),
        cell_row("data", 1, 2, math.nan, "RESUMED"), cell_row("data", 2, 2, 30.0),
        cell_row("experiment", 1, 3, 90.0), cell_row("experiment", 2, 3, 45.0), cell_row("data", 1, 3, 80.0),
        cell_row("data", 2, 3, math.nan, "FAILED", error="RuntimeError: boom", trials=0),
    ]
    table = speedup_table(cells).set_index(["mode", "workers"])
    row = table.loc[("experiment", 2)]  # repeat 2 had a failed trial: its 10 s is no figure to compare
    assert row["repeats"] == 2 and row["elapsed_s"] == pytest.approx(47.5)
    assert row["speedup"] == pytest.approx(2.0) and row["speedup_std"] == pytest.approx(0.0)
    assert row["status"] == "FINISHED, #2 TRIALS_FAILED" and row["failed_trials"] == 1
    # data x2: repeat 2's baseline was resumed (no time), repeat 3 failed: one paired speedup is left.
    row = table.loc[("data", 2)]
    assert row["repeats"] == 2 and row["elapsed_s"] == pytest.approx(45.0)
    assert row["speedup"] == pytest.approx(1.5) and math.isnan(row["speedup_std"])
    assert row["status"] == "FINISHED, #3 FAILED" and row["error"] == "#3: RuntimeError: boom"
    assert table.loc[("data", 1), "repeats"] == 2 and table.loc[("data", 1), "status"] == "FINISHED, #2 RESUMED"
    assert table.loc[("data", 1), "elapsed_s"] == pytest.approx(85.0)
    text = format_comparison(speedup_table(cells))
    assert "47.50 ± 3.54" in text and "2.000 ± 0.000" in text and "elapsed_s_std" not in text


def test_one_repeat_keeps_the_table_of_a_single_run():
    cells = [
        {"mode": "data", "workers": 2, "elapsed_s": 60.0, "best_val_dice": 0.8, "trials": 4, "failed_trials": 0, "status": "FINISHED"},
        {"mode": "experiment", "workers": 1, "elapsed_s": 100.0, "best_val_dice": 0.8, "trials": 4, "failed_trials": 0, "status": "FINISHED"},
        {"mode": "experiment", "workers": 2, "elapsed_s": 35.5, "best_val_dice": 0.7, "trials": 4, "failed_trials": 1, "status": "TRIALS_FAILED"},
        {"mode": "data", "workers": 1, "elapsed_s": 90.0, "best_val_dice": 0.8, "trials": 4, "failed_trials": 0, "status": "FINISHED"},
    ]
    unnumbered = speedup_table(cells)
    numbered = speedup_table([c | {"repeat": 1} for c in cells])
    pd.testing.assert_frame_equal(unnumbered, numbered)
    assert list(numbered.columns) == ["mode", "workers", "elapsed_s", "speedup", "efficiency", "best_val_dice",
                                      "trials", "failed_trials", "status"]
    row = numbered.iloc[1]  # experiment x2: its trials failed; its time is shown, with no speedup
    assert row["elapsed_s"] == 35.5 and math.isnan(row["speedup"]) and row["status"] == "TRIALS_FAILED"
    assert numbered["speedup"].tolist()[2:] == [1.0, 1.5]
    assert format_comparison(numbered) == format_results(numbered, "table")


def test_too_many_repeats_are_refused_naming_the_field(tmp_path: Path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(compare_tree(tmp_path / "data")))
    assert main(["compare", str(spec), "--repeats", "101", "--output", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "parallelism.repeats" in err and "100" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "data").exists()  # nothing started


def test_unknown_or_repeated_modes_are_refused_before_anything_starts(tmp_path: Path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(compare_tree(tmp_path / "data")))
    for modes in ("experiment,hybrid", "auto,auto"):
        with pytest.raises(SystemExit):
            main(["compare", str(spec), "--modes", modes, "--output", str(tmp_path / "out"), "--quiet"])
        assert "expected modes among experiment,data,auto" in capsys.readouterr().err
    tree = compare_tree(tmp_path / "data")
    tree["parallelism"]["modes"] = ["data", "data"]
    with pytest.raises(SpecError, match=r"modes must name each mode to compare once, got \['data', 'data'\]"):
        validate_spec(tree)
    assert not (tmp_path / "out").exists() and not (tmp_path / "data").exists()


def test_the_cells_run_interleaved_repeat_after_repeat():
    assert cell_sequence([1, 2, 4]) == [("experiment", 1, 1), ("data", 1, 1), ("data", 2, 1), ("experiment", 2, 1),
                                        ("experiment", 4, 1), ("data", 4, 1)]
    sequence = cell_sequence([1, 2], repeats=3)
    assert sequence == [(m, n, r) for r in (1, 2, 3) for m, n, _ in cell_sequence([1, 2])]
    # three modes: each count runs them all, the first turning by one from one count to the next
    assert [m for m, n, _ in cell_sequence([1, 2, 4], modes=["auto", "experiment", "data"])] == [
        "experiment", "data", "auto", "data", "auto", "experiment", "auto", "experiment", "data"]


def test_a_resumed_repeated_comparison_skips_the_cells_done_and_resumes_the_one_under_way(tmp_path: Path,
                                                                                           monkeypatch):
    """The bookkeeping of run_compare alone (no Ray): what runs, in which order, resumed or not, named how."""
    tree = compare_tree(tmp_path / "data")
    tree["parallelism"]["repeats"] = 2
    spec = validate_spec(tree)
    state = SearchState.start("compare", spec, "parent")
    # Interrupted in repeat 2's second cell; repeat 1 was saved before repeats existed (no "repeat": repeat 1).
    state.cells = [cell_row("experiment", 1, 1, 100.0), cell_row("data", 1, 1, 90.0), cell_row("data", 2, 1, 60.0),
                   cell_row("experiment", 2, 1, 50.0), cell_row("experiment", 1, 2, 110.0)]
    del state.cells[0]["repeat"]
    state.current = {"mode": "data", "workers": 1, "repeat": 2, "run_id": "cell-under-way", "experiment": "exp"}
    opened, executed = [], []

    def fake_run(run_id: str) -> SimpleNamespace:
        return SimpleNamespace(run_id=run_id, tracking_uri="sqlite://", log_metrics=lambda *a, **k: None,
                               finish=lambda *a, **k: None)

    def open_run(search, output_dir, data, *, run_name, parent_run_id, tags):
        opened.append((run_name, tags))
        return fake_run(f"run-{len(opened)}")

    def execute(search, data, plan, run, output_dir, *, resume, **kwargs):
        par = search.parallelism
        executed.append((par.mode, par.workers if par.mode == "data" else par.max_concurrent_trials, run.run_id,
                         resume))
        return SimpleNamespace(results=pd.DataFrame({"best_val_dice": [0.5, 0.7]}), failed=0, search_seconds=40.0)

    monkeypatch.setattr(compare, "preflight", lambda *a, **k: state)
    monkeypatch.setattr(compare, "ray_connection", lambda *a, **k: nullcontext())
    monkeypatch.setattr(compare, "check_capacity", lambda *a: None)
    monkeypatch.setattr(compare, "prepare_output", lambda *a, **k: None)
    monkeypatch.setattr(compare, "reopen_search_run", lambda spec, output_dir, run_id: fake_run(run_id))
    monkeypatch.setattr(compare, "open_search_run", open_run)
    monkeypatch.setattr(compare, "execute_search", execute)
    monkeypatch.setattr(compare, "_log_table", lambda *a: None)
    (tmp_path / "out").mkdir()
    outcome = run_compare(spec, tmp_path / "out", progress=False, resume=True)

    assert executed == [("data", 1, "cell-under-way", True), ("data", 2, "run-1", False),
                        ("experiment", 2, "run-2", False)]
    assert [name for name, _ in opened] == ["data x2 #2", "experiment x2 #2"]
    assert opened[0][1] == {"distmis.compare.mode": "data", "distmis.compare.workers": "2",
                            "distmis.compare.repeat": "2"}
    saved = SearchState.load(tmp_path / "out")
    assert [compare.cell_key(c) for c in saved.cells][-3:] == [("data", 1, 2), ("data", 2, 2), ("experiment", 2, 2)]
    assert saved.current is None and saved.status == "finished"
    table = outcome.table.set_index(["mode", "workers"])
    assert table.loc[("data", 1), "status"] == "FINISHED, #2 RESUMED" and table.loc[("data", 1), "repeats"] == 1
    assert table.loc[("experiment", 2), "speedup"] == pytest.approx((100 / 50 + 110 / 40) / 2)
    assert outcome.failed_cells == []


def test_compare_command_records_the_table(ray_local, tmp_path: Path, capsys):
    """The whole command, each cell a one-trial search, run once (repeats: their order, names and tags in
    test_a_resumed_repeated_comparison_skips_the_cells_done_and_resumes_the_one_under_way; their statistics in
    test_repeated_cells_give_means_stds_and_speedups_paired_within_a_repeat; the table rebuilt from repeated runs
    in tests/tracking/test_speedup.py)."""
    tree = compare_tree(tmp_path / "data")
    tree["search"]["space"] = {"training.optimizer.lr": {"grid": [1.0e-3]}}
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(tree))
    out = tmp_path / "out"
    code = main(["compare", str(spec), "--workers", "2", "--modes", "experiment,data,auto", "--output", str(out),
                 "--quiet"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "speedup" in printed and "efficiency" in printed and "predicted_s" in printed

    client = MlflowClient(f"sqlite:///{(out / 'mlflow.db').resolve()}")
    [parent] = client.search_runs(client.get_experiment_by_name("tiny").experiment_id,
                                  filter_string="tags.`distmis.role` = 'compare'")
    assert {"speedup.csv", "speedup.md", "speedup.png"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    table = pd.read_csv(client.download_artifacts(parent.info.run_id, "speedup.csv", str(tmp_path)))
    assert sorted(zip(table["mode"], table["workers"])) == [("auto", 1), ("auto", 2), ("data", 1), ("data", 2),
                                                             ("experiment", 1), ("experiment", 2)]
    assert (table["status"] == "FINISHED").all() and table["elapsed_s"].gt(0).all()
    # the model's makespan of every cell, calibrated on the 1-worker experiment-parallel one
    assert table["predicted_s"].gt(0).all()
    cells = client.search_runs(parent.info.experiment_id, filter_string=f"tags.`mlflow.parentRunId` = "
                                                                        f"'{parent.info.run_id}'")
    [auto] = [run for run in cells if run.info.run_name == "auto x2"]
    assert auto.data.tags["distmis.layout"].startswith("auto: 2 worker(s)")
    assert table["best_val_dice"].between(0, 1).all()
    assert table.loc[table["workers"] == 1, "speedup"].tolist() == [1.0, 1.0, 1.0]
    assert table.loc[table["workers"] == 2, "speedup"].gt(0).all()
    # Each cell is a search run under the comparison, with its trial under it.
    cells = trial_runs(client, parent)
    assert len(cells) == 6
    runs = sorted(cells, key=lambda run: run.info.start_time)
    modes = ["experiment", "data", "auto"]
    assert [(run.data.tags["distmis.compare.mode"], int(run.data.tags["distmis.compare.workers"]),
             int(run.data.tags["distmis.compare.repeat"])) for run in runs] == cell_sequence([1, 2], modes=modes)
    assert [run.info.run_name for run in runs] == ["experiment x1", "data x1", "auto x1", "data x2", "auto x2",
                                                   "experiment x2"]
    for cell in cells:
        assert len(trial_runs(client, cell)) == 1
        workers = int(cell.data.tags["distmis.compare.workers"])
        mode = cell.data.tags["distmis.compare.mode"]
        [trial] = trial_runs(client, cell)
        if mode == "auto":  # one trial: it takes every worker of the pool
            assert trial.data.params["trial.workers"] == "1"
            assert {m.value for m in client.get_metric_history(trial.info.run_id, "workers")} == {float(workers)}
        else:
            assert trial.data.params["trial.workers"] == str(workers if mode == "data" else 1)

    uri = f"sqlite:///{(out / 'mlflow.db').resolve()}"
    assert main(["results", "--tracking-uri", uri, "--experiment", "tiny", "--format", "csv"]) == 0
    again = capsys.readouterr().out
    assert again.splitlines()[0].startswith("mode,workers,elapsed_s,speedup,efficiency,predicted_s,best_val_dice")
    assert main(["results", str(out)]) == 0  # the comparison rebuilt from its runs: as the command printed it
    rebuilt = capsys.readouterr().out
    rows = re.compile(r"^\s*(experiment|data|auto)\s+\d+\s+\d+\.\d+\s+.*$", re.MULTILINE)
    assert len(rows.findall(printed)) == 6 and rows.findall(rebuilt) == rows.findall(printed)


def die_after_first_epoch(worker) -> None:
    """Make this worker of a data-mode search's worker group (run inside it by ``__ray_call__``) die after its
    trial's first epoch, as a process killed by the OOM killer would."""
    import distmis.train.loop as loop

    epoch_reports = loop.epoch_reports

    def dying(*args, **kwargs):
        for report in epoch_reports(*args, **kwargs):
            yield report
            os._exit(3)

    loop.epoch_reports = dying  # in this worker's process only


def trial_with_a_dying_worker(config, **kwargs):
    if "storage_path" in kwargs:  # the search's worker group, as the trial will find it; its rank 1 dies
        import ray

        from distmis.trial.worker_group import group_for

        trial, layout = resolve_trial(kwargs["spec"], config)
        group = group_for(layout, Path(kwargs["storage_path"]).name, trial.model.framework)
        ray.get(group.workers[1].__ray_call__.remote(die_after_first_epoch))
        return data_parallel_trial(config, **kwargs)
    return single_process_trial(config, **kwargs)


def test_a_dead_worker_fails_its_trial_and_the_search_records_why(ray_local, tmp_path: Path):
    """A data-parallel trial whose worker process dies (on the search's worker group) fails (not retried:
    max_failures 0) after the epoch it reported, and its run says why; what a comparison makes of a cell with a
    failed trial: the next test."""
    tree = compare_tree(tmp_path / "data")
    tree["search"]["space"] = {"training.optimizer.lr": {"grid": [1.0e-3]}}
    tree["training"]["epochs"] = 2
    tree["parallelism"] = {"mode": "data", "workers": 2}
    outcome = run_search(validate_spec(tree), tmp_path / "out", progress=False, trainable=trial_with_a_dying_worker)
    assert outcome.failed == 1 and outcome.results["status"].tolist() == ["FAILED"]
    client = MlflowClient(outcome.tracking_uri)
    [trial] = trial_runs(client, client.get_run(outcome.parent_run_id))
    assert trial.info.status == "FAILED"
    error = trial.data.tags["error"]
    assert "worker process has died" in error, error  # the worker's death, as Ray tells it
    assert sorted(m.step for m in client.get_metric_history(trial.info.run_id, "val_dice")) == [1]


def test_a_cell_with_a_failed_trial_is_named_and_left_out_of_the_speedups(tmp_path: Path, monkeypatch):
    """run_compare's bookkeeping (no Ray): the data x2 cell's search ends with one failed trial."""
    spec = validate_spec(compare_tree(tmp_path / "data"))
    state = SearchState.start("compare", spec, "parent")

    def fake_run(run_id: str) -> SimpleNamespace:
        return SimpleNamespace(run_id=run_id, tracking_uri="sqlite://", log_metrics=lambda *a, **k: None,
                               finish=lambda *a, **k: None)

    def execute(search, data, plan, run, output_dir, *, resume, **kwargs):
        par = search.parallelism
        failed = int(par.mode == "data" and par.workers == 2)
        return SimpleNamespace(results=pd.DataFrame({"best_val_dice": [0.5 if failed else 0.7]}), failed=failed,
                               search_seconds=40.0)

    monkeypatch.setattr(compare, "preflight", lambda *a, **k: state)
    monkeypatch.setattr(compare, "ray_connection", lambda *a, **k: nullcontext())
    monkeypatch.setattr(compare, "check_capacity", lambda *a: None)
    monkeypatch.setattr(compare, "prepare_output", lambda *a, **k: None)
    monkeypatch.setattr(compare, "reopen_search_run", lambda spec, output_dir, run_id: fake_run(run_id))
    monkeypatch.setattr(compare, "open_search_run",
                        lambda search, output_dir, data, *, run_name, **k: fake_run(run_name))
    monkeypatch.setattr(compare, "execute_search", execute)
    monkeypatch.setattr(compare, "_log_table", lambda *a: None)
    (tmp_path / "out").mkdir()
    outcome = run_compare(spec, tmp_path / "out", progress=False)
    assert outcome.failed_cells == ["data x2"]
    row = outcome.table[(outcome.table["mode"] == "data") & (outcome.table["workers"] == 2)].iloc[0]
    assert row["status"] == "TRIALS_FAILED" and row["failed_trials"] == 1 and math.isnan(row["speedup"])
    others = outcome.table[outcome.table["status"] == "FINISHED"]
    assert len(others) == 3 and others["speedup"].notna().all()


def test_compare_refuses_more_workers_than_the_cluster_holds(ray_local, tmp_path: Path):
    tree = compare_tree(tmp_path / "data")
    tree["parallelism"]["workers"] = [1, 8]
    with pytest.raises(SpecError, match=r"\[8\] worker\(s\) do not fit"):
        run_compare(validate_spec(tree), tmp_path / "out", progress=False)
