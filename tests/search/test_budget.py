"""``search.budget`` below the search (distmis.search.budget): what is counted as spent and when it is, the spec's
durations, the scheduler that starts no trial once it is spent, the stopper that stops each trial at its next report
and ends Tune once none runs, both pickled as Tune pickles them. A budget's search end to end:
``tests/search/test_budget_search.py``."""

from __future__ import annotations

import pickle
import types

import pytest
from ray.tune.schedulers import FIFOScheduler

from distmis.search.budget import (
    BudgetScheduler, BudgetSpent, BudgetStopper, LiveBudget, SearchBudget, format_seconds, register, unregister,
)
from distmis.spec import validate_spec
from distmis.spec.load import SpecError
from distmis.spec.schema import BudgetSpec, duration_seconds


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("text, seconds", [("6h", 21600), ("90m", 5400), ("1h30m", 5400), ("45s", 45),
                                           ("1.5h", 5400), (120, 120), ("2h 5m 3s", 7503)])
def test_durations(text, seconds):
    assert duration_seconds(text) == seconds
    assert BudgetSpec(wall=text).wall == seconds


@pytest.mark.parametrize("bad", ["6 hours", "", "h", "-5m"])
def test_a_bad_duration_names_what_is_allowed(bad):
    with pytest.raises(ValueError, match="a duration is a number of seconds or text such as 6h"):
        duration_seconds(bad)


def test_a_budget_names_something_and_a_comparison_refuses_it(spec_tree):
    with pytest.raises(ValueError, match="a budget names wall, worker_hours or both"):
        BudgetSpec()
    spec_tree["search"]["budget"] = {"wall": "10m", "worker_hours": 2}
    assert validate_spec(spec_tree).search.budget == BudgetSpec(wall=600, worker_hours=2)
    spec_tree["parallelism"] = {"mode": "compare", "workers": [1, 2]}
    with pytest.raises(SpecError, match="search.budget: mode 'compare' times whole searches"):
        validate_spec(spec_tree)


def test_wall_time_and_worker_hours_count_from_what_earlier_runs_spent():
    clock, recorded = Clock(), []
    budget = SearchBudget(BudgetSpec(wall=600, worker_hours=1), BudgetSpent(wall_s=500, worker_s=1800),
                          record=recorded.append, clock=clock)
    clock.now += 50
    assert budget.wall_s == 550 and budget.spent() == ""
    budget.observe(300, workers=2)  # an epoch of 300 s on two workers: 600 worker-seconds
    assert budget.worker_s == 2400 and recorded[-1] == {"budget_wall_s": 550, "budget_worker_s": 2400}
    assert budget.summary() == "budget: 0:09:10 of 0:10:00 wall, 0.667 of 1 worker-hours"
    budget.observe(600, workers=2)
    assert budget.spent() == "1 of 1 worker-hours"
    clock.now += 60
    assert budget.spent() == "wall 0:10:10 of 0:10:00"  # the wall is said first
    budget.restart()  # a new run's Tune starts: its wall time counts from there
    assert budget.wall_s == 500 and BudgetSpent.from_metrics(recorded[-1]) == BudgetSpent(550, 3600)
    assert format_seconds(3725.4) == "1:02:05"


def trial(trial_id: str, status: str = "PENDING"):
    return types.SimpleNamespace(trial_id=trial_id, status=status)


class Controller:
    """What a scheduler reads of Tune's controller: its trials and its search algorithm."""

    def __init__(self, *trials) -> None:
        self.trials = list(trials)
        self.search_alg = types.SimpleNamespace(finished=False)
        self.search_alg.set_finished = lambda: setattr(self.search_alg, "finished", True)

    def get_trials(self):
        return self.trials


