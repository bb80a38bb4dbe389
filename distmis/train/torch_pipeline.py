"""Training the torch U-Net pipelined inside a trial (``parallelism.pipeline.stages > 1``; LAMP).

:class:`TorchPipelineUNetTrainer` is the U-Net trainer's loop (same data order, tiles, augmentation, losses) with
the model cut into stages by :func:`~distmis.parallel.pipeline.pipeline_unet`. Inside a Ray Train worker group of
DP x PP ranks it takes its :class:`~distmis.parallel.groups.PipelineGroups`: the data is sharded over the DP
groups (every stage of one pipeline reads the same batches, the first feeds the images in, the last the labels),
each rank's optimizer updates its own stage, and the stage's gradients are averaged over its DP group.

Every step trains the batch the unpipelined trainer trains (:meth:`TorchUNetTrainer.epoch_batches`: the same
cases, a short last batch short). The tensors the stages send each other have fixed shapes, so a batch of another
size than ``training.batch_size`` goes through a pipeline made for its own shape
(:meth:`TorchPipelineUNetTrainer.pipeline_for`): the same cut over the same stage modules, its micro-batches and
schedule given by :func:`~distmis.parallel.pipeline.batch_plan` (equal micro-batches no larger than the configured
one; GPipe where 1F1B would have fewer micro-batches than stages). Its loss and gradients are the mean over its own
samples, as unpipelined, and the epoch's train loss is the mean of its batches' losses, as unpipelined: with group
norm the two train alike, a short batch included.

With DP replicas (DP x PP) the rule is the unpipelined one (:func:`~distmis.train.torch_unet.shard_batches`):
every replica runs the same number of steps, a replica's short batch trains short, and the stages' gradients are
averaged over the replicas with equal weights, as DDP averages the ranks'. All ranks of one pipeline share a DP
rank, so they read the same batches and run the same schedule shape at every step; replicas may run different
shapes at the same step, their only collective being the gradient all-reduce, whose shapes are the parameters'.
A ``training.curriculum`` stage of another tile or batch gets pipelines of its own shapes over the same stage
modules.

Validation, checkpoints and the registered model use the whole model: after each epoch's training every
stage's weights are broadcast to every rank of its pipeline (:meth:`UNetPipeline.gather_weights`), and the
validation cases are shared out over every rank of the trial. The choice: a U-Net's weights are small next to
the activations that a training step at a large input holds (their backward is what the pipeline splits), and
inference under ``no_grad`` keeps none of them, so each rank predicts on its own, with the plain model, as an
unpipelined trial does.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from distmis.parallel.collectives import all_reduce_gradients
from distmis.parallel.groups import PipelineGroups
from distmis.models.unet3d_torch import UNet3D
from distmis.parallel.pipeline import UNetPipeline, batch_plan, pipeline_unet
from distmis.spec.layout import TrialLayout
from distmis.spec.schema import Spec
from distmis.train.epoch import ValidationScores
from distmis.train.torch_unet import TorchUNetTrainer, make_loss


class TorchPipelineUNetTrainer(TorchUNetTrainer):
    """Train one stage of a pipelined U-Net and validate the whole one; ``groups`` from
    :func:`~distmis.parallel.groups.build_pipeline_groups`."""

    def __init__(self, spec: Spec, tfrecord_dir: str | Path, *, groups: PipelineGroups,
                 layout: TrialLayout | None = None, device: str = "cpu") -> None:
        if spec.model.name != "unet3d" or spec.model.framework != "torch":
            raise ValueError(f"a pipeline cuts the torch U-Net, got {spec.model.name!r} ({spec.model.framework})")
        pipe = spec.parallelism.pipeline
        if groups.pp_size != pipe.stages:
            raise ValueError(f"parallelism.pipeline.stages is {pipe.stages}, but the pipeline group holds "
                             f"{groups.pp_size} rank(s)")
        self.groups = groups
        self.pipeline: UNetPipeline | None = None  # the current input's full batch's

        def cut(model: torch.nn.Module) -> torch.nn.Module:
            """This rank's stage (its parameters are what the optimizer updates)."""
            assert isinstance(model, UNet3D)
            return self._make_pipeline(model)

        super().__init__(spec, tfrecord_dir, layout=layout, rank=groups.dp_rank, world_size=groups.dp_size,
                         wrap_model=cut, device=device)

    def _make_pipeline(self, model: UNet3D) -> torch.nn.Module:
        """Cut ``model`` for the current training input's full batch (tile and batch: the shapes the stages
        exchange); this rank's stage module."""
        self.pipeline = None
        self.pipeline = self._build_pipeline(model, self.stage.batch_size)
        return self.pipeline.stage_module

    def _build_pipeline(self, model: UNet3D, samples: int) -> UNetPipeline:
        """The pipeline of a batch of ``samples`` at the current tile, its micro-batches and schedule those of
        :func:`~distmis.parallel.pipeline.batch_plan`."""
        pipe, loss = self.spec.parallelism.pipeline, self.spec.training.loss
        plan = batch_plan(samples, batch_size=self.stage.batch_size, microbatches=pipe.microbatches,
                          schedule=pipe.schedule, stages=self.groups.pp_size)
        built = pipeline_unet(
            model, tile=self.tile or self.volume_shape, microbatches=plan.microbatches, schedule=plan.schedule,
            batch_size=samples, loss_fn=make_loss(loss.name, loss.smooth, activation=self.activation),
            group=self.groups.pp_group, device=self.device)
        if self.pipeline is not None and built.bounds != self.pipeline.bounds:  # the cut depends on the tile only
            raise RuntimeError(f"a batch of {samples} cut the U-Net at {built.bounds}, the full batch at "
                               f"{self.pipeline.bounds}")
        return built

    def pipeline_for(self, samples: int) -> UNetPipeline:
        """The pipeline that trains a batch of ``samples`` at the current input: the full batch's (kept for the
        curriculum stage), or one made for the short batch's own shape, over the same stage modules. Every rank of
        the pipeline makes it at the same step (they read the same batches); nothing is sent in making it.

        A short batch's pipeline is not kept: a stage holds receiving buffers for every micro-batch from its first
        step on, and they would stay allocated through every full step after. Making one costs a pass over the
        model on the meta device, once per short batch (about one per epoch)."""
        if samples == self.stage.batch_size:
            return self.pipe
        return self._build_pipeline(self.model, samples)

    def _stage_changed(self) -> None:
        """A curriculum stage of another tile or batch: a pipeline for its shapes, over the same stage modules
        (and so the same parameters, optimizer state and all)."""
        self.train_model = self._make_pipeline(self.model)

    @property
    def pipe(self) -> UNetPipeline:
        assert self.pipeline is not None
        return self.pipeline

    # ------------------------------------------------------------------ training
    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The batch through the pipeline of its size (:meth:`pipeline_for`): its mean loss over its samples, the
        gradients of that mean in this stage's parameters."""
        pipe = self.pipeline_for(int(x.shape[0]))
        return pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None)

    def _synchronize_gradients(self) -> None:
        if self.groups.dp_size > 1:
            all_reduce_gradients(self.pipe.parameters(), self.groups.dp_group, "mean")

    def _measurement_groups(self) -> list[object]:
        """Every rank of the DP x PP world: the largest over each pipeline, then over the DP groups across them."""
        return [group for group, size in ((self.groups.pp_group, self.groups.pp_size),
                                          (self.groups.dp_group, self.groups.dp_size)) if size > 1]

    # ------------------------------------------------------------------ validation, on the whole model
    def validate(self) -> ValidationScores:
        """Gather every stage's weights on every rank, then validate with the whole model, the cases shared out
        over every rank of the trial."""
        self.pipe.gather_weights()
        self.reduce_group = None  # all ranks' shares add up
        return super().validate()

    def _validation_share(self) -> tuple[int, int]:
        return dist.get_rank(), dist.get_world_size()

    # ------------------------------------------------------------------ checkpoints
    def save_state(self, directory: str | Path, *, rank: int = 0, primary: bool = True) -> None:
        """The whole model (gathered at validation) and stage 0's optimizer from the primary rank, as unpipelined;
        and the first replica's every stage its own optimizer state (``optimizer.stage<k>.pt``)."""
        super().save_state(directory, rank=rank, primary=primary)
        if self.groups.dp_rank == 0:
            torch.save(self.optimizer.state_dict(), Path(directory) / f"optimizer.stage{self.groups.pp_rank}.pt")

    def _saved_optimizer_state(self, directory: Path, state: dict) -> dict:
        path = directory / f"optimizer.stage{self.groups.pp_rank}.pt"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no optimizer state for pipeline stage {self.groups.pp_rank} (was the "
                                    "checkpoint written with another number of stages?)")
        return torch.load(path, map_location=self.device, weights_only=True)
