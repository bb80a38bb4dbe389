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
    CLASS_DICE_PREFIX, CONFIGURATION_ROLE, FOLD_TAG, INFERENCE_METRICS, METRIC_TAG, MODE_TAG, PARENT_TAG, RESUMES_TAG,
    ROLE_TAG, SEARCHED_TAG, STOPPED_TAG, short_name,
)

Format = Literal["table", "csv", "json", "markdown"]
MODES = ("experiment", "data", "auto")  # the modes a comparison may run, in its table's order
PREDICTED_MAKESPAN = "predicted_makespan_s"  # a comparison cell's run: the model's makespan of it (predicted_s)
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
    """One row per trial (per configuration in a search with cross-validation folds: :func:`cv_results_frame`): status, searched values, best metric and epoch, each scored channel's validation dice at
    that best epoch (``val_dice_<key>``: the data set's classes or regions), test dice (the trials scored on the
    test split: ``search.evaluate_top``), epochs, seconds, worker-hours (the workers it held times its time),
    error."""
    searched: list[str] = json.loads(parent.data.tags.get(SEARCHED_TAG, "[]"))
    metric = parent.data.tags.get(METRIC_TAG, "val_dice")
    mode = parent.data.tags.get(MODE_TAG, "max")
    children = trial_runs(client, parent)
    if any(run.data.tags.get(ROLE_TAG) == CONFIGURATION_ROLE for run in children):
        return cv_results_frame(client, children, searched, metric, mode)
    rows: list[dict[str, Any]] = []
    stopped_any = any(STOPPED_TAG in run.data.tags for run in children)
    for run in children:
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
        row["worker_h"] = round(m.get("worker_seconds", math.nan) / 3600, 4)
        row["num_params"] = p.get("model.num_parameters")
        if stopped_any:  # "<scheduler> at epoch <n> of <N>" for the trials a scheduler stopped early
            row["stopped"] = run.data.tags.get(STOPPED_TAG, "")
        row["error"] = run.data.tags.get("error", "")
        row["run_id"] = run.info.run_id
        rows.append(row)
    return _ranked(rows, f"best_{metric}", mode)


def cv_results_frame(client: MlflowClient, configurations: Sequence[Run], searched: Sequence[str], metric: str,
                     mode: str) -> pd.DataFrame:
    """One row per configuration of a cross-validated search, best first: status, searched values,
    ``cv_<metric>`` (the mean over its folds of each fold's best value) and ``cv_<metric>_std``, how many folds
    finished, each fold's best value (``fold<i>_<metric>``), the fold ensemble's test scores (the configurations
    scored: ``search.evaluate_top``), the folds' epochs and seconds added up, the fold runs' errors."""
    rows: list[dict[str, Any]] = []
    for run in configurations:
        m, p = run.data.metrics, run.data.params
        folds = trial_runs(client, run)
        row: dict[str, Any] = {"configuration": run.info.run_name, "status": run.info.status}
        for path in searched:
            row[short_name(path)] = p.get(path)
        row[f"cv_{metric}"] = m.get(f"cv_{metric}", math.nan)
        row[f"cv_{metric}_std"] = m.get(f"cv_{metric}_std", math.nan)
        row["folds"] = sum(fold.info.status == "FINISHED" for fold in folds)
        for name in sorted(k for k in m if k.startswith("fold") and k.endswith(f"_{metric}")):
            row[name] = m[name]
        row.update({name: value for name, value in sorted(m.items()) if name.startswith("test_dice_")})
        row["epochs"] = sum(int(fold.data.metrics.get("epochs_completed", 0)) for fold in folds)
        row["elapsed_s"] = round(sum(fold.data.metrics.get("elapsed_seconds", 0.0) for fold in folds), 1)
        row["worker_h"] = round(sum(fold.data.metrics.get("worker_seconds", 0.0) for fold in folds) / 3600, 4)
        row["num_params"] = p.get("model.num_parameters") or next(
            (fold.data.params["model.num_parameters"] for fold in folds if "model.num_parameters" in fold.data.params),
            None)
        errors = [f"fold {fold.data.tags.get(FOLD_TAG)}: {fold.data.tags['error']}" for fold in folds
                  if fold.data.tags.get("error")]
        row["error"] = "; ".join([*([run.data.tags["error"]] if run.data.tags.get("error") else []), *errors])
        row["run_id"] = run.info.run_id
        rows.append(row)
    return _ranked(rows, f"cv_{metric}", mode)


