"""Sequence parallelism for :class:`~distmis.models.vit_seg.ViTSeg`, applied from outside (torchtitan style).

The ranks of one sequence-parallel (SP) group all hold the same tile and split its ``N`` tokens between them
(Lyngaas et al., docs/references.md). :func:`parallelize_vit_seg` swaps the
attention core of every transformer block of a plain model for a parallel one and wraps the model in a
:class:`SequenceParallelViTSeg`, whose ``forward(tile)`` runs the rank's share.

Splitting (``split``; the arithmetic is :mod:`distmis.perf.partition`, which the spec checks with too)
    ``ordered``: rank ``r`` takes tokens ``[r N/SP, (r+1) N/SP)`` of the row-major token order.
    ``spatial``: rank ``r`` takes a sub-volume of the patch grid (the paper's Figure 4): SP=2 halves the first
    axis (H), SP=4 H and W, SP=8 all three; ranks are numbered over the parts row-major.
    Each rank embeds its tokens (cropping its sub-volume when its share is a box, selecting patches
    otherwise) and adds the position embedding of their *global* indices.

Attention (``attention``)
    ``allgather-kv`` (the paper's): queries stay local; keys and values are all-gathered
    (:class:`~distmis.parallel.collectives.AllGatherForwardReduceScatterBackward`, one collective for K and V
    together); the backward reduce-scatters their gradients to the ranks that own them. The gathered keys come
    in rank order, not token order: attention without a mask does not depend on the order of the keys.
    ``ulysses``: Q, K and V go from sequence-split to head-split by one all-to-all, each rank attends over the
    whole sequence with ``heads / SP`` heads, and one all-to-all brings the output back to sequence-split
    (heads must divide by SP). Both run the model's own local core (``scaled_dot_product_attention``).

Decoder input (``decoder``) and gradients
    Every rank calls ``backward`` on its own loss; the collectives' backwards route each rank's share of the
    gradient to where it came from, so after ``backward`` the gradient of every encoder parameter on a rank is
    its *partial sum* (the contribution through that rank's tokens). :func:`sync_sp_gradients` completes them:

    ``gather`` (exact): the encoder outputs are all-gathered
    (:class:`~distmis.parallel.collectives.AllGatherForwardSplitBackward`) and every rank decodes the whole
    tile and computes the same loss ``L`` as one device would. The split backward hands each rank
    ``dL/d(own tokens)`` once, so the encoder gradients *sum* over the SP group to SP=1's gradient. The decoder
    gradients are replicas of SP=1's on every rank: they are averaged (a no-op in exact arithmetic that keeps
    the replicas bitwise identical when GPU kernels are not deterministic). Loss, gradients and an optimizer
    step equal SP=1's up to floating-point summation order.

    ``no-gather`` (the paper's cheaper variant, not equal to SP=1): no gather; each rank decodes its own
    sub-volume (so it needs a split whose chunks are boxes) with its own copy of the decoder, seeing only its
    tokens' features (attention still saw the whole tile) and zero padding at the sub-volume's borders, and
    computes the loss ``l_r`` on its part of the label (``local_target``). The objective is the mean of the
    ``l_r`` (for a voxel-mean loss, the loss of the whole tile with per-part decoding); every gradient is
    *averaged* over the SP group, as the paper describes. Instance normalization in the decoder uses each
    part's statistics.

    With data parallelism on top, :func:`sync_gradients` then averages all gradients over the DP group. Do not
    wrap the parallel model in a DDP over all DP x SP ranks: it would average the encoder's partial sums.

Axial models (``model.params.attention: axial``)
    An axial model's stream is a grid ``(B, b0, b1, b2, E)`` of the rank's box of the patch grid, so every
    rank's share must be a box (:func:`distmis.perf.partition.check_sequence_parallel` says so). Three ways:

    ``dsp`` (dynamic sequence parallelism, the DSP seed): the tokens are split in slabs along one grid axis, and
    a stage that attends along another axis attends over whole lines the rank holds, with no communication.
    Before a stage that attends along the split axis, a forward pre-hook on the stage
    (:class:`SplitSwitch`: :class:`~distmis.parallel.collectives.SwitchSplitForwardSwitchBackBackward`, one
    all-to-all of the stream) moves the split to the axis attended along farthest ahead
    (:func:`~distmis.perf.partition.dsp_schedule`); its backward moves the gradient's split back. The MLP and
    norms act on each token. The encoder's output is split along the schedule's last axis
    (:attr:`SequenceParallelViTSeg.output_chunks`), which ``gather`` all-gathers and ``no-gather`` decodes.
    ``split`` does not apply. Per block of three stages, one forward and one backward all-to-all of the
    activation per two stages, against Ulysses' four and four per stage.

    ``ulysses`` and ``allgather-kv`` (the seed's baselines): each stage's core is replaced as for full attention,
    the all-to-all (or the all-gather of K and V) running at every stage; the rank then attends over whole
    lines of the grid (Ulysses: all of them for ``heads/SP`` heads; allgather-kv: the lines through its box).

Dropout draws different masks than one device would; exactness holds with ``dropout=0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from distmis.models.vit_seg import AxialSelfAttention, LineAttention, MultiHeadSelfAttention, ViTSeg
from distmis.parallel.collectives import (
    all_gather_reduce_scatter_grad,
    all_gather_split_grad,
    all_reduce_gradients,
    all_to_all,
    group_rank,
    group_size,
    switch_split,
)
from distmis.parallel.mesh import TrialMesh
from distmis.perf.partition import (
    AXES,
    AttentionKind,
    DecoderKind,
    DSPSchedule,
    ModelAttention,
    SplitKind,
    TokenShare,
    dsp_schedule,
)
from distmis.perf.partition import check_sequence_parallel

@dataclass(frozen=True)
class TokenChunk:
    """One rank's share of a tile's tokens: global ``indices`` in the rank's order, and its ``box`` of the
    patch grid (slices along H, W, D) when the tokens fill one, listed row-major (last axis fastest)."""

    indices: torch.Tensor
    box: tuple[slice, slice, slice] | None

    @property
    def grid(self) -> tuple[int, int, int] | None:
        """The box's shape in patches, or ``None``."""
        return None if self.box is None else tuple(s.stop - s.start for s in self.box)  # type: ignore[return-value]

    def voxel_box(self, patch: int) -> tuple[slice, slice, slice]:
        """The box in voxels of the tile; ValueError if the chunk is not a box."""
        if self.box is None:
            raise ValueError("this rank's tokens do not form a box of the tile")
        return tuple(slice(s.start * patch, s.stop * patch) for s in self.box)  # type: ignore[return-value]


