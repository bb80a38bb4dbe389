"""The front of validation score against worker-hours (distmis.tracking.pareto): checked against a front computed
here another way (a sweep over the points sorted by cost), on random points with ties, on hand-made ones, and the
table and figure the search's end writes from a results table. End to end, on a search's run:
``tests/search/test_schedulers.py``."""

from __future__ import annotations

import math
import random

import pandas as pd
import pytest

from distmis.tracking.pareto import non_dominated, pareto_frame


def swept_front(points: list[tuple[float, float]], mode: str) -> set[int]:
    """The non-dominated points by a sweep: cheapest first (the better value first among equal costs), a point is on
    the front when its value beats every cheaper point's, or equals the best so far at the same cost as it."""
    sign = 1.0 if mode == "max" else -1.0
    order = sorted((i for i, (v, c) in enumerate(points) if math.isfinite(v) and math.isfinite(c)),
                   key=lambda i: (points[i][1], -sign * points[i][0]))
    front, best, best_cost = set(), -math.inf, None
    for i in order:
        value, cost = sign * points[i][0], points[i][1]
        if value > best or (value == best and cost == best_cost):
            front.add(i)
            best, best_cost = value, cost
    return front


@pytest.mark.parametrize("mode", ["max", "min"])
def test_the_front_is_the_non_dominated_points(mode: str):
    draws = random.Random(7)
    for _ in range(200):
        points = [(draws.choice([0.5, 0.6, 0.7, draws.random()]), draws.choice([1.0, 2.0, draws.random() * 3]))
                  for _ in range(draws.randint(1, 12))]
        if draws.random() < 0.2:
            points.append((math.nan, 1.0))
        assert set(non_dominated(points, mode)) == swept_front(points, mode), points


def test_by_hand():
    points = [(0.9, 2.0), (0.8, 1.0), (0.85, 3.0), (0.8, 1.0), (0.95, 5.0), (math.nan, 0.1)]
    assert non_dominated(points, "max") == [0, 1, 3, 4]  # (0.85, 3) is beaten by (0.9, 2); equal points both stay
    assert non_dominated([(0.2, 1.0), (0.1, 1.0)], "min") == [1]  # a loss: the lower the better


def test_the_table_puts_the_front_first_cheapest_first_and_the_figure_draws_it():
    from distmis.tracking.figures import pareto_figure

    results = pd.DataFrame({"trial": ["t0 lr=1", "t1 lr=2", "t2 lr=3", "t3 lr=4"],
                            "best_val_dice": [0.9, 0.7, 0.8, 0.6], "worker_h": [2.0, 0.5, 3.0, 0.4]})
    frame = pareto_frame(results, "best_val_dice", "max")
    assert list(frame["trial"]) == ["t3 lr=4", "t1 lr=2", "t0 lr=1", "t2 lr=3"]
    assert list(frame["pareto"]) == [True, True, True, False]
    assert pareto_frame(results.drop(columns="worker_h"), "best_val_dice", "max").empty
    figure = pareto_figure(frame, "best_val_dice")
    [ax] = figure.axes
    assert ax.get_xlabel().startswith("worker-hours") and ax.get_ylabel() == "best_val_dice"
    grey = ax.collections[0].get_offsets()
    assert [tuple(p) for p in grey] == [(3.0, 0.8)]  # the dominated trial, drawn grey
