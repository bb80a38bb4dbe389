"""One epoch's numbers, shared by the TensorFlow and PyTorch trainers."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from distmis.data.manifest import DataManifest
from distmis.spec.curriculum import stage_at
from distmis.spec.schema import TrainingSpec
from distmis.trial.record import CLASS_DICE_PREFIX, EpochMetrics  # noqa: F401 - CLASS_DICE_PREFIX: the trainers'


class NonFiniteLossError(FloatingPointError):
    """Training diverged: the loss became NaN or infinite."""




@dataclass(frozen=True)
class ValidationScores:
    """A validation pass: the mean loss over the cases, ``dice`` the mean over the cases of each case's mean dice over
    the foreground channels, and ``class_dice`` each foreground channel's mean dice over the cases, by its key
    (:func:`distmis.data.targets.metric_keys`; ``dice`` is their mean)."""

    loss: float
    dice: float
    class_dice: Mapping[str, float] = field(default_factory=dict)


def checked_epoch(epoch: int, train: Callable[[], float], validate: Callable[[], ValidationScores], *,
                  learning_rate: float) -> EpochMetrics:
    """Train one epoch, validate, and time both. Raises NonFiniteLossError if a loss is NaN or infinite.
    ``learning_rate``: the rate of the epoch's first step, reported with it."""
    start = time.perf_counter()
    train_loss = train()
    if not math.isfinite(train_loss):
        raise NonFiniteLossError(f"training loss became {train_loss} at epoch {epoch}")
    validation_start = time.perf_counter()
    scores = validate()
    if not math.isfinite(scores.loss):
        raise NonFiniteLossError(f"validation loss became {scores.loss} at epoch {epoch}")
    end = time.perf_counter()
    return EpochMetrics(epoch, train_loss, scores.loss, scores.dice, end - start, learning_rate,
                        class_dice=dict(scores.class_dice) or None, validation_seconds=end - validation_start)


def curriculum_metrics(training: TrainingSpec, epoch: int, volume: Sequence[int]) -> dict[str, int]:
    """``curriculum_stage`` and the training input's ``tile_h``, ``tile_w``, ``tile_d`` (the ``volume`` in a
    whole-volume stage) of ``epoch``, for :class:`EpochMetrics`; nothing without a ``training.curriculum``."""
    if not training.curriculum:
        return {}
    stage = stage_at(training, epoch)
    h, w, d = (int(v) for v in (stage.tile or volume)[:3])
    return {"curriculum_stage": stage.number, "tile_h": h, "tile_w": w, "tile_d": d}


def trainer_targets(manifest: DataManifest, where: Any = "the TFRecord folder") -> dict[str, Any]:
    """The target scheme of a TFRecord folder (:func:`distmis.data.targets.manifest_targets`), checked against its
    ``num_classes``: what a trainer's head activation, loss and scored channels follow. ValueError naming ``where``
    when the two disagree."""
    from distmis.data.targets import manifest_targets

    targets = manifest_targets(manifest)
    channels = [channel["name"] for channel in targets["channels"]]
    if len(channels) != manifest.num_classes:
        raise ValueError(f"{where}: the manifest's num_classes is {manifest.num_classes}, its target scheme has "
                         f"{len(channels)} channel(s) {channels}")
    if targets["activation"] not in ("sigmoid", "softmax"):
        raise ValueError(f"{where}: the target scheme's activation must be 'sigmoid' or 'softmax', got "
                         f"{targets['activation']!r}")
    return targets


@dataclass(frozen=True)
class TrialParts:
    """The parts of a TFRecord folder one trial trains and validates on (``("train",)`` and ``("val",)``, or with
    cross-validation every other fold and its own), and how many cases the training parts hold."""

    train: tuple[str, ...]
    val: tuple[str, ...]
    num_train: int


def trial_parts(manifest: DataManifest, fold: int | None, where: Any = "the TFRecord folder") -> TrialParts:
    """The parts a trial reads: :func:`distmis.data.split.fold_parts` of the folder's split (``manifest.split``)
    for the trial's ``fold`` (``spec.dataset.split.fold``, which the search sets per trial). The one place both
    trainers (and a kept trainer's restart) learn which cases are theirs. ValueError naming ``where`` when the fold
    and the folder's split disagree (a fold for a folder without folds, none for one with folds, one out of range),
    or the manifest lacks a part."""
    from distmis.data.split import fold_parts

    try:
        train, val = fold_parts(manifest.split, fold)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    splits = manifest.splits
    missing = [part for part in (*train, *val) if part not in splits]
    if missing:
        raise ValueError(f"{where}: the manifest has no part {missing[0]!r} (it has {sorted(splits)}); was it "
                         f"written for another split?")
    return TrialParts(train, val, sum(int(splits[part]["num_cases"]) for part in train))