def _ranked(rows: list[dict[str, Any]], column: str, mode: str) -> pd.DataFrame:
    """``rows`` as a table, best ``column`` first (``mode`` max or min), unscored rows last."""
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    frame = frame.sort_values(column, ascending=(mode == "min"), na_position="last", kind="stable")
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
        shown = _mean_and_std(frame.drop(columns=["run_id"], errors="ignore"))
        if "error" in shown and not shown["error"].astype(bool).any():
            shown = shown.drop(columns=["error"])
        return shown.to_string(index=False, float_format=lambda v: f"{v:.4f}", na_rep="")  # blank: not scored
    raise ValueError(f"format must be table, csv, json or markdown, got {fmt!r}")


def _mean_and_std(frame: pd.DataFrame) -> pd.DataFrame:
    """For a person: each ``cv_<metric>`` column with its ``_std`` beside it as one ``mean ± std`` column, without
    the folds' own values (the CSV keeps them all)."""
    means = [c for c in frame.columns if c.startswith("cv_") and not c.endswith("_std") and f"{c}_std" in frame]
    if not means:
        return frame
    shown = frame.copy()
    for column in means:
        shown[column] = [_plus_minus(mean, std) for mean, std in zip(frame[column], frame[f"{column}_std"])]
    folds = [c for c in frame.columns if c.startswith("fold") and c != "folds"]
    return shown.drop(columns=[*(f"{c}_std" for c in means), *folds])


def _plus_minus(mean: float, std: float) -> str:
    if mean is None or math.isnan(mean):
        return ""
    return f"{mean:.4f}" if std is None or math.isnan(std) else f"{mean:.4f} ± {std:.4f}"


REPEAT_TAG = "distmis.compare.repeat"  # a comparison cell's run: which repeat of its (mode, workers) cell, 1-based
TIME_STATISTICS = ("elapsed_s", "speedup", "efficiency")  # each with a ``_std`` column when cells were repeated


