"""``search.cost_limit``: the registered model is the best of the trials (with folds: configurations) whose
worker-hours are within the limit, rather than the best of all.

A trial's worker-hours are its run's ``worker_seconds`` / 3600 (its workers times its wall time, as the results
table's ``worker_h`` and the Pareto front count them); a configuration's, with cross-validation folds, are its folds'
together."""

from __future__ import annotations

from typing import Mapping

__all__ = ["within_cost_limit"]


def within_cost_limit(finished: set[str], worker_seconds: Mapping[str, float],
                      trial_folds: Mapping[str, tuple[str, int]], limit_hours: float | None) -> set[str]:
    """The trials of ``finished`` that may become the model: every one without a limit; else those whose
    worker-hours (``worker_seconds``, by trial; a trial without a record has none within any limit) are at most
    ``limit_hours``, or with folds (``trial_folds``: trial -> (configuration, fold)) those whose configuration's
    folds together are."""
    if limit_hours is None:
        return set(finished)
    limit = limit_hours * 3600

    def cost(trial: str) -> float:
        if trial not in trial_folds:
            return worker_seconds.get(trial, float("inf"))
        configuration = trial_folds[trial][0]
        return sum(worker_seconds.get(other, float("inf"))
                   for other, (owner, _) in trial_folds.items() if owner == configuration)

    return {trial for trial in finished if cost(trial) <= limit}
