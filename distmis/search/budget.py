"""``search.budget``: a search that ends when its wall time or its worker-hours are spent (issue 51).

What counts (:class:`SearchBudget`):

- **wall**: the seconds Ray Tune ran the search's trials (``Tuner.fit``), over every run of the search (a resumed
  search starts from what the runs before it spent);
- **worker-hours**: each trial's workers times the seconds between its reports (its start-up included in the
  first), added up over its epochs as they are reported, and over every run of the search.

Both are logged on the search's run as each trial reports (``budget_wall_s``, ``budget_worker_s``); ``--resume``
reads them back and goes on with what is left.

When either is spent, no trial starts (:class:`BudgetScheduler`: the spec's scheduler, which then picks no trial
to run and tells the search algorithm it is finished, so that it makes none; the search makes its trials no faster
than they can run, ``max_concurrent_trials``, so that Tune holds none made and waiting), each running trial is stopped as it reports its next epoch, its best
checkpoint kept and its run recorded as stopped by the budget (:class:`BudgetStopper`, Tune's per-trial stop: the
trial's run is FINISHED), and once none runs Tune ends the search (``stop_all``); the trials never started are not
run, and one that failed and waits for its retry is not retried. The search then ends as any does: its best
finished trial is scored on the test split and registered. A running trial overshoots the budget by at most the
epoch it is in; one still starting, by its start-up and first epoch (a trial is stopped at a report). A trial
that was running when the search was stopped (a killed driver) owes that report too: ``--resume`` restores it as
pending and starts it again from its checkpoint, and Tune waits for its report however little of the budget was
left (or none), so that it ends with its weights saved and known to the search.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ray.tune import Stopper
from ray.tune.schedulers import FIFOScheduler, TrialScheduler

from distmis.spec.schema import BudgetSpec

__all__ = ["BudgetSpent", "SearchBudget", "LiveBudget", "register", "unregister", "BudgetScheduler",
           "BudgetStopper", "format_seconds"]

WALL_METRIC = "budget_wall_s"
WORKER_METRIC = "budget_worker_s"


@dataclass(frozen=True)
class BudgetSpent:
    """What a search's earlier runs spent: seconds of wall time and worker-seconds."""

    wall_s: float = 0.0
    worker_s: float = 0.0

    @classmethod
    def from_metrics(cls, metrics: dict[str, float]) -> BudgetSpent:
        """What the search's run recorded (its metrics; nothing recorded: nothing spent)."""
        return cls(float(metrics.get(WALL_METRIC, 0.0)), float(metrics.get(WORKER_METRIC, 0.0)))


