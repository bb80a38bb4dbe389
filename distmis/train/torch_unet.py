"""Train and validate the PyTorch 3D U-Net of one trial: the twin of :mod:`distmis.train.tf_unet`.

The trainer holds no case data: its cases are read from the search's TFRecords when needed
(:class:`~distmis.data.cases.SplitCases`, without TensorFlow), so its memory does not grow with the data set.
During an epoch one background thread reads the rank's training cases in the epoch's order, crops each to
its tile, augments it (``training.augment``: :meth:`TorchUNetTrainer._transform_case`) and stacks the batches, at most
``PREFETCH_BATCHES`` ahead of the training step (:func:`prefetched`).

Each epoch a seeded permutation orders the training cases identically on every rank; rank ``r`` of
``world_size`` takes every ``world_size``-th case of it, and every rank runs the same number of steps, so
gradient all-reduces (when a wrapper such as DDP adds them) never wait on a rank that has finished. The
trainer itself holds no distribution logic: the caller passes ``rank``/``world_size`` and a ``wrap_model``
(Ray Train's ``prepare_model``, DDP, ...).

Validation is per case on whole volumes (or stitched tiles when ``training.tile`` is set), read one at a
time; in a process group each rank predicts its share and the sums are all-reduced, so all ranks report
the same numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import queue
import resource
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from distmis.data.augment_torch import TorchAugmenter
from distmis.data.cases import SplitCases
from distmis.data.targets import metric_keys
from distmis.models.unet3d_torch import Activation, UNet3D, count_trainable_parameters
from distmis.spec.layout import TrialLayout, resolve_layout
from distmis.spec.schema import Spec
from distmis.spec.curriculum import TrainingStage, inference_window, stage_at
from distmis.train.epoch import (
    EpochMetrics, ValidationScores, checked_epoch, curriculum_metrics, trainer_targets,
)
from distmis.train.inference import predict_channels_last
from distmis.train.schedules import LearningRateSchedule
from distmis.train.torch_losses import (  # noqa: F401  (the losses' old home: imported from here too)
    BCE_EPSILON,
    LOSSES,
    LossName,
    dice_bce_loss,
    dice_bce_with_logits_loss,
    make_loss,
    soft_dice_loss,
    soft_dice_per_sample,
)

__all__ = [
    "LossName",
    "soft_dice_per_sample",
    "soft_dice_loss",
    "dice_bce_loss",
    "dice_bce_with_logits_loss",
    "make_loss",
    "PREFETCH_BATCHES",
    "prefetched",
    "StepMeter",
    "TorchUNetTrainer",
]

# --------------------------------------------------------------------------- data
#: Training batches the reading thread may have ready ahead of the training step. Two keep the step fed
#: while the next batch is read, and bound the memory: a batch of tiles each, never whole training volumes.
PREFETCH_BATCHES = 2
#: How often (seconds) a reading thread blocked on a full queue checks whether its consumer has gone.
_PUT_POLL_S = 0.1

T = TypeVar("T")


def prefetched(items: Iterable[T], depth: int = PREFETCH_BATCHES, *, name: str = "distmis-prefetch") -> Iterator[T]:
    """``items``, computed by one background thread at most ``depth`` ahead of the consumer.

    One thread, so the items are made in order (seeded random draws in them happen as without it). An
    exception in the thread is raised in the consumer as itself, its traceback kept, in place of the item
    that failed. Closing the iterator early (``close()``, or garbage collection after the consumer raised)
    stops the thread before it makes another item, and waits for it.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    slots: queue.Queue[tuple[bool, object]] = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(entry: tuple[bool, object]) -> bool:
        while not stop.is_set():
            try:
                slots.put(entry, timeout=_PUT_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        iterator = iter(items)
        try:
            while not stop.is_set():
                try:
                    item = next(iterator)
                except StopIteration:
                    put((False, done))
                    return
                if not put((True, item)):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            put((False, exc))

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            ok, entry = slots.get()
            if ok:
                yield entry  # type: ignore[misc]
            elif entry is done:
                return
            else:
                assert isinstance(entry, BaseException)
                raise entry
    finally:
        stop.set()
        thread.join()


def channels_first(volume: np.ndarray) -> torch.Tensor:
    """(h, w, d, C) numpy -> contiguous (C, h, w, d) float32 tensor."""
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(volume, -1, 0), dtype=np.float32))


