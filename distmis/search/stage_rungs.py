"""``search.scheduler: stage-asha`` and ``stage-halving``: multi-fidelity over the input size (issue 51). LAMP's
curriculum trains a network on small tiles first, larger ones next and the whole input last
(``training.curriculum``); here the stages' ends are the rungs at which weak configurations are stopped while their
epochs are cheap:

* ``stage-asha`` (:class:`StageRungASHA`): Ray Tune's asynchronous successive halving; at the end of each stage but
  the last, a trial goes on to the next, larger and dearer input only when its result is at least the
  ``1 - 1 / reduction_factor`` quantile of the results that rung has recorded (Tune's rule). What it stops depends
  on the order in which trials arrive.
* ``stage-halving`` (:class:`StageRungHalving`): synchronous successive halving, Tune's ``HyperBandScheduler`` in
  one bracket of every trial; a trial waits, paused, at a stage's end until all have reached it, and the best
  ``ceil(n / reduction_factor)`` go on from their checkpoints. What it stops does not depend on the order.

What a rung judges: the trial's validation result at that epoch, as every epoch's, on whole validation volumes
predicted with the input the trial will be used with (the last stage's tile, by sliding windows, or whole volumes;
:func:`~distmis.spec.curriculum.inference_window`). So every rung ranks the trials on one scale, the final one's: a
network that has seen only small tiles is judged as what it is so far, on the task it is for.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from ray.tune.schedulers import AsyncHyperBandScheduler, HyperBandScheduler, TrialScheduler
from ray.tune.schedulers.hyperband import _Bracket

from distmis.spec.curriculum import training_stages
from distmis.spec.schema import TrainingSpec

__all__ = ["StageRungASHA", "StageRungHalving", "stage_rungs"]


def stage_rungs(training: TrainingSpec) -> list[int]:
    """The epochs at which ``training.curriculum``'s stages end, but the last's: the rungs."""
    return [stage.last_epoch for stage in training_stages(training)[:-1]]


class StageRungASHA(AsyncHyperBandScheduler):
    """Tune's ASHA in one bracket, over the epochs trials report, whose rungs are ``rungs`` (epochs) instead of
    ``grace_period * reduction_factor ** k``."""

    def __init__(self, rungs: Sequence[int], max_t: int, reduction_factor: float):
        if not rungs or min(rungs) < 1 or max(rungs) >= max_t:
            raise ValueError(f"rungs must be epochs within 1..{max_t - 1}, got {list(rungs)}")
        super().__init__(time_attr="epoch", max_t=max_t, grace_period=min(rungs), reduction_factor=reduction_factor,
                         brackets=1)
        for bracket in self._brackets:  # Tune's rule at each rung, the rungs ours (highest first, as Tune keeps them)
            bracket._rungs = [(epoch, {}) for epoch in sorted(set(rungs), reverse=True)]

    @property
    def rungs(self) -> list[int]:
        return sorted(epoch for epoch, _ in self._brackets[0]._rungs)



class _StageBracket(_Bracket):
    """One bracket of synchronous successive halving: its milestones are ``rungs`` (epochs), then ``max_t``; it
    holds ``size`` trials (every trial of the search) and halves once all were made and every live one has reached
    the milestone.

    Two changes to Tune's ``_Bracket``: a trial is ranked by its best result so far (the search keeps, and selects
    by, each trial's best epoch), not its last; and ``ceil(live / reduction_factor)`` of the live trials go on (a
    failed trial leaves fewer)."""

    def __init__(self, rungs: Sequence[int], max_t: int, reduction_factor: float, size: int, metric: str,
                 sign: float):
        super().__init__(time_attr="epoch", max_trials=size, init_t_attr=rungs[0], max_t_attr=max_t,
                         eta=reduction_factor, s=len(rungs), stop_last_trials=False)
        self.size, self.metric, self.sign = size, metric, sign
        self.later = [*rungs[1:], max_t]  # the milestones after the current one
        self.best: dict[Any, float] = {}  # trial -> its best result so far, times the metric's sign

    def filled(self) -> bool:
        return len(self._all_trials) >= self.size

    def add(self, trial: Any) -> None:
        """A new trial, or one of a resumed search (Tune adds those again): live unless it ended, at the epoch it
        last reported."""
        self._all_trials.append(trial)
        if trial.status in ("TERMINATED", "ERROR"):
            return
        self._live_trials[trial] = None
        if "epoch" in (trial.last_result or {}):
            self.update_trial_stats(trial, trial.last_result)

    def cur_iter_done(self) -> bool:
        return self.filled() and super().cur_iter_done()

    def update_trial_stats(self, trial: Any, result: dict) -> None:
        super().update_trial_stats(trial, result)
        if self.metric in result:
            value = self.sign * float(result[self.metric])
            self.best[trial] = max(value, self.best.get(trial, value))

    def successive_halving(self, metric: str, metric_op: float) -> tuple[list, list]:
        live = list(self._live_trials)
        if self._halves == 0:  # the last stage: every trial left trains to its end
            return live, []
        self._halves -= 1
        self._n = max(1, math.ceil(len(live) / self._eta))
        self._r = self._cumul_r = self.later.pop(0)
        ranked = sorted(live, key=lambda trial: self.best.get(trial, -math.inf), reverse=True)
        return ranked[:self._n], ranked[self._n:]


class StageRungHalving(HyperBandScheduler):
    """Synchronous successive halving of all ``trials`` trials in one bracket, whose rungs are ``rungs`` (epochs): a
    trial that reaches a rung is paused (its newest checkpoint kept, its workers given back) until every trial has
    reached it; then the best ``ceil(live / reduction_factor)`` by their best result so far go on from their
    checkpoints, and the others are stopped. Unlike ASHA's, the outcome does not depend on the order in which the
    trials arrive. A trial Tune restarts after a failure keeps its place; one that fails for good leaves, and the
    trials waiting at a rung are judged without it."""

    def __init__(self, rungs: Sequence[int], max_t: int, reduction_factor: float, trials: int):
        if not rungs or min(rungs) < 1 or max(rungs) >= max_t:
            raise ValueError(f"rungs must be epochs within 1..{max_t - 1}, got {list(rungs)}")
        if trials < 1:
            raise ValueError(f"a bracket holds one trial at least, got {trials}")
        super().__init__(time_attr="epoch", max_t=max_t, reduction_factor=reduction_factor, stop_last_trials=False)
        self.rungs = sorted(set(rungs))
        self.trials = trials
        self._processing = False  # inside _process_bracket, which stops trials (and so removes them)

    def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
        if trial in self._trial_info:  # restarted after a failure: it kept its place
            return
        if self._metric_op is None:
            raise ValueError(f"{type(self).__name__} needs the search's metric and mode")
        bracket = self._state["bracket"]
        if bracket is None or bracket.filled():  # a bracket of its own for a trial past the search's count
            bracket = _StageBracket(self.rungs, self._max_t_attr, self._eta, self.trials, self._metric,
                                    self._metric_op)
            self._hyperbands[-1].append(bracket)
            self._state["bracket"] = bracket
        bracket.add(trial)
        self._trial_info[trial] = bracket, self._state["band_idx"]

    def _process_bracket(self, tune_controller: Any, bracket: Any) -> str:
        """Tune's, then again while the trials kept are already at the next milestone (a resumed search's: its
        trials went on past the rung before it was stopped), so that none waits for a halving that has no one
        left to report."""
        self._processing = True
        try:
            action = super()._process_bracket(tune_controller, bracket)
            while bracket._halves > 0 and bracket.current_trials() and bracket.cur_iter_done():
                again = super()._process_bracket(tune_controller, bracket)
                action = action if action == TrialScheduler.STOP else again  # STOP: the reporting trial was judged
            return action
        finally:
            self._processing = False

    def on_trial_error(self, tune_controller: Any, trial: Any) -> None:
        """A trial that failed for good leaves its bracket. Ray Tune (2.x) also calls this for a failure it retries,
        with the trial already marked ERROR, just before it queues the trial again: that one keeps its place."""
        if trial.status == "ERROR":  # requeued: it goes on from its checkpoint
            return
        self.on_trial_remove(tune_controller, trial)

    def on_trial_remove(self, tune_controller: Any, trial: Any) -> None:
        """A trial that ended leaves its bracket, and the trials waiting at a rung are judged without it (Tune's own
        scheduler does so only before its first halving)."""
        bracket, _ = self._trial_info[trial]
        bracket.cleanup_trial(trial)
        if not self._processing and bracket.current_trials():
            self._process_bracket(tune_controller, bracket)
