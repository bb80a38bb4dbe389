"""How sequence parallelism shares a tile's tokens between ranks: pure arithmetic, no torch.

The spec checks a sequence-parallel configuration with these functions before any trial starts, and the
SP runtime (:mod:`distmis.parallel.sequence`) builds its token indices from the same shares, so the two can
never disagree.

Axes and token order (one vocabulary across data, U-Nets, ViT and SP)
    Volumes are ``(H, W, D)`` in voxels, the array axes of the NIfTI files (channels last in numpy and
    TensorFlow, ``(B, C, H, W, D)`` in torch). A ViT cuts a tile into ``P^3`` patches on a patch grid
    ``(gh, gw, gd) = (H/P, W/P, D/P)`` and orders the tokens row-major, the last axis fastest::

        token index n = (ih * gw + iw) * gd + id

Splits
    ``ordered``: rank ``r`` of ``k`` takes tokens ``[r N/k, (r+1) N/k)``.
    ``spatial``: rank ``r`` takes a box of the patch grid (the SP-ViT paper's Figure 4): degree 2 halves the
    first axis, 4 the first two, 8 all three; the boxes are numbered row-major.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

AXES: tuple[str, str, str] = ("H", "W", "D")

SplitKind = Literal["ordered", "spatial"]
AttentionKind = Literal["allgather-kv", "ulysses"]
DecoderKind = Literal["gather", "no-gather"]
SPLITS: tuple[str, ...] = ("ordered", "spatial")
ATTENTIONS: tuple[str, ...] = ("allgather-kv", "ulysses")
DECODERS: tuple[str, ...] = ("gather", "no-gather")

# Parts of the (gh, gw, gd) patch grid per sequence-parallel degree, for the spatial split.
SPATIAL_PARTS: dict[int, tuple[int, int, int]] = {1: (1, 1, 1), 2: (2, 1, 1), 4: (2, 2, 1), 8: (2, 2, 2)}

Box = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]  # (start, stop) along each grid axis


@dataclass(frozen=True)
class TokenShare:
    """One rank's tokens: the contiguous range ``[start, stop)`` of the token order (``ordered``), or a
    ``box`` of the patch grid (``spatial``). ``box`` is also set for an ordered range that happens to fill one."""

    box: Box | None
    start: int | None = None
    stop: int | None = None

    @property
    def grid(self) -> tuple[int, int, int] | None:
        """The box's shape in patches, or ``None``."""
        return None if self.box is None else tuple(b - a for a, b in self.box)  # type: ignore[return-value]


def token_grid(shape: Sequence[int], patch: int) -> tuple[int, int, int]:
    """The patch grid of a ``shape`` (H, W, D) volume; ValueError naming the axes that do not divide."""
    bad = [f"{axis}={size}" for axis, size in zip(AXES, shape) if size % patch]
    if len(shape) != 3 or bad:
        raise ValueError(f"shape {tuple(shape)} must divide by the patch {patch} along H, W and D; "
                         f"not along {', '.join(bad) or 'all three'}")
    return tuple(s // patch for s in shape)  # type: ignore[return-value]


def range_box(start: int, stop: int, grid: Sequence[int]) -> Box | None:
    """The box that the tokens ``[start, stop)`` of a row-major ``grid`` fill, or ``None`` if they fill none."""
    _, g1, g2 = grid
    size = stop - start

    def coords(n: int) -> tuple[int, int, int]:
        return n // (g1 * g2), (n // g2) % g1, n % g2

    first = coords(start)
    if size <= g2:  # part of one row
        return ((first[0], first[0] + 1), (first[1], first[1] + 1), (first[2], first[2] + size)) \
            if first[2] + size <= g2 else None
    if start % g2 or size % g2:
        return None
    rows = size // g2
    if rows <= g1:  # whole rows of one plane
        return ((first[0], first[0] + 1), (first[1], first[1] + rows), (0, g2)) if first[1] + rows <= g1 else None
    if first[1] or rows % g1:
        return None
    return ((first[0], first[0] + rows // g1), (0, g1), (0, g2))  # whole planes


def partition_tokens(grid: Sequence[int], degree: int, split: SplitKind) -> list[TokenShare]:
    """Every rank's :class:`TokenShare` of a tile whose patch grid is ``grid``; ValueError if it does not divide."""
    grid = tuple(grid)
    if not isinstance(degree, int) or degree < 1:
        raise ValueError(f"the sequence-parallel degree must be a positive int, got {degree!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if split == "ordered":
        n = math.prod(grid)
        if n % degree:
            raise ValueError(f"split 'ordered': the tile's {n} tokens (patch grid {grid}) must be divisible by the "
                             f"sequence-parallel degree {degree}")
        size = n // degree
        return [TokenShare(range_box(r * size, (r + 1) * size, grid), r * size, (r + 1) * size) for r in range(degree)]
    if degree not in SPATIAL_PARTS:
        raise ValueError(f"split 'spatial' supports sequence-parallel degrees {tuple(SPATIAL_PARTS)} "
                         f"(the paper's Figure 4), got {degree}")
    parts = SPATIAL_PARTS[degree]
    bad = [f"{axis}={g}" for axis, g, p in zip(AXES, grid, parts) if g % p]
    if bad:
        raise ValueError(f"split 'spatial' with degree {degree} cuts the patch grid {grid} (H, W, D) into {parts} "
                         f"parts; not divisible along {', '.join(bad)}")
    sizes = [g // p for g, p in zip(grid, parts)]
    return [
        TokenShare(tuple((r * s, (r + 1) * s) for r, s in zip((r0, r1, r2), sizes)))  # type: ignore[arg-type]
        for r0 in range(parts[0]) for r1 in range(parts[1]) for r2 in range(parts[2])
    ]


def check_sequence_parallel(
    grid: Sequence[int],
    heads: int,
    degree: int,
    *,
    attention: AttentionKind = "allgather-kv",
    decoder: DecoderKind = "gather",
    split: SplitKind = "ordered",
) -> list[TokenShare]:
    """Validate an SP configuration for a patch ``grid`` and ``heads``; return every rank's share.

    Raises a ValueError naming the option and its allowed values, or what does not divide.
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    if decoder not in DECODERS:
        raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}")
    shares = partition_tokens(grid, degree, split)
    if attention == "ulysses" and heads % degree:
        raise ValueError(f"attention 'ulysses' needs heads ({heads}) divisible by the sequence-parallel degree ({degree})")
    if decoder == "no-gather":
        for rank, share in enumerate(shares):
            if share.box is None:
                raise ValueError(
                    f"decoder 'no-gather' needs every rank's tokens to form a box (a sub-volume to decode), but "
                    f"split {split!r} with degree {degree} gives rank {rank} a chunk of the patch grid {tuple(grid)} "
                    f"that is not one; use split 'spatial' or decoder 'gather'"
                )
    return shares
