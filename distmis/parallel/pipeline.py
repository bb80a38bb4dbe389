"""Pipeline parallelism for the torch 3D U-Net (LAMP), applied from outside the model.

LAMP (its eq. 3) trains a U-Net too large for one device by GPipe: the network cut into ``K`` stages on ``K``
ranks, every batch cut into ``M`` micro-batches that flow through the stages one after the other. GPipe needs a
*sequence* of layers, and a U-Net is not one: the output of encoder level ``i`` is used again by decoder level
``i``. LAMP breaks that dependency by duplicating each encoder output: one copy goes down the encoder, the other
travels forward with the activation, stage to stage, until its decoder level takes it.

This module builds that sequence from a :class:`~distmis.models.unet3d_torch.UNet3D` without touching it:

- :func:`unet_cells`: the U-Net as ``2 * levels - 1`` cells, each ``cell(x, *skips) -> (x', *skips')``: an encoder
  level (its block, the skip pushed, the pooling), the bottleneck, a decoder level (the last skip popped and
  concatenated); the head (and the model's output activation, sigmoid or softmax) ends the last decoder cell. Cells
  hold the model's own modules, so a stage's parameters *are* the model's parameters, under the model's names.
- :func:`cell_macs` and :func:`balanced_partition`: the forward multiply-accumulates of every cell at the tile, and
  the cut of the cells into ``K`` contiguous stages whose largest cost is smallest (the pipeline runs at the pace
  of its slowest stage).
- :func:`pipeline_unet`: one rank's :class:`UNetPipeline`: its stage of cells as a
  ``torch.distributed.pipelining.PipelineStage`` and a GPipe or 1F1B schedule over ``M`` micro-batches, the
  stages' ranks given by a process group (the pipeline group of a :class:`~distmis.parallel.mesh.TrialMesh`).
- :meth:`UNetPipeline.gather_weights`: every stage's weights broadcast to every rank of the pipeline, so each
  holds the whole trained model (validation, checkpoints, the registered model).

Short batches (:func:`batch_plan`): the stages exchange tensors of fixed shapes, so a batch of another size gets a
pipeline of its own (the same cut, over the same modules). Its micro-batches are of the largest size that divides
it and is no larger than the configured micro-batch (``batch_size / microbatches``), so they are equal, and no
stage ever holds a larger micro-batch than a full batch's; it runs the configured schedule, or GPipe where that
leaves fewer micro-batches than 1F1B needs (one per stage: GPipe then holds no more than 1F1B would). A short batch
is thus trained as it is, on its own samples, exactly as an unpipelined trainer trains it.

Micro-batches and normalization: the schedule averages the micro-batches' gradients (``scale_grads``), so a loss
that is a mean over samples gives the gradients of the whole batch (the micro-batches being equal). That holds
exactly for group normalization, which normalizes each sample on its own; batch normalization normalizes each
*micro-batch* by its own statistics, so with ``M > 1`` a pipelined batch-norm U-Net is a different (noisier)
function than on one device, as GPipe's paper notes, and its running statistics see ``M`` small batches per step
(a short batch's micro-batches may be smaller still).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
import torch.distributed as dist
from torch import nn

from distmis.models.unet3d_torch import Activation, ConvBlock, UNet3D, UpBlock, activate

__all__ = [
    "PipelineSchedule",
    "PIPELINE_SCHEDULES",
    "EncoderCell",
    "BottleneckCell",
    "DecoderCell",
    "unet_cells",
    "max_pipeline_stages",
    "cell_macs",
    "balanced_partition",
    "IdentityForwardContiguousBackward",
    "StageCells",
    "stage_examples",
    "BatchPlan",
    "batch_plan",
    "UNetPipeline",
    "pipeline_unet",
]

PipelineSchedule = Literal["gpipe", "1f1b"]
PIPELINE_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")


# --------------------------------------------------------------------------- the U-Net as a sequence
class EncoderCell(nn.Module):
    """Encoder level: ``(x, *skips) -> (pool(block(x)), *skips, block(x))``: the level's output is pushed as a skip."""

    def __init__(self, block: ConvBlock, pool: nn.Module) -> None:
        super().__init__()
        self.block, self.pool = block, pool

    def forward(self, x: torch.Tensor, *skips: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.block(x)
        return (self.pool(y), *skips, y)


class BottleneckCell(nn.Module):
    """The bottleneck: ``(x, *skips) -> (block(x), *skips)``."""

    def __init__(self, block: ConvBlock) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, *skips: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.block(x), *skips)


