"""Training the torch U-Net pipelined inside a trial (``parallelism.pipeline.stages > 1``; LAMP).

:class:`TorchPipelineUNetTrainer` is the U-Net trainer's loop (same data order, tiles, augmentation, losses) with
the model cut into stages by :func:`~distmis.parallel.pipeline.pipeline_unet`. Inside a Ray Train worker group of
DP x PP ranks it takes its :class:`~distmis.parallel.groups.PipelineGroups`: the data is sharded over the DP
groups (every stage of one pipeline reads the same batches, the first feeds the images in, the last the labels),
each rank's optimizer updates its own stage, and the stage's gradients are averaged over its DP group.

Every step takes a full batch of ``training.batch_size`` samples: the micro-batches and the tensors the stages
send each other have fixed shapes, so a rank's short last batch is completed with the first cases of its shard
(:meth:`TorchPipelineUNetTrainer.epoch_batches`). A ``training.curriculum`` stage of another tile or batch gets a
pipeline of its own shapes over the same stage modules.

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
from distmis.parallel.pipeline import UNetPipeline, pipeline_unet
from distmis.spec.layout import TrialLayout
from distmis.spec.schema import Spec
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
        self.pipeline: UNetPipeline | None = None

        def cut(model: torch.nn.Module) -> torch.nn.Module:
            """This rank's stage (its parameters are what the optimizer updates)."""
            assert isinstance(model, UNet3D)
            return self._make_pipeline(model)

        super().__init__(spec, tfrecord_dir, layout=layout, rank=groups.dp_rank, world_size=groups.dp_size,
                         wrap_model=cut, device=device)

    def _make_pipeline(self, model: UNet3D) -> torch.nn.Module:
        """Cut ``model`` for the current training input (tile and batch: the shapes the stages exchange); this
        rank's stage module."""
        pipe, loss = self.spec.parallelism.pipeline, self.spec.training.loss
        self.pipeline = pipeline_unet(
            model, tile=self.tile or self.volume_shape, microbatches=pipe.microbatches, schedule=pipe.schedule,
            batch_size=self.stage.batch_size, loss_fn=make_loss(loss.name, loss.smooth),
            group=self.groups.pp_group, device=self.device)
        return self.pipeline.stage_module

    def _stage_changed(self) -> None:
        """A curriculum stage of another tile or batch: a pipeline for its shapes, over the same stage modules
        (and so the same parameters, optimizer state and all)."""
        self.train_model = self._make_pipeline(self.model)

    @property
    def pipe(self) -> UNetPipeline:
        assert self.pipeline is not None
        return self.pipeline

    # ------------------------------------------------------------------ training
    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """:meth:`TorchUNetTrainer.epoch_batches`, every batch full: a short one takes cases from the start of
        the rank's shard (the pipeline's shapes are fixed)."""
        batches = super().epoch_batches(epoch)
        size = self.stage.batch_size
        shard = [i for batch in batches for i in batch]
        return [batch + [shard[k % len(shard)] for k in range(size - len(batch))] for batch in batches]

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pipe = self.pipe
        return pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None)

    def _synchronize_gradients(self) -> None:
        if self.groups.dp_size > 1:
            all_reduce_gradients(self.pipe.parameters(), self.groups.dp_group, "mean")

    def _measurement_groups(self) -> list[object]:
        """Every rank of the DP x PP world: the largest over each pipeline, then over the DP groups across them."""
        return [group for group, size in ((self.groups.pp_group, self.groups.pp_size),
                                          (self.groups.dp_group, self.groups.dp_size)) if size > 1]

    # ------------------------------------------------------------------ validation, on the whole model
    def validate(self) -> tuple[float, float]:
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
