"""The search's front of validation score against cost (issue 51): each trial's (or, with folds, each
configuration's) best selected metric against the worker-hours it held, and the trials no other beats on both: a
trial is dominated when another is at least as good on the metric and cost no more, and better on one of the two.
Written by the search's end as ``pareto.md`` / ``pareto.csv`` and drawn as ``pareto.png`` on the search's run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import pandas as pd

__all__ = ["non_dominated", "pareto_frame"]


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