class DecoderCell(nn.Module):
    """Decoder level: pops the deepest skip, ``(x, *skips, s) -> (up(x, s), *skips)``; with ``head`` (the last
    level) it returns ``activation(head(up(x, s)))``, the model's probabilities (the model's own activation:
    sigmoid, or softmax over the channels)."""

    def __init__(self, up: UpBlock, head: nn.Module | None = None, activation: Activation = "sigmoid") -> None:
        super().__init__()
        self.up, self.head, self.activation = up, head, activation

    def forward(self, x: torch.Tensor, *skips: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if not skips:
            raise ValueError("a decoder cell needs the skip tensor of its level; none came with the activation")
        x = self.up(x, skips[-1])
        if self.head is not None:
            return activate(self.head(x), self.activation)
        return (x, *skips[:-1])


def unet_cells(model: UNet3D) -> list[nn.Module]:
    """The U-Net as LAMP's sequence: ``levels - 1`` encoder cells, the bottleneck, ``levels - 1`` decoder cells
    (the last with the head). Running them in turn, each on the previous one's outputs, is ``model(x)``."""
    if not isinstance(model, UNet3D):
        raise ValueError(f"pipeline parallelism splits the torch UNet3D, got {type(model).__name__}")
    cells: list[nn.Module] = [EncoderCell(block, model.pool) for block in model.down]
    cells.append(BottleneckCell(model.bottleneck))
    last = len(model.up) - 1
    cells += [DecoderCell(up, model.head if i == last else None, model.activation) for i, up in enumerate(model.up)]
    return cells


def max_pipeline_stages(levels: int) -> int:
    """The most stages a U-Net of ``levels`` resolution levels can be cut into: one cell each."""
    return 2 * levels - 1


def _conv_macs(module: nn.Module, out_voxels: int) -> int:
    """Forward multiply-accumulates of a Conv3d (per output voxel) or ConvTranspose3d (per input voxel)."""
    kernel = math.prod(module.kernel_size)
    per_voxel = kernel * module.in_channels * module.out_channels // module.groups
    if isinstance(module, nn.ConvTranspose3d):
        return per_voxel * out_voxels // math.prod(module.stride)
    return per_voxel * out_voxels


def cell_macs(model: UNet3D, tile: Sequence[int]) -> list[int]:
    """Forward convolution multiply-accumulates of every cell of :func:`unet_cells` for one sample of ``tile``."""
    voxels = math.prod(int(t) for t in tile)
    costs = []
    for level, cell in enumerate(unet_cells(model)):
        # encoder cell i works at level i; the bottleneck at levels - 1; decoder cell j produces level levels-2-j
        depth = level if level < model.levels else 2 * (model.levels - 1) - level
        out_voxels = voxels // 8**depth
        convolutions = (m for m in cell.modules() if isinstance(m, (nn.Conv3d, nn.ConvTranspose3d)))
        costs.append(sum(_conv_macs(m, out_voxels) for m in convolutions))
    return costs


def balanced_partition(costs: Sequence[float], stages: int) -> list[tuple[int, int]]:
    """Cut ``costs`` (one per cell, in order) into ``stages`` contiguous, non-empty ranges ``(start, stop)`` whose
    largest sum is as small as it can be (the classic linear partition, by dynamic programming). Among equal
    cuts each stage starts as late as it can, so ties leave the later stages lighter: ``[1, 1, 1]`` in two is
    ``[(0, 2), (2, 3)]``. The later stages of a U-Net hold the full-resolution decoder, its heaviest activations."""
    n = len(costs)
    if not isinstance(stages, int) or not 1 <= stages <= n:
        raise ValueError(f"stages must be an int from 1 to the {n} cells, got {stages!r}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: the smallest largest-stage cost of cells[:i] cut into k stages; cut[k][i]: where the last starts
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] or (value == best[k][i] and j > cut[k][i]):
                    best[k][i], cut[k][i] = value, j
    bounds, stop = [], n
    for k in range(stages, 0, -1):
        start = cut[k][stop]
        bounds.append((start, stop))
        stop = start
    return bounds[::-1]


# --------------------------------------------------------------------------- one rank's stage
class IdentityForwardContiguousBackward(torch.autograd.Function):
    """Forward: ``x`` itself (a view). Backward: the gradient made contiguous.

    The gradient a stage sends back for a skip it received is a slice of its concatenation's gradient, a strided
    view; gloo sends and receives contiguous memory only, and the previous stage sizes its receiving buffer from
    the first gradient's strides.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class StageCells(nn.Module):
    """The cells of one stage, run in turn: ``forward(*tensors)`` gives the next stage's inputs (a tuple), or the
    probabilities on the last stage.

    ``compute_dtype`` (mixed precision, ``training.precision``): the cells run under ``torch.autocast`` of the
    stage's device to that dtype, and every tensor sent to the next stage is in it (the receiving buffers are
    made so: :func:`stage_examples`); the backward, which the schedule runs outside the forward, sends their
    gradients in it too. The parameters stay fp32."""

    def __init__(self, cells: Sequence[nn.Module], compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cells = nn.ModuleList(cells)
        self.compute_dtype = compute_dtype

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        out: Any = tuple(IdentityForwardContiguousBackward.apply(t) if t.requires_grad else t for t in tensors)
        if self.compute_dtype is None:
            for cell in self.cells:
                out = cell(*out)
        else:
            with torch.autocast(tensors[0].device.type, dtype=self.compute_dtype):
                for cell in self.cells:
                    out = cell(*out)
        # What crosses to the next stage must be contiguous: the receiving (and gradient) buffers are made like
        # it, and gloo sends only contiguous memory (a convolution may leave a channels-last layout). Under mixed
        # precision it is in the compute dtype (autocast leaves fp32 what it computes in fp32), the dtype the next
        # stage's convolution would cast it to anyway.
        if isinstance(out, tuple):
            if self.compute_dtype is not None:
                out = tuple(t.to(self.compute_dtype) for t in out)
            return tuple(t.contiguous() for t in out)
        return out


@dataclass(frozen=True)
class BatchPlan:
    """How a batch goes through the pipeline: its ``samples``, cut into ``microbatches`` equal micro-batches, under
    ``schedule``."""

    samples: int
    microbatches: int
    schedule: PipelineSchedule

    @property
    def micro_batch(self) -> int:
        """Samples per micro-batch."""
        return self.samples // self.microbatches


def batch_plan(samples: int, *, batch_size: int, microbatches: int, schedule: PipelineSchedule,
               stages: int) -> BatchPlan:
    """The micro-batches and schedule of a batch of ``samples`` in a pipeline configured for ``batch_size`` samples
    in ``microbatches`` micro-batches under ``schedule``, over ``stages`` stages.

    The rule: micro-batches of ``d`` samples, ``d`` the largest divisor of ``samples`` no larger than the configured
    micro-batch ``batch_size // microbatches``; ``samples // d`` of them; the configured schedule, unless it is 1F1B
    and that leaves fewer micro-batches than stages, then GPipe. A full batch keeps its configuration. The
    micro-batches being equal, the mean of their mean losses is the mean over the batch's samples, and their
    averaged gradients the batch's own: a short batch trains exactly as unpipelined. No micro-batch is larger than
    a full batch's, and a GPipe fallback holds fewer than ``stages`` of them (what 1F1B holds at most).

    Configured for 8 samples in 2 micro-batches (of 4): a batch of 6 goes as 2 micro-batches of 3, one of 7 as 7
    of 1, one of 4 as 1 of 4. With 2 stages under 1F1B a batch of 1 runs one micro-batch under GPipe.
    """
    if not isinstance(batch_size, int) or not isinstance(microbatches, int) or microbatches < 1 \
            or batch_size % microbatches:
        raise ValueError(f"the batch of {batch_size} samples must divide into {microbatches} micro-batches")
    if not isinstance(samples, int) or not 1 <= samples <= batch_size:
        raise ValueError(f"a batch holds from 1 to training.batch_size = {batch_size} samples, got {samples!r}")
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule must be one of {PIPELINE_SCHEDULES}, got {schedule!r}")
    largest = batch_size // microbatches
    size = max(d for d in range(1, min(largest, samples) + 1) if samples % d == 0)
    count = samples // size
    chosen: PipelineSchedule = "gpipe" if schedule == "1f1b" and count < stages else schedule
    return BatchPlan(samples=samples, microbatches=count, schedule=chosen)


@dataclass
class UNetPipeline:
    """One rank's part of a pipelined U-Net: the whole ``model`` (every rank builds it, same seed: only its own
    stage's weights are trained here), its ``stage_module`` of cells, the ``PipelineStage`` and the schedule."""

    model: UNet3D
    stage_module: StageCells
    stage: Any  # torch.distributed.pipelining.PipelineStage
    schedule: Any  # ScheduleGPipe | Schedule1F1B
    bounds: list[tuple[int, int]]  # every stage's cells, (start, stop)
    stage_index: int
    group: Any  # the pipeline's process group (None: the default group)
    group_ranks: tuple[int, ...]  # global ranks of the stages, in stage order
    plan: BatchPlan  # the batch it takes: its samples, micro-batches and schedule

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def parameters(self) -> list[nn.Parameter]:
        """This stage's parameters: what its optimizer updates."""
        return list(self.stage_module.parameters())

    def train_step(self, x: torch.Tensor | None, target: torch.Tensor | None) -> torch.Tensor:
        """One training step's forward and backward through the pipeline, the micro-batches' gradients averaged
        into this stage's ``.grad``; the batch's mean loss (a scalar tensor), the same on every stage.

        ``x`` is read on the first stage and ``target`` on the last (others may pass None).
        """
        losses: list[torch.Tensor] = []
        args = (x,) if self.is_first else ()
        if self.is_first and x is None:
            raise ValueError("the first stage needs the batch's input")
        if self.is_last and target is None:
            raise ValueError("the last stage needs the batch's target")
        try:
            self.schedule.step(*args, target=target if self.is_last else None,
                               losses=losses if self.is_last else None, return_outputs=False)
        except RuntimeError as error:
            clearer = self._unwrapped(error)
            if clearer is error:
                raise
            raise clearer from error
        return self._shared_loss(losses)

    def _unwrapped(self, error: RuntimeError) -> Exception:
        """The error a user should read. The pipelining library wraps what fails in a stage's forward or backward
        (an allocator out of memory, a shape mismatch) in a ``RuntimeError`` listing the stage's tensor shapes, the
        reason only in ``__cause__``: name the stage and give the reason, keeping an out-of-memory error's type."""
        cause, text = error.__cause__, str(error)
        if cause is None:
            return error
        if "failed to run forward" in text:
            where = "forward"
        elif "Failed to run stage backward" in text:
            where = "backward"
        else:
            return error
        message = (f"pipeline stage {self.stage_index} of {self.num_stages} (cells {self.bounds[self.stage_index]}) "
                   f"failed in its {where}: {type(cause).__name__}: {cause}")
        return torch.OutOfMemoryError(message) if isinstance(cause, torch.OutOfMemoryError) else RuntimeError(message)

    def _shared_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean of the last stage's micro-batch losses, broadcast to every stage."""
        device = self.stage.device
        loss = (torch.stack([l.detach() for l in losses]).mean() if self.is_last
                else torch.zeros((), device=device))
        loss = loss.to(device=device, dtype=torch.float32)
        if self.num_stages > 1:
            dist.broadcast(loss, src=self.group_ranks[-1], group=self.group)
        return loss

    @torch.no_grad()
    def gather_weights(self) -> None:
        """Give every rank of the pipeline every stage's current parameters and buffers (batch norm's running
        statistics included): each stage broadcasts its own, flattened, to the others."""
        if self.num_stages == 1:
            return
        cells = unet_cells(self.model)
        for index, (start, stop) in enumerate(self.bounds):
            tensors = [t for cell in cells[start:stop]
                       for t in (*cell.parameters(), *cell.buffers()) if t.is_floating_point()]
            counters = [t for cell in cells[start:stop] for t in cell.buffers() if not t.is_floating_point()]
            for group_of_tensors in (tensors, counters):
                if not group_of_tensors:
                    continue
                flat = torch.cat([t.detach().reshape(-1) for t in group_of_tensors])
                dist.broadcast(flat, src=self.group_ranks[index], group=self.group)
                offset = 0
                for t in group_of_tensors:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()