def shard_batches(order: list[int], *, rank: int, world_size: int, batch_size: int) -> list[list[int]]:
    """The batches of case indices rank ``rank`` trains on, given one epoch's case ``order``.

    The rank's shard is ``order[rank::world_size]``, cut into batches of ``batch_size`` (the last
    one may be shorter). Every rank returns ``max(1, ceil(len(order) / (batch_size * world_size)))``
    batches: a rank whose shard yields fewer repeats its batches from the start. A rank whose shard
    is empty (fewer cases than ranks) borrows one case of the order.
    """
    if not order:
        raise ValueError("no training cases to shard")
    steps = max(1, math.ceil(len(order) / (batch_size * world_size)))
    shard = order[rank::world_size] or [order[rank % len(order)]]
    chunks = [shard[i : i + batch_size] for i in range(0, len(shard), batch_size)]
    return [chunks[k % len(chunks)] for k in range(steps)]


# --------------------------------------------------------------------------- step measurements
def _proc_status_bytes(field: str) -> int | None:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``, given in KiB) in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere), so that the
    resident set holds what is in use, as in a process that has just started, not what earlier work freed."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):  # not glibc
        pass


def _reset_resident_peak() -> bool:
    """Set the process's resident-set high-water mark (``VmHWM``) to its current resident set (Linux:
    ``5`` to ``/proc/self/clear_refs``, which touches nothing else); False where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return _proc_status_bytes("VmHWM") is not None


def _lifetime_resident_peak() -> int:
    """``getrusage``'s ``ru_maxrss`` in bytes (KiB on Linux, bytes on macOS): the peak since the process began."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class StepMeter:
    """One rank's training steps of an epoch: their mean wall time, and how far their peak memory rises above
    the parameters (what :attr:`~distmis.perf.model.MemoryEstimate.step` predicts).

    A step is timed from the moment its batch is in hand (the wait for the reading thread is not counted) to
    its loss read back after the optimizer's step: the batch's copy to the device, forward, loss, backward,
    gradient synchronization (DDP's all-reduce, or the SP and DP collectives) and the optimizer; on CUDA after a
    ``synchronize``, so every kernel of the step is in it.

    Memory is the epoch's peak less a baseline taken just before its first step (its batch in hand):

    - CUDA: ``torch.cuda.max_memory_allocated`` (its peak reset at :meth:`start_epoch`) less ``memory_allocated``;
    - CPU: the resident set's high-water mark ``VmHWM`` (reset at :meth:`start_epoch` through
      ``/proc/self/clear_refs``; in a process that has not peaked before it is the ``getrusage`` ``ru_maxrss``
      that ``benchmarks/sp_scaling.py`` reads) less the resident set ``VmRSS``. The C heap's free pages are given
      back first (glibc's ``malloc_trim``): else the steps reuse what earlier epochs and validation freed, and
      the resident set does not show them. Where the peak cannot be reset (no ``/proc``) the process's lifetime
      peak (``ru_maxrss``) is used.

    ``held`` gives the bytes of training state earlier steps left in place (gradients, the optimizer's moments:
    none before a trainer's first step); they are taken off the baseline, so every epoch counts them as the first
    does. On CPU the first epoch also counts what first use pages in (library code, kernel caches), and every
    epoch the allocator's own overhead and the batches the reading thread prepares.
    """

    def __init__(self, device: torch.device, held: Callable[[], float] | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.held = held or (lambda: 0.0)
        self.baseline: float | None = None  # bytes in use before this epoch's first step, less `held`
        self.seconds = 0.0
        self.steps = 0
        self._resettable = False
        self._started: float | None = None

    def _in_use(self) -> float:
        if self.cuda:
            return float(torch.cuda.memory_allocated(self.device))
        rss = _proc_status_bytes("VmRSS")
        if rss is None:
            import psutil

            rss = psutil.Process().memory_info().rss
        return float(rss)

    def _peak(self) -> float:
        if self.cuda:
            return float(torch.cuda.max_memory_allocated(self.device))
        hwm = _proc_status_bytes("VmHWM") if self._resettable else None
        return float(hwm if hwm is not None else _lifetime_resident_peak())

    def start_epoch(self) -> None:
        """Forget the previous epoch's steps and reset the memory peak."""
        self.seconds, self.steps, self._started, self.baseline = 0.0, 0, None, None
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _trim_heap()
            self._resettable = _reset_resident_peak()

    def start_step(self) -> None:
        """A step begins (its batch is in hand)."""
        if self.baseline is None:
            self.baseline = self._in_use() - self.held()
        self._started = time.perf_counter()

    def end_step(self) -> None:
        """The step has ended (its loss has been read back)."""
        if self._started is None:
            raise RuntimeError("end_step without start_step")
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - self._started
        self.steps += 1
        self._started = None

    @property
    def step_seconds(self) -> float:
        """Mean seconds of this epoch's steps."""
        if not self.steps:
            raise ValueError("no step measured this epoch")
        return self.seconds / self.steps

    @property
    def peak_bytes(self) -> float:
        """This epoch's peak above the baseline (0 if the memory in use fell below it)."""
        if self.baseline is None:
            raise ValueError("no step measured this epoch")
        return max(0.0, self._peak() - self.baseline)


# --------------------------------------------------------------------------- trainer
class TorchUNetTrainer:
    """Builds the PyTorch U-Net, its optimizer and the streaming input of one trial's spec on one rank.

    Args:
        spec: the trial's spec (its ``model.params`` and ``training`` sections are used).
        tfrecord_dir: the converted data (see :func:`distmis.search.prepare.prepare_data`).
        layout: the trial's layout; the optimizer takes its ``effective_lr``. Default: the spec's own
            (:func:`~distmis.spec.layout.resolve_layout`).
        rank: this worker's index among ``world_size`` data-parallel workers.
        world_size: how many workers share each epoch's training cases.
        wrap_model: applied to the model to give :attr:`train_model` (e.g. Ray Train's
            ``prepare_model`` or ``DistributedDataParallel``); ``None`` trains the model itself.
        device: where the model and batches live (``"cpu"``, ``"cuda:0"``, ...).
    """

    def __init__(
        self,
        spec: Spec,
        tfrecord_dir: str | Path,
        *,
        layout: TrialLayout | None = None,
        rank: int = 0,
        world_size: int = 1,
        wrap_model: Callable[[nn.Module], nn.Module] | None = None,
        device: str = "cpu",
    ) -> None:
        from distmis.data.tfrecord import read_manifest

        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in [0, {world_size}), got {rank}")
        self.spec = spec
        self.layout = layout or resolve_layout(spec)
        self.tfrecord_dir = Path(tfrecord_dir)
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        manifest = read_manifest(self.tfrecord_dir)
        self.num_classes = int(manifest["num_classes"])
        # What the output channels mean (distmis.data.targets): the head's activation, the loss, the scored channels
        self.targets = trainer_targets(manifest, self.tfrecord_dir)
        self.activation: Activation = self.targets["activation"]
        self.metric_keys: list[str] = metric_keys(self.targets)
        training = spec.training

        self.volume_shape = tuple(int(v) for v in manifest["image_shape"][:3])
        # training.curriculum: the stage of the epoch being trained gives the tile, batch and tile sampling
        # (a spec without one is one stage); validation and inference use the last stage's input throughout.
        self.stage = stage_at(training, 1)
        self.tile = self._check_tile(self.stage.tile, self.volume_shape)
        self.window = self._check_tile(inference_window(training), self.volume_shape)
        self.reduce_group: object | None = None  # the ranks whose validation shares add up (None: all)
        # Same seed -> same initial weights, whatever hyperparameters differ.
        torch.manual_seed(training.seed)
        self.in_channels = int(manifest["image_shape"][-1])
        self.model = self._build_model(self.in_channels).to(self.device)
        self.train_model = wrap_model(self.model) if wrap_model is not None else self.model
        self.num_parameters = count_trainable_parameters(self.model)
        opt = training.optimizer
        self.optimizer = torch.optim.Adam(
            self.train_model.parameters(), lr=self.layout.effective_lr, betas=(opt.beta1, opt.beta2), eps=opt.epsilon,
            amsgrad=opt.amsgrad,
        )
        # training.lr_schedule at the layout's (data-parallel scaled) rate: set at each epoch's start or step
        self.learning_rates = LearningRateSchedule.for_training(training, self.layout.effective_lr)
        self.loss_fn = make_loss(training.loss.name, training.loss.smooth, activation=self.activation)

        # Where the cases lie, not the cases: each is read when a batch or the validation needs it.
        self.train_cases = SplitCases(self.tfrecord_dir, "train", manifest=manifest)
        if not self.train_cases:
            raise ValueError(f"{self.tfrecord_dir}: the training split holds no cases")
        # Validation cases are channels-last numpy with float32 labels, as in the TF trainer.
        self.val_cases = SplitCases(self.tfrecord_dir, "val", label_dtype=np.float32, manifest=manifest)
        if not self.val_cases:
            raise ValueError(f"{self.tfrecord_dir}: the validation split holds no cases")

        self._tile_rng = torch.Generator().manual_seed(training.seed * 1_000 + rank)
        self._foreground_rng = torch.Generator().manual_seed(training.seed * 1_000 + rank + 500)  # tile_sampling
        # training.augment: MONAI's transforms of each training input, reseeded at every epoch's start
        self.augmenter = (TorchAugmenter(training.augment, self.tile or self.volume_shape)
                          if training.augment.active else None)
        self._epochs_trained = 0
        self.step_meter = StepMeter(self.device, held=self._training_state_bytes)
        self._measured: tuple[float, float] | None = None  # the last trained epoch's (step seconds, peak bytes)

    def _training_state_bytes(self) -> float:
        """Bytes of what training keeps between steps: the gradients and the optimizer's state."""
        tensors = [p.grad for p in self.train_model.parameters() if p.grad is not None]
        tensors += [t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        return float(sum(t.numel() * t.element_size() for t in tensors))

    def _build_model(self, in_channels: int) -> UNet3D:
        params = self.spec.model.params
        # UNet3D takes model.params' fields by name, like the Keras builder.
        return UNet3D(in_channels=in_channels, num_classes=self.num_classes, activation=self.activation,
                      **params.model_dump())

    @staticmethod
    def _check_tile(
        tile: tuple[int, int, int] | list[int] | None, volume: tuple[int, ...]
    ) -> tuple[int, int, int] | None:
        if tile is None:
            return None
        tile = tuple(int(t) for t in tile)
        if len(tile) != 3 or any(t < 1 or t > v for t, v in zip(tile, volume)):
            raise ValueError(
                f"training.tile {list(tile)} must be 3 positive sizes no larger than the volume {list(volume)}"
            )
        return tile  # type: ignore[return-value]

    # ------------------------------------------------------------------ data order
    @property
    def steps_per_epoch(self) -> int:
        """Batches every rank trains on per epoch (the same on all ranks)."""
        n = len(self.train_cases)
        return max(1, math.ceil(n / (self.stage.batch_size * self.world_size)))

    def epoch_order(self, epoch: int) -> list[int]:
        """The permutation of training-case indices for ``epoch``: seeded, identical on every rank."""
        generator = torch.Generator().manual_seed(self.spec.training.seed + epoch)
        return torch.randperm(len(self.train_cases), generator=generator).tolist()

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of training-case indices for ``epoch`` (see :func:`shard_batches`)."""
        return shard_batches(
            self.epoch_order(epoch), rank=self.rank, world_size=self.world_size,
            batch_size=self.stage.batch_size,
        )

    def _batch(self, indices: list[int], epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_host_batch` on the trainer's device."""
        images, labels = self._host_batch(indices, epoch)
        return images.to(self.device), labels.to(self.device)

    def _host_batch(self, indices: list[int], epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack training cases into (B, C, ...) float32 image and label tensors on the CPU, each case read,
        cropped to a random tile if set and transformed (:meth:`_training_sample`)."""
        images, labels = [], []
        for i in indices:
            image, label = self._training_sample(i, epoch)
            images.append(image)
            labels.append(label)
        return torch.stack(images), torch.stack(labels)

    def _training_sample(self, index: int, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Training case ``index`` read from disk, cropped (tile draws as ever: one crop per case, in batch
        order) and made channels-first float32, then :meth:`_transform_case`.

        The crop is copied out of the volume, so nothing of the whole volume outlives this call.
        """
        _case_id, image_hwdc, label_hwdc = self.train_cases[index]
        image = torch.from_numpy(image_hwdc).movedim(-1, 0)  # views (C, H, W, D): nothing copied yet
        label = torch.from_numpy(label_hwdc).movedim(-1, 0)
        if self.tile is not None:
            crop = self._random_crop(tuple(image.shape[1:]), label)
            image, label = image[crop], label[crop]
        image = image.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        label = label.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        return self._transform_case(image, label, epoch)

    def _transform_case(
        self, image: torch.Tensor, label: torch.Tensor, epoch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every training sample after its crop: ``image`` (C, h, w, d) and ``label`` (K, h, w, d), channels-first
        float32 tensors of its own, augmented (``training.augment``) or returned as they are.

        It runs in the reading thread (:func:`prefetched`) while the model trains: its random draws come from
        the augmenter's own generators, which :meth:`train_epoch` seeds from ``(training.seed, epoch, rank)``
        before the thread starts, never from torch's global one, which the training thread uses. ``epoch`` is the
        data order's epoch.
        """
        if self.augmenter is None:
            return image, label
        return self.augmenter(image, label)

    def _random_crop(self, volume: tuple[int, ...], label: torch.Tensor) -> tuple[slice, ...]:
        """Slices (all channels, then a tile at a seeded random offset): the same for image and label.

        With probability ``training.tile_sampling`` the tile is centred on a random foreground voxel of
        ``label`` (C, H, W, D) instead (a voxel of any target channel but a softmax scheme's background), moved
        inside the volume where it would stick out (a case without foreground keeps its uniform offset). Those draws come from a generator of their own, so the uniform
        offsets are those of ``tile_sampling`` 0, as in the TensorFlow pipeline (:func:`~distmis.data.tfrecord
        .make_dataset`).
        """
        assert self.tile is not None
        starts = [int(torch.randint(0, v - t + 1, (1,), generator=self._tile_rng)) for v, t in zip(volume, self.tile)]
        sampling = self.stage.tile_sampling
        if sampling and float(torch.rand(1, generator=self._foreground_rng)) < sampling:
            pick = float(torch.rand(1, generator=self._foreground_rng))
            held = label[1:] if self.activation == "softmax" else label  # a one-hot's background is no foreground
            foreground = torch.nonzero(held.any(dim=0))  # (N, 3) voxels
            if len(foreground):
                centre = foreground[min(int(pick * len(foreground)), len(foreground) - 1)].tolist()
                starts = [min(max(c - t // 2, 0), v - t) for c, t, v in zip(centre, self.tile, volume)]
        return (slice(None), *(slice(s, s + t) for s, t in zip(starts, self.tile)))

    # ------------------------------------------------------------------ training
    def train_epoch(self, epoch: int | None = None) -> float:
        """Train on this rank's batches of one epoch; the mean batch loss.

        ``epoch`` picks the data order; by default it is the number of epochs this trainer has trained. The
        learning rate is ``training.lr_schedule``'s for epoch ``epoch`` (counted from 1; by default the next one).
        """
        lr_epoch = self._epochs_trained + 1 if epoch is None else max(epoch, 1)  # a data order of 0: the first's
        epoch = self._epochs_trained if epoch is None else epoch
        self.enter_stage(stage_at(self.spec.training, lr_epoch))
        self.train_model.train()
        losses = []
        batches = self.epoch_batches(epoch)
        if self.augmenter is not None:  # the epoch's augmentation draws: the same whenever this epoch is trained
            self.augmenter.reseed(self.spec.training.seed, epoch, self.rank)
        meter = self.step_meter
        meter.start_epoch()
        stream = prefetched((self._host_batch(indices, epoch) for indices in batches), PREFETCH_BATCHES)
        try:
            for step, (x, y) in enumerate(stream):
                meter.start_step()  # the batch is here: what follows is the step (see StepMeter)
                if step == 0 or self.learning_rates.per_step:
                    self.set_learning_rate(self.learning_rates.at(lr_epoch, step, len(batches)))
                x, y = x.to(self.device), y.to(self.device)
                self.optimizer.zero_grad(set_to_none=True)
                loss = self._forward_backward(x, y)
                self._synchronize_gradients()
                self.optimizer.step()
                losses.append(float(loss))
                meter.end_step()
        finally:
            stream.close()  # a step that raised stops the reading thread before its next batch
        self._measured = (meter.step_seconds, meter.peak_bytes)  # read before validation can raise the peak
        self._epochs_trained += 1
        return float(np.mean(losses))

    def enter_stage(self, stage: TrainingStage) -> None:
        """Train on ``stage``'s input from now on (``training.curriculum``): its tile, batch and tile sampling."""
        if stage == self.stage:
            return
        self.stage = stage
        self.tile = self._check_tile(stage.tile, self.volume_shape)
        if self.augmenter is not None:  # its transforms are made for the input's size
            self.augmenter = TorchAugmenter(self.spec.training.augment, self.tile or self.volume_shape)
        self._stage_changed()

    def _stage_changed(self) -> None:
        """Called when the training input changes (a subclass whose model depends on it rebuilds here)."""

    def set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One step's forward and backward: the gradients in place, the batch's loss returned (detached)."""
        loss = self._batch_loss(x, y)
        loss.backward()
        return loss.detach()

    def _batch_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The training loss of one batch (a subclass may predict only part of it)."""
        return self.loss_fn(self.train_model(x), y)

    def _synchronize_gradients(self) -> None:
        """Called between backward and the optimizer step; DDP (``wrap_model``) has already all-reduced."""

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def _predict(self, images_hwdc: np.ndarray) -> np.ndarray:
        """Probabilities (B, h, w, d, C) for channels-last images (B, h, w, d, 4)."""
        x = torch.from_numpy(np.ascontiguousarray(np.moveaxis(images_hwdc, -1, 1), dtype=np.float32))
        prob = self.model(x.to(self.device))
        return prob.cpu().numpy().transpose(0, 2, 3, 4, 1)

    def predict_volume(self, image_hwdc: np.ndarray) -> np.ndarray:
        """Probabilities (h, w, d, C) for one (h, w, d, 4) volume: whole, or by sliding windows of the (last
        curriculum stage's) tile (``training.inference``: overlap, constant or Gaussian weights)."""
        return self.predict_with_window(image_hwdc, self.window)

    def predict_with_window(self, image_hwdc: np.ndarray, window: tuple[int, int, int] | None) -> np.ndarray:
        """:meth:`predict_volume` by sliding windows of ``window`` (None: the whole volume in one pass)."""
        self.model.eval()
        training = self.spec.training
        return predict_channels_last(self._predict, image_hwdc, window, inference=training.inference,
                                     batch_size=training.inference_batch_size)

    @contextlib.contextmanager
    def weights_from(self, directory: str | Path) -> Iterator[None]:
        """The weights :meth:`save` wrote to ``directory`` in the model for the block, the current ones after."""
        current = {name: value.detach().clone() for name, value in self.model.state_dict().items()}
        self.load(directory)
        try:
            yield
        finally:
            self.model.load_state_dict(current)

    def case_dice(self, prob: np.ndarray, label: np.ndarray) -> np.ndarray:
        """Dice of one case's prediction ``prob`` against its target channels ``label`` (both ``(h, w, d, C)``), for
        each foreground channel of the target scheme (:func:`~distmis.train.metrics.class_dice`: thresholded
        sigmoid channels, or the softmax's argmax), in the order of :attr:`metric_keys`."""
        from distmis.train.metrics import class_dice

        return class_dice(prob, label, self.targets)

    def validate(self) -> ValidationScores:
        """Mean validation loss, mean per-case dice (each case's mean over the foreground channels) and each
        foreground channel's mean dice, over every validation case.

        In a process group of ``world_size`` ranks each rank predicts every ``world_size``-th case (with rank
        0's normalization statistics) and the sums are all-reduced, so every rank returns the same means.
        """
        rank, size = self._validation_share()
        distributed = size > 1 and dist.is_available() and dist.is_initialized()
        if distributed:
            self._sync_buffers_from_rank0()
        cases = self.val_cases[rank::size] if distributed else self.val_cases
        loss_sum, dice_sum = 0.0, 0.0
        class_sums = np.zeros(len(self.metric_keys), dtype=np.float64)
        with torch.no_grad():
            for _case_id, image, label in cases:
                prob = self.predict_volume(image)
                loss_sum += float(self.loss_fn(channels_first(prob)[None], channels_first(label)[None]))
                dice = self.case_dice(prob, label)
                dice_sum += float(dice.mean())
                class_sums += dice
        totals = torch.tensor([loss_sum, dice_sum, *class_sums.tolist(), float(len(cases))], dtype=torch.float64,
                              device=self.device)
        if distributed:
            dist.all_reduce(totals, group=self.reduce_group)  # sum over ranks (on the model's device, for nccl)
        values = totals.cpu().tolist()
        count = values[-1]
        return ValidationScores(values[0] / count, values[1] / count,
                                {key: value / count for key, value in zip(self.metric_keys, values[2:-1])})

    def _validation_share(self) -> tuple[int, int]:
        """``(r, n)``: this rank validates every ``n``-th case from the ``r``-th; the sums add up over
        :attr:`reduce_group`. Here the data-parallel rank and size."""
        return self.rank, self.world_size

    def _sync_buffers_from_rank0(self) -> None:
        """Give every rank rank 0's buffers (batch-norm running statistics drift apart per rank)."""
        for buffer in self.model.buffers():
            dist.broadcast(buffer.data, src=0)

    def run_epoch(self, epoch: int) -> EpochMetrics:
        """Train one epoch (data order from ``epoch``), validate, and time both; with the steps' measurements
        (:meth:`step_metrics`).

        Raises NonFiniteLossError if training diverged.
        """
        metrics = checked_epoch(epoch, lambda: self.train_epoch(epoch), self.validate,
                                learning_rate=self.learning_rates.at(epoch))
        return dataclasses.replace(metrics, **self.step_metrics(),
                                   **curriculum_metrics(self.spec.training, epoch, self.volume_shape))

    def step_metrics(self) -> dict[str, float]:
        """The last trained epoch's ``step_seconds`` and ``peak_memory_mb`` (MiB) (:class:`StepMeter`), each the
        largest over the trial's ranks (the slowest rank's mean step, the fullest rank's peak: a collective when
        the trainer is in a process group, so every rank calls it), and ``fom`` where the model defines one
        (:meth:`figure_of_merit`)."""
        if self._measured is None:
            raise ValueError("no epoch trained yet")
        values = list(self._measured)
        groups = self._measurement_groups()
        if groups:
            largest = torch.tensor(values, dtype=torch.float64, device=self.device)
            for group in groups:
                dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
            values = largest.cpu().tolist()
        step_seconds, peak = values
        metrics = {"step_seconds": step_seconds, "peak_memory_mb": peak / 2**20}
        fom = self.figure_of_merit(step_seconds)
        if fom is not None:
            metrics["fom"] = fom
        return metrics

    def _measurement_groups(self) -> list[object]:
        """The process groups whose successive MAX all-reduces span every rank of the trial: the default group
        in a data-parallel process group; none for a trainer on its own."""
        distributed = self.world_size > 1 and dist.is_available() and dist.is_initialized()
        return [None] if distributed else []

    def figure_of_merit(self, step_seconds: float) -> float | None:
        """A model's figure of merit for a step of ``step_seconds`` (the U-Net has none)."""
        return None

    weight_files: tuple[str, ...] = ("model.pt",)

    def save(self, directory: str | Path) -> Path:
        """Save the plain model's ``state_dict`` as ``model.pt`` in ``directory``."""
        path = Path(directory) / "model.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(self.model.state_dict(), path)
        return path

    def load(self, directory: str | Path) -> None:
        """Load weights saved by :meth:`save`."""
        state = torch.load(Path(directory) / "model.pt", map_location=self.device, weights_only=True)
        self.model.load_state_dict(state)

    # ------------------------------------------------------------------ resuming (see distmis.train.checkpoint)
    def save_state(self, directory: str | Path, *, rank: int = 0, primary: bool = True) -> None:
        """What continuing exactly needs: the weights and the optimizer state (``primary`` rank) and this rank's
        random-number state (``rng.rank<rank>.pt``: torch's global generator and the tile generator)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if primary:
            torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()},
                       directory / "trainer.pt")
        rng = {"torch": torch.get_rng_state(), "tiles": self._tile_rng.get_state(),
               "foreground": self._foreground_rng.get_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        torch.save(rng, directory / f"rng.rank{rank}.pt")

    def _saved_optimizer_state(self, directory: Path, state: dict) -> dict:
        """This rank's optimizer state in a :meth:`save_state` folder whose ``trainer.pt`` holds ``state``."""
        return state["optimizer"]

    def load_state(self, directory: str | Path, *, rank: int = 0, epoch: int) -> None:
        """Continue after ``epoch`` epochs from :meth:`save_state`'s folder.

        The data order of every epoch is a function of the seed and the epoch, and the random-number state is
        this rank's own, so an interrupted trial continues as it would have without the interruption. A rank
        that finds no state of its own (the trial resumed on a different number of ranks) seeds its tile
        generator from the seed, its rank and the epoch.
        """
        directory = Path(directory)
        state = torch.load(directory / "trainer.pt", map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(self._saved_optimizer_state(directory, state))
        rng_file = directory / f"rng.rank{rank}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["torch"])
            self._tile_rng.set_state(rng["tiles"])
            if "foreground" in rng:  # absent from checkpoints written before training.tile_sampling
                self._foreground_rng.set_state(rng["foreground"])
            if "cuda" in rng and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.device)
        else:
            self._tile_rng.manual_seed((self.spec.training.seed * 1_000 + rank) * 10_000 + epoch)
            self._foreground_rng.manual_seed((self.spec.training.seed * 1_000 + rank + 500) * 10_000 + epoch)
        self._epochs_trained = epoch
