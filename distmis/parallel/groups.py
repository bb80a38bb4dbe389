"""Process groups of a DP x SP (or DP x PP) world: groups of consecutive ranks, data-parallel groups across.

A trial with ``DP * SP`` workers (global ranks ``r_0 .. r_{DP*SP-1}``, in order) is cut into ``DP``
sequence-parallel groups of ``SP`` consecutive ranks; all ranks of one SP group see the same tile and
split its tokens between them. The ``SP`` data-parallel groups run across them: DP group ``j`` holds the
``j``-th rank of every SP group, and samples are sharded over the DP groups. For ``DP = 2, SP = 2``::

    SP groups: (0, 1) (2, 3)        DP groups: (0, 2) (1, 3)

``torch.distributed.new_group`` must be called by every process of the default group, in the same order,
for every group, member or not: :func:`build_parallel_groups` does exactly that, so every process calls it.

A pipeline-parallel trial (:mod:`distmis.parallel.pipeline`) is laid out alike: :func:`build_pipeline_groups`
makes pipelines of ``PP`` consecutive ranks (one per stage) and DP groups of the same stage across them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelGroups:
    """The calling process's place in a DP x SP world (ranks within groups are group ranks)."""

    sp_group: Any
    sp_rank: int
    sp_size: int
    dp_group: Any
    dp_rank: int
    dp_size: int
    sp_ranks: tuple[int, ...]  # global ranks of this process's SP group, in group-rank order
    dp_ranks: tuple[int, ...]  # global ranks of this process's DP group, in group-rank order


def parallel_layout(ranks: Sequence[int], sp_size: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The SP groups (consecutive ranks) and DP groups (across them) of ``ranks`` for sequence degree ``sp_size``."""
    ranks = list(ranks)
    if not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"sp_size must be a positive int, got {sp_size!r}")
    if not ranks or len(ranks) % sp_size:
        raise ValueError(f"the {len(ranks)} ranks must divide into sequence-parallel groups of sp_size {sp_size}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks must be distinct, got {ranks}")
    sp_groups = [tuple(ranks[i : i + sp_size]) for i in range(0, len(ranks), sp_size)]
    dp_groups = [tuple(ranks[j::sp_size]) for j in range(sp_size)]
    return sp_groups, dp_groups


def _build_groups(inner: str, inner_size: int, ranks: Sequence[int] | None) -> dict[str, Any] | None:
    """The calling process's groups of ``inner_size`` consecutive ranks over ``ranks`` and the DP groups across
    them, as the fields ``<inner>_group, <inner>_rank, <inner>_size, <inner>_ranks`` and ``dp_...`` of
    :class:`ParallelGroups` (``inner="sp"``) or :class:`PipelineGroups` (``"pp"``); None on a process outside."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process groups need torch.distributed initialized (init_process_group) first")
    world = dist.get_world_size()
    ranks = list(range(world)) if ranks is None else list(ranks)
    if any(not 0 <= r < world for r in ranks):
        raise ValueError(f"ranks must lie in [0, {world}), got {ranks}")
    inner_layout, dp_layout = parallel_layout(ranks, inner_size)
    me = dist.get_rank()
    fields: dict[str, Any] = {}
    for kind, layout in ((inner, inner_layout), ("dp", dp_layout)):
        for members in layout:
            group = dist.new_group(list(members))
            if me in members:
                fields.update({f"{kind}_group": group, f"{kind}_rank": members.index(me),
                               f"{kind}_size": len(members), f"{kind}_ranks": members})
    return fields or None


def build_parallel_groups(sp_size: int, ranks: Sequence[int] | None = None) -> ParallelGroups | None:
    """Create the SP and DP groups over ``ranks`` (default: the whole world); ``None`` on a process outside them.

    Collective: every process of the default group must call it with the same arguments.
    """
    fields = _build_groups("sp", sp_size, ranks)
    return None if fields is None else ParallelGroups(**fields)


@dataclass(frozen=True)
class PipelineGroups:
    """The calling process's place in a DP x PP world: its pipeline (``pp_ranks``, one rank per stage, in stage
    order: ``pp_rank`` is its stage) and its DP group (the same stage of every pipeline)."""

    pp_group: Any
    pp_rank: int
    pp_size: int
    dp_group: Any
    dp_rank: int
    dp_size: int
    pp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]


def build_pipeline_groups(pp_size: int, ranks: Sequence[int] | None = None) -> PipelineGroups | None:
    """Create the pipeline groups (``pp_size`` consecutive ranks: stages ``0 .. pp_size - 1``) and the DP groups
    across them over ``ranks`` (default: the whole world), laid out as :func:`parallel_layout` lays out SP groups;
    ``None`` on a process outside them. Collective, as :func:`build_parallel_groups`."""
    fields = _build_groups("pp", pp_size, ranks)
    return None if fields is None else PipelineGroups(**fields)
