"""Read a search's results back from MLflow as a table (one row per trial, best first).

The driver prints this table at the end of a search and ``distmis results`` prints it later:
both read the MLflow store, so what a user sees is what was recorded.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

import pandas as pd
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from distmis.tracking.mlflow_tracking import METRIC_TAG, MODE_TAG, PARENT_TAG, ROLE_TAG, SEARCHED_TAG

Format = Literal["table", "csv", "json", "markdown"]


class ResultsNotFound(LookupError):
    pass


def find_search_run(client: MlflowClient, experiment: str, run_id: str | None = None) -> Run:
    """The given parent run, or the newest search run of ``experiment``."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = [e.name for e in client.search_experiments()]
        raise ResultsNotFound(f"no MLflow experiment named {experiment!r}; experiments in this store: {names}")
    if run_id is not None:
        return client.get_run(run_id)
    runs = client.search_runs(
        [exp.experiment_id],
        filter_string=f"tags.`{ROLE_TAG}` = 'search'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if not runs:
        raise ResultsNotFound(f"experiment {experiment!r} holds no distmis search run")
    return runs[0]


def trial_runs(client: MlflowClient, parent: Run) -> list[Run]:
    return client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'",
        max_results=10_000,
    )


def short_name(path: str) -> str:
    """``training.optimizer.lr`` -> ``lr``; keeps the table narrow."""
    return path.rsplit(".", 1)[-1]


def results_frame(client: MlflowClient, parent: Run) -> pd.DataFrame:
    """One row per trial: status, searched values, best metric and epoch, epochs, seconds, error."""
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
        return shown.to_string(index=False, float_format=lambda v: f"{v:.4f}")
    raise ValueError(f"format must be table, csv, json or markdown, got {fmt!r}")
