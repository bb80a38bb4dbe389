"""Read a search's results back from MLflow as a table (one row per trial, best first).

The driver prints this table at the end of a search and ``distmis results`` prints it later:
both read the MLflow store, so what a user sees is what was recorded.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal, Sequence

import pandas as pd
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from distmis.tracking.mlflow_tracking import (
    CLASS_DICE_PREFIX, INFERENCE_METRICS, METRIC_TAG, MODE_TAG, PARENT_TAG, RESUMES_TAG, ROLE_TAG, SEARCHED_TAG,
    short_name,
)

Format = Literal["table", "csv", "json", "markdown"]
MODES = ("experiment", "data")  # the two sides of a comparison
RESUMED_CELL = "RESUMED"  # a comparison cell finished after a resume: its results hold, its time is not measured


class ResultsNotFound(LookupError):
    pass


def find_search_run(client: MlflowClient, experiment: str, run_id: str | None = None) -> Run:
    """The given run, or the newest top-level search or comparison run of ``experiment``."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = [e.name for e in client.search_experiments()]
        raise ResultsNotFound(f"no MLflow experiment named {experiment!r}; experiments in this store: {names}")
    if run_id is not None:
        return client.get_run(run_id)
    runs = [
        run
        for role in ("search", "compare")
        for run in client.search_runs([exp.experiment_id], filter_string=f"tags.`{ROLE_TAG}` = '{role}'",
                                      order_by=["attributes.start_time DESC"], max_results=100)
        if PARENT_TAG not in run.data.tags  # a comparison's searches are its children
    ]
    runs.sort(key=lambda run: run.info.start_time, reverse=True)
    if not runs:
        raise ResultsNotFound(f"experiment {experiment!r} holds no distmis search run")
    return runs[0]


def trial_runs(client: MlflowClient, parent: Run) -> list[Run]:
    return client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'",
        max_results=10_000,
    )


def best_epoch_values(client: MlflowClient, run: Run, names: Sequence[str], epoch: int | None) -> dict[str, float]:
    """The values the trial ``run`` logged for each metric of ``names`` at ``epoch`` (its step); NaN where it logged
    none (no best epoch, or a metric that epoch lacks)."""
    values = {name: math.nan for name in names}
    if epoch is None:
        return values
    for name in names:
        at_epoch = [m.value for m in client.get_metric_history(run.info.run_id, name) if m.step == epoch]
        if at_epoch:
            values[name] = at_epoch[-1]
    return values


def results_frame(client: MlflowClient, parent: Run) -> pd.DataFrame:
    """One row per trial: status, searched values, best metric and epoch, each scored channel's validation dice at
    that best epoch (``val_dice_<key>``: the data set's classes or regions), test dice (the trials scored on the
    test split: ``search.evaluate_top``), epochs, seconds, error."""
    searched: list[str] = json.loads(parent.data.tags.get(SEARCHED_TAG, "[]"))
    metric = parent.data.tags.get(METRIC_TAG, "val_dice")
    mode = parent.data.tags.get(MODE_TAG, "max")
    rows: list[dict[str, Any]] = []
    for run in trial_runs(client, parent):
        m, p = run.data.metrics, run.data.params
        row: dict[str, Any] = {"trial": run.info.run_name, "status": run.info.status}
        for path in searched:
            row[short_name(path)] = p.get(path)
        row[f"best_{metric}"] = m.get(f"best_{metric}", math.nan)
        row["best_epoch"] = int(m["best_epoch"]) if "best_epoch" in m else None
        per_class = sorted(name for name in m if name.startswith(CLASS_DICE_PREFIX))
        row.update(best_epoch_values(client, run, per_class, row["best_epoch"]))
        row.update({name: value for name, value in sorted(m.items()) if name.startswith("test_dice_")})
        if any(name in m for name in INFERENCE_METRICS):  # training.inference.compare (no tile: no sliding window)
            row.update({name: m.get(name, math.nan) for name in INFERENCE_METRICS})
        row["epochs"] = int(m.get("epochs_completed", 0))
        row["elapsed_s"] = round(m.get("elapsed_seconds", math.nan), 1)
        row["num_params"] = p.get("model.num_parameters")
        row["error"] = run.data.tags.get("error", "")
        row["run_id"] = run.info.run_id
        rows.append(row)
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    frame = frame.sort_values(f"best_{metric}", ascending=(mode == "min"), na_position="last", kind="stable")
    return frame.reset_index(drop=True)


