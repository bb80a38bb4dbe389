"""One epoch's numbers, shared by the TensorFlow and PyTorch trainers."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

from distmis.spec.curriculum import stage_at
from distmis.spec.schema import TrainingSpec


class NonFiniteLossError(FloatingPointError):
    """Training diverged: the loss became NaN or infinite."""


@dataclass(frozen=True)
class EpochMetrics:
    epoch: int
    train_loss: float
    val_loss: float
    val_dice: float
    epoch_seconds: float
    learning_rate: float  # at the epoch's first step (training.lr_schedule)
    # Measured by the PyTorch trainers (None where a trainer does not measure them; left out of as_dict):
    step_seconds: float | None = None  # mean wall seconds of a training step, the batch's wait excluded
    peak_memory_mb: float | None = None  # a step's peak memory above what the process held before training, MiB
    fom: float | None = None  # the seed's figure of merit b L s^2 d / step_seconds (ViT-seg)
    # With a training.curriculum: the epoch's stage (1-based) and the size of its training input
    curriculum_stage: int | None = None
    tile_h: int | None = None
    tile_w: int | None = None
    tile_d: int | None = None

    def as_dict(self) -> dict[str, float]:
        return {key: value for key, value in asdict(self).items() if value is not None}


def checked_epoch(epoch: int, train: Callable[[], float], validate: Callable[[], tuple[float, float]], *,
                  learning_rate: float) -> EpochMetrics:
    """Train one epoch, validate, and time both. Raises NonFiniteLossError if a loss is NaN or infinite.
    ``learning_rate``: the rate of the epoch's first step, reported with it."""
    start = time.perf_counter()
    train_loss = train()
    if not math.isfinite(train_loss):
        raise NonFiniteLossError(f"training loss became {train_loss} at epoch {epoch}")
    val_loss, val_dice = validate()
    if not math.isfinite(val_loss):
        raise NonFiniteLossError(f"validation loss became {val_loss} at epoch {epoch}")
    return EpochMetrics(epoch, train_loss, val_loss, val_dice, time.perf_counter() - start, learning_rate)


def curriculum_metrics(training: TrainingSpec, epoch: int, volume: Sequence[int]) -> dict[str, int]:
    """``curriculum_stage`` and the training input's ``tile_h``, ``tile_w``, ``tile_d`` (the ``volume`` in a
    whole-volume stage) of ``epoch``, for :class:`EpochMetrics`; nothing without a ``training.curriculum``."""
    if not training.curriculum:
        return {}
    stage = stage_at(training, epoch)
    h, w, d = (int(v) for v in (stage.tile or volume)[:3])
    return {"curriculum_stage": stage.number, "tile_h": h, "tile_w": w, "tile_d": d}
