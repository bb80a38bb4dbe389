"""What a trial leaves for the driver to read: its epochs' metrics (:class:`EpochMetrics`, defined here once), the
reserved keys of its reports and its checkpoint folders.

The trial's side (:mod:`distmis.train.loop`, :mod:`distmis.train.checkpoint`, :mod:`distmis.train.startup`,
:mod:`distmis.train.system_metrics`: its :class:`SystemSample` s) writes them; the driver's side
(:mod:`distmis.tracking.mlflow_tracking`, :mod:`distmis.trial.checkpoints`) reads them. Both import this
module, so the tracking package need not import the training code to read what a trial wrote. Plain Python
(pyarrow's filesystem classes are imported where a folder is listed): no torch, TensorFlow, Ray or other distmis
module.

A checkpoint folder (``checkpoint_000012``) holds ``resume/state.json`` (a :class:`TrainingState`) once it is
complete; the rest of its files are the trainer's (:mod:`distmis.train.checkpoint`).
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

__all__ = ["CLASS_DICE_PREFIX", "EpochMetrics", "epoch_metric_names", "HISTORY_KEY", "STARTUP_PREFIX", "DEVICE_KEY",
           "NODES_KEY", "SYSTEM_KEY", "CHECKPOINT_PREFIX", "STORAGE_TYPE", "RESUME_DIR", "STATE_FILE", "SystemSample",
           "samples_to_json", "samples_from_json", "with_every_rank_records", "TrainingState", "stored_state",
           "held_epoch", "complete_folders"]

# --------------------------------------------------------------------------- keys of a trial's reports
HISTORY_KEY = "history"  # in a restarted trial's first report: JSON of every epoch's metrics so far
STARTUP_PREFIX = "startup_"  # the first report's start-up seconds, ``startup_<part>_s`` (train.startup)
DEVICE_KEY = "device"  # the first report's: where the (primary rank's) model trains, "cpu" or "cuda:0 (NVIDIA ...)"
NODES_KEY = "nodes"  # the first report's: the Ray node of each rank's process, rank 0 first, comma-separated
SYSTEM_KEY = "system_metrics"  # a report's system samples since the previous report: JSON (samples_to_json)


@dataclass(frozen=True)
class SystemSample:
    """One sample of a trial's system use (:mod:`distmis.train.system_metrics`): when (milliseconds since the epoch,
    as MLflow times a metric) and each figure by MLflow's system-metric name without its ``system/`` prefix
    (``cpu_utilization_percentage``, ``gpu_0_utilization_percentage``, ``rank0_memory_usage_megabytes``...)."""

    timestamp_ms: int
    values: dict[str, float]


def samples_to_json(samples: list[SystemSample]) -> str:
    return json.dumps([{"t": sample.timestamp_ms, "v": sample.values} for sample in samples])


def samples_from_json(text: str) -> list[SystemSample]:
    """The samples a report carries; ``[]`` for anything else (a report is a record, never a reason to fail)."""
    try:
        return [SystemSample(int(item["t"]), {str(k): float(v) for k, v in item["v"].items()})
                for item in json.loads(text)]
    except (TypeError, ValueError, KeyError, AttributeError):
        return []


def with_every_rank_records(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's report of an epoch (``reports``: every rank's, rank 0 first) carrying every rank's system samples
    (each rank samples its own processes and GPUs under names of its own, ``rank<r>_...``, ``gpu_<i>_...``) and, in a
    first report, every rank's node (``nodes``, in rank order)."""
    merged = dict(reports[0])
    if all(report.get(NODES_KEY) for report in reports):
        merged[NODES_KEY] = ",".join(str(report[NODES_KEY]) for report in reports)
    samples = [sample for report in reports if report.get(SYSTEM_KEY)
               for sample in samples_from_json(str(report[SYSTEM_KEY]))]
    if samples:
        merged[SYSTEM_KEY] = samples_to_json(sorted(samples, key=lambda sample: sample.timestamp_ms))
    return merged


# --------------------------------------------------------------------------- an epoch's metrics
#: The prefix of a foreground channel's validation dice in an epoch's metrics: ``val_dice_<key>``.
CLASS_DICE_PREFIX = "val_dice_"


