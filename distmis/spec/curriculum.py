"""``training.curriculum``: training on growing inputs, stage by stage (LAMP's curriculum), as pure arithmetic.

LAMP trains first on small tiles centred on foreground ("positive patches": easy, balanced), then on larger
ones, and last on the whole volume. A curriculum is a list of stages, each ``epochs`` epochs on ``tile`` (None:
the whole volume) in batches of ``batch_size`` with ``tile_sampling`` of its tiles centred on foreground.

The trainers hold the :class:`TrainingStage` of the epoch they train (:func:`stage_at`) and read its tile, batch
and tile sampling in place of ``training``'s; the spec's checks check each stage as a spec of its own
(:func:`distmis.spec.load.stage_spec`). The input a trial is validated, tested and used with is the last stage's
(:func:`inference_window`): its validation dice is comparable from epoch to epoch, and its best epoch is chosen
for the input it will be used on. A spec without a curriculum is one stage: its ``training`` as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from distmis.spec.schema import TrainingSpec


@dataclass(frozen=True)
class TrainingStage:
    """One stage of training: its number (1-based), input and the epochs (1-based, inclusive) it spans."""

    number: int
    tile: tuple[int, int, int] | None  # None: the whole volume
    batch_size: int
    tile_sampling: float
    first_epoch: int
    last_epoch: int

    def __contains__(self, epoch: int) -> bool:
        return self.first_epoch <= epoch <= self.last_epoch

    @property
    def shape(self) -> tuple[tuple[int, int, int] | None, int]:
        """``(tile, batch_size)``: what the shapes of a training step depend on."""
        return self.tile, self.batch_size


def training_stages(training: TrainingSpec) -> list[TrainingStage]:
    """The stages of ``training``: its curriculum's, or the one stage of a spec without one."""
    if not training.curriculum:
        tile = tuple(training.tile) if training.tile is not None else None
        return [TrainingStage(1, tile, training.batch_size, training.tile_sampling, 1, training.epochs)]  # type: ignore[arg-type]
    stages, first = [], 1
    for number, stage in enumerate(training.curriculum, start=1):
        sampling = stage.tile_sampling if stage.tile_sampling is not None else training.tile_sampling
        stages.append(TrainingStage(
            number=number, tile=tuple(stage.tile) if stage.tile is not None else None,  # type: ignore[arg-type]
            batch_size=stage.batch_size or training.batch_size,
            tile_sampling=sampling if stage.tile is not None else 0.0,  # whole volumes: nothing to centre
            first_epoch=first, last_epoch=first + stage.epochs - 1))
        first += stage.epochs
    return stages


def stage_at(training: TrainingSpec, epoch: int) -> TrainingStage:
    """The stage that trains ``epoch`` (1-based; 0 and epochs past the end: the first and the last stage)."""
    stages = training_stages(training)
    return next((stage for stage in stages if epoch in stage), stages[0] if epoch < 1 else stages[-1])


def inference_window(training: TrainingSpec) -> tuple[int, int, int] | None:
    """The network input of validation, testing and prediction: the last stage's tile (None: whole volumes)."""
    return training_stages(training)[-1].tile
