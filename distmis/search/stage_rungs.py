"""``search.scheduler: stage-asha``: multi-fidelity over the input size (issue 51). LAMP's curriculum trains a
network on small tiles first, larger ones next and the whole input last (``training.curriculum``); here the stages
are the rungs of Ray Tune's asynchronous successive halving: at the end of each stage but the last, a trial goes on
to the next, larger and dearer input only when its result is at least the ``1 - 1 / reduction_factor`` quantile of
the results that rung has recorded (Tune's rule), so weak configurations are stopped while their epochs are cheap.

What a rung judges: the trial's validation result at that epoch, as every epoch's, on whole validation volumes
predicted with the input the trial will be used with (the last stage's tile, by sliding windows, or whole volumes;
:func:`~distmis.spec.curriculum.inference_window`). So every rung ranks the trials on one scale, the final one's: a
network that has seen only small tiles is judged as what it is so far, on the task it is for.
"""

from __future__ import annotations

from typing import Sequence

from ray.tune.schedulers import AsyncHyperBandScheduler

from distmis.spec.curriculum import training_stages
from distmis.spec.schema import TrainingSpec

__all__ = ["StageRungASHA", "stage_rungs"]


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
