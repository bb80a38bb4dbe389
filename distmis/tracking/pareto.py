"""The search's front of validation score against cost (issue 51): each trial's (or, with folds, each
configuration's) best selected metric against the worker-hours it held, and the trials no other beats on both: a
trial is dominated when another is at least as good on the metric and cost no more, and better on one of the two.
Written by the search's end as ``pareto.md`` / ``pareto.csv`` and drawn as ``pareto.png`` on the search's run."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import pandas as pd

if TYPE_CHECKING:
    from distmis.tracking.mlflow_tracking import SearchRun

__all__ = ["non_dominated", "pareto_frame", "record_pareto"]

logger = logging.getLogger(__name__)


def non_dominated(points: Sequence[tuple[float, float]], mode: Literal["max", "min"]) -> list[int]:
    """The indices of ``points`` ``(value, cost)`` that no other point dominates (value by ``mode``, cost the
    lower the better), in their order; a point with a non-finite value or cost is in no front. Equal points do not
    dominate each other: both are on the front."""
    sign = 1.0 if mode == "max" else -1.0
    finite = [i for i, (value, cost) in enumerate(points) if math.isfinite(value) and math.isfinite(cost)]
    front = []
    for i in finite:
        value, cost = sign * points[i][0], points[i][1]
        beaten = any(sign * points[j][0] >= value and points[j][1] <= cost
                     and (sign * points[j][0] > value or points[j][1] < cost) for j in finite if j != i)
        if not beaten:
            front.append(i)
    return front


def pareto_frame(results: pd.DataFrame, metric: str, mode: Literal["max", "min"]) -> pd.DataFrame:
    """The results table (:func:`~distmis.tracking.results.results_frame`) with ``pareto``: whether each row is on
    the front of ``metric`` (its ``best_<metric>`` or ``cv_<metric>`` column) against ``worker_h``; the front's rows
    first, cheapest first. Empty when the table has neither column."""
    if results.empty or metric not in results or "worker_h" not in results:
        return pd.DataFrame()
    points = [(float(v), float(c)) for v, c in zip(results[metric].astype(float), results["worker_h"].astype(float))]
    front = set(non_dominated(points, mode))
    frame = results.assign(pareto=[i in front for i in range(len(results))])
    return frame.sort_values(["pareto", "worker_h"], ascending=[False, True], kind="stable").reset_index(drop=True)


def record_pareto(search_run: SearchRun, results: pd.DataFrame, metric: str, mode: Literal["max", "min"]) -> None:
    """The front of ``metric`` against worker-hours on the search's run: ``pareto.md`` / ``.csv`` (every row, the
    front's first) and ``pareto.png``. Never raises: a figure never stops the search's end."""
    from distmis.tracking.figures import pareto_figure
    from distmis.tracking.results import format_results

    try:
        frame = pareto_frame(results, metric, mode)
        if frame.empty or not frame["pareto"].any():
            return
        search_run.log_text(format_results(frame, "csv"), "pareto.csv")
        search_run.log_text(format_results(frame, "markdown"), "pareto.md")
        title = f"{metric} against cost: {int(frame['pareto'].sum())} of {len(frame)} on the front"
        search_run.log_figure(pareto_figure(frame, metric, title=title), "pareto.png")
    except Exception as exc:  # noqa: BLE001 - a record of the cost never stops the search's end
        logger.warning("no Pareto front of %s against worker-hours: %s", metric, exc)