def stage_examples(model: UNet3D, bounds: Sequence[tuple[int, int]], micro_batch: Sequence[int], *,
                   compute_dtype: torch.dtype | None = None
                   ) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """Every stage's inputs and outputs for a micro-batch of shape ``micro_batch`` ``(b, C, *tile)``, as
    contiguous tensors on the meta device (shapes only: nothing is computed, no memory is taken).

    Given to ``PipelineStage`` they spare it the forward it would otherwise run on the first micro-batch to learn
    them, a forward that batch normalization would count in its running statistics. With ``compute_dtype`` (mixed
    precision) what stages send each other is in that dtype (:class:`StageCells`); the first stage's input (the
    batch) and the last stage's output (the probabilities) stay fp32.
    """
    meta_model = copy.deepcopy(model).to("meta")
    cells = unet_cells(meta_model)

    def like(tensors: Sequence[torch.Tensor], requires_grad: bool, sent: bool) -> tuple[torch.Tensor, ...]:
        return tuple(torch.empty(t.shape, dtype=compute_dtype if sent and compute_dtype is not None else t.dtype,
                                 device="meta", requires_grad=requires_grad) for t in tensors)

    examples = []
    tensors: tuple[torch.Tensor, ...] = (torch.empty(tuple(micro_batch), device="meta"),)
    last = len(bounds) - 1
    for index, (start, stop) in enumerate(bounds):
        inputs = like(tensors, requires_grad=index > 0, sent=index > 0)
        out: Any = tensors
        for cell in cells[start:stop]:
            out = cell(*out)
        tensors = out if isinstance(out, tuple) else (out,)
        examples.append((inputs, like(tensors, requires_grad=True, sent=index < last)))
    return examples


