"""How a trial's parallelism is applied to the plain network from outside (torchtitan's ``parallelize_*``).

The trainer (:class:`~distmis.train.torch_trainer.TorchTrainer`) holds one plain network, built by the model
registry, and one :class:`Parallelism` chosen from its :class:`~distmis.parallel.mesh.TrialMesh` by
:func:`parallelism_for`; the strategy says what module trains, how a step's forward and backward and its gradient
synchronization run, how whole windows are predicted, and how validation and the steps' measurements are shared
over the ranks:

- :class:`Replicas` (data parallelism only): the model itself, in a ``DistributedDataParallel`` over the mesh's DP
  group when there is one (more than one replica).
- :class:`SequenceParallel` (``sp > 1``): the entry's ``parallelize`` function applied over the SP group
  (:func:`~distmis.parallel.sequence.parallelize_vit_seg`); each rank's loss on its part of the target
  (``local_target``), :func:`~distmis.parallel.sequence.sync_gradients` after backward (the SP completion, then the
  DP mean; no DDP, which would average the encoder's partial sums), and a ``no-gather`` decoder's sub-volumes
  assembled when predicting. The data order, tiles and initial weights depend on the seed and the DP rank only,
  so SP=1 and SP=k trials follow the same loss curve.
- :class:`PipelineParallel` (``pp > 1``, LAMP): the entry's ``pipeline`` function
  (:func:`~distmis.parallel.pipeline.pipeline_unet`) cuts the network into stages for the current training
  input's full batch; a batch of another size goes through a pipeline made for its own shape
  (:meth:`PipelineParallel.pipeline_for`, micro-batches and schedule by
  :func:`~distmis.parallel.pipeline.batch_plan`), a curriculum stage of another tile or batch gets pipelines of
  its own shapes over the same stage modules. The stage's gradients are averaged over its DP group. Before
  validation every stage's weights are broadcast to every rank of its pipeline
  (:meth:`~distmis.parallel.pipeline.UNetPipeline.gather_weights`) and the validation cases are shared out over
  every rank of the trial, each predicting with the whole model; checkpoints keep every stage's optimizer state
  (``optimizer.stage<k>.pt``).

Every strategy runs its forward in the trainer's ``training.precision``
(:class:`~distmis.train.precision.TorchPrecision`, ``precision``): under autocast for bf16 and fp16, the backward
outside it from the (fp16: scaled) fp32 loss; a pipeline's stages compute under autocast and exchange 16-bit
activations (:class:`~distmis.parallel.pipeline.StageCells`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol

import torch
import torch.distributed as dist
from torch import nn

from distmis.models.registry import PARALLELISM_NAMES, ModelEntry
from distmis.networks import PipelineCut, SequenceParallelize, parallelize_function, pipeline_function
from distmis.parallel.mesh import TrialMesh
from distmis.spec.schema import Spec

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from distmis.parallel.pipeline import UNetPipeline
    from distmis.train.precision import TorchPrecision

__all__ = ["InputShape", "Parallelism", "Replicas", "SequenceParallel", "PipelineParallel", "parallelism_for"]

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class InputShape:
    """The training input a strategy is applied for: the network input (tile, or whole volume) and the batch."""

    tile: tuple[int, int, int]
    batch_size: int


class Parallelism(Protocol):
    """One trial's parallelism on one rank, applied to the plain network from outside."""

    name: str
    mesh: TrialMesh

    def apply(self, model: nn.Module, shape: InputShape) -> nn.Module:
        """The module that trains (its parameters are what the optimizer updates) for ``model`` on ``device``."""
        ...

    def input_changed(self, model: nn.Module, shape: InputShape) -> nn.Module | None:
        """A curriculum stage of another input: the module that trains from now on, or None (the same)."""
        ...

    def forward_backward(self, train_model: nn.Module, loss_fn: Loss, x: torch.Tensor,
                         y: torch.Tensor) -> torch.Tensor:
        """One step's forward and backward: the gradients in place, the batch's loss returned (detached)."""
        ...

    def synchronize_gradients(self, train_model: nn.Module) -> None:
        """Between backward and the optimizer's step: the gradients every rank's optimizer should apply."""
        ...

    def forward(self, model: nn.Module, train_model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The network's output for whole windows ``x`` (B, C, *window), in eval mode, on every rank."""
        ...

    def before_validation(self) -> None: ...

    def validation_share(self) -> tuple[int, int, ProcessGroup | None]:
        """``(r, n, group)``: this rank validates every ``n``-th case from the ``r``-th, and the sums add up over
        ``group`` (None: the default group)."""
        ...

    def measurement_groups(self) -> list[ProcessGroup | None]:
        """The groups whose successive MAX all-reduces span every rank of the trial (none when alone)."""
        ...

    def save_optimizer(self, directory: Path, optimizer: torch.optim.Optimizer) -> None:
        """What a checkpoint needs of the optimizer besides the primary rank's ``trainer.pt``."""
        ...

    def optimizer_state(self, directory: Path, state: dict) -> dict:
        """This rank's optimizer state in a checkpoint folder whose ``trainer.pt`` holds ``state``."""
        ...


def _mesh_groups(mesh: TrialMesh) -> list[ProcessGroup | None]:
    return [group for group, size in ((mesh.sp_group, mesh.sp_size), (mesh.pp_group, mesh.pp_size),
                                      (mesh.dp_group, mesh.dp_size)) if size > 1]


def _autocast(precision: TorchPrecision | None) -> ContextManager[object]:
    """The forward's context: ``training.precision``'s autocast (:class:`~distmis.train.precision.TorchPrecision`),
    nothing without one."""
    return contextlib.nullcontext() if precision is None else precision.autocast()


def _backward(precision: TorchPrecision | None, loss: torch.Tensor) -> None:
    """Backward from ``loss``, outside autocast (scaled for fp16)."""
    if precision is None:
        loss.backward()
    else:
        precision.backward(loss)


def _plain_forward_backward(train_model: nn.Module, loss_fn: Loss, x: torch.Tensor, y: torch.Tensor,
                            precision: TorchPrecision | None = None) -> torch.Tensor:
    with _autocast(precision):
        output = train_model(x)
    loss = loss_fn(output, y)
    del output  # under autocast the loss keeps an fp32 copy: the 16-bit output need not live through the backward
    _backward(precision, loss)
    return loss.detach()


@dataclass
class Replicas:
    """Data parallelism only: the model, in DDP over the DP group when the mesh has one."""

    mesh: TrialMesh
    device: torch.device
    name: str = "replicas"
    # training.precision: the forward's autocast, the backward's scaling (None: fp32)
    precision: TorchPrecision | None = None

    def apply(self, model: nn.Module, shape: InputShape) -> nn.Module:
        if self.mesh.dp_group is None:
            return model
        device_ids = [self.device] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, process_group=self.mesh.dp_group, device_ids=device_ids)

    def input_changed(self, model: nn.Module, shape: InputShape) -> nn.Module | None:
        return None

    def forward_backward(self, train_model: nn.Module, loss_fn: Loss, x: torch.Tensor,
                         y: torch.Tensor) -> torch.Tensor:
        return _plain_forward_backward(train_model, loss_fn, x, y, self.precision)

    def synchronize_gradients(self, train_model: nn.Module) -> None:
        """DDP has all-reduced during backward."""

    def forward(self, model: nn.Module, train_model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    def before_validation(self) -> None:
        pass

    def validation_share(self) -> tuple[int, int, ProcessGroup | None]:
        return self.mesh.dp_rank, self.mesh.dp_size, self.mesh.dp_group

    def measurement_groups(self) -> list[ProcessGroup | None]:
        return _mesh_groups(self.mesh)

    def save_optimizer(self, directory: Path, optimizer: torch.optim.Optimizer) -> None:
        pass

    def optimizer_state(self, directory: Path, state: dict) -> dict:
        return state["optimizer"]


@dataclass
class SequenceParallel(Replicas):
    """DP x SP: the entry's ``parallelize`` function over the SP group, gradients by ``sync_gradients``."""

    parallelize: SequenceParallelize | None = None
    attention: str = "allgather-kv"
    decoder: str = "gather"
    split: str = "ordered"
    name: str = "sequence"

    def apply(self, model: nn.Module, shape: InputShape) -> nn.Module:
        assert self.parallelize is not None
        return self.parallelize(model, self.mesh.sp_group, attention=self.attention, decoder=self.decoder,
                                split=self.split)

    def forward_backward(self, train_model: nn.Module, loss_fn: Loss, x: torch.Tensor,
                         y: torch.Tensor) -> torch.Tensor:
        with _autocast(self.precision):
            logits = train_model(x)
        loss = loss_fn(logits, train_model.local_target(y))  # no-gather: this rank's sub-volume; gather: all of it
        del logits
        _backward(self.precision, loss)
        return loss.detach()

    def synchronize_gradients(self, train_model: nn.Module) -> None:
        from distmis.parallel.sequence import sync_gradients

        sync_gradients(train_model, self.mesh)

    def forward(self, model: nn.Module, train_model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Every rank of the SP group runs the same windows and gets the whole output."""
        out = train_model(x)
        if getattr(train_model, "decoder", None) == "no-gather":
            out = self._assemble(train_model, out, tuple(x.shape[2:]))
        return out

    @staticmethod
    def _assemble(model: Any, local: torch.Tensor, spatial: tuple[int, ...]) -> torch.Tensor:
        """The whole tile's output from every rank's sub-volume (no-gather decodes boxes of equal size)."""
        parts = [torch.empty_like(local) for _ in range(model.sp_size)]
        dist.all_gather(parts, local.contiguous(), group=model.sp_group)
        whole = local.new_empty(local.shape[:2] + spatial)
        for chunk, part in zip(model.output_chunks, parts):
            whole[(Ellipsis,) + chunk.voxel_box(model.model.patch)] = part
        return whole


@dataclass
class PipelineParallel(Replicas):
    """DP x PP: this rank's stage of the entry's ``pipeline`` cut trains; validation on the whole model."""

    pipeline_function: PipelineCut | None = None
    microbatches: int = 1
    schedule: str = "gpipe"
    loss_fn: Loss | None = None
    name: str = "pipeline"
    pipeline: UNetPipeline | None = None  # the current input's full batch's
    model: nn.Module | None = None
    shape: InputShape | None = None

    def apply(self, model: nn.Module, shape: InputShape) -> nn.Module:
        """Cut ``model`` for ``shape``'s full batch (tile and batch: the shapes the stages exchange); this rank's
        stage module."""
        self.model, self.shape, self.pipeline = model, shape, None
        self.pipeline = self._build(shape.batch_size)
        return self.pipeline.stage_module

    def input_changed(self, model: nn.Module, shape: InputShape) -> nn.Module | None:
        """A pipeline for the new input's shapes, over the same stage modules (the same parameters, optimizer
        state and all)."""
        return self.apply(model, shape)

    def _build(self, samples: int) -> UNetPipeline:
        from distmis.parallel.pipeline import batch_plan

        assert self.pipeline_function is not None and self.shape is not None
        plan = batch_plan(samples, batch_size=self.shape.batch_size, microbatches=self.microbatches,
                          schedule=self.schedule, stages=self.mesh.pp_size)  # type: ignore[arg-type]
        # training.precision: the stages compute under autocast and send activations in its dtype; fp16's scaled
        # loss starts the schedule's backward
        precision = self.precision
        compute = {} if precision is None or not precision.mixed else {"compute_dtype": precision.compute_dtype}
        loss_fn = self.loss_fn
        if precision is not None and precision.scaler is not None and loss_fn is not None:
            unscaled = loss_fn
            loss_fn = lambda output, target: precision.scale(unscaled(output, target))  # noqa: E731
        built = self.pipeline_function(
            self.model, tile=self.shape.tile, microbatches=plan.microbatches, schedule=plan.schedule,
            batch_size=samples, loss_fn=loss_fn, group=self.mesh.pp_group, device=self.device, **compute)
        if self.pipeline is not None and built.bounds != self.pipeline.bounds:  # the cut depends on the tile only
            raise RuntimeError(f"a batch of {samples} cut the model at {built.bounds}, the full batch at "
                               f"{self.pipeline.bounds}")
        return built

    def pipeline_for(self, samples: int) -> Any:
        """The pipeline that trains a batch of ``samples`` at the current input: the full batch's, or one made for
        the short batch's own shape, over the same stage modules. Every rank of the pipeline makes it at the same
        step (they read the same batches); nothing is sent in making it. A short batch's pipeline is not kept: a
        stage holds receiving buffers for every micro-batch from its first step on."""
        assert self.shape is not None and self.pipeline is not None
        if samples == self.shape.batch_size:
            return self.pipeline
        return self._build(samples)

    def forward_backward(self, train_model: nn.Module, loss_fn: Loss, x: torch.Tensor,
                         y: torch.Tensor) -> torch.Tensor:
        """The batch through the pipeline of its size: its mean loss over its samples, the gradients of that mean
        in this stage's parameters (the pipeline's loss is the trainer's training loss, given at construction)."""
        pipe = self.pipeline_for(int(x.shape[0]))
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None)
        return loss if self.precision is None else self.precision.unscale_loss(loss)

    def synchronize_gradients(self, train_model: nn.Module) -> None:
        if self.mesh.dp_size > 1:
            from distmis.parallel.collectives import all_reduce_gradients

            all_reduce_gradients(self.pipeline.parameters(), self.mesh.dp_group, "mean")

    def before_validation(self) -> None:
        self.pipeline.gather_weights()

    def validation_share(self) -> tuple[int, int, Any]:
        return self.mesh.rank, self.mesh.world_size, None  # every rank of the trial; all shares add up

    def save_optimizer(self, directory: Path, optimizer: torch.optim.Optimizer) -> None:
        """The first replica's every stage its own optimizer state (``optimizer.stage<k>.pt``)."""
        if self.mesh.dp_rank == 0:
            torch.save(optimizer.state_dict(), directory / f"optimizer.stage{self.mesh.pp_rank}.pt")

    def optimizer_state(self, directory: Path, state: dict) -> dict:
        path = directory / f"optimizer.stage{self.mesh.pp_rank}.pt"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no optimizer state for pipeline stage {self.mesh.pp_rank} (was the "
                                    "checkpoint written with another number of stages?)")
        return torch.load(path, map_location=self.device, weights_only=True)


