"""A DynUNet's kernels and strides planned as nnU-Net plans them, from the network input and the voxel spacing.

nnU-Net (Isensee et al. 2021; ``get_pool_and_conv_props`` of nnU-Net v2) pools a network input level by level:

- an axis is downsampled (stride 2) only while its feature map keeps at least :data:`MIN_FEATURE_MAP` (4) voxels
  after the pooling, and only while its current spacing is less than twice the finest current spacing of the axes
  that may still be pooled (an anisotropic volume, 0.8 x 0.8 x 3 mm, pools its fine axes first, until their spacing
  catches up with the coarse one);
- when a single axis is left to pool, it pools only while its map holds at least ``3 * 4`` voxels;
- a level's convolutions have a kernel of 3 along every axis whose spacing is within twice the finest, 1 along an
  axis still too coarse (the first levels of an anisotropic volume); once 3, an axis stays 3; the bottleneck is 3
  along every axis;
- the first level has stride 1 (it works at the input's resolution).

Where distmis differs: nnU-Net pads its patch to the pooling's multiple, but distmis's network input (the tile) is
given, so an axis is pooled only while its map has an even size: the planned strides always divide the tile. The
tile planner (``training.tile: auto``) prefers the tiles that lose no pooling that way (:func:`full_pooling`). The
depth is capped at :data:`MAX_DOWNSAMPLINGS` (5) downsamplings, nnU-Net's usual 3D depth (the filters of the deeper
levels are capped at 320 anyway), or fewer (``max_downsamplings``: ``len(filters) - 1`` when a spec gives the
filters). DynUNet needs at least three levels (input, one downsampling, bottleneck): an input too small to be
pooled twice gets stride-1 levels at the bottom.

A curriculum trains one network on several tiles: plan from the per-axis greatest common divisor of every input
it will see (:func:`distmis.spec.load.network_tile`), so that the strides divide them all.

Pure arithmetic: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["MIN_FEATURE_MAP", "MAX_DOWNSAMPLINGS", "MIN_LEVELS", "DynUNetPlan", "full_pooling", "plan_dynunet"]

#: nnU-Net's smallest feature map edge (``UNet_featuremap_min_edge_length``).
MIN_FEATURE_MAP = 4
#: The most downsampling levels a plan makes (6 levels with the input's).
MAX_DOWNSAMPLINGS = 5
#: DynUNet's fewest levels: the input block, one downsampling, the bottleneck.
MIN_LEVELS = 3

Triple = tuple[int, int, int]


@dataclass(frozen=True)
class DynUNetPlan:
    """One entry per level (the input's first, the bottleneck last), each per axis."""

    kernel_size: tuple[Triple, ...]
    strides: tuple[Triple, ...]

    @property
    def upsample_kernel_size(self) -> tuple[Triple, ...]:
        """The transposed convolutions' kernels: the strides they undo (``strides[1:]``, MONAI's advice)."""
        return self.strides[1:]

    @property
    def levels(self) -> int:
        return len(self.strides)

    @property
    def downsampling(self) -> Triple:
        """The strides' product along each axis: the input's size over the bottleneck's."""
        product = [1, 1, 1]
        for stride in self.strides:
            product = [p * s for p, s in zip(product, stride)]
        return tuple(product)  # type: ignore[return-value]


def full_pooling(tile: Sequence[int], spacing: Sequence[float] | None = None, *,
                 max_downsamplings: int = MAX_DOWNSAMPLINGS, min_feature_map: int = MIN_FEATURE_MAP) -> bool:
    """Whether the plan for ``tile`` pools every axis as often as nnU-Net would pool it, were the tile padded to
    the pooling's multiple: the tile divides by the strides' product nnU-Net plans for its size. An odd side (45)
    is not pooled at all, where 40 is pooled three times: the tiles distmis's planner prefers
    (:attr:`distmis.models.registry.ModelEntry.tile_preference`)."""
    kwargs = {"max_downsamplings": max_downsamplings, "min_feature_map": min_feature_map}
    return (plan_dynunet(tile, spacing, **kwargs).downsampling
            == plan_dynunet(tile, spacing, even=False, **kwargs).downsampling)


def plan_dynunet(tile: Sequence[int], spacing: Sequence[float] | None = None, *,
                 max_downsamplings: int = MAX_DOWNSAMPLINGS, min_feature_map: int = MIN_FEATURE_MAP,
                 even: bool = True) -> DynUNetPlan:
    """The kernels and strides nnU-Net plans for a network input of ``tile`` voxels of ``spacing`` (mm; None:
    isotropic); see the module's docstring. ``even=False``: as nnU-Net plans them, pooling an axis of odd size
    too (its patch is padded to the multiple). ValueError for a tile or spacing that is not positive."""
    if len(tile) != 3 or any(int(t) != t or t < 1 for t in tile):
        raise ValueError(f"the tile must be three positive integers, got {list(tile)}")
    spacing = (1.0, 1.0, 1.0) if spacing is None else tuple(float(s) for s in spacing)
    if len(spacing) != 3 or not all(s > 0 for s in spacing):
        raise ValueError(f"the spacing must be three positive numbers, got {list(spacing)}")
    if max_downsamplings < 0:
        raise ValueError(f"max_downsamplings must be >= 0, got {max_downsamplings}")
    size: list[float] = [int(t) for t in tile]
    current = list(spacing)
    kernel = [1, 1, 1]
    kernels: list[Triple] = []
    strides: list[Triple] = [(1, 1, 1)]
    while len(strides) - 1 < max_downsamplings:
        # axes whose map stays >= min_feature_map (and whose size halves exactly) after pooling
        axes = [a for a in range(3) if size[a] >= 2 * min_feature_map and (size[a] % 2 == 0 or not even)]
        if not axes:
            break
        finest = min(current[a] for a in axes)
        axes = [a for a in axes if current[a] / finest < 2]
        if len(axes) == 1 and size[axes[0]] < 3 * min_feature_map:
            break
        finest_of_all = min(current)
        kernel = [3 if k == 3 or current[a] / finest_of_all < 2 else 1 for a, k in enumerate(kernel)]
        kernels.append(tuple(kernel))  # type: ignore[arg-type]
        strides.append(tuple(2 if a in axes else 1 for a in range(3)))  # type: ignore[arg-type]
        for a in axes:
            size[a] = size[a] // 2 if even else size[a] / 2
            current[a] *= 2
    kernels.append((3, 3, 3))  # the bottleneck
    while len(strides) < MIN_LEVELS:  # too small to pool twice: stride-1 levels at the bottom
        strides.append((1, 1, 1))
        kernels.append((3, 3, 3))
    return DynUNetPlan(kernel_size=tuple(kernels), strides=tuple(strides))
