"""Training the ViT segmentation model (``model.name: vit-seg``), alone or sequence-parallel inside a trial.

:class:`TorchViTTrainer` is the U-Net trainer's loop (same data order, tiles, losses, validation) with
the ViT as the model. Inside a Ray Train worker group of DP x SP ranks it takes the :class:`ParallelGroups`
of its rank: the data is sharded over the DP groups (all ranks of one SP group see the same samples and
the same tiles), the model is parallelized from outside with :func:`parallelize_vit_seg`, and after every
backward :func:`sync_gradients` makes the gradients the ones SP=1 would have (``gather``). The data order,
the tiles and the initial weights depend on the seed and the DP rank only, so SP=1 and SP=k trials of one
search follow the same loss curve.

Every epoch reports, besides the U-Net trainer's numbers, the steps' ``step_seconds`` and ``peak_memory_mb``
(:class:`~distmis.train.torch_unet.StepMeter`, the largest over all DP x SP ranks) and ``fom``, the seed's figure
of merit ``b L s^2 d / step_seconds`` (:func:`~distmis.perf.model.figure_of_merit`, ``b`` the
``training.batch_size`` samples a rank trains per step, ``s`` the tile's tokens).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from distmis.models.unet3d_torch import activate
from distmis.models.vit_seg import ViTSeg
from distmis.perf import model as perf_model
from distmis.parallel.groups import ParallelGroups
from distmis.parallel.sequence import SequenceParallelViTSeg, parallelize_vit_seg, sync_gradients
from distmis.spec.layout import TrialLayout
from distmis.models.params import ViTSegParams
from distmis.spec.schema import Spec
from distmis.train.inference import sliding_window
from distmis.train.torch_unet import TorchUNetTrainer, make_loss


class TorchViTTrainer(TorchUNetTrainer):
    """Train and validate a ViTSeg; ``groups`` (from :func:`build_parallel_groups`) makes it DP x SP."""

    def __init__(self, spec: Spec, tfrecord_dir: str | Path, *, layout: TrialLayout | None = None,
                 groups: ParallelGroups | None = None, device: str = "cpu") -> None:
        if not isinstance(spec.model.params, ViTSegParams):
            raise ValueError(f"TorchViTTrainer trains model 'vit-seg', got {spec.model.name!r}")
        self.groups = groups
        sp = spec.parallelism.sequence_parallel
        parallel = groups is not None and groups.sp_size > 1

        def wrap(model: torch.nn.Module) -> torch.nn.Module:
            assert groups is not None and isinstance(model, ViTSeg)
            return parallelize_vit_seg(model, groups.sp_group, attention=sp.attention, decoder=sp.decoder,
                                       split=sp.split)

        super().__init__(
            spec, tfrecord_dir, layout=layout,
            rank=groups.dp_rank if groups else 0, world_size=groups.dp_size if groups else 1,
            wrap_model=wrap if parallel else None, device=device,
        )
        if groups is not None:
            self.reduce_group = groups.dp_group  # validation shares add up over DP; SP ranks hold copies
        # The ViT gives logits: train on them (cross-entropy from the logits: BCE with logits for sigmoid targets,
        # MONAI's DiceCELoss for softmax ones); validation scores averaged probabilities.
        loss = spec.training.loss
        self.logits_loss_fn = make_loss(loss.name, loss.smooth, from_logits=True, activation=self.activation)

    def _build_model(self, in_channels: int) -> ViTSeg:
        params = self.spec.model.params
        tile = self.tile or self.volume_shape  # no tile: the whole volume is one input
        return ViTSeg(in_channels, self.num_classes, tile, **params.model_dump())

    @property
    def shape(self) -> perf_model.ViTShape:
        """The model's arithmetic shape (:mod:`distmis.perf.model`): its parameters on its tile."""
        return perf_model.ViTShape.of(self.spec.model.params, self.model.tile, in_channels=self.in_channels,
                                      num_classes=self.num_classes)

    def figure_of_merit(self, step_seconds: float) -> float | None:
        """The seed's ``b L s^2 d / step_seconds``, ``b`` the samples a rank trains per step."""
        return perf_model.figure_of_merit(self.shape, batch=self.spec.training.batch_size, seconds=step_seconds)

    def _measurement_groups(self) -> list[object]:
        """Every rank of the DP x SP world: the largest over each SP group, then over the DP groups across them."""
        if self.groups is None:
            return super()._measurement_groups()
        return [group for group, size in ((self.groups.sp_group, self.groups.sp_size),
                                          (self.groups.dp_group, self.groups.dp_size)) if size > 1]

    def _batch_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.train_model(x)
        if isinstance(self.train_model, SequenceParallelViTSeg):
            y = self.train_model.local_target(y)  # no-gather: this rank's sub-volume; gather: all of it
        return self.logits_loss_fn(logits, y)

    def _synchronize_gradients(self) -> None:
        if self.groups is not None:
            sync_gradients(self.train_model, self.groups)

    @torch.no_grad()
    def predict_volume(self, image_hwdc: np.ndarray) -> np.ndarray:
        """Probabilities (h, w, d, C) for one channels-last volume by sliding windows of the model's tile
        (``training.inference``). Every rank of an SP group runs the same windows and gets the whole result."""
        self.model.eval()
        inference = self.spec.training.inference
        x = torch.from_numpy(np.ascontiguousarray(np.moveaxis(image_hwdc, -1, 0), dtype=np.float32))[None]
        prob = sliding_window(self._probabilities, x.to(self.device), self.model.tile, overlap=inference.overlap,
                              mode=inference.mode, sigma_scale=inference.sigma_scale,
                              batch_size=self.spec.training.inference_batch_size)
        return prob[0].permute(1, 2, 3, 0).cpu().numpy()

    def _probabilities(self, x: torch.Tensor) -> torch.Tensor:
        """Probabilities of whole tiles (B, C, *tile) -> (B, K, *tile), on every rank of an SP group: the target
        scheme's activation (sigmoid, or softmax over the channels) of the logits."""
        model = self.train_model  # eval mode: set by predict_volume on the (shared) plain model
        logits = model(x)
        if isinstance(model, SequenceParallelViTSeg) and model.decoder == "no-gather":
            logits = self._assemble(model, logits, tuple(x.shape[2:]))
        return activate(logits, self.activation)

    @staticmethod
    def _assemble(model: SequenceParallelViTSeg, local: torch.Tensor, spatial: tuple[int, ...]) -> torch.Tensor:
        """The whole tile's logits from every rank's sub-volume (no-gather decodes boxes of equal size)."""
        parts = [torch.empty_like(local) for _ in range(model.sp_size)]
        dist.all_gather(parts, local.contiguous(), group=model.sp_group)
        whole = local.new_empty(local.shape[:2] + spatial)
        for chunk, part in zip(model.output_chunks, parts):
            whole[(Ellipsis,) + chunk.voxel_box(model.model.patch)] = part
        return whole
