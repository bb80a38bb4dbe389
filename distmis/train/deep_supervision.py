"""Deep supervision (``training.deep_supervision``): the loss over a U-Net's decoder outputs, as nnU-Net v2 trains.

A network built with deep supervision (an entry whose ``deep_supervision`` names the framework: distmis's torch
U-Net, MONAI's DynUNet) returns in training mode a list of outputs, the full resolution's first, then each lower
decoder level's at its own resolution, highest first; in eval mode (validation, inference, the registered model)
only the full-resolution output. The training loss is

    sum_i w_i * loss(output_i, target_i),    w_i = 2**-i / sum_j 2**-j,

``target_i`` the batch's target downsampled to output ``i``'s shape by nearest-neighbour interpolation
(``nearest-exact``, as nnU-Net's ``DownsampleSegForDSTransform``; a one-hot or region channel stays 0/1).

nnU-Net computes the loss over every decoder level, halving the weight per level, with the lowest resolution's
weight set to 0, and normalizes the weights to sum to 1. Its lowest level's output then takes no part in the loss;
the networks here do not build it (MONAI's DynUNet cannot: ``deep_supr_num`` stops one level above it), so the
weights above, over the outputs that are built, are nnU-Net's (:func:`level_weights`). A U-Net of ``n`` levels has
``n - 1`` decoder levels and so ``n - 2`` supervised outputs, ``n - 3`` heads besides the full resolution's
(:func:`~distmis.models.registry.supervision_heads`): with three levels the full resolution only, plain training.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

__all__ = ["level_weights", "downsample_target", "DeepSupervisionLoss"]

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def level_weights(outputs: int) -> list[float]:
    """The loss weight of each of ``outputs`` outputs, the full resolution's first: halving per level, summing to 1
    (nnU-Net's, its zero-weighted lowest level left out)."""
    if outputs < 1:
        raise ValueError(f"deep supervision needs at least one output, got {outputs}")
    raw = [0.5**i for i in range(outputs)]
    return [w / sum(raw) for w in raw]


def downsample_target(target: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A ``(B, C, *spatial)`` target at ``shape`` by nearest-neighbour interpolation (``nearest-exact``), in its
    own dtype; itself when it has that shape already."""
    shape = tuple(int(s) for s in shape)
    if tuple(target.shape[2:]) == shape:
        return target
    return F.interpolate(target.float(), size=shape, mode="nearest-exact").to(target.dtype)


class DeepSupervisionLoss:
    """``loss`` over a deep-supervised network's outputs (see the module's docstring); a single output tensor (no
    deep supervision, or eval mode) gets ``loss`` itself."""

    def __init__(self, loss: Loss) -> None:
        self.loss = loss

    def __call__(self, output: torch.Tensor | Sequence[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        if isinstance(output, torch.Tensor):
            return self.loss(output, target)
        outputs = list(output)
        if tuple(outputs[0].shape[2:]) != tuple(target.shape[2:]):
            raise ValueError(f"the first output {tuple(outputs[0].shape)} must be at the target's resolution "
                             f"{tuple(target.shape)}")
        total = None
        for weight, out in zip(level_weights(len(outputs)), outputs):
            term = weight * self.loss(out, downsample_target(target, out.shape[2:]))
            total = term if total is None else total + term
        assert total is not None
        return total
