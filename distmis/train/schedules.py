"""Learning-rate schedules (``training.lr_schedule``), as plain arithmetic both frameworks' trainers read.

A schedule is a factor of the trial's peak learning rate, a function of how far training has gone: ``progress``
epochs trained so far, fractional when the schedule is stepped every batch (``interval: step``). The peak is
the optimizer's ``lr`` as the trial's layout resolved it (``TrialLayout.effective_lr``: scaled by the number
of data-parallel replicas), so a data-parallel trial follows the same curve at its scaled rate.

- ``constant``: the peak throughout.
- ``cosine``: half a cosine from the peak down to ``min_factor`` x peak at the end of training (SP-ViT's
  "cosine annealing"; PyTorch's ``CosineAnnealingLR`` over the whole run).
- ``cyclic``: triangular cycles of ``cycle_epochs`` (Smith 2017, which DistMIS uses): from the trough
  (``min_factor`` x peak; 0.25 unless given) up to the peak at mid-cycle and back down.
- ``poly``: ``(1 - t / T) ** power`` (nnU-Net: power 0.9), towards 0 at the end of training.

Any of them may begin with ``warmup_epochs`` of linear warm-up from ``warmup_start_factor`` x peak to the peak;
the schedule proper then runs over the epochs left (``t`` counts from the end of the warm-up, ``T`` is what is
left). Resuming a trial needs no state of its own: the rate is a function of the epoch and step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distmis.spec.schema import LRScheduleSpec, TrainingSpec

__all__ = ["LearningRateSchedule", "lr_factor"]


def lr_factor(schedule: LRScheduleSpec, progress: float, epochs: int) -> float:
    """The factor of the peak learning rate after ``progress`` epochs of ``epochs`` (0 <= progress <= epochs)."""
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if not 0 <= progress <= epochs:
        raise ValueError(f"progress must be within [0, {epochs}] epochs, got {progress}")
    warmup = schedule.warmup_epochs
    if progress < warmup:
        start = schedule.warmup_start_factor
        return start + (1.0 - start) * progress / warmup
    t, total = progress - warmup, epochs - warmup  # total > 0: the spec keeps the warm-up shorter than training
    done = min(t / total, 1.0)
    if schedule.name == "constant":
        return 1.0
    if schedule.name == "cosine":
        low = schedule.trough_factor
        return low + (1.0 - low) * 0.5 * (1.0 + math.cos(math.pi * done))
    if schedule.name == "cyclic":
        low = schedule.trough_factor
        phase = (t / schedule.cycle_epochs) % 1.0  # 0 at the trough, 0.5 at the peak
        return low + (1.0 - low) * (1.0 - abs(2.0 * phase - 1.0))
    if schedule.name == "poly":
        return (1.0 - done) ** schedule.power
    raise ValueError(f"unknown learning-rate schedule {schedule.name!r}")


@dataclass(frozen=True)
class LearningRateSchedule:
    """A trial's learning rate at every epoch and step: ``peak`` times :func:`lr_factor`."""

    peak: float
    schedule: LRScheduleSpec
    epochs: int

    @classmethod
    def for_training(cls, training: TrainingSpec, peak: float) -> LearningRateSchedule:
        """The schedule of ``training`` at ``peak`` (the layout's ``effective_lr``)."""
        return cls(peak=peak, schedule=training.lr_schedule, epochs=training.epochs)

    @property
    def per_step(self) -> bool:
        """Whether the rate changes at every step (else once at each epoch's start)."""
        return self.schedule.interval == "step" and self.schedule.name != "constant"

    def at(self, epoch: int, step: int = 0, steps_per_epoch: int = 1) -> float:
        """The rate of step ``step`` (from 0) of epoch ``epoch`` (from 1) of ``steps_per_epoch`` steps."""
        if epoch < 1:
            raise ValueError(f"epochs count from 1, got {epoch}")
        if steps_per_epoch < 1 or not 0 <= step < steps_per_epoch:
            raise ValueError(f"step {step} is outside an epoch of {steps_per_epoch} step(s)")
        progress = epoch - 1 + (step / steps_per_epoch if self.per_step else 0.0)
        return self.peak * lr_factor(self.schedule, min(progress, self.epochs), self.epochs)
