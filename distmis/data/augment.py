"""What both frameworks' ``training.augment`` share (the transforms themselves: :mod:`distmis.data.augment_torch`
with MONAI, :mod:`distmis.data.augment_tf` with graph ops). Imports neither framework."""

from __future__ import annotations

import numpy as np

__all__ = ["augment_seed", "rotate90_planes"]


def augment_seed(seed: int, epoch: int, rank: int = 0) -> int:
    """A 32-bit seed for the draws of ``(seed, epoch, rank)``, well mixed (nearby seeds give unrelated streams)."""
    return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])


def rotate90_planes(spatial: tuple[int, ...]) -> list[tuple[int, int]]:
    """The planes (pairs of spatial axes) a 90-degree rotation may turn: those of equal extents, so that an
    input keeps its shape (a batch stacks, and the network sees the tile it was built for)."""
    return [(a, b) for a in range(3) for b in range(a + 1, 3) if spatial[a] == spatial[b]]