@dataclass(frozen=True)
class EpochMetrics:
    epoch: int
    train_loss: float
    val_loss: float
    val_dice: float  # the mean over the foreground channels of their dice
    epoch_seconds: float
    learning_rate: float  # at the epoch's first step (training.lr_schedule)
    # Each foreground channel's validation dice, by its key: reported as val_dice_<key>
    class_dice: Mapping[str, float] | None = None
    # Measured by the PyTorch trainers (None where a trainer does not measure them; left out of as_dict):
    step_seconds: float | None = None  # mean wall seconds of a training step, the batch's wait excluded
    peak_memory_mb: float | None = None  # a step's peak memory above what the process held before training, MiB
    fom: float | None = None  # the seed's figure of merit b L s^2 d / step_seconds (ViT-seg)
    # The traced memory model's prediction of the same step (distmis.estimate.memory: torch trials training the
    # whole network on a rank, the ViT-seg's aside, whose prediction the driver logs at step 0): MiB and FLOPs
    predicted_step_memory_mb: float | None = None  # what peak_memory_mb measures
    predicted_peak_memory_mb: float | None = None  # with the weights and the batch
    predicted_flops_per_step: float | None = None
    # The step's rate: its counted FLOPs (predicted_flops_per_step) over step_seconds, FLOP/s, and as a fraction of
    # the device's own matmul rate (FLOP/s of a 2048^3 product in the training's compute dtype, this process)
    step_flop_rate: float | None = None
    matmul_rate: float | None = None
    matmul_fraction: float | None = None
    # training.performance.memory_format (torch): 1 where the trial trains channels-last, and where it measured
    # the formats at its start, each one's step seconds (distmis.train.step_settings)
    channels_last: float | None = None
    format_step_seconds_contiguous: float | None = None
    format_step_seconds_channels_last: float | None = None
    # training.performance.compile (torch): 1 where the training step runs compiled (torch.compile), and what was
    # measured: the eager and compiled steps' seconds and the compilation's
    compiled: float | None = None
    # the training steps' share of the epoch's training time (the rest: waiting for the input pipeline's batches);
    # a TensorFlow trial stepping a distributed dataset in one graph does not measure it
    step_share: float | None = None
    # the bits of the torch step's compute dtype: 32 (fp32), 16 (bf16, fp16; training.precision auto's resolution)
    compute_bits: float | None = None
    compile_step_seconds_eager: float | None = None
    compile_step_seconds_compiled: float | None = None
    compile_seconds: float | None = None
    # With a training.curriculum: the epoch's stage (1-based) and the size of its training input
    curriculum_stage: int | None = None
    tile_h: int | None = None
    tile_w: int | None = None
    tile_d: int | None = None
    # The validation's share of epoch_seconds (what a data-parallel trial does not divide among its workers)
    validation_seconds: float | None = None
    # parallelism.mode 'auto': the workers the trial held for the epoch and the worker pool's prediction of its time
    # (distmis.perf.pool), set by the trial beside its workers' report
    workers: int | None = None
    predicted_epoch_seconds: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The fields that hold a value, flat: ``class_dice`` as ``val_dice_<key>`` after ``val_dice``."""
        out: dict[str, Any] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if value is not None and item.name != "class_dice":
                out[item.name] = value
            if item.name == "val_dice":
                out.update({f"{CLASS_DICE_PREFIX}{key}": float(dice) for key, dice in (self.class_dice or {}).items()})
        return out


def epoch_metric_names() -> tuple[str, ...]:
    """The names of the numbers every epoch's report may carry (:class:`EpochMetrics`' fields but the epoch, which
    is the step, and ``class_dice``, reported as ``val_dice_<key>``): what the driver logs as MLflow metrics."""
    return tuple(item.name for item in fields(EpochMetrics) if item.name not in ("epoch", "class_dice"))


# --------------------------------------------------------------------------- a checkpoint folder's structure
CHECKPOINT_PREFIX = "checkpoint_"  # the folders Tune and Ray Train write a trial's checkpoints to
#: pyarrow's ``type_name`` of the file system a search's Ray storage is on (:mod:`distmis.trial.storage`): the local
#: disk, with every file written whole.
STORAGE_TYPE = "py::distmis-atomic-local"
RESUME_DIR = "resume"
STATE_FILE = "state.json"  # in RESUME_DIR, written last: a folder with a state is complete


@dataclass
class TrainingState:
    """Where a trial's training stands: ``epoch`` epochs done, the best value of the search metric so far."""

    epoch: int = 0
    best_value: float | None = None
    best_epoch: int = 0
    history: list[dict[str, float]] = field(default_factory=list)  # every epoch's metrics, epoch 1 first

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrainingState:
        data = json.loads(text)
        return cls(epoch=int(data["epoch"]), best_value=data.get("best_value"),
                   best_epoch=int(data.get("best_epoch", 0)), history=list(data.get("history", [])))


# --------------------------------------------------------------------------- a trial's folders on storage
def _checkpoint_folders(filesystem: Any, parent: str) -> list[str]:
    """Every checkpoint folder (``checkpoint_000012``, ...) of the trial folder ``parent`` (a pyarrow filesystem)."""
    from pyarrow.fs import FileSelector, FileType

    infos = filesystem.get_file_info(FileSelector(parent))
    return [info.path for info in infos
            if info.type == FileType.Directory and posixpath.basename(info.path).startswith(CHECKPOINT_PREFIX)]


def stored_state(filesystem: Any, folder: str) -> TrainingState | None:
    """The training state a checkpoint folder on ``filesystem`` holds; None when it holds no readable one
    (emptied, never completed, or cut short)."""
    try:
        with filesystem.open_input_stream(posixpath.join(folder, RESUME_DIR, STATE_FILE)) as stream:
            return TrainingState.from_json(stream.read().decode())
    except (OSError, ValueError, KeyError, TypeError):  # missing, unreadable, or not a state of ours
        return None


def held_epoch(filesystem: Any, folder: str) -> int | None:
    """The epoch a checkpoint folder holds (see :func:`stored_state`)."""
    state = stored_state(filesystem, folder)
    return None if state is None else state.epoch


def complete_folders(filesystem: Any, parent: str) -> list[tuple[int, str]]:
    """``(epoch, folder)`` of every checkpoint folder of the trial folder ``parent`` that holds a training state,
    the newest epoch first (of two folders with one epoch, the later name first: the later write).

    Ranked by the epoch each holds, never by name: a restored Tune trial numbers its new folders from the index its
    (older) saved state knew."""
    held = [(held_epoch(filesystem, folder), folder) for folder in _checkpoint_folders(filesystem, parent)]
    return sorted(((epoch, folder) for epoch, folder in held if epoch is not None), reverse=True)
