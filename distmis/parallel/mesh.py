"""One trial's device mesh: where this process sits among the trial's ranks, and its process groups.

A trial of ``dp`` data-parallel replicas, each split over ``sp`` sequence-parallel ranks or ``pp`` pipeline stages
(:class:`~distmis.spec.layout.TrialLayout`), holds ``dp * sp * pp`` ranks laid out as one rank matrix of shape
``(dp, sp, pp)``: global rank ``((d * sp) + s) * pp + p``. Consecutive ranks thus share an SP group (or a pipeline,
one rank per stage, in stage order), and the data-parallel groups run across them. For ``dp = 2, sp = 2``::

    SP groups: (0, 1) (2, 3)        DP groups: (0, 2) (1, 3)

and for ``dp = 2, pp = 2``: pipelines ``(0, 1) (2, 3)``, DP groups ``(0, 2) (1, 3)`` (the same stage of every
pipeline).

:meth:`TrialMesh.build` makes the groups (collective: ``torch.distributed.new_group`` must be called by every
process of the default group, in the same order, for every group, member or not, and it is); an axis of size 1
gets no group (``None``: the process is alone on it). Every group has the default group's backend, which must be
the layout's (:func:`~distmis.parallel.backend.process_group_backend`: NCCL on GPUs, gloo on CPUs).
:meth:`TrialMesh.local` is one process on its own: an experiment-parallel trial, or the driver rebuilding a trained
trial on one device to evaluate it. The degrees come from the layout, never recomputed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from distmis.parallel.backend import process_group_backend
from distmis.spec.layout import TrialLayout

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["AXES", "TrialMesh"]

#: The mesh's axes, in the rank matrix's order.
AXES = ("dp", "sp", "pp")


@dataclass(frozen=True)
class TrialMesh:
    """The calling process's place in its trial's ``(dp, sp, pp)`` rank matrix (ranks within groups are group
    ranks; ``*_ranks`` are the global ranks of this process's group on that axis, in group-rank order)."""

    layout: TrialLayout
    rank: int = 0  # global rank
    dp_rank: int = 0
    dp_size: int = 1
    sp_rank: int = 0
    sp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_group: ProcessGroup | None = None  # None when the process is alone on the axis
    sp_group: ProcessGroup | None = None
    pp_group: ProcessGroup | None = None
    dp_ranks: tuple[int, ...] = (0,)
    sp_ranks: tuple[int, ...] = (0,)
    pp_ranks: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        for axis in AXES:
            rank, size = getattr(self, f"{axis}_rank"), getattr(self, f"{axis}_size")
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{axis}_size must be a positive int, got {size!r}")
            if not isinstance(rank, int) or not 0 <= rank < size:
                raise ValueError(f"{axis}_rank must lie in [0, {size}), got {rank!r}")

    @property
    def world_size(self) -> int:
        """Ranks of the mesh (1 for a local one)."""
        return self.dp_size * self.sp_size * self.pp_size

    @property
    def is_local(self) -> bool:
        """One process on its own: no process group."""
        return self.world_size == 1

    @staticmethod
    def rank_matrix(layout: TrialLayout) -> np.ndarray:
        """The global ranks of ``layout``'s trial as an int array of shape ``(dp, sp, pp)`` (pure)."""
        return np.arange(layout.world_size).reshape(layout.dp, layout.sp, layout.pp)

    @staticmethod
    def axis_groups(layout: TrialLayout, axis: str) -> list[tuple[int, ...]]:
        """Every group along ``axis`` (``dp``, ``sp`` or ``pp``) of ``layout``'s rank matrix, each in group-rank
        order, in a fixed order (pure)."""
        if axis not in AXES:
            raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
        matrix = np.moveaxis(TrialMesh.rank_matrix(layout), AXES.index(axis), -1)
        return [tuple(int(r) for r in line) for line in matrix.reshape(-1, matrix.shape[-1])]

    @classmethod
    def local(cls, layout: TrialLayout) -> TrialMesh:
        """One process alone: every size 1, no groups (whatever ``layout``'s degrees)."""
        return cls(layout=layout)

    @classmethod
    def build(cls, layout: TrialLayout) -> TrialMesh:
        """This process's mesh in the initialized default process group, which must hold ``layout.world_size``
        ranks (RuntimeError otherwise). Collective: every process of the default group calls it."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("a trial mesh needs torch.distributed initialized (init_process_group) first")
        world = dist.get_world_size()
        if world != layout.world_size:
            raise RuntimeError(f"the trial's layout has {layout.world_size} rank(s) ({layout.describe()}), but the "
                               f"process group holds {world}")
        # NCCL on GPUs, gloo on CPUs (distmis.parallel.backend): the subgroups take the default group's backend
        backend = process_group_backend(layout)
        if dist.get_backend() != backend:
            raise RuntimeError(f"the trial's layout ({layout.describe()}) calls for {backend} process groups, but the "
                               f"default group is {dist.get_backend()}")
        me = dist.get_rank()
        fields: dict[str, Any] = {"rank": me}
        for axis in AXES:
            for members in cls.axis_groups(layout, axis):
                if len(members) == 1:  # nobody shares this axis: no group
                    if me in members:
                        fields.update({f"{axis}_ranks": members})
                    continue
                group = dist.new_group(list(members), backend=backend)
                if me in members:
                    fields.update({f"{axis}_group": group, f"{axis}_rank": members.index(me),
                                   f"{axis}_size": len(members), f"{axis}_ranks": members})
        return cls(layout=layout, **fields)

    def describe(self) -> str:
        """``"rank 3: dp 1/2, sp 1/2, pp 0/1"``."""
        return f"rank {self.rank}: " + ", ".join(
            f"{axis} {getattr(self, f'{axis}_rank')}/{getattr(self, f'{axis}_size')}" for axis in AXES)
