"""Collectives over a sequence-parallel group as autograd functions, named ``<Forward>Forward<Backward>Backward``.

Each rank holds an equal chunk of a sequence along some dimension; chunks are concatenated in group-rank
order. ``group=None`` means the default group. On a group of one rank the functional forms return their
input unchanged.

- :class:`AllGatherForwardReduceScatterBackward`: forward gathers the chunks; the backward reduce-scatters
  (sums over ranks, keeps the own chunk): the exact adjoint when every rank's gathered copy feeds a
  *different* computation (the keys and values of ``allgather-kv`` attention).
- :class:`AllGatherForwardSplitBackward`: forward gathers; the backward keeps the rank's own slice of the
  gradient without communication. Right when every rank's gathered copy feeds the *same* computation
  (the ``gather`` decoder): the reduce-scatter would sum ``SP`` identical gradients of the one loss; the
  own slice is that gradient once, as the single-device model computes it.
- :class:`AllToAll`: scatter one dimension, gather another (Ulysses: sequence-split <-> head-split); the
  backward is the inverse all-to-all.
- :class:`SwitchSplitForwardSwitchBackBackward`: the dynamic switch of DSP: a tensor split along one dimension
  comes out split along another (one all-to-all); the backward switches its gradient back (the inverse).
"""

from __future__ import annotations

from typing import Any, Iterable, Literal

import torch
import torch.distributed as dist

ReduceOp = Literal["sum", "mean"]

# torch 2.13 renamed the single-tensor collectives (the old names still work, with a FutureWarning)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: Any = None) -> int:
    return dist.get_world_size(group)


def group_rank(group: Any = None) -> int:
    return dist.get_rank(group)


def _all_gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    size = group_size(group)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((size * front.shape[0],) + tuple(front.shape[1:]))
    _all_gather_single(out, front, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    size = group_size(group)
    front = x.movedim(dim, 0).contiguous()
    if front.shape[0] % size:
        raise ValueError(f"dimension {dim} of size {front.shape[0]} does not split into {size} equal chunks")
    out = front.new_empty((front.shape[0] // size,) + tuple(front.shape[1:]))
    _reduce_scatter_single(out, front, op=dist.ReduceOp.SUM, group=group)
    return out.movedim(0, dim)


def _own_slice(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    size = group_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split into {size} equal chunks")
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any) -> torch.Tensor:
    size = group_size(group)
    if x.shape[scatter_dim] % size:
        raise ValueError(
            f"dimension {scatter_dim} of size {x.shape[scatter_dim]} does not split into {size} equal chunks"
        )
    inputs = [chunk.contiguous() for chunk in x.chunk(size, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class AllGatherForwardReduceScatterBackward(torch.autograd.Function):
    """Forward: concatenate every rank's chunk along ``dim``. Backward: sum the gradients, keep the own chunk."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class AllGatherForwardSplitBackward(AllGatherForwardReduceScatterBackward):
    """Forward: concatenate every rank's chunk along ``dim`` (as above). Backward: keep the own chunk of the
    gradient, for a gathered tensor every rank uses identically (each rank injects its share once)."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _own_slice(grad, ctx.dim, ctx.group), None, None


class AllToAll(torch.autograd.Function):
    """Forward: split ``scatter_dim`` into one chunk per rank, send chunk ``i`` to rank ``i``, concatenate the
    received chunks along ``gather_dim``. Backward: the same with the two dimensions swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any) -> torch.Tensor:
        ctx.scatter_dim, ctx.gather_dim, ctx.group = scatter_dim, gather_dim, group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(grad, ctx.gather_dim, ctx.scatter_dim, ctx.group), None, None, None


class SwitchSplitForwardSwitchBackBackward(AllToAll):
    """Forward: a tensor whose ranks hold equal chunks along ``from_dim`` (whole along ``to_dim``) comes out whole
    along ``from_dim`` and chunked along ``to_dim`` (rank ``r`` the ``r``-th chunk), in one all-to-all of
    ``(SP-1)/SP`` of the local tensor. Backward: the gradient's split goes from ``to_dim`` back to ``from_dim``
    (:class:`AllToAll`'s inverse, with ``to_dim`` scattered and ``from_dim`` gathered)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, from_dim: int, to_dim: int, group: Any) -> torch.Tensor:
        return AllToAll.forward(ctx, x, to_dim, from_dim, group)


def all_gather_reduce_scatter_grad(x: torch.Tensor, dim: int, group: Any = None) -> torch.Tensor:
    """:class:`AllGatherForwardReduceScatterBackward` (identity on a one-rank group)."""
    return x if group_size(group) == 1 else AllGatherForwardReduceScatterBackward.apply(x, dim, group)


def all_gather_split_grad(x: torch.Tensor, dim: int, group: Any = None) -> torch.Tensor:
    """:class:`AllGatherForwardSplitBackward` (identity on a one-rank group)."""
    return x if group_size(group) == 1 else AllGatherForwardSplitBackward.apply(x, dim, group)


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any = None) -> torch.Tensor:
    """:class:`AllToAll` (identity on a one-rank group)."""
    return x if group_size(group) == 1 else AllToAll.apply(x, scatter_dim, gather_dim, group)


def switch_split(x: torch.Tensor, from_dim: int, to_dim: int, group: Any = None) -> torch.Tensor:
    """:class:`SwitchSplitForwardSwitchBackBackward` (identity on a one-rank group)."""
    return x if group_size(group) == 1 else SwitchSplitForwardSwitchBackBackward.apply(x, from_dim, to_dim, group)


def all_reduce_gradients(parameters: Iterable[torch.nn.Parameter], group: Any = None, op: ReduceOp = "sum") -> None:
    """Sum or average the ``.grad`` of ``parameters`` over ``group`` in place, in one flat all-reduce.

    A parameter without a gradient counts as zeros (it gets one), so every rank sends the same layout.
    """
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
    size = group_size(group)
    params = [p for p in parameters if p.requires_grad]
    if size == 1 or not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    if op == "mean":
        flat /= size
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n
