"""Train and validate one trial's torch network on one rank: the registry's network, whatever its parallelism.

:class:`TorchTrainer` builds the network of the trial's registry entry (:mod:`distmis.models.registry`) for the
data's channels, the target scheme's output channels and activation, the network input (the tile, or the whole
volume) and the preprocessed spacing, and applies the trial's parallelism to it from outside: a
:class:`~distmis.train.parallelism.Parallelism` chosen from the trial's :class:`~distmis.parallel.mesh.TrialMesh`
(data-parallel replicas, sequence parallelism, pipeline stages). It holds no per-model code: an entry whose output
is ``logits`` is trained on them (the loss from the logits) and predicts the target scheme's activation of them.

The trainer holds no case data: its cases are read from the search's TFRecords when needed
(:class:`~distmis.data.cases.SplitCases`, without TensorFlow), so its memory does not grow with the data set.
During an epoch one background thread reads the replica's training cases in the epoch's order, crops each to its
tile, augments it (``training.augment``: :meth:`TorchTrainer._transform_case`) and stacks the batches, at most
``PREFETCH_BATCHES`` ahead of the training step (:func:`~distmis.train.prefetch.prefetched`).

Each epoch a seeded permutation orders the training cases identically on every rank; data-parallel replica ``r``
of ``n`` (the mesh's DP rank and size) takes every ``n``-th case of it, and every replica runs the same number of
steps (:func:`~distmis.train.prefetch.shard_batches`); all ranks of one SP group or pipeline read the same batches.
The data order, the tiles, the augmentation and the initial weights depend on the seed and the DP rank only.

Validation is per case on whole volumes (or stitched windows when ``training.tile`` is set), read one at a time;
in a process group each rank predicts its share (the strategy's) and the sums are all-reduced, so all ranks report
the same numbers. Every epoch reports its steps' ``step_seconds`` and ``peak_memory_mb``
(:class:`~distmis.train.metering.StepMeter`, the largest over the trial's ranks) and, where the entry has a
performance-model shape (``perf_shape``), ``fom``, the seed's figure of merit ``b L s^2 d / step_seconds``.

``training.precision`` (:mod:`distmis.train.precision`): bf16 and fp16 train the fp32 network under autocast (fp32
master weights, gradients and optimizer state; the loss in fp32; fp16's loss scaler, whose state the checkpoint keeps),
and validate and predict under the same autocast with fp32 probabilities.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from distmis.data.augment_torch import TorchAugmenter
from distmis.data.cases import SplitCases
from distmis.data.targets import metric_keys
from distmis.models.registry import ModelEntry, NetworkInput
from distmis.models.unet3d_torch import Activation, activate, count_trainable_parameters
from distmis.networks import build_network
from distmis.parallel.devices import set_cudnn_benchmark
from distmis.parallel.mesh import TrialMesh
from distmis.perf.model import ViTShape
from distmis.spec.curriculum import TrainingStage, inference_window, stage_at
from distmis.spec.layout import TrialLayout
from distmis.spec.load import network_tile
from distmis.spec.schema import Spec
from distmis.train.epoch import (
    EpochMetrics, ValidationScores, checked_epoch, curriculum_metrics, trainer_targets, trial_parts,
)
from distmis.train.deep_supervision import DeepSupervisionLoss
from distmis.train.inference import predict_channels_last, sliding_window
from distmis.train.metering import StepMeter
from distmis.train.optimizers import torch_optimizer
from distmis.train.parallelism import InputShape, Parallelism, parallelism_for
from distmis.train.precision import TorchPrecision
from distmis.train.protocol import Window
from distmis.train.prefetch import PREFETCH_BATCHES, channels_first, prefetched, shard_batches
from distmis.train.schedules import LearningRateSchedule
from distmis.train.choice_cache import ChoiceCache
from distmis.train.compile_choice import cached_compile, compile_cache_entry
from distmis.train.step_settings import (
    CompileChoice, MemoryFormatChoice, apply_memory_format, choice_key, choose_compile, choose_memory_format,
    compile_error, compile_model, device_name, in_memory_format, matmul_rate,
)
from distmis.train.torch_losses import make_loss

__all__ = ["TorchTrainer"]

logger = logging.getLogger(__name__)


class TorchTrainer:
    """Builds one trial's torch network, its optimizer and the streaming input of its spec on one rank.

    Args:
        spec: the trial's spec (its ``model`` and ``training`` sections are used).
        tfrecord_dir: the converted data (see :func:`distmis.search.prepare.prepare_data`).
        layout: the trial's layout, resolved once per trial (:func:`~distmis.spec.layout.resolve_trial`); the
            optimizer takes its ``effective_lr``.
        mesh: this process's place in the trial (:meth:`TrialMesh.build` in a worker group,
            :meth:`TrialMesh.local` alone): the parallelism applied to the network and the data's share.
        device: where the model and batches live (``"cpu"``, ``"cuda:0"``, ...).
    """

    weight_files: tuple[str, ...] = ("model.pt",)

    def __init__(self, spec: Spec, tfrecord_dir: str | Path, *, layout: TrialLayout, mesh: TrialMesh,
                 device: str = "cpu") -> None:
        from distmis.data.manifest import read_manifest

        self.spec, self.layout, self.mesh = spec, layout, mesh
        self.entry: ModelEntry = spec.model.entry
        self.tfrecord_dir = Path(tfrecord_dir)
        self.rank, self.world_size = mesh.dp_rank, mesh.dp_size  # the data's share: the DP replica's
        self.device = torch.device(device)
        set_cudnn_benchmark(spec.training.cudnn_benchmark)  # this process's, set for every trial it trains
        manifest = read_manifest(self.tfrecord_dir)
        self.num_classes = manifest.num_classes
        # What the output channels mean (distmis.data.targets): the activation, the loss, the scored channels
        self.targets = trainer_targets(manifest, self.tfrecord_dir)
        self.activation: Activation = self.targets["activation"]
        self.metric_keys: list[str] = metric_keys(self.targets)
        training = spec.training

        self.volume_shape = manifest.volume
        # training.curriculum: the stage of the epoch being trained gives the tile, batch and tile sampling
        # (a spec without one is one stage); validation and inference use the last stage's input throughout.
        self.stage = stage_at(training, 1)
        self.tile = self._check_tile(self.stage.tile, self.volume_shape)
        self.in_channels = manifest.in_channels
        spacing = (manifest.preprocess or {}).get("spacing")
        self.network_input = NetworkInput(
            in_channels=self.in_channels, out_channels=self.num_classes,
            # what every training input and the inference window divide by (DynUNet plans its strides from it):
            # the tile, the whole volume without one, a curriculum's stages' greatest common divisor
            tile=network_tile(spec, self.volume_shape),  # type: ignore[arg-type]
            activation=self.activation, spacing=tuple(float(v) for v in spacing) if spacing else None,
            deep_supervision=training.deep_supervision)
        # A network built for one input size predicts by windows of it; any other by the last stage's tile.
        self.window = (self.network_input.tile if self.entry.fixed_input
                       else self._check_tile(inference_window(training), self.volume_shape))

        loss = training.loss
        self.loss_fn = make_loss(loss.name, loss.smooth, activation=self.activation)  # on probabilities
        # training.precision: the forward under autocast (bf16, fp16), the weights, gradients and optimizer state fp32,
        # the loss in fp32, fp16's loss scaled (distmis.train.precision); ValueError where the device cannot
        self.precision = TorchPrecision(training.precision, self.device)
        # A network that gives logits trains on them (BCE with logits for sigmoid targets, MONAI's DiceCELoss for
        # softmax ones); validation scores the probabilities either way.
        # training.deep_supervision: the network trains on a list of outputs, each scored on the target at its own
        # resolution and weighed as nnU-Net does (distmis.train.deep_supervision); one output: the loss itself
        self.train_loss_fn = DeepSupervisionLoss(self.precision.fp32_loss(
            make_loss(loss.name, loss.smooth, from_logits=True, activation=self.activation)
            if self.entry.output == "logits" else self.loss_fn))
        self.parallelism: Parallelism = parallelism_for(self.entry, spec, mesh, self.device, self.train_loss_fn,
                                                        precision=self.precision)

        # Where the cases lie, not the cases: each is read when a batch or the validation needs it. The parts: train
        # and val, or with cross-validation (dataset.split.fold) the other folds and this trial's fold.
        self.parts = trial_parts(manifest, spec.dataset.split.fold, self.tfrecord_dir)
        self.train_cases = SplitCases(self.tfrecord_dir, self.parts.train, manifest=manifest)
        if not self.train_cases:
            raise ValueError(f"{self.tfrecord_dir}: the training split holds no cases")
        # Validation cases are channels-last numpy with float32 labels, as in the TF trainer.
        self.val_cases = SplitCases(self.tfrecord_dir, self.parts.val, label_dtype=np.float32, manifest=manifest)
        if not self.val_cases:
            raise ValueError(f"{self.tfrecord_dir}: the validation split holds no cases")

        # Same seed -> same initial weights, whatever hyperparameters differ.
        torch.manual_seed(training.seed)
        self.model = build_network(self.entry, spec.model.params, self.network_input).to(self.device)
        # training.performance.memory_format: the layout the step is fastest in (distmis.train.step_settings), set
        # before the parallelism wraps the model
        self.memory_format: MemoryFormatChoice = self._choose_memory_format()
        apply_memory_format(self.model, self.memory_format.memory_format)
        self.train_model = self.parallelism.apply(self.model, self._input_shape())
        # training.performance.compile: the training step through torch.compile where it pays (step_settings); a
        # network that fails to compile at its first step trains eager (_step)
        self.compile: CompileChoice = self._choose_compile()
        self._eager_train_model: torch.nn.Module | None = None  # the uncompiled model until the compiled step has run
        if self.compile.compiled:
            self._eager_train_model, self.train_model = self.train_model, compile_model(self.train_model)
        self.num_parameters = count_trainable_parameters(self.model)
        self._predictions: dict[tuple, dict[str, float]] = {}  # predicted_step's, by stage input
        # training.optimizer's (distmis.train.optimizers) over the parameters this rank trains (a pipeline stage's own)
        self.optimizer = torch_optimizer(self.train_model.parameters(), training.optimizer, self.layout.effective_lr)
        # training.lr_schedule at the layout's (data-parallel scaled) rate: set at each epoch's start or step
        self.learning_rates = LearningRateSchedule.for_training(training, self.layout.effective_lr)

        self._tile_rng = torch.Generator().manual_seed(training.seed * 1_000 + self.rank)
        self._foreground_rng = torch.Generator().manual_seed(training.seed * 1_000 + self.rank + 500)  # tile_sampling
        # training.augment: MONAI's transforms of each training input, reseeded at every epoch's start
        self.augmenter = (TorchAugmenter(training.augment, self.tile or self.volume_shape)
                          if training.augment.active else None)
        self._epochs_trained = 0
        self.step_meter = StepMeter(self.device, held=self._training_state_bytes)
        self._measured: tuple[float, float] | None = None  # the last trained epoch's (step seconds, peak bytes)
        self._step_share = 0.0  # the last trained epoch's steps' share of its training time

    def _choose_memory_format(self) -> MemoryFormatChoice:
        """``training.performance.memory_format``: the spec's, or (``auto``) the faster for this trial's step,
        measured on a copy of the network with a batch of the first training case at the current stage's input
        (its centre), or read from the cache; contiguous for a trial over several ranks, whose ranks would have to
        agree. The random-number state is left as it was."""
        asked = self.spec.training.performance.memory_format
        if self.layout.sp > 1 or self.layout.pp > 1:
            return MemoryFormatChoice("contiguous", "set" if asked == "contiguous" else "not measured")
        if asked != "auto":
            return MemoryFormatChoice(asked, "set")
        if self.layout.world_size > 1:
            return MemoryFormatChoice("contiguous", "not measured")
        shape = self._input_shape()
        cache = ChoiceCache()
        key = choice_key(network=self.entry.name, params=self.spec.model.params.model_dump(mode="json"),
                         tile=shape.tile, batch=shape.batch_size, channels=(self.in_channels, self.num_classes),
                         precision=self.precision.name, deep_supervision=self.spec.training.deep_supervision,
                         device=device_name(self.device), threads=torch.get_num_threads())
        cached = MemoryFormatChoice.from_cache(cache.entry(key))
        if cached is not None:
            return cached
        x, y = self._probe_batch(shape.tile, shape.batch_size)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            choice = choose_memory_format(self.model, self.train_loss_fn, x, y,
                                          autocast_dtype=None if self.precision.name == "fp32" else self.precision.dtype)
        cache.put_entry(key, choice.cache_entry())
        return choice

    def _choose_compile(self) -> CompileChoice:
        """``training.performance.compile``: the spec's, or (``auto``) compiled where the measured saving over the
        trial's planned steps exceeds the compilation (:func:`choose_compile`, on a copy of the network; its
        measurement cached); eager for a trial split by sequence parallelism or pipeline stages, or (``auto``) over
        several ranks."""
        asked = self.spec.training.performance.compile
        if self.layout.sp > 1 or self.layout.pp > 1:
            return CompileChoice(False, "set" if asked == "off" else "not measured",
                                 reason="a trial split by sequence parallelism or pipeline stages runs eager")
        if asked != "auto":
            return CompileChoice(asked == "on", "set")
        if self.layout.world_size > 1:
            return CompileChoice(False, "not measured", reason="a trial over several ranks runs eager under 'auto'")
        shape = self._input_shape()
        memory_format = self.memory_format.memory_format
        planned_steps = self.steps_per_epoch * self.spec.training.epochs
        autocast = None if self.precision.name == "fp32" else self.precision.dtype
        key = choice_key(kind="compile", network=self.entry.name,
                         params=self.spec.model.params.model_dump(mode="json"), tile=shape.tile,
                         batch=shape.batch_size, channels=(self.in_channels, self.num_classes),
                         precision=self.precision.name, deep_supervision=self.spec.training.deep_supervision,
                         memory_format=memory_format, device=device_name(self.device), threads=torch.get_num_threads())
        cache = ChoiceCache()
        cached = cached_compile(cache.entry(key), planned_steps)
        if cached is not None:
            return cached
        x, y = self._probe_batch(shape.tile, shape.batch_size)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            # the format's measured eager step; None where the format was set: choose_compile measures it
            eager = self.memory_format.seconds.get(memory_format)
            choice = choose_compile(self.model, self.train_loss_fn, x, y, eager_seconds=eager,
                                    planned_steps=planned_steps, memory_format=memory_format,
                                    autocast_dtype=autocast)
        if choice.source == "fell back":
            logger.warning("%s does not compile; its step runs eager: %s", self.entry.name, choice.reason)
        entry = compile_cache_entry(choice)
        if entry is not None:
            cache.put_entry(key, entry)
        return choice

    def _probe_batch(self, tile: tuple[int, ...], batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch for timing steps, drawn without the trial's random numbers: the first training case's centre
        (at ``tile``) ``batch`` times."""
        _case_id, image_hwdc, label_hwdc = self.train_cases[0]
        image = torch.from_numpy(image_hwdc).movedim(-1, 0)
        label = torch.from_numpy(label_hwdc).movedim(-1, 0)
        crop = (slice(None), *(slice(max(0, (s - t) // 2), max(0, (s - t) // 2) + t)
                               for s, t in zip(image.shape[1:], tile)))
        image, label = image[crop].to(torch.float32), label[crop].to(torch.float32)
        return (image.unsqueeze(0).repeat(batch, *[1] * image.dim()).to(self.device),
                label.unsqueeze(0).repeat(batch, *[1] * label.dim()).to(self.device))

    def _input_shape(self) -> InputShape:
        """The current training input: what a parallelism that depends on it is applied for."""
        return InputShape(tuple(self.tile or self.volume_shape), self.stage.batch_size)  # type: ignore[arg-type]

    def _training_state_bytes(self) -> float:
        """Bytes of what training keeps between steps: the gradients and the optimizer's state."""
        tensors = [p.grad for p in self.train_model.parameters() if p.grad is not None]
        tensors += [t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        return float(sum(t.numel() * t.element_size() for t in tensors))

    @property
    def perf_shape(self) -> ViTShape | None:
        """The network's arithmetic shape on its input (:mod:`distmis.perf.model`), where the entry has one."""
        if self.entry.perf_shape is None:
            return None
        return self.entry.perf_shape(self.spec.model.params, self.network_input.tile, self.in_channels,
                                     self.num_classes)

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
        """Batches every rank trains on per epoch (the same on all ranks): ``training.steps_per_epoch``, or one pass
        over the training cases."""
        return self.spec.training.epoch_steps(len(self.train_cases), self.stage.batch_size, self.world_size)

    def epoch_order(self, epoch: int) -> list[int]:
        """The training-case indices of ``epoch``, in order: seeded, identical on every rank. One pass: a permutation
        of the cases. With ``training.steps_per_epoch``: the epoch's stretch of an endless stream of seeded
        permutations (pass ``p`` seeded by ``p``), ``steps x batch x replicas`` cases from ``epoch`` times that on,
        so every case comes once per pass whatever the epochs' lengths."""
        training = self.spec.training
        n = len(self.train_cases)
        if training.steps_per_epoch is None:
            generator = torch.Generator().manual_seed(training.seed + epoch)
            return torch.randperm(n, generator=generator).tolist()
        length = training.steps_per_epoch * self.stage.batch_size * self.world_size
        position = epoch * length
        order: list[int] = []
        while len(order) < length:
            passed, offset = divmod(position, n)
            generator = torch.Generator().manual_seed(training.seed * 1_000_003 + passed)
            taken = torch.randperm(n, generator=generator).tolist()[offset:offset + length - len(order)]
            order += taken
            position += len(taken)
        return order

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
        started, in_steps = time.perf_counter(), 0.0
        try:
            for step, (x, y) in enumerate(stream):
                stepping = time.perf_counter()
                meter.start_step()  # the batch is here: what follows is the step (see StepMeter)
                if step == 0 or self.learning_rates.per_step:
                    self.set_learning_rate(self.learning_rates.at(lr_epoch, step, len(batches)))
                x, y = in_memory_format(x.to(self.device), self.memory_format.memory_format), y.to(self.device)
                self.optimizer.zero_grad(set_to_none=True)
                loss = self._step(x, y)
                self.parallelism.synchronize_gradients(self.train_model)
                self.precision.step(self.optimizer, self._overflow_groups(),  # fp16: unscaled, skipped on overflow
                                    clip_norm=self.spec.training.clip_grad_norm, norm_groups=self._stage_groups())
                losses.append(float(loss))
                meter.end_step()
                in_steps += time.perf_counter() - stepping
        finally:
            stream.close()  # a step that raised stops the reading thread before its next batch
        # the steps' share of the epoch's training time: the rest is waiting for batches (their reading thread)
        self._step_share = in_steps / max(time.perf_counter() - started, 1e-9)
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
        changed = self.parallelism.input_changed(self.model, self._input_shape())  # a pipeline's new shapes
        if changed is not None:
            self.train_model = changed

    def set_learning_rate(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _overflow_groups(self) -> list[Any]:
        """The groups over which fp16's overflow is agreed (they span the trial's ranks); none alone, or without
        loss scaling."""
        if self.precision.scaler is None or not (dist.is_available() and dist.is_initialized()):
            return []
        return self.parallelism.measurement_groups()

    def _stage_groups(self) -> list[Any]:
        """The groups whose ranks hold the model's other parameters (a pipeline's stages): a global gradient norm
        sums over them."""
        return [self.mesh.pp_group] if self.mesh.pp_size > 1 else []

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """:meth:`_forward_backward`; the first compiled step, where the compilation happens, falls back to the
        eager model (and says why) when the network does not compile."""
        if self._eager_train_model is None:
            return self._forward_backward(x, y)
        try:
            loss = self._forward_backward(x, y)
        except Exception as exc:  # noqa: BLE001 - a compilation's failure of any kind: the step runs eager
            reason = compile_error(exc)
            logger.warning("%s does not compile; its step runs eager: %s", self.entry.name, reason)
            self.compile = CompileChoice(False, "fell back", self.compile.seconds, reason)
            self.train_model = self._eager_train_model
            self.optimizer.zero_grad(set_to_none=True)
            loss = self._forward_backward(x, y)
        self._eager_train_model = None
        return loss

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One step's forward and backward (the parallelism's): the gradients in place, the batch's training loss
        returned (detached)."""
        return self.parallelism.forward_backward(self.train_model, self.train_loss_fn, x, y)

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def _probabilities(self, x: torch.Tensor) -> torch.Tensor:
        """Probabilities of whole windows (B, C, *window) -> (B, K, *window), on every rank of a group: the
        network's output, or the target scheme's activation (sigmoid, or softmax over the channels) of its
        logits. Under mixed precision the forward runs in the training's autocast; the probabilities are fp32."""
        x = in_memory_format(x, self.memory_format.memory_format)
        with self.precision.autocast():
            out = self.parallelism.forward(self.model, self.train_model, x)  # eval mode: set on the shared model
        return activate(out, self.activation) if self.entry.output == "logits" else out.float()

    @torch.no_grad()
    def _predict(self, images_hwdc: np.ndarray) -> np.ndarray:
        """Probabilities (B, h, w, d, C) for channels-last images (B, h, w, d, 4)."""
        x = torch.from_numpy(np.ascontiguousarray(np.moveaxis(images_hwdc, -1, 1), dtype=np.float32))
        prob = self._probabilities(x.to(self.device))
        return prob.cpu().numpy().transpose(0, 2, 3, 4, 1)

    def predict_volume(self, image: np.ndarray, *, mirror: Sequence[int] = ()) -> np.ndarray:
        """Probabilities (h, w, d, C) for one (h, w, d, 4) volume: whole, or by sliding windows of the (last
        curriculum stage's) tile, or of the network's input for a network built for one input size
        (``training.inference``: overlap, constant or Gaussian weights); each window test-time mirrored on the
        axes ``mirror`` of the volume (default none: validation; the test split: ``training.inference.mirror``)."""
        return self.predict_with_window(image, self.window, mirror=mirror)

    @torch.no_grad()
    def predict_with_window(self, image: np.ndarray, window: Window, *, mirror: Sequence[int] = ()) -> np.ndarray:
        """:meth:`predict_volume` by sliding windows of ``window`` (None: the whole volume in one pass).

        A network built for one input size runs its windows on the device, the volume there too (every rank of an
        SP group runs the same windows and gets the whole result); any other gets each batch of channels-last
        windows moved there (:func:`~distmis.train.inference.predict_channels_last`). ``mirror``: the axes (0, 1,
        2 of ``(h, w, d)``) each window is mirrored on (:func:`distmis.pyfunc_model.mirrored`)."""
        self.model.eval()
        training = self.spec.training
        inference = training.inference
        if self.entry.fixed_input and window is not None:
            x = torch.from_numpy(np.ascontiguousarray(np.moveaxis(image, -1, 0), dtype=np.float32))[None]
            prob = sliding_window(self._probabilities, x.to(self.device), window, overlap=inference.overlap,
                                  mode=inference.mode, sigma_scale=inference.sigma_scale,
                                  batch_size=training.inference_batch_size, mirror=mirror)
            return prob[0].permute(1, 2, 3, 0).cpu().numpy()
        return predict_channels_last(self._predict, image, window, inference=inference,
                                     batch_size=training.inference_batch_size, mirror=mirror)

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

        In a process group each rank predicts its share of the cases (the parallelism's: every ``n``-th; with rank
        0's normalization statistics) and the sums are all-reduced, so every rank returns the same means.
        """
        self.parallelism.before_validation()  # a pipeline gathers every stage's weights
        rank, size, group = self.parallelism.validation_share()
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
            dist.all_reduce(totals, group=group)  # sum over ranks (on the model's device, for nccl)
        values = totals.cpu().tolist()
        count = values[-1]
        return ValidationScores(values[0] / count, values[1] / count,
                                {key: value / count for key, value in zip(self.metric_keys, values[2:-1])})

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
        the trainer is in a process group, so every rank calls it), and ``fom`` where the entry has a
        performance-model shape (:meth:`figure_of_merit`)."""
        if self._measured is None:
            raise ValueError("no epoch trained yet")
        values = list(self._measured)
        groups = self.parallelism.measurement_groups() if dist.is_available() and dist.is_initialized() else []
        if groups:
            largest = torch.tensor(values, dtype=torch.float64, device=self.device)
            for group in groups:
                dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
            values = largest.cpu().tolist()
        step_seconds, peak = values
        predicted = self.predicted_step()
        metrics = {"step_seconds": step_seconds, "peak_memory_mb": peak / 2**20, **predicted,
                   **self.memory_format.metrics(), **self.compile.metrics(),
                   "compute_bits": float(torch.finfo(self.precision.dtype).bits), "step_share": self._step_share}
        if predicted.get("predicted_flops_per_step") and step_seconds > 0:  # the step's counted FLOPs, its rate
            rate = predicted["predicted_flops_per_step"] / step_seconds
            dtype = torch.float32 if self.precision.name == "fp32" else self.precision.dtype
            metrics.update(step_flop_rate=rate, matmul_rate=matmul_rate(self.device, dtype),
                           matmul_fraction=rate / matmul_rate(self.device, dtype))
        fom = self.figure_of_merit(step_seconds)
        if fom is not None:
            metrics["fom"] = fom
        return metrics

    def predicted_step(self) -> dict[str, float]:
        """The traced memory model's prediction of this rank's training step at the current stage's input
        (:func:`distmis.estimate.memory.predict_step_memory`, on a fake copy of the network): ``{}`` where a rank
        does not train the whole network (sequence parallelism, pipeline stages) or the driver logs the performance
        model's (a network with a ``perf_shape``). Traced once per stage input."""
        if self.entry.perf_shape is not None or self.layout.sp > 1 or self.layout.pp > 1:
            return {}
        shape = self._input_shape()
        key = (shape.tile, shape.batch_size)
        if key not in self._predictions:
            from distmis.estimate.memory import predict_step_memory

            network = dataclasses.replace(self.network_input, tile=shape.tile)
            try:
                memory = predict_step_memory(self.entry, self.spec.model.params, network, self.train_loss_fn,
                                             batch=shape.batch_size, precision=self.precision.name,
                                             device="cuda" if self.device.type == "cuda" else "cpu",
                                             threads=torch.get_num_threads(), model=self.model)
            except Exception as exc:  # noqa: BLE001 - a prediction that cannot be made never stops training
                logger.warning("no memory prediction for %s at %s, batch %d: %s: %s", self.entry.name,
                               list(shape.tile), shape.batch_size, type(exc).__name__, exc)
                self._predictions[key] = {}
                return {}
            self._predictions[key] = {"predicted_step_memory_mb": memory.step / 2**20,
                                      "predicted_peak_memory_mb": memory.peak / 2**20,
                                      "predicted_flops_per_step": memory.trace.flops}
        return self._predictions[key]

    def figure_of_merit(self, step_seconds: float) -> float | None:
        """The seed's ``b L s^2 d / step_seconds`` (``b`` the ``training.batch_size`` samples a rank trains per
        step) where the entry has a performance-model shape; None otherwise."""
        from distmis.perf.model import figure_of_merit

        shape = self.perf_shape
        if shape is None:
            return None
        return figure_of_merit(shape, batch=self.spec.training.batch_size, seconds=step_seconds)

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
        """What continuing exactly needs: the weights and the optimizer state (``primary`` rank; and what the
        parallelism keeps besides: a pipeline's every stage its own optimizer state) and this rank's random-number
        state (``rng.rank<rank>.pt``: torch's global generator and the tile generators)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if primary:  # with fp16's loss scaler (its scale is the same on every rank of the trial)
            torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                        "memory_format": self.memory_format.memory_format,
                        **self.precision.state_dict()}, directory / "trainer.pt")
        rng = {"torch": torch.get_rng_state(), "tiles": self._tile_rng.get_state(),
               "foreground": self._foreground_rng.get_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        torch.save(rng, directory / f"rng.rank{rank}.pt")
        self.parallelism.save_optimizer(directory, self.optimizer)

    def load_state(self, directory: str | Path, *, rank: int = 0, epoch: int) -> None:
        """Continue after ``epoch`` epochs from :meth:`save_state`'s folder.

        The data order of every epoch is a function of the seed and the epoch, and the random-number state is
        this rank's own, so an interrupted trial continues as it would have without the interruption. A rank
        that finds no state of its own (the trial resumed on a different number of ranks) seeds its tile
        generator from the seed, its rank and the epoch.
        """
        directory = Path(directory)
        state = torch.load(directory / "trainer.pt", map_location=self.device, weights_only=True)
        kept = state.get("memory_format")
        if (kept in ("contiguous", "channels_last") and kept != self.memory_format.memory_format
                and self.memory_format.source in ("measured", "cached")):  # a measured choice: the trial's first
            self.memory_format = dataclasses.replace(self.memory_format, memory_format=kept, source="cached")
            apply_memory_format(self.model, kept)
        self.model.load_state_dict(state["model"])
        # The optimizer's state (moments, momentum buffers) is the checkpoint's; its hyperparameters are this
        # trial's configuration's, which population-based training may have changed since (search.pbt).
        settings = [{key: value for key, value in group.items() if key != "params"}
                    for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(self.parallelism.optimizer_state(directory, state))
        for group, own in zip(self.optimizer.param_groups, settings):
            group.update(own)
        self.precision.load_state_dict(state)
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