def inference_frame(results: pd.DataFrame) -> pd.DataFrame:
    """LAMP's table from a search's :func:`results_frame`: per trial that compared its inference
    (``training.inference.compare``), its searched values, its best validation dice, and the dice and seconds per
    case of its best model by whole-volume and by sliding-window inference; empty when no trial compared."""
    if results.empty or "whole_volume_seconds" not in results:
        return pd.DataFrame()
    compared = results[results["whole_volume_seconds"].notna()]
    names = list(results.columns)
    best = next(c for c in names if c.startswith("best_"))  # best_<metric>: the searched values come before it
    searched = names[names.index("status") + 1 : names.index(best)]
    columns = ["trial", *searched, best, "num_params", *(c for c in INFERENCE_METRICS if c in results)]
    return compared[columns].reset_index(drop=True)


def to_markdown(frame: pd.DataFrame) -> str:
    columns = list(frame.columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for _, row in frame.iterrows():
        lines.append("| " + " | ".join(_cell(row[c]) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.4g}"
    return "" if value is None else str(value)


def format_results(frame: pd.DataFrame, fmt: Format = "table") -> str:
    if fmt == "csv":
        return frame.to_csv(index=False)
    if fmt == "json":
        return frame.to_json(orient="records", indent=2)
    if fmt == "markdown":
        return to_markdown(frame)
    if fmt == "table":
        shown = frame.drop(columns=["run_id"], errors="ignore")
        if "error" in shown and not shown["error"].astype(bool).any():
            shown = shown.drop(columns=["error"])
        return shown.to_string(index=False, float_format=lambda v: f"{v:.4f}", na_rep="")  # blank: not scored
    raise ValueError(f"format must be table, csv, json or markdown, got {fmt!r}")


def speedup_table(cells: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """Rows ``{mode, workers, elapsed_s, best_<metric>, trials, failed_trials, status}`` -> the speedup table.

    Speedup is ``T1 / TN`` with ``T1`` the same mode's 1-worker time; efficiency is ``speedup / N``.
    A cell that did not finish has no speedup.
    """
    frame = pd.DataFrame(list(cells))
    if frame.empty:
        return frame
    frame = frame.sort_values(["mode", "workers"], key=lambda c: c.map(MODES.index) if c.name == "mode" else c)
    baseline = {
        row["mode"]: row["elapsed_s"]
        for _, row in frame.iterrows()
        if row["workers"] == 1 and row["status"] == "FINISHED"
    }
    speedups = []
    for _, row in frame.iterrows():
        t1 = baseline.get(row["mode"])
        ok = row["status"] == "FINISHED" and t1 is not None and row["elapsed_s"] > 0
        speedups.append(t1 / row["elapsed_s"] if ok else math.nan)
    frame["speedup"] = speedups
    frame["efficiency"] = frame["speedup"] / frame["workers"]
    best = [c for c in frame.columns if c.startswith("best_")]  # best_<metric> of the search
    columns = ["mode", "workers", "elapsed_s", "speedup", "efficiency", *best, "trials", "failed_trials", "status"]
    if "error" in frame:
        frame["error"] = frame["error"].fillna("")
        columns.append("error")
    return frame[columns].reset_index(drop=True)


def comparison_frame(client: MlflowClient, parent: Run) -> pd.DataFrame:
    """The speedup table of a comparison run, rebuilt from its (mode, workers) child search runs."""
    metric = parent.data.tags.get(METRIC_TAG, "val_dice")
    cells = []
    for run in trial_runs(client, parent):
        tags, m = run.data.tags, run.data.metrics
        if "distmis.compare.mode" not in tags:
            continue
        failed = int(m.get("failed_trials", 0))
        finished = run.info.status == "FINISHED" and "search_seconds" in m
        status = ("FINISHED" if failed == 0 else "TRIALS_FAILED") if finished else "FAILED"
        resumed = finished and RESUMES_TAG in tags  # its time is only the part after the resume
        cells.append({
            "mode": tags["distmis.compare.mode"],
            "workers": int(tags["distmis.compare.workers"]),
            "elapsed_s": math.nan if resumed else round(m.get("search_seconds", math.nan), 2),
            f"best_{metric}": m.get(f"best_{metric}", math.nan),
            "trials": int(m.get("trials", 0)),
            "failed_trials": failed,
            "status": RESUMED_CELL if resumed and failed == 0 else status,
        })
    return speedup_table(cells)
