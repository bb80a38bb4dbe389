"""Trainers a process keeps from one trial to the next, so a trial whose graphs equal an earlier one's does not trace
them again.

A process that runs a search's trials in turn (a Tune actor reused between experiment-mode trials, or a rank of a
data-mode search's worker group: :mod:`distmis.trial.worker_group`) keeps up to :data:`KEPT_TRAINERS` TensorFlow
trainers by :func:`~distmis.train.tf_unet.graph_key`. A trial whose key matches one restarts it
(:meth:`~distmis.train.tf_unet.UNetTrainer.restart`: the initial weights, optimizer, data order and cases a new
trainer would have, so it trains exactly as on a fresh process); another builds a new trainer, the least recently
used one going first. A trial that fails takes its trainer with it: a trainer in an unknown state is never restarted.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from distmis.spec.layout import TrialLayout
    from distmis.spec.schema import Spec
    from distmis.train.protocol import RestartableTrainer

# A grid over two architectures alternates between them; more would hold more models' weights (and device memory)
# for trials that may never come.
KEPT_TRAINERS = 2


def trainer_key(spec: Spec, tfrecord_dir: str) -> str:
    """What a kept trainer must share with a trial to serve it: its graphs and its data."""
    from distmis.train.tf_unet import graph_key

    return json.dumps({"graphs": graph_key(spec), "tfrecords": str(tfrecord_dir)})


class KeptTrainers:
    """Up to ``capacity`` restartable trainers by key, the least recently used first."""

    def __init__(self, capacity: int = KEPT_TRAINERS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._trainers: dict[str, RestartableTrainer] = {}

    def __len__(self) -> int:
        return len(self._trainers)

    def __contains__(self, key: str) -> bool:
        return key in self._trainers

    def trainer_for(self, key: str, spec: Spec, layout: TrialLayout,
                    build: Callable[[], RestartableTrainer]) -> tuple[RestartableTrainer, bool]:
        """The trainer for a trial with ``key``: a kept one restarted for ``spec`` (True), or ``build()``'s (False).
        Either is kept, as the most recently used."""
        trainer = self._trainers.pop(key, None)
        reused = trainer is not None
        if trainer is not None:
            trainer.restart(spec, layout)  # a restart that raises leaves the trainer out
        else:
            while len(self._trainers) >= self.capacity:  # the least recently used goes, with its model's memory
                self._trainers.pop(next(iter(self._trainers)))
            trainer = build()
        self._trainers[key] = trainer
        return trainer, reused

    def discard(self, key: str) -> None:
        """Forget the trainer of ``key`` (its trial failed)."""
        self._trainers.pop(key, None)
