"""Networks for the predict tests whose output is known: a voxel is tumour where its z-scored FLAIR is above 0.

Pointwise, so their prediction of a volume does not depend on how it is cut into windows: a written segmentation
must then equal the bright-FLAIR mask of the scan exactly, which pins down every step of the geometry.
"""

from __future__ import annotations

import torch
from torch import nn


class BrightFlair(nn.Module):
    """Channels-first ``(B, 4, *window)`` -> ``(B, K, *window)``: probabilities 1 where FLAIR > ``cuts[0]``, else 0;
    channel k of K also needs T1 above ``cuts[1]`` for k >= 1 and T2 above ``cuts[3]`` for k == 2 (nested regions).

    Cuts half-way between a case's z-scored head and tumour values keep a resampled boundary where it was."""

    def __init__(self, num_classes: int = 1, logits: bool = False, cuts: tuple[float, ...] = (0.0,) * 4) -> None:
        super().__init__()
        self.num_classes, self.logits = num_classes, logits
        self.register_buffer("cuts", torch.tensor(cuts, dtype=torch.float32).view(1, 4, 1, 1, 1))
        self.scale = nn.Parameter(torch.ones(()))  # a parameter, so that it is a model like any other

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        above = (x > self.cuts).float()
        wt = above[:, 0:1]
        channels = [wt, wt * above[:, 1:2], wt * above[:, 1:2] * above[:, 3:4]]
        prob = torch.cat(channels[: self.num_classes], dim=1) * self.scale
        return (prob - 0.5) * 20 if self.logits else prob