def test_once_spent_no_trial_starts_each_stops_at_its_next_report_and_tune_ends_when_none_runs():
    clock, stopped = Clock(), []
    live = register("run1", LiveBudget(SearchBudget(BudgetSpec(worker_hours=0.5), clock=clock),
                                       workers=lambda trial_id, result: 2, stopped=stopped.append))
    try:
        scheduler, stopper = BudgetScheduler(None, "run1"), BudgetStopper("run1")
        assert isinstance(scheduler.inner, FIFOScheduler)
        scheduler, stopper = pickle.loads(pickle.dumps(scheduler)), pickle.loads(pickle.dumps(stopper))  # as Tune
        a, b, c = trial("a"), trial("b"), trial("c")
        controller = Controller(a, b, c)
        for each in controller.trials:  # as Tune adds them
            scheduler.on_trial_add(controller, each)
        assert scheduler.choose_trial_to_run(controller) is a
        a.status = "RUNNING"
        assert scheduler.choose_trial_to_run(controller) is b
        assert stopper("a", {"time_this_iter_s": 600}) is False  # 1200 of 1800 worker-seconds
        a.status = "PENDING"  # a failed: waits for its retry
        scheduler.on_trial_error(controller, a)
        assert scheduler.choose_trial_to_run(controller) is a  # retried
        a.status = b.status = "RUNNING"
        assert stopper("b", {"time_this_iter_s": 300}) is True and stopped == ["b"]  # spent at b's first report
        assert live.ended == "0.5 of 0.5 worker-hours"
        b.status = "TERMINATED"
        assert not controller.search_alg.finished
        scheduler.on_trial_complete(controller, b, {})
        assert controller.search_alg.finished  # no trial made after it: Tune would start any it made
        assert scheduler.choose_trial_to_run(controller) is None  # c never starts
        assert stopper.stop_all() is False  # a still runs: it stops at its next epoch
        assert stopper("a", {"time_this_iter_s": 10}) is True and stopped == ["b", "a"]
        a.status = "PENDING"  # a failed as it stopped: its retry never starts
        scheduler.on_trial_error(controller, a)
        assert stopper.stop_all() is True
    finally:
        unregister("run1")
    assert stopper("a", {"time_this_iter_s": 1e9}) is False and stopper.stop_all() is False  # no budget: no stop


def test_a_trial_running_when_the_search_was_stopped_reports_once_before_tune_ends():
    """A trial that was running when the driver was killed (``--resume`` restores it as pending) reports once more
    however little of the budget is left, its weights saved; a trial chosen but still waiting for its process, or
    for a retry, or never started, does not hold Tune up."""
    clock, stopped = Clock(), []
    budget = SearchBudget(BudgetSpec(wall=60), BudgetSpent(wall_s=50), clock=clock)
    live = register("run2", LiveBudget(budget, workers=lambda trial_id, result: 1, stopped=stopped.append,
                                       owed={"resumed"}))  # running when the search was stopped
    try:
        scheduler, stopper = BudgetScheduler(None, "run2"), BudgetStopper("run2")
        waiting, resumed, retry, queued = trial("waiting"), trial("resumed"), trial("retry"), trial("queued")
        controller = Controller(waiting, resumed, retry, queued)
        for each in controller.trials:  # as Tune adds them, restored or made: all pending
            scheduler.on_trial_add(controller, each)
        assert scheduler.choose_trial_to_run(controller) is waiting  # no room for it yet
        scheduler.on_trial_error(controller, retry)  # failed: waits for its retry
        clock.now += 20  # 70 of 60 s: spent before any reported
        assert scheduler.choose_trial_to_run(controller) is None  # none chosen now
        assert stopper.stop_all() is False  # Tune starts pending trials itself: resumed owes a report
        resumed.status = "RUNNING"
        assert stopper.stop_all() is False
        assert stopper("resumed", {"time_this_iter_s": 5}) is True and stopped == ["resumed"]
        assert stopper.stop_all() is False  # until Tune has stopped it
        resumed.status = "TERMINATED"
        scheduler.on_trial_complete(controller, resumed, {})
        assert stopper.stop_all() is True  # waiting, retry and queued still pending: never (re)started
        assert live.ended == "wall 0:01:10 of 0:01:00" and stopped == ["resumed"]
    finally:
        unregister("run2")
