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
    ``dsp`` (dynamic sequence parallelism, for axial attention): rank ``r`` takes the ``r``-th slab of the grid
    along one axis, and the axis changes between attention stages (:func:`dsp_schedule`); ``split`` does not
    apply to it.

Axial attention (``model.params.attention: axial``)
    Each block attends along H, then W, then D (:data:`AXIAL_ORDER`), each stage over the lines of the grid
    along its axis. A sequence-parallel rank of an axial model holds its tokens as a box of the grid, so every
    rank's share must be one, whatever the attention strategy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

AXES: tuple[str, str, str] = ("H", "W", "D")

SplitKind = Literal["ordered", "spatial"]
AttentionKind = Literal["allgather-kv", "ulysses", "dsp"]
DecoderKind = Literal["gather", "no-gather"]
ModelAttention = Literal["full", "axial"]
SPLITS: tuple[str, ...] = ("ordered", "spatial")
ATTENTIONS: tuple[str, ...] = ("allgather-kv", "ulysses", "dsp")
DECODERS: tuple[str, ...] = ("gather", "no-gather")
MODEL_ATTENTIONS: tuple[str, ...] = ("full", "axial")

#: The grid axes (0 = H, 1 = W, 2 = D) an axial block attends along, in order: one attention stage each.
AXIAL_ORDER: tuple[int, int, int] = (0, 1, 2)

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


def slab_shares(grid: Sequence[int], degree: int, axis: int) -> list[TokenShare]:
    """Every rank's slab of the patch ``grid`` cut into ``degree`` equal parts along ``axis`` (rank order)."""
    grid = tuple(grid)
    if grid[axis] % degree:
        raise ValueError(f"the patch grid {grid} (H, W, D) does not cut into {degree} slabs along "
                         f"{AXES[axis]}={grid[axis]}")
    size = grid[axis] // degree
    return [TokenShare(tuple((r * size, (r + 1) * size) if a == axis else (0, g)  # type: ignore[arg-type]
                             for a, g in enumerate(grid)))
            for r in range(degree)]


@dataclass(frozen=True)
class DSPSchedule:
    """Dynamic sequence parallelism's plan for an axial encoder (the DSP seed's dynamic switch).

    ``splits[i]`` is the grid axis the tokens are split along during attention stage ``i`` (block ``i // 3``,
    attending along ``AXIAL_ORDER[i % 3]``); it is never the stage's own axis, so every stage attends over whole
    lines that one rank holds. Where ``splits`` changes, one all-to-all switches the split before the stage
    (and one switches the gradient back in the backward). The MLP and norms act on each token and need none.
    """

    grid: tuple[int, int, int]
    degree: int
    splits: tuple[int, ...]

    @property
    def first(self) -> int:
        """The axis of the encoder's input slabs (what each rank embeds)."""
        return self.splits[0]

    @property
    def last(self) -> int:
        """The axis of the encoder's output slabs (what each rank decodes, or sends to the gather)."""
        return self.splits[-1]

    @property
    def switch_stages(self) -> tuple[int, ...]:
        """The attention stages before which the split switches (one all-to-all each, forward)."""
        return tuple(i for i in range(1, len(self.splits)) if self.splits[i] != self.splits[i - 1])

    @property
    def switches(self) -> int:
        """All-to-alls of the activation in one forward (as many again in the backward)."""
        return len(self.switch_stages)

    def shares(self, axis: int) -> list[TokenShare]:
        """Every rank's slab along ``axis``."""
        return slab_shares(self.grid, self.degree, axis)


def dsp_splittable_axes(grid: Sequence[int], degree: int) -> tuple[int, ...]:
    """The grid axes whose extent divides by ``degree``: the ones DSP may split the tokens along."""
    return tuple(a for a, g in enumerate(grid) if g % degree == 0)