def pipeline_unet(
    model: UNet3D,
    *,
    tile: Sequence[int],
    microbatches: int,
    batch_size: int,
    schedule: PipelineSchedule = "gpipe",
    loss_fn: Any,
    group: Any = None,
    device: torch.device | str = "cpu",
    compute_dtype: torch.dtype | None = None,
) -> UNetPipeline:
    """This rank's stage of ``model`` cut into as many stages as ``group`` (default: the world) has ranks, with a
    ``schedule`` over ``microbatches`` micro-batches and ``loss_fn(prediction, target)`` (a mean over samples)
    on the last stage. Every rank of ``group`` calls it with the same arguments.

    Every step takes batches of ``batch_size`` samples of ``tile`` (the shapes the stages send each other are
    fixed here: :func:`stage_examples`); another tile or batch needs another pipeline, over the same ``model``
    (a short batch: the micro-batches and schedule :func:`batch_plan` gives). The cut balances :func:`cell_macs`
    at ``tile`` (not the batch); the stage's modules move to ``device``. Nothing is sent in making it, but every
    rank of ``group`` must make the same pipeline for the same steps. ``compute_dtype``: mixed precision, the
    stages' autocast dtype and the dtype of what they send each other (:class:`StageCells`); the parameters stay
    fp32, and ``loss_fn`` gets the last stage's output as it is (the U-Net's probabilities: fp32).
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("pipeline_unet needs torch.distributed initialized (init_process_group) first")
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule must be one of {PIPELINE_SCHEDULES}, got {schedule!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
    stages = dist.get_world_size(group)
    if stages > max_pipeline_stages(model.levels):
        raise ValueError(f"a U-Net of {model.levels} levels has {max_pipeline_stages(model.levels)} cells: "
                         f"it cannot be cut into {stages} stages")
    if schedule == "1f1b" and microbatches < stages:
        raise ValueError(f"the 1f1b schedule needs at least as many micro-batches as stages, "
                         f"got {microbatches} for {stages} stages")
    index = dist.get_rank(group)
    ranks = tuple(dist.get_global_rank(group, r) if group is not None else r for r in range(stages))
    if not isinstance(batch_size, int) or batch_size < 1 or batch_size % microbatches:
        raise ValueError(f"the batch of {batch_size} samples must divide into {microbatches} micro-batches")
    bounds = balanced_partition(cell_macs(model, tile), stages)
    start, stop = bounds[index]
    stage_module = StageCells(unet_cells(model)[start:stop], compute_dtype).to(device)
    micro_batch = (batch_size // microbatches, model.in_channels, *(int(t) for t in tile))
    inputs, outputs = stage_examples(model, bounds, micro_batch, compute_dtype=compute_dtype)[index]
    stage = PipelineStage(stage_module, index, stages, torch.device(device), input_args=inputs,
                          output_args=outputs, group=group)
    schedule_class = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    runner = schedule_class(stage, microbatches, loss_fn=loss_fn, scale_grads=True)
    return UNetPipeline(model=model, stage_module=stage_module, stage=stage, schedule=runner, bounds=bounds,
                        stage_index=index, group=group, group_ranks=ranks,
                        plan=BatchPlan(samples=batch_size, microbatches=microbatches, schedule=schedule))