def box_indices(box: Sequence[slice], grid: Sequence[int]) -> torch.Tensor:
    """Global token indices of a ``box`` of the patch ``grid``, row-major (last axis fastest)."""
    i0, i1, i2 = (torch.arange(s.start, s.stop) for s in box)
    _, g1, g2 = grid
    return ((i0[:, None, None] * g1 + i1[None, :, None]) * g2 + i2[None, None, :]).reshape(-1)


def token_chunk(share: TokenShare, grid: Sequence[int]) -> TokenChunk:
    """The torch form of a rank's :class:`~distmis.perf.partition.TokenShare`."""
    box = None if share.box is None else tuple(slice(a, b) for a, b in share.box)
    if share.start is not None:
        indices = torch.arange(share.start, share.stop)
    else:
        indices = box_indices(box, grid)  # type: ignore[arg-type]
    return TokenChunk(indices, box)  # type: ignore[arg-type]


def sequence_chunks(
    grid: Sequence[int],
    heads: int,
    sp_size: int,
    *,
    attention: AttentionKind = "allgather-kv",
    decoder: DecoderKind = "gather",
    split: SplitKind = "ordered",
    model_attention: ModelAttention = "full",
) -> list[TokenChunk]:
    """Every rank's chunk of the tokens, once the SP configuration is checked
    (:func:`distmis.perf.partition.check_sequence_parallel`, which raises a ValueError naming what does not fit)."""
    shares = check_sequence_parallel(grid, heads, sp_size, attention=attention, decoder=decoder, split=split,
                          model_attention=model_attention)
    return [token_chunk(share, grid) for share in shares]