def dsp_schedule(grid: Sequence[int], degree: int, layers: int) -> DSPSchedule:
    """The split axis of every attention stage of ``layers`` axial blocks over ``degree`` ranks.

    Each stage must be split along an axis other than the one it attends along, and along an axis whose extent
    divides by the degree; so at least two axes must divide. Among the allowed axes the schedule keeps the
    current split as long as it can and, when a stage attends along it, switches to the allowed axis attended
    along farthest ahead (fewest switches, as a cache evicts the page used farthest ahead): with all three axes
    allowed, one switch per two stages, ``ceil(3 L / 2) - 1`` in all. Ties go to the earlier axis (H, W, D).
    """
    grid = tuple(int(g) for g in grid)
    if len(grid) != 3 or layers < 1 or degree < 1:
        raise ValueError(f"dsp_schedule needs a 3-axis grid, layers >= 1 and degree >= 1; got {grid}, {layers}, "
                         f"{degree}")
    allowed = dsp_splittable_axes(grid, degree)
    if len(allowed) < 2:
        divides = ", ".join(f"{AXES[a]}={g}" for a, g in enumerate(grid))
        raise ValueError(
            f"attention 'dsp' splits the patch grid {list(grid)} along one axis at a time and switches it before "
            f"a stage that attends along that axis, so at least two of its axes must divide by the "
            f"sequence-parallel degree {degree} ({divides}); use a degree that divides two of them, a tile or "
            f"patch that makes them divide, or attention 'ulysses'")
    stages = [AXIAL_ORDER[i % 3] for i in range(3 * layers)]

    def next_use(axis: int, start: int) -> int:
        return next((j for j in range(start, len(stages)) if stages[j] == axis), len(stages))

    splits: list[int] = []
    current: int | None = None
    for i, attended in enumerate(stages):
        if current is None or current == attended:
            current = max((a for a in allowed if a != attended), key=lambda a: (next_use(a, i), -a))
        splits.append(current)
    return DSPSchedule(grid, degree, tuple(splits))


def check_sequence_parallel(
    grid: Sequence[int],
    heads: int,
    degree: int,
    *,
    attention: AttentionKind = "allgather-kv",
    decoder: DecoderKind = "gather",
    split: SplitKind = "ordered",
    model_attention: ModelAttention = "full",
) -> list[TokenShare]:
    """Validate an SP configuration for a patch ``grid`` and ``heads``; return every rank's share of the
    encoder's input (``dsp``: the slabs of its schedule's first axis).

    ``model_attention`` is the model's (``full`` or ``axial``): ``dsp`` needs ``axial``, and an axial model needs
    every rank's share to be a box. Raises a ValueError naming the option and its allowed values, or what does
    not divide.
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    if decoder not in DECODERS:
        raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}")
    if model_attention not in MODEL_ATTENTIONS:
        raise ValueError(f"the model's attention must be one of {MODEL_ATTENTIONS}, got {model_attention!r}")
    if attention == "dsp":
        if model_attention != "axial":
            raise ValueError(
                "attention 'dsp' needs model.params.attention 'axial': it keeps the tokens split along an axis "
                "the current stage does not attend along, and full attention attends along all of them at once "
                "(no split is free of communication); use attention 'ulysses' or 'allgather-kv' with full "
                "attention")
        if not isinstance(degree, int) or degree < 1:
            raise ValueError(f"the sequence-parallel degree must be a positive int, got {degree!r}")
        schedule = dsp_schedule(grid, degree, 1)  # the first axis does not depend on the number of blocks
        return schedule.shares(schedule.first)
    shares = partition_tokens(grid, degree, split)
    if model_attention == "axial":
        _require_boxes(shares, grid, split, "axial attention attends along the lines of the patch grid, so every "
                       "rank's tokens must form a box", "use split 'spatial', a degree that divides the grid's "
                       "first axis, or attention 'dsp'")
    if attention == "ulysses" and heads % degree:
        raise ValueError(f"attention 'ulysses' needs heads ({heads}) divisible by the sequence-parallel degree ({degree})")
    if decoder == "no-gather":
        _require_boxes(shares, grid, split, "decoder 'no-gather' needs every rank's tokens to form a box (a "
                       "sub-volume to decode)", "use split 'spatial' or decoder 'gather'")
    return shares


def _require_boxes(shares: Sequence[TokenShare], grid: Sequence[int], split: str, need: str, fix: str) -> None:
    """ValueError (``need``, the first rank whose share is not a box, ``fix``) unless every share is a box."""
    for rank, share in enumerate(shares):
        if share.box is None:
            raise ValueError(f"{need}, but split {split!r} with degree {len(shares)} gives rank {rank} a chunk of "
                             f"the patch grid {tuple(grid)} that is not one; {fix}")