def format_seconds(seconds: float) -> str:
    """``h:mm:ss``."""
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class SearchBudget:
    """The budget of one run of a search: its limits (``spec``), what earlier runs spent (``before``), and what
    this run spends from its start (``clock()`` at construction) and from the epochs :meth:`observe` is given.
    ``record(metrics)``: where the running totals go as they change (the search's run)."""

    def __init__(self, spec: BudgetSpec, before: BudgetSpent = BudgetSpent(), *,
                 record: Callable[[dict[str, float]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.spec, self.before, self.record, self.clock = spec, before, record, clock
        self.started = clock()
        self.worker_s_here = 0.0

    def restart(self) -> None:
        """Count this run's wall time from now (Tune's start)."""
        self.started = self.clock()

    def record_now(self) -> None:
        """Hand the running totals to ``record`` (after each report, and at the run's end)."""
        if self.record is not None:
            self.record({WALL_METRIC: self.wall_s, WORKER_METRIC: self.worker_s})

    @property
    def wall_s(self) -> float:
        return self.before.wall_s + self.clock() - self.started

    @property
    def worker_s(self) -> float:
        return self.before.worker_s + self.worker_s_here

    def observe(self, seconds: float, workers: int) -> None:
        """A trial's report: ``seconds`` since its last one (Tune's ``time_this_iter_s``) on ``workers`` workers."""
        self.worker_s_here += max(0.0, float(seconds)) * max(1, int(workers))
        self.record_now()

    def spent(self) -> str:
        """Why the budget is spent (``"wall 1:00:03 of 1:00:00"``), or ``""`` while it is not."""
        if self.spec.wall is not None and self.wall_s >= self.spec.wall:
            return f"wall {format_seconds(self.wall_s)} of {format_seconds(self.spec.wall)}"
        if self.spec.worker_hours is not None and self.worker_s >= self.spec.worker_hours * 3600:
            return f"{self.worker_s / 3600:.3g} of {self.spec.worker_hours:g} worker-hours"
        return ""

    def summary(self) -> str:
        """What the console prints: ``budget: 0:41:00 of 1:00:00 wall, 0.31 of 2 worker-hours``."""
        parts = []
        if self.spec.wall is not None:
            parts.append(f"{format_seconds(self.wall_s)} of {format_seconds(self.spec.wall)} wall")
        if self.spec.worker_hours is not None:
            parts.append(f"{self.worker_s / 3600:.3g} of {self.spec.worker_hours:g} worker-hours")
        return "budget: " + ", ".join(parts)


@dataclass
class LiveBudget:
    """A search's budget in its driver process, which :class:`BudgetScheduler` and :class:`BudgetStopper` find by
    the search run's id (:func:`register`): Tune pickles both into its experiment folder and ``Tuner.restore``
    brings them back, so they hold that id only, and a resumed driver registers its own budget under it.

    ``workers(trial_id, result)``: the workers a trial held for a report; ``stopped(trial_id)``: told when the
    budget stops a trial (its record says so); ``trials``: the trials Tune added (Tune's trial objects, for their
    status); ``owed``: the ids of those that owe a report though pending (the trials that were running when the
    search was stopped: a resumed search passes them in), until they report, end or fail; ``ended``: why the budget
    ended the search, once it has."""

    budget: SearchBudget
    workers: Callable[[str, dict], int]
    stopped: Callable[[str], None]
    trials: dict[str, Any] = field(default_factory=dict)
    owed: set[str] = field(default_factory=set)
    ended: str = ""

    def add(self, trial: Any) -> None:
        """Tune adds ``trial`` (made, or restored on resume): every trial, before the scheduler may choose it."""
        self.trials[trial.trial_id] = trial

    def settled(self, trial_id: str) -> None:
        """``trial_id`` reported, ended or failed (a failed one waits for its retry): it owes nothing."""
        self.owed.discard(trial_id)

    def running(self) -> bool:
        """Whether a trial runs (its process up) or owes a report (its process coming up again after the search
        was stopped). One waiting for its process otherwise, or for a retry after a failure, does not: once the
        budget is spent it does not start (a trial the scheduler chose may still wait for room on the cluster)."""
        return any(trial.status == "RUNNING" or (trial.status == "PENDING" and trial.trial_id in self.owed)
                   for trial in self.trials.values())


_LIVE: dict[str, LiveBudget] = {}


def register(key: str, live: LiveBudget) -> LiveBudget:
    """Make ``live`` the budget of the search run ``key`` in this process (replacing an earlier one)."""
    _LIVE[key] = live
    return live


def unregister(key: str) -> None:
    _LIVE.pop(key, None)


class BudgetScheduler(TrialScheduler):
    """The search's scheduler (``inner``: the spec's, or Tune's first-in first-out) that starts no trial once the
    budget registered under ``key`` is spent, and tells it (:class:`LiveBudget`) the trials Tune adds and the ones
    that end or fail. Without a registered budget it is ``inner``."""

    def __init__(self, inner: TrialScheduler | None, key: str):
        super().__init__()
        self.inner = inner if inner is not None else FIFOScheduler()
        self.key = key

    # -- what the budget changes
    def _spent(self, tune_controller: Any) -> bool:
        """Whether the budget is spent; once it is, the search algorithm makes no more trials (Tune starts every
        trial it makes, whatever the scheduler picks)."""
        live = _LIVE.get(self.key)
        if live is None or not live.budget.spent():
            return False
        tune_controller.search_alg.set_finished()
        return True

    def choose_trial_to_run(self, tune_controller: Any) -> Any:
        if self._spent(tune_controller):
            return None
        return self.inner.choose_trial_to_run(tune_controller)

    def _live(self, tell: Callable[[LiveBudget], None]) -> None:
        live = _LIVE.get(self.key)
        if live is not None:
            tell(live)

    # -- the rest is the inner scheduler's (and what the budget is told of it)
    def set_search_properties(self, metric: str | None, mode: str | None, **spec: Any) -> bool:
        return self.inner.set_search_properties(metric, mode, **spec)

    @property
    def metric(self) -> str | None:
        return self.inner.metric

    @property
    def supports_buffered_results(self) -> bool:
        return self.inner.supports_buffered_results

    def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
        self._live(lambda live: live.add(trial))
        self.inner.on_trial_add(tune_controller, trial)

    def on_trial_error(self, tune_controller: Any, trial: Any) -> None:
        self._live(lambda live: live.settled(trial.trial_id))
        self.inner.on_trial_error(tune_controller, trial)

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
        return self.inner.on_trial_result(tune_controller, trial, result)

    def on_trial_complete(self, tune_controller: Any, trial: Any, result: dict) -> None:
        self._live(lambda live: live.settled(trial.trial_id))
        self.inner.on_trial_complete(tune_controller, trial, result)
        self._spent(tune_controller)  # before Tune tells the search algorithm, which would make the next trial

    def on_trial_remove(self, tune_controller: Any, trial: Any) -> None:
        self._live(lambda live: live.settled(trial.trial_id))
        self.inner.on_trial_remove(tune_controller, trial)

    def debug_string(self) -> str:
        live = _LIVE.get(self.key)
        return self.inner.debug_string() + (f"\n{live.budget.summary()}" if live is not None else "")

    def save(self, checkpoint_path: str) -> None:
        self.inner.save(checkpoint_path)

    def restore(self, checkpoint_path: str) -> None:
        self.inner.restore(checkpoint_path)


class BudgetStopper(Stopper):
    """Tune's stopper for the budget registered under ``key``: each report adds its worker-seconds; once the
    budget is spent every trial that reports is stopped there (:attr:`LiveBudget.stopped` told), and Tune ends
    once no trial runs or owes a report (:meth:`LiveBudget.running`). Without a registered budget it stops nothing."""

    def __init__(self, key: str):
        self.key = key

    def __call__(self, trial_id: str, result: dict) -> bool:
        live = _LIVE.get(self.key)
        if live is None:
            return False
        live.settled(trial_id)
        live.budget.observe(float(result.get("time_this_iter_s") or 0.0), live.workers(trial_id, result))
        spent = live.budget.spent()
        if spent:
            live.ended = spent
            live.stopped(trial_id)
        return bool(spent)

    def stop_all(self) -> bool:
        live = _LIVE.get(self.key)
        if live is None:
            return False
        spent = live.budget.spent()
        if spent and not live.running():
            live.ended = spent
            return True
        return False