def rank_order(chunks: Sequence[TokenChunk]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(to_rank, to_token)``: index tensors that reorder a whole sequence from token order to the order of the
    ranks' chunks concatenated (what a gather or an all-to-all yields), and back; ``(None, None)`` when the two
    orders are one."""
    order = torch.cat([c.indices for c in chunks])
    if torch.equal(order, torch.arange(len(order))):
        return None, None
    return order, torch.argsort(order)


class AllGatherKVAttention(nn.Module):
    """Local queries against the whole sequence's keys and values, all-gathered (K and V in one collective)."""

    def __init__(self, local: nn.Module, group: Any) -> None:
        super().__init__()
        self.local = local
        self.group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = all_gather_reduce_scatter_grad(torch.stack((k, v)), 3, self.group)  # (2, B, heads, N, head_dim)
        return self.local(q, kv[0], kv[1])


class UlyssesAttention(nn.Module):
    """All-to-all to head-split (``heads/SP`` heads, whole sequence), local attention, all-to-all back."""

    def __init__(self, local: nn.Module, group: Any) -> None:
        super().__init__()
        self.local = local
        self.group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qkv = all_to_all(torch.stack((q, k, v)), 2, 3, self.group)  # (3, B, heads/SP, N, head_dim)
        out = self.local(qkv[0], qkv[1], qkv[2])
        return all_to_all(out, 2, 1, self.group)  # (B, heads, n, head_dim)


class _AxialCore(nn.Module):
    """What both axial baselines share: the model's own :class:`LineAttention` (``local``), the SP group, the
    whole patch grid, the rank's box, and the reorderings between token order and the ranks' order."""

    def __init__(self, local: LineAttention, group: Any, grid: Sequence[int], chunks: Sequence[TokenChunk],
                 rank: int) -> None:
        super().__init__()
        if chunks[rank].box is None:
            raise ValueError("axial attention under sequence parallelism needs every rank's tokens to form a box")
        self.local = local
        self.group = group
        self.grid = tuple(grid)
        self.box = chunks[rank].box
        to_rank, to_token = rank_order(chunks)
        self.register_buffer("to_rank", to_rank, persistent=False)
        self.register_buffer("to_token", to_token, persistent=False)

    def in_token_order(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """A whole sequence along ``dim``, received in the ranks' order, as the grid ``(..., g0, g1, g2, ...)``."""
        if self.to_token is not None:
            x = x.index_select(dim, self.to_token)
        return x.unflatten(dim, self.grid)


class UlyssesAxialAttention(_AxialCore):
    """Ulysses on an axial stage: Q, K, V of the rank's box to ``heads/SP`` heads of the whole grid (one
    all-to-all), attention along the stage's axis, the output back to the rank's box (one all-to-all)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        box = q.shape[2:5]
        qkv = all_to_all(torch.stack((q, k, v)).flatten(3, 5), 2, 3, self.group)  # (3, B, heads/SP, N, head_dim)
        qkv = self.in_token_order(qkv, 3)
        out = self.local(qkv[0], qkv[1], qkv[2]).flatten(2, 4)  # (B, heads/SP, N, head_dim)
        if self.to_rank is not None:
            out = out.index_select(2, self.to_rank)
        return all_to_all(out, 2, 1, self.group).unflatten(2, box)  # (B, heads, b0, b1, b2, head_dim)


class AllGatherKVAxialAttention(_AxialCore):
    """allgather-kv on an axial stage: K and V of the whole grid all-gathered (one collective, as for full
    attention); the rank's queries attend along the stage's axis against the lines through its box."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = all_gather_reduce_scatter_grad(torch.stack((k, v)).flatten(3, 5), 3, self.group)  # (2, B, heads, N, hd)
        kv = self.in_token_order(kv, 3)  # (2, B, heads, g0, g1, g2, head_dim)
        lines = tuple(slice(None) if a == self.local.axis else self.box[a] for a in range(3))
        kv = kv[(slice(None),) * 3 + lines]
        return self.local(q, kv[0], kv[1])


class SplitSwitch:
    """DSP's dynamic switch as a forward pre-hook on an axial stage: the stream ``(B, b0, b1, b2, E)`` entering
    the stage goes from slabs along grid axis ``from_axis`` to slabs along ``to_axis`` (one all-to-all; its
    backward switches the gradient back)."""

    def __init__(self, from_axis: int, to_axis: int, group: Any) -> None:
        self.from_axis, self.to_axis, self.group = from_axis, to_axis, group

    def __call__(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (switch_split(args[0], 1 + self.from_axis, 1 + self.to_axis, self.group),) + tuple(args[1:])

    def __repr__(self) -> str:
        return f"SplitSwitch({AXES[self.from_axis]} -> {AXES[self.to_axis]})"


class SequenceParallelViTSeg(nn.Module):
    """A :class:`ViTSeg` run on one rank's share of the tokens; made by :func:`parallelize_vit_seg`.

    ``forward(tile)`` takes the whole tile ``(B, C, H, W, D)`` (every rank of the group the same one) and
    returns the logits of the whole tile (``gather``) or of the rank's sub-volume (``no-gather``); compute
    the loss against :meth:`local_target` of the labels, then call :func:`sync_sp_gradients`.

    ``chunks`` are every rank's tokens entering the encoder, ``output_chunks`` leaving it (the same but under
    ``dsp``, whose ``schedule`` may end on another axis); ``switches`` lists DSP's hooks as
    ``(block, stage, SplitSwitch)``.
    """

    def __init__(
        self, model: ViTSeg, sp_group: Any, chunks: list[TokenChunk], *,
        attention: AttentionKind, decoder: DecoderKind, split: SplitKind,
        output_chunks: list[TokenChunk] | None = None, schedule: DSPSchedule | None = None,
        switches: Sequence[tuple[int, int, SplitSwitch]] = (),
    ) -> None:
        super().__init__()
        self.model = model
        self.sp_group = sp_group
        self.sp_size = group_size(sp_group)
        self.sp_rank = group_rank(sp_group)
        self.attention, self.decoder, self.split = attention, decoder, split
        self.schedule = schedule
        self.switches = list(switches)
        self.chunks = chunks
        self.chunk = chunks[self.sp_rank]
        self.output_chunks = chunks if output_chunks is None else output_chunks
        self.output_chunk = self.output_chunks[self.sp_rank]
        device = next(model.parameters()).device
        self.register_buffer("indices", self.chunk.indices.to(device), persistent=False)
        _, restore = rank_order(self.output_chunks)
        self.register_buffer("gather_order", None if restore is None else restore.to(device), persistent=False)

    def region(self) -> tuple[slice, slice, slice]:
        """The voxels of the tile this rank's logits cover."""
        if self.decoder == "gather":
            return (slice(None), slice(None), slice(None))
        return self.output_chunk.voxel_box(self.model.patch)

    def local_target(self, target: torch.Tensor) -> torch.Tensor:
        """The part of a ``(B, ..., H, W, D)`` label tensor that this rank's logits predict."""
        return target[(Ellipsis,) + self.region()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model = self.model
        if x.dim() != 5 or tuple(x.shape[2:]) != model.tile:
            raise ValueError(
                f"input must be a whole tile (B, C, {', '.join(map(str, model.tile))}), got {tuple(x.shape)}"
            )
        if self.chunk.box is not None:
            tokens = model.embed(x[(Ellipsis,) + self.chunk.voxel_box(model.patch)])
        else:
            tokens = model.patch_embed.forward_at(x, self.indices)
        tokens = model.encode(tokens, self.indices, self.chunk.grid)  # (B, n, E) of the output chunk
        if self.decoder == "no-gather":
            return model.decode(tokens, self.output_chunk.grid)
        tokens = all_gather_split_grad(tokens, 1, self.sp_group)  # (B, N, E) in rank order
        if self.gather_order is not None:
            tokens = tokens.index_select(1, self.gather_order)  # back to token order
        return model.decode(tokens)


def parallelize_vit_seg(
    model: ViTSeg,
    sp_group: Any = None,
    *,
    attention: AttentionKind = "allgather-kv",
    decoder: DecoderKind = "gather",
    split: SplitKind = "ordered",
) -> SequenceParallelViTSeg:
    """Apply sequence parallelism over ``sp_group`` to a plain ``model``, in place; return the parallel module.

    Every attention core of ``model`` is replaced, or (``dsp``) its axial stages get the switches' hooks: the
    model alone no longer runs on one device, so parallelize a copy if the plain model is still needed. All
    ranks of the group must pass models with the same weights (same seed, or a broadcast).
    """
    if not isinstance(model, ViTSeg):
        raise TypeError(f"parallelize_vit_seg takes a ViTSeg, got {type(model).__name__}")
    if _is_parallelized(model):
        raise ValueError("the model is already parallelized")
    size, rank = group_size(sp_group), group_rank(sp_group)
    chunks = sequence_chunks(model.grid, model.heads, size, attention=attention, decoder=decoder,
                                     split=split, model_attention=model.attention)  # type: ignore[arg-type]
    if attention == "dsp":
        schedule = dsp_schedule(model.grid, size, len(model.blocks))
        output = [token_chunk(share, model.grid) for share in schedule.shares(schedule.last)]
        switches = []
        for i in schedule.switch_stages if size > 1 else ():
            switch = SplitSwitch(schedule.splits[i - 1], schedule.splits[i], sp_group)
            model.blocks[i // 3].axial[i % 3].register_forward_pre_hook(switch)
            switches.append((i // 3, i % 3, switch))
        return SequenceParallelViTSeg(model, sp_group, chunks, attention=attention, decoder=decoder, split=split,
                                      output_chunks=output, schedule=schedule, switches=switches)
    for module in model.modules():
        if isinstance(module, MultiHeadSelfAttention):
            wrapper = {"allgather-kv": AllGatherKVAttention, "ulysses": UlyssesAttention}[attention]
            module.core = wrapper(module.core, sp_group)
        elif isinstance(module, AxialSelfAttention):  # its token reorderings live where the model does
            axial = {"allgather-kv": AllGatherKVAxialAttention, "ulysses": UlyssesAxialAttention}[attention]
            module.core = axial(module.core, sp_group, model.grid, chunks, rank).to(module.qkv.weight.device)
    return SequenceParallelViTSeg(model, sp_group, chunks, attention=attention, decoder=decoder, split=split)


_PARALLEL_CORES = (AllGatherKVAttention, UlyssesAttention, AllGatherKVAxialAttention, UlyssesAxialAttention)


def _is_parallelized(model: ViTSeg) -> bool:
    """Whether an attention core was replaced, or a stage holds a DSP switch."""
    return any(isinstance(getattr(m, "core", None), _PARALLEL_CORES)
               or any(isinstance(hook, SplitSwitch) for hook in m._forward_pre_hooks.values())
               for m in model.modules())


def sync_sp_gradients(model: SequenceParallelViTSeg) -> None:
    """Turn every rank's gradients into the group's (see the module docstring), in one all-reduce.

    ``gather``: encoder gradients summed, decoder gradients averaged. ``no-gather``: all averaged.
    """
    group, size = model.sp_group, model.sp_size
    if size == 1:
        return
    if model.decoder == "no-gather":
        all_reduce_gradients(model.parameters(), group, "mean")
        return
    for p in model.model.decoder.parameters():
        if p.grad is not None:
            p.grad.div_(size)
    all_reduce_gradients(model.parameters(), group, "sum")


def sync_gradients(model: nn.Module, mesh: TrialMesh) -> None:
    """Gradients of a DP x SP step: :func:`sync_sp_gradients` (for a parallel model), then the mean over the
    mesh's DP group."""
    if isinstance(model, SequenceParallelViTSeg):
        sync_sp_gradients(model)
    if mesh.dp_size > 1:
        all_reduce_gradients(model.parameters(), mesh.dp_group, "mean")