def speedup_table(cells: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """Rows ``{mode, workers, repeat, elapsed_s, best_<metric>, trials, failed_trials, status}`` (one per run of a
    cell; ``repeat`` 1-based, 1 when absent) -> the speedup table, one row per (mode, workers).

    A repeat *finished* when its status is FINISHED (all trials finished, the time measured: not RESUMED).
    ``elapsed_s`` is the mean over the finished repeats (a cell none of whose repeats finished shows the time its
    searches took, if measured, as a single run does, and has no speedup). The speedup of repeat ``r`` is
    ``T1_r / TN_r``, with ``T1_r`` the same mode's 1-worker time in the same repeat (the interleaved order runs them
    close together); ``speedup`` is its mean over the repeats where both finished, ``efficiency`` is ``speedup / N``.

    When any cell has a repeat above 1, the table has ``repeats`` (how many finished) and the sample standard
    deviations (ddof=1; NaN with fewer than two) ``elapsed_s_std``, ``speedup_std`` and ``efficiency_std``;
    ``best_<metric>`` is then the mean over the repeats, ``trials`` and ``failed_trials`` their sums, ``status`` the
    repeats' common status or, when they differ, ``FINISHED`` (if any did) and each other one as ``#r STATUS``.
    A comparison of one repeat has today's columns only: mode, workers, elapsed_s, speedup, efficiency,
    best_<metric>, trials, failed_trials, status (and error).
    """
    frame = pd.DataFrame(list(cells))
    if frame.empty:
        return frame
    frame["repeat"] = frame["repeat"].fillna(1).astype(int) if "repeat" in frame else 1
    repeated = bool(frame["repeat"].max() > 1)
    frame = frame.sort_values(["mode", "workers", "repeat"],
                              key=lambda c: c.map(MODES.index) if c.name == "mode" else c)
    finished = frame["status"].eq("FINISHED") & frame["elapsed_s"].gt(0)  # NaN (not measured) is not > 0
    baseline = {(row.mode, row.repeat): row.elapsed_s for row in frame[finished & frame["workers"].eq(1)].itertuples()}
    frame["_speedup"] = [baseline.get((row.mode, row.repeat), math.nan) / row.elapsed_s if ok else math.nan
                         for ok, row in zip(finished, frame.itertuples())]
    best = [c for c in frame.columns if c.startswith("best_")]  # best_<metric> of the search
    rows = []
    for (mode, workers), group in frame.groupby(["mode", "workers"], sort=False):
        done = finished[group.index]
        times = group.loc[done, "elapsed_s"] if done.any() else group["elapsed_s"].dropna()
        speedups = group["_speedup"].dropna()
        row: dict[str, Any] = {"mode": mode, "workers": workers, "repeats": int(done.sum()),
                               "elapsed_s": round(times.mean(), 2), "elapsed_s_std": round(times.std(), 2),
                               "speedup": speedups.mean(), "speedup_std": speedups.std()}
        row["efficiency"], row["efficiency_std"] = row["speedup"] / workers, row["speedup_std"] / workers
        row.update({c: group[c].mean() for c in best})
        if "predicted_s" in group:  # the model's makespan of the cell (distmis.search.compare)
            row["predicted_s"] = group["predicted_s"].mean()
        row["trials"], row["failed_trials"] = int(group["trials"].sum()), int(group["failed_trials"].sum())
        row["status"] = _repeats_status(list(group["repeat"]), list(group["status"]))
        if "error" in group:
            errors = [(r, e) for r, e in zip(group["repeat"], group["error"]) if isinstance(e, str) and e]
            row["error"] = "; ".join(f"#{r}: {e}" if repeated else e for r, e in errors)
        rows.append(row)
    table = pd.DataFrame(rows)
    if repeated:
        statistics = [name for column in TIME_STATISTICS for name in (column, f"{column}_std")]
        columns = ["mode", "workers", "repeats", *statistics]
    else:
        columns = ["mode", "workers", *TIME_STATISTICS]
    columns += [*(["predicted_s"] if "predicted_s" in table else []), *best, "trials", "failed_trials", "status",
                *(["error"] if "error" in table else [])]
    return table[columns]


def _repeats_status(repeats: list[int], statuses: list[str]) -> str:
    """One cell's status over its repeats: their common one, else FINISHED (if any did) and ``#r STATUS`` for the
    others."""
    if len(set(statuses)) == 1:
        return statuses[0]
    others = [f"#{r} {s}" for r, s in zip(repeats, statuses) if s != "FINISHED"]
    return ", ".join(["FINISHED", *others] if "FINISHED" in statuses else others)


def format_comparison(table: pd.DataFrame, fmt: Format = "table") -> str:
    """A speedup table for a person (``table``): each of elapsed_s, speedup and efficiency as ``mean ± std`` when
    the cells were repeated (just the mean where one repeat finished); other formats as :func:`format_results`,
    the std columns apart."""
    if fmt != "table" or "elapsed_s_std" not in table:
        return format_results(table, fmt)
    shown = table.copy()
    for column, digits in zip(TIME_STATISTICS, (2, 3, 3)):
        shown[column] = [_mean_std_text(mean, std, digits) for mean, std in zip(table[column], table[f"{column}_std"])]
    shown = shown.drop(columns=[f"{column}_std" for column in TIME_STATISTICS])
    return format_results(shown, "table")


def _mean_std_text(mean: float, std: float, digits: int) -> str:
    if math.isnan(mean):
        return ""
    return f"{mean:.{digits}f}" if math.isnan(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def comparison_frame(client: MlflowClient, parent: Run) -> pd.DataFrame:
    """The speedup table of a comparison run, rebuilt from its child search runs, one per (mode, workers, repeat)
    (a run without the repeat tag, from before repeats, is repeat 1)."""
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
            "repeat": int(tags.get(REPEAT_TAG, 1)),
            "elapsed_s": math.nan if resumed else round(m.get("search_seconds", math.nan), 2),
            f"best_{metric}": m.get(f"best_{metric}", math.nan),
            "trials": int(m.get("trials", 0)),
            "failed_trials": failed,
            "status": RESUMED_CELL if resumed and failed == 0 else status,
            **({"predicted_s": m[PREDICTED_MAKESPAN]} if PREDICTED_MAKESPAN in m else {}),
        })
    return speedup_table(cells)