def parallelism_for(entry: ModelEntry, spec: Spec, mesh: TrialMesh, device: torch.device,
                    loss_fn: Loss, precision: TorchPrecision | None = None) -> Parallelism:
    """The strategy ``mesh`` asks for, for ``entry``'s network; ValueError naming the model and the parallelism
    when the entry does not support it. ``loss_fn``: the training loss (a pipeline's last stage computes it).
    ``precision``: the trainer's :class:`~distmis.train.precision.TorchPrecision` (None: fp32), whose autocast the
    strategy's forward runs in and whose scaling its backward starts from."""
    for axis in ("sp", "pp"):
        if getattr(mesh, f"{axis}_size") > 1 and not entry.supports(axis):
            raise ValueError(f"model {entry.name!r} does not support {PARALLELISM_NAMES[axis]}: the trial's mesh "
                             f"has {axis}={getattr(mesh, f'{axis}_size')}")
    if mesh.pp_size > 1:
        pipe = spec.parallelism.pipeline
        if mesh.pp_size != pipe.stages:
            raise ValueError(f"parallelism.pipeline.stages is {pipe.stages}, but the pipeline group holds "
                             f"{mesh.pp_size} rank(s)")
        return PipelineParallel(mesh, device, precision=precision, pipeline_function=pipeline_function(entry),
                                microbatches=pipe.microbatches, schedule=pipe.schedule, loss_fn=loss_fn)
    if mesh.sp_size > 1:
        sp = spec.parallelism.sequence_parallel
        return SequenceParallel(mesh, device, precision=precision, parallelize=parallelize_function(entry),
                                attention=sp.attention, decoder=sp.decoder, split=sp.split)
    return Replicas(mesh, device, precision=precision)
