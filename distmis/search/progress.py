"""A search as a whole: the trials ended, running and left, the best so far, and an estimate of the time left.

:class:`SearchProgress` is a Tune callback in the driver, beside the MLflow callback and the console. After every
trial that ends (finished, failed, or stopped early by a scheduler such as ASHA) it has a :class:`ProgressFigures`,
which it logs on the search's MLflow run (:meth:`ProgressFigures.metrics`, stepped by the number of trials ended)
and the console prints as one line.

**Counting.** The total is the plan's: grid points x ``num_samples``, times the folds with cross-validation
(:func:`~distmis.search.search_space.num_trials`). A trial has *ended* once Tune completed or failed it (a trial a
scheduler stopped early has ended, and is counted among the stopped early); *running* is a trial Tune is running;
*left* is the rest, those made and waiting for room and those not made yet. A resumed search counts the trials
that ended before it was interrupted.

**The estimate of the time left** (:func:`seconds_left`), from what this driver measured:

* a *trial-epoch* takes the mean of the epochs timed so far: the driver's clock from a trial's report of an epoch
  to its report of the next (validation and the checkpoint included). A trial's first epoch after it starts (or is
  restarted) also holds its start-up, so it is used only until some trial has reported two epochs; the epochs a
  restarted trial replays are not counted;
* what is left is each running trial's remaining epochs, each waiting trial's (a trial of a resumed search that
  trained some epochs before has its remaining ones), and ``training.epochs`` for each trial not made yet;
* the trials run ``at_once`` at a time, the plan's concurrency (``parallelism.max_concurrent_trials``, or as many
  as the cluster holds): each waiting trial starts on the first slot that frees, and the time left is when the last
  slot is free, in trial-epochs, times the mean trial-epoch.

It assumes that the trials left take as long an epoch as those measured (a searched network or tile size that
changes the epoch's time makes it rougher) and that every trial trains all its epochs: with ASHA, which stops
trials early, it is an upper bound. It leaves out the trials' start-up: a search's trials reuse its processes (and
a data-mode search its worker group), so only the first ones start cold; a hybrid search's trial starts its Ray
Train workers anew each time, and that time is missing from the estimate. It does not include the
search's end either (scoring the best model on the test split, publishing it).
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ray import tune

from distmis.spec.schema import Spec
from distmis.tracking.mlflow_tracking import searched_values
from distmis.trial.record import HISTORY_KEY

__all__ = ["ProgressFigures", "SearchProgress", "seconds_left", "trial_label"]

logger = logging.getLogger(__name__)

ENDED = ("TERMINATED", "ERROR")  # Tune's statuses of a trial that has ended
ACTIVE = ("RUNNING", "PAUSED")


def trial_label(trial_id: str, config: Mapping[str, Any]) -> str:
    """A trial by its searched values (``lr=0.005 norm=group``); by its number when nothing is searched."""
    return searched_values(config) or f"trial {trial_id.rsplit('_', 1)[-1]}"


def seconds_left(running: Sequence[float], waiting: Sequence[float], seconds_per_epoch: float, at_once: int) -> float:
    """The time until the last trial ends: ``running``, the epochs each running trial has left; ``waiting``, the
    epochs of each trial still to start, in the order they start; ``at_once`` trials at a time (more when more are
    running). Each waiting trial starts on the slot that frees first."""
    slots = [float(epochs) for epochs in running] + [0.0] * max(0, max(1, at_once) - len(running))
    heapq.heapify(slots)
    for epochs in waiting:
        heapq.heappush(slots, heapq.heappop(slots) + float(epochs))
    return max(slots, default=0.0) * seconds_per_epoch


@dataclass(frozen=True)
class ProgressFigures:
    """Where a search stands (see the module's docstring)."""

    total: int
    ended: int  # finished, failed or stopped early
    failed: int
    stopped_early: int
    running: int
    left: int  # not started yet
    best: tuple[float, str, int] | None  # the best value of the metric so far, its trial's label and its epoch
    seconds_per_epoch: float | None  # the mean trial-epoch measured, None before the first
    epochs_left: float  # trial-epochs
    at_once: int
    seconds_left: float | None  # None while no epoch was measured and some are left

    def metrics(self, metric: str) -> dict[str, float]:
        """The figures as the search run's metrics."""
        out = {"search_trials_finished": float(self.ended), "search_trials_failed": float(self.failed),
               "search_trials_running": float(self.running), "search_trials_left": float(self.left)}
        if self.best is not None:
            out[f"search_best_{metric}"] = self.best[0]
        if self.seconds_per_epoch is not None:
            out["search_epoch_seconds"] = self.seconds_per_epoch
        if self.seconds_left is not None:
            out["search_eta_seconds"] = self.seconds_left
        return out


@dataclass
class _Trial:
    epochs: int  # the epochs it trains
    last_epoch: int = 0  # the last epoch it reported (replayed ones included)
    best: tuple[float, int] | None = None  # its best value of the metric and that epoch
    mark: float | None = None  # when it started or last reported an epoch (the driver's clock)
    warm: bool = False  # its mark is a report of a trained epoch (the next interval is a whole epoch, no start-up)


class SearchProgress(tune.Callback):
    """Counts a search's trials and times their epochs (see the module's docstring).

    ``total``: the trials the search runs; ``at_once``: how many run at once; ``record(metrics, step)``: where the
    figures go after each trial ends (the search run's :meth:`~distmis.tracking.mlflow_tracking.SearchRun.log_metrics`);
    ``clock``: seconds. It is given to Tune through the MLflow callback's handle, which forwards Tune's calls to it
    before the console's (the console prints its figures).
    """

    def __init__(self, spec: Spec, *, total: int, at_once: int,
                 record: Callable[[dict[str, float], int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.metric, self.mode = spec.search.selected_metric, spec.search.mode
        self.epochs = spec.training.epochs
        self.total, self.at_once = int(total), max(1, int(at_once))
        self.record, self.clock = record, clock
        self.trials: dict[str, _Trial] = {}
        self.configs: dict[str, Mapping[str, Any]] = {}
        self.status: dict[str, str] = {}  # trial id -> Tune's status, as last seen
        self.ended_here: dict[str, str] = {}  # trial id -> "finished", "stopped" or "failed", as this driver saw it
        self.seconds = 0.0  # trial-epochs timed, from a report to the next: their seconds and count
        self.timed = 0
        self.first_seconds = 0.0  # a trial's first epoch after it started: start-up included
        self.first_timed = 0

    # ------------------------------------------------------------------ what a trial did
    def _trial(self, trial_id: str) -> _Trial:
        if trial_id not in self.trials:
            epochs = (self.configs.get(trial_id) or {}).get("training.epochs", self.epochs)
            self.trials[trial_id] = _Trial(int(epochs))
        return self.trials[trial_id]

    def _epoch(self, trial_id: str, epoch: int, value: Any) -> None:
        trial = self._trial(trial_id)
        trial.last_epoch = max(trial.last_epoch, epoch)
        if isinstance(value, (int, float)) and math.isfinite(value):
            if trial.best is None or (value > trial.best[0] if self.mode == "max" else value < trial.best[0]):
                trial.best = (float(value), epoch)

    def adopt(self, best: Mapping[str, tuple[float, int]], epochs: Mapping[str, int]) -> None:
        """A resumed search: each trial's best and last epoch as its MLflow run holds them (the MLflow callback's
        :meth:`~distmis.tracking.mlflow_tracking.MLflowTrialCallback.adopt_existing_runs`)."""
        for trial_id, last in epochs.items():
            self._trial(trial_id).last_epoch = max(self._trial(trial_id).last_epoch, int(last))
        for trial_id, (value, epoch) in best.items():
            self._epoch(trial_id, int(epoch), value)

    def best_of(self, trial_id: str) -> tuple[float, int] | None:
        """The trial's best value of the metric and its epoch, over every epoch it trained (before a restart or an
        interruption too)."""
        trial = self.trials.get(trial_id)
        return trial.best if trial else None

    def last_epoch(self, trial_id: str) -> int:
        trial = self.trials.get(trial_id)
        return trial.last_epoch if trial else 0

    def _observe(self, trials: Sequence[Any]) -> None:
        """Tune's trials as they stand (a resumed search's include those that ended before it)."""
        for trial in trials:
            config = self.configs[trial.trial_id] = getattr(trial, "config", None) or {}
            self.status[trial.trial_id] = str(getattr(trial, "status", ""))
            if "training.epochs" in config:
                self._trial(trial.trial_id).epochs = int(config["training.epochs"])
            if self.status[trial.trial_id] in ENDED:
                last = (getattr(trial, "last_result", None) or {}).get("epoch")
                if isinstance(last, (int, float)):
                    self._trial(trial.trial_id).last_epoch = max(self._trial(trial.trial_id).last_epoch, int(last))

    # ------------------------------------------------------------------ the figures
    def figures(self) -> ProgressFigures:
        ended = set(self.ended_here) | {t for t, status in self.status.items() if status in ENDED}
        failed = {t for t in ended if self.ended_here.get(t, self.status.get(t)) in ("failed", "ERROR")}
        stopped = {t for t in ended - failed
                   if self.ended_here.get(t) == "stopped"
                   or (t not in self.ended_here and 0 < self.last_epoch(t) < self._trial(t).epochs)}
        running = sorted(t for t, status in self.status.items() if status in ACTIVE and t not in ended)
        left = max(0, self.total - len(ended) - len(running))

        candidates = [(trial.best, t) for t, trial in self.trials.items() if trial.best and t not in failed]
        best = None
        if candidates:
            pick = max if self.mode == "max" else min
            (value, epoch), trial_id = pick(candidates, key=lambda c: c[0][0])
            best = (value, trial_label(trial_id, self.configs.get(trial_id) or {}), epoch)

        # waiting: the trials Tune made that wait (a resumed one with its remaining epochs), then those not made yet
        made = [t for t, status in self.status.items() if t not in ended and t not in running]
        typical = [self.trials[t].epochs for t in self.trials] or [self.epochs]
        waiting = [max(0, self._trial(t).epochs - self.last_epoch(t)) for t in made][:left]
        waiting += [sum(typical) / len(typical)] * (left - len(waiting))
        remaining = [max(0, self._trial(t).epochs - self.last_epoch(t)) for t in running]
        per_epoch = (self.seconds / self.timed if self.timed
                     else self.first_seconds / self.first_timed if self.first_timed else None)
        eta = None if per_epoch is None else seconds_left(remaining, waiting, per_epoch, self.at_once)
        if not remaining and not waiting:
            eta = 0.0
        return ProgressFigures(self.total, len(ended), len(failed), len(stopped), len(running), left, best,
                               per_epoch, float(sum(remaining) + sum(waiting)), self.at_once, eta)

    def _ended(self, trial_id: str, how: str) -> None:
        self.ended_here[trial_id] = how
        if self.record is None:
            return
        try:
            figures = self.figures()
            self.record(figures.metrics(self.metric), figures.ended)
        except Exception:  # noqa: BLE001 - a progress record is never a reason to stop the search
            logger.warning("could not record the search's progress", exc_info=True)

    # ------------------------------------------------------------------ Tune's calls
    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._observe(trials)
        state = self._trial(trial.trial_id)
        state.mark, state.warm = self.clock(), False

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        self._observe(trials)
        epoch = int(result.get("epoch", result.get("training_iteration", 0)))
        # A restarted trial's first report replays the epochs it trained before: its best is over them too.
        replayed = json.loads(result[HISTORY_KEY]) if result.get(HISTORY_KEY) else []
        for index, entry in enumerate(replayed, start=1):
            self._epoch(trial.trial_id, int(entry.get("epoch", index)), entry.get(self.metric))
        self._epoch(trial.trial_id, epoch, result.get(self.metric))
        # A newly trained epoch is timed; a report that only replays (the trial had trained every epoch) is not.
        trained = not replayed or epoch > max(int(e.get("epoch", i)) for i, e in enumerate(replayed, start=1))
        state, now = self._trial(trial.trial_id), self.clock()
        if trained and state.mark is not None:
            if state.warm and not replayed:  # (a replay starts a restarted attempt: Ray Train's own retries too)
                self.seconds, self.timed = self.seconds + now - state.mark, self.timed + 1
            else:
                self.first_seconds, self.first_timed = self.first_seconds + now - state.mark, self.first_timed + 1
        state.mark, state.warm = now, trained

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._observe(trials)
        self._trial(trial.trial_id).warm = False  # its next epoch holds its restart

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._observe(trials)
        state = self._trial(trial.trial_id)
        self._ended(trial.trial_id, "stopped" if 0 < state.last_epoch < state.epochs else "finished")

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._observe(trials)
        self._ended(trial.trial_id, "failed")
