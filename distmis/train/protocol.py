"""What the search, the epoch loop, checkpointing, evaluation and inference timing call on a trainer.

:class:`Trainer` is the one seam between them and the framework code: :func:`distmis.trial.trainables.build_trainer`
hands back a trainer of it, whatever the framework and the parallelism, and nothing outside ``distmis/train`` asks
what class it is. Its contract:

- **build**: a trainer is built for one trial's ``spec`` (its config applied) and the ``layout`` resolved once for
  that trial (:func:`~distmis.spec.layout.resolve_trial`): the model (``model``, the plain network: a torch
  ``nn.Module`` or a Keras model, what is exported and published), its optimizer at ``layout.effective_lr``, the
  input of the trial's data; the same seed gives the same initial weights and data order.
- **train**: :meth:`~Trainer.train_epoch` trains one pass over the training split (its learning rate the schedule's
  for ``epoch``, by default the one after those trained) and gives the mean batch loss; :meth:`~Trainer.validate`
  scores the whole validation split; :meth:`~Trainer.run_epoch` is both, timed, as the epoch loop reports it
  (:mod:`distmis.train.loop`; it raises :class:`~distmis.train.epoch.NonFiniteLossError` when training diverged).
- **predict**: :meth:`~Trainer.predict_volume` gives the probabilities of one ``(H, W, D, C)`` volume, whole or by
  sliding windows of the trial's tile (``training.inference``); :meth:`~Trainer.predict_with_window` the same
  by windows of a given size (None: one pass), which inference timing compares
  (:mod:`distmis.train.inference_timing`). Both take ``mirror``, the axes each window is test-time mirrored on
  (:func:`distmis.pyfunc_model.mirrored`; default none, as validation predicts: the test split uses
  ``training.inference.mirror``).
- **save / load**: :meth:`~Trainer.save` writes the weights (the files named by ``weight_files``) to a folder and
  :meth:`~Trainer.load` reads them back; :meth:`~Trainer.weights_from` holds them for a block only.
  :meth:`~Trainer.save_state` / :meth:`~Trainer.load_state` write and read what a restarted trial goes on from
  (weights, optimizer, random state: every rank calls them, the ``primary`` one writes the shared part), as
  :mod:`distmis.train.checkpoint` lays a checkpoint out.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from distmis.spec.layout import TrialLayout
from distmis.spec.schema import Spec
from distmis.train.epoch import EpochMetrics, ValidationScores

__all__ = ["RestartableTrainer", "Trainer", "Window"]

#: A sliding window's size (H, W, D); None: the whole volume in one pass.
Window = tuple[int, int, int] | None


@runtime_checkable
class Trainer(Protocol):
    """One trial's trainer on one rank (see the module's docstring for the contract)."""

    spec: Spec  # the trial's spec
    layout: TrialLayout  # the trial's layout, resolved once per trial
    num_parameters: int  # trainable parameters of the whole model
    model: object  # the plain network (torch nn.Module or Keras model): what is exported and published
    weight_files: tuple[str, ...]  # what :meth:`save` writes (the best weights, at a checkpoint's root)
    volume_shape: tuple[int, ...]  # (H, W, D) of the data's volumes
    val_cases: Sequence[tuple[str, np.ndarray, np.ndarray]]  # (case id, image, label) of the validation split

    def run_epoch(self, epoch: int) -> EpochMetrics: ...

    def train_epoch(self, epoch: int | None = None) -> float: ...

    def validate(self) -> ValidationScores: ...

    def predict_volume(self, image: np.ndarray, *, mirror: Sequence[int] = ()) -> np.ndarray: ...

    def predict_with_window(self, image: np.ndarray, window: Window, *, mirror: Sequence[int] = ()) -> np.ndarray: ...

    def case_dice(self, prob: np.ndarray, label: np.ndarray) -> np.ndarray: ...

    def save(self, directory: str | Path) -> Path: ...

    def load(self, directory: str | Path) -> None: ...

    def weights_from(self, directory: str | Path) -> AbstractContextManager[None]: ...

    def save_state(self, directory: str | Path, *, rank: int, primary: bool) -> None: ...

    def load_state(self, directory: str | Path, *, rank: int, epoch: int) -> None: ...


@runtime_checkable
class RestartableTrainer(Trainer, Protocol):
    """A trainer that can become the fresh trainer of another trial with the same graphs (the TensorFlow worker
    group's: :mod:`distmis.trial.worker_group`, :meth:`distmis.train.tf_unet.UNetTrainer.restart`)."""

    def restart(self, spec: Spec, layout: TrialLayout) -> None: ...
