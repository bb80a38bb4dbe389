"""The epoch loop every trial runs, in whatever process: train an epoch, report it with a checkpoint.

:func:`epoch_reports` yields the epochs one at a time (the worker group of a data-mode search steps it one call
per epoch: :mod:`distmis.trial.worker_group`); :func:`train_and_report` hands each to a report function (Tune's
or Ray Train's). Restarted trials go on from their checkpoint (:mod:`distmis.train.checkpoint`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import uuid
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Mapping, Protocol, Sequence

from distmis.spec.schema import Spec

if TYPE_CHECKING:
    from distmis.train.protocol import Trainer
    from distmis.train.system_metrics import SystemSampler
    from distmis.trial.record import TrainingState

logger = logging.getLogger(__name__)

#: One epoch's report: the epoch's metrics (:meth:`~distmis.train.epoch.EpochMetrics.as_dict`), the trial's
#: ``num_parameters`` and ``attempt``, the first report's start-up seconds and replayed history (JSON).
Metrics = dict[str, float | int | str]

#: A rank's scratch folder in its trial's working folder is ``distmis-trial-rank<r>`` (:func:`trial_scratch`); the
#: best epoch's weights so far are in its ``best/``.
SCRATCH_PREFIX = "distmis-trial-rank"
BEST_DIR = "best"


class StoredCheckpoint(Protocol):
    """A checkpoint folder Ray keeps (``ray.train.Checkpoint``, which Tune's is): what the loop reads of one."""

    @property
    def path(self) -> str: ...

    def as_directory(self) -> AbstractContextManager[str]: ...


class CheckpointFactory(Protocol):
    """What makes a report's checkpoint of an epoch's folder: the class ``ray.train.Checkpoint`` (or Tune's)."""

    def from_directory(self, path: str) -> StoredCheckpoint: ...


class Report(Protocol):
    """``ray.tune.report`` or ``ray.train.report``: one epoch's metrics, with its checkpoint or none."""

    def __call__(self, metrics: Metrics, checkpoint: StoredCheckpoint | None = None) -> None: ...


def is_better(value: float, best: float | None, mode: str) -> bool:
    if not math.isfinite(value):
        return False
    return best is None or (value > best if mode == "max" else value < best)


def quiet_worker() -> None:
    """Keep a trial's log to what a user reads: no TensorFlow C++ chatter, no line per saved checkpoint."""
    import logging

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for name in ("ray.train._internal.storage", "ray.train.v2._internal.execution.storage"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:  # Ray Train 2.60 logs every report of every rank, named by its file path
        from ray.train.v2._internal.execution import context as train_context

        train_context.logger.setLevel(logging.WARNING)
    except (ImportError, AttributeError):
        pass


def train_and_report(trainer: Trainer, spec: Spec, report: Report, checkpoint_type: CheckpointFactory, *,
                     checkpoints: Sequence[StoredCheckpoint] = (), rank: int = 0, primary: bool = True,
                     startup: Mapping[str, float] | None = None, scratch: str | Path | None = None) -> None:
    """Run the trial's epochs, reporting each with a resumable checkpoint (:mod:`distmis.train.checkpoint`):
    :func:`epoch_reports`, each epoch handed to ``report`` (``checkpoint_type.from_directory`` of its folder)."""
    for metrics, folder in epoch_reports(trainer, spec, checkpoints=checkpoints, rank=rank, primary=primary,
                                         startup=startup, scratch=scratch):
        if folder is not None:
            report(metrics, checkpoint=checkpoint_type.from_directory(str(folder)))
        else:
            report(metrics)


def epoch_reports(trainer: Trainer, spec: Spec, *, checkpoints: Sequence[StoredCheckpoint] = (), rank: int = 0,
                  primary: bool = True, startup: Mapping[str, float] | None = None,
                  scratch: str | Path | None = None) -> Iterator[tuple[Metrics, Path | None]]:
    """The trial's epochs, one at a time: each epoch's metrics and the folder of its checkpoint (None when this rank
    adds nothing to it), which lives until the next epoch is asked for.

    ``scratch``: the trial's own working folder, where this rank keeps the best epoch's weights so far and each
    epoch's checkpoint until it is reported (:func:`trial_scratch`); None: the system's temporary folder.

    ``checkpoints``: when the trial is restarted (a retry, or a resumed search), its checkpoints, newest first:
    training goes on after the epoch of the first one that loads. ``rank``/``primary``: this process's rank; the
    primary one writes the weights. Every report carries ``attempt``, an id of this process's run of the trial,
    so the driver can count restarts; the first one also ``startup`` (:mod:`distmis.train.startup`), the device
    the model is on (``device``: :func:`~distmis.parallel.devices.model_device`) and this process's node (``nodes``:
    :func:`~distmis.parallel.devices.process_node`). With ``tracking.system_metrics``
    every report also carries this rank's system samples since the previous one (``system_metrics``:
    :mod:`distmis.train.system_metrics`).
    """
    from distmis.parallel.devices import model_device, process_node
    from distmis.train.checkpoint import write_checkpoint
    from distmis.trial.record import DEVICE_KEY, HISTORY_KEY, NODES_KEY, SYSTEM_KEY, TrainingState, samples_to_json

    from distmis.train.selection import selection_metrics

    # search.selection: the best epoch by the metric, or by its moving average (reported beside it)
    metric, mode = spec.search.selected_metric, spec.search.mode
    attempt = uuid.uuid4().hex[:12]
    sampler = _system_sampler(trainer, spec, rank)
    with trial_scratch(scratch, rank) as folder, sampler or nullcontext():
        best_dir = str(folder / BEST_DIR)
        state = _resume(trainer, checkpoints, best_dir, rank) if checkpoints else TrainingState()
        # After a restart, the first report carries the epochs trained so far: the driver may have missed some.
        replay = {HISTORY_KEY: json.dumps(state.history)} if state.history else {}
        # what only this attempt's first report carries
        first = {**replay, **(startup or {}), DEVICE_KEY: model_device(trainer.model), NODES_KEY: process_node()}
        if state.epoch >= spec.training.epochs and replay:  # it had trained every epoch: only the replay is left
            yield {**state.history[-1], "num_parameters": trainer.num_parameters, "attempt": attempt, **first}, None
        for epoch in range(state.epoch + 1, spec.training.epochs + 1):
            epoch_metrics = trainer.run_epoch(epoch).as_dict()
            if spec.parallelism.mode == "auto":  # the workers it ran on, kept in the history a restart replays
                epoch_metrics["workers"] = trainer.layout.world_size
            epoch_metrics.update(selection_metrics([*state.history, epoch_metrics], spec.search))
            metrics: Metrics = {**epoch_metrics, "num_parameters": trainer.num_parameters, "attempt": attempt,
                                **first}
            first = {}
            state.epoch = epoch
            state.history.append(epoch_metrics)
            if is_better(metrics[metric], state.best_value, mode):
                state.best_value, state.best_epoch = float(metrics[metric]), epoch
                if primary:
                    trainer.save(best_dir)
            if epoch == spec.training.epochs and primary and spec.training.inference.compare \
                    and state.best_epoch is not None:
                from distmis.train.inference_timing import compare_inference

                metrics.update(compare_inference(trainer, best_dir))  # the best epoch's weights, two ways
            with tempfile.TemporaryDirectory(prefix="checkpoint-", dir=folder) as tmp:
                written = write_checkpoint(trainer, tmp, state, best_dir, rank=rank, primary=primary)
                if sampler is not None:  # the system's use since the last report (tracking.system_metrics)
                    metrics[SYSTEM_KEY] = samples_to_json(sampler.drain())
                yield metrics, Path(tmp) if written else None


def _system_sampler(trainer: Trainer, spec: Spec, rank: int) -> SystemSampler | None:
    """This rank's sampler of its system use (:mod:`distmis.train.system_metrics`), not yet started; None when
    ``tracking.system_metrics`` is off."""
    if not spec.tracking.system_metrics:
        return None
    from distmis.train.system_metrics import SystemSampler

    layout = trainer.layout
    return SystemSampler(spec.tracking.system_metrics_interval, rank=rank, cpus=layout.cpu, gpus=layout.gpu > 0)


@contextmanager
def trial_scratch(folder: str | Path | None, rank: int) -> Iterator[Path]:
    """This rank's scratch folder for one run of a trial's epochs: the best epoch's weights so far (``best/``) and
    each epoch's checkpoint until it is reported.

    ``folder``: the trial's own working folder (Ray's, which Tune and Ray Train make a trial process's working
    directory). The scratch is ``folder/distmis-trial-rank<r>``, emptied first, so what a killed run of the same
    trial left there is reused rather than piled up, and removed at the end; whatever is left goes with the trial's
    folder. None (outside a trial): a new folder in the system's temporary folder, removed at the end."""
    if folder is None:
        with tempfile.TemporaryDirectory(prefix=f"{SCRATCH_PREFIX}{rank}-") as tmp:
            (Path(tmp) / BEST_DIR).mkdir()
            yield Path(tmp)
        return
    scratch = Path(folder) / f"{SCRATCH_PREFIX}{rank}"
    _remove(scratch)
    (scratch / BEST_DIR).mkdir(parents=True)
    try:
        yield scratch
    finally:
        _remove(scratch)


def _remove(path: Path) -> None:
    """Delete ``path``, a scratch folder distmis made (a link in its place is unlinked, never followed)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


@contextmanager
def read_in_place(checkpoint: StoredCheckpoint) -> Iterator[str]:
    """The folder to read ``checkpoint`` from: its own, when it is on this machine's disk (a search's storage, or
    pyarrow's local file system), else Ray's local copy (``as_directory``).

    Not Ray's copy where it need not be: the ranks of a restarted trial on one node share one copy, and a rank that
    takes Ray's download lock after another rank's download has finished copies the checkpoint again, over the
    files that rank is reading (seen: ``PytorchStreamReader failed reading file``, then a failed trial)."""
    from distmis.trial.record import STORAGE_TYPE

    filesystem = getattr(checkpoint, "filesystem", None)
    if getattr(filesystem, "type_name", None) in ("local", STORAGE_TYPE) and os.path.isdir(checkpoint.path):
        yield checkpoint.path
        return
    with checkpoint.as_directory() as directory:
        yield directory


def _resume(trainer: Trainer, checkpoints: Sequence[StoredCheckpoint], best_dir: str, rank: int) -> TrainingState:
    """Load the newest of ``checkpoints`` that loads; an unreadable one (cut short when a process died while it
    was being saved) is skipped with a warning."""
    from distmis.train.checkpoint import resume_from

    problems = []
    for checkpoint in checkpoints:
        try:
            with read_in_place(checkpoint) as directory:
                state = resume_from(trainer, directory, best_dir, rank=rank)
        except Exception as exc:  # noqa: BLE001 - a missing or truncated file, whatever its reader raises
            logger.warning("cannot resume from %s (%s); trying an older checkpoint", checkpoint.path, exc)
            problems.append(f"{checkpoint.path}: {exc}")
            continue
        logger.info("resuming after epoch %d from %s", state.epoch, checkpoint.path)
        return state
    raise RuntimeError("no checkpoint of this trial could be loaded:\n" + "\n".join(problems))
