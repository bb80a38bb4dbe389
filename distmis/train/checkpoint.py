"""A trial's checkpoint: what it needs to go on after its process, a worker or the whole search died.

After every epoch a trial reports one checkpoint folder (Tune keeps the latest; in a data-parallel trial
Ray Train does, and every rank adds its own files to it)::

    model.pt | model.weights.h5   the best epoch's weights so far: what the overlay and inference load
    resume/state.json             epochs done, the best value of the search metric and its epoch, and every
                                  epoch's metrics (the driver logs from them any epoch it missed)
    resume/...                    the last epoch's weights and optimizer state (written by the primary rank)
                                  and each rank's random-number state (``rng.rank<r>.pt``, torch)

The folder's structure, its :class:`~distmis.trial.record.TrainingState` and the readers that rank a trial's folders
by the epoch they hold are :mod:`distmis.trial.record`'s (the driver reads them too).

A restarted trial (a retry after a crash, or ``distmis run --resume``) calls :func:`resume_from`: the
trainer loads ``resume/``, the best weights are carried over, and training continues at the next epoch.
What "the random-number state" covers depends on the framework and is said by each trainer's
``load_state``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Protocol

from distmis.trial.record import RESUME_DIR, STATE_FILE, TrainingState


class Resumable(Protocol):
    """What a trainer offers the epoch loop to save and restore itself."""

    weight_files: tuple[str, ...]  # what ``save`` writes (the best weights, at the checkpoint's root)

    def save(self, directory: str | Path) -> Path: ...

    def save_state(self, directory: str | Path, *, rank: int, primary: bool) -> None: ...

    def load_state(self, directory: str | Path, *, rank: int, epoch: int) -> None: ...


def read_state(checkpoint_dir: str | Path) -> TrainingState | None:
    """The state saved in a checkpoint folder; None when it holds none (not a resumable checkpoint)."""
    path = Path(checkpoint_dir) / RESUME_DIR / STATE_FILE
    return TrainingState.from_json(path.read_text()) if path.is_file() else None


def write_checkpoint(trainer: Resumable, directory: str | Path, state: TrainingState, best_dir: str | Path, *,
                     rank: int = 0, primary: bool = True) -> bool:
    """Fill ``directory`` with this rank's part of the epoch's checkpoint; False if it has nothing to add."""
    directory = Path(directory)
    resume = directory / RESUME_DIR
    trainer.save_state(resume, rank=rank, primary=primary)
    if primary:
        for name in trainer.weight_files:
            if (Path(best_dir) / name).is_file():
                shutil.copy2(Path(best_dir) / name, directory / name)
        (resume / STATE_FILE).write_text(state.to_json())  # last: a folder with a state is complete
    return any(directory.rglob("*"))


def resume_from(trainer: Resumable, checkpoint_dir: str | Path, best_dir: str | Path, *, rank: int = 0) -> TrainingState:
    """Load a checkpoint written by :func:`write_checkpoint` into ``trainer``; the best weights go to ``best_dir``.

    Raises ValueError for a folder that holds no training state (a checkpoint of an older distmis).
    """
    checkpoint_dir = Path(checkpoint_dir)
    state = read_state(checkpoint_dir)
    if state is None:
        raise ValueError(f"{checkpoint_dir} holds no {RESUME_DIR}/{STATE_FILE}: it is not a checkpoint this "
                         "version of distmis can resume from")
    for name in trainer.weight_files:
        if (checkpoint_dir / name).is_file():
            shutil.copy2(checkpoint_dir / name, Path(best_dir) / name)
    trainer.load_state(checkpoint_dir / RESUME_DIR, rank=rank, epoch=state.epoch)
    return state
