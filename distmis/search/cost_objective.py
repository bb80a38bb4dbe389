"""``search.algorithm: optuna-cost``: Optuna's multi-objective TPE over two objectives, each trial's best value of
the search metric and its worker-hours, so that the configurations it proposes move along the front of dice against
cost rather than towards the best dice at any price (issue 51).

A trial's objectives as Optuna is told them when it ends (:class:`CostAwareOptuna`): its best value of
``search.metric`` over its epochs (the value its kept checkpoint holds, as the search ranks it), and its workers
times the seconds between its reports, added up (mode auto: the workers each epoch ran on), in hours: the
``worker_seconds`` its run records. The front itself is drawn on the search's run (:mod:`distmis.tracking.pareto`);
the registered model is the best by the metric, or within ``search.cost_limit`` (:mod:`distmis.search.cost_limit`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from ray.tune.search.optuna import OptunaSearch

from distmis.spec.schema import Spec

__all__ = ["COST_METRIC", "CostAwareOptuna"]

logger = logging.getLogger(__name__)

COST_METRIC = "worker_hours"


class CostAwareOptuna(OptunaSearch):
    """Ray Tune's ``OptunaSearch`` over ``[search.metric, worker_hours]`` (modes ``[search.mode, "min"]``), made with
    the search space itself; ``sampler``: a multi-objective Optuna sampler (TPE, seeded with ``training.seed``)."""

    def __init__(self, spec: Spec, space: dict[str, Any], sampler: Any):
        super().__init__(space=space, metric=[spec.search.selected_metric, COST_METRIC],
                         mode=[spec.search.mode, "min"], sampler=sampler)
        self.spec = spec
        self.best: dict[str, float] = {}
        self.worker_s: dict[str, float] = {}
        self.workers_by_trial: dict[str, int] = {}

    @property
    def metric(self) -> str:
        """What the trials report, which Tune checks their results for (and a concurrency limiter takes): the
        search metric. Its objectives (``_metric``, ``_mode``) add the worker-hours, this searcher's own count."""
        return self.spec.search.selected_metric

    @property
    def mode(self) -> str:
        return self.spec.search.mode

    def suggest(self, trial_id: str) -> dict | None:
        config = super().suggest(trial_id)
        if isinstance(config, dict):  # the workers the trial holds, by its layout
            from distmis.spec.layout import resolve_trial

            try:
                self.workers_by_trial[trial_id] = resolve_trial(self.spec, config)[1].world_size
            except Exception:  # noqa: BLE001 - a configuration the trial refuses: it fails with the reason itself
                self.workers_by_trial[trial_id] = 1
        return config

    def _workers(self, trial_id: str, result: dict) -> int:
        if result.get("workers"):  # mode auto: each epoch says its own
            return int(result["workers"])
        return self.workers_by_trial.get(trial_id, 1)

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        """Each epoch: the best value so far and the worker-seconds (Optuna takes no intermediate values of a
        multi-objective study)."""
        metric, mode = self.spec.search.selected_metric, self.spec.search.mode
        value = result.get(metric)
        if value is not None and math.isfinite(float(value)):
            best = self.best.get(trial_id)
            if best is None or (float(value) > best if mode == "max" else float(value) < best):
                self.best[trial_id] = float(value)
        seconds = float(result.get("time_this_iter_s") or 0.0)
        self.worker_s[trial_id] = self.worker_s.get(trial_id, 0.0) + seconds * self._workers(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        """Optuna is told the trial's best value and its worker-hours; a trial without a result failed (or, not
        failed, was pruned)."""
        import optuna

        if trial_id in self._completed_trials or trial_id not in self._ot_trials:
            return
        state = optuna.trial.TrialState.COMPLETE
        values: list[float] | None = None
        if result and trial_id in self.best:
            values = [self.best[trial_id], self.worker_s.get(trial_id, 0.0) / 3600]
        else:
            state = optuna.trial.TrialState.FAIL if error else optuna.trial.TrialState.PRUNED
        try:
            self._ot_study.tell(self._ot_trials[trial_id], values, state=state)
        except Exception:  # noqa: BLE001 - Optuna refuses the values (a NaN): the search goes on without them
            logger.warning("Optuna was not told trial %s's result", trial_id, exc_info=True)
        self._completed_trials.add(trial_id)
