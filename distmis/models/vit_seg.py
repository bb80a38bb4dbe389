"""A ViT encoder with a convolutional decoder for 3D segmentation (UNETR without skip connections).

The model of *Efficient Distributed Sequence Parallelism for Transformer-based Image Segmentation*
(Lyngaas et al.; docs/references.md), in plain PyTorch. It holds no
distribution logic: :mod:`distmis.parallel.sequence` splits its token sequence between ranks from
outside, through the pieces this module exposes.

Layout and token order
    Inputs are channels-first tiles ``(B, C, H, W, D)``, the axes of the data everywhere in distmis
    (:mod:`distmis.perf.partition`). :class:`PatchEmbedding3D` cuts a tile into non-overlapping ``P x P x P``
    patches (a ``Conv3d`` with ``kernel_size = stride = P``) on a patch grid ``(gh, gw, gd) = (H/P, W/P, D/P)``;
    the ``N = gh * gw * gd`` tokens are ordered row-major, the last axis fastest (the paper's Figure 3 order,
    whose fastest axis it calls Height)::

        token index n = (ih * gw + iw) * gd + id     for the patch at grid coordinates (ih, iw, id)

    :func:`token_coordinates` inverts it.

Pieces, so that an encoder can run on a slice of the sequence
    ``embed(x)`` -> tokens ``(B, n, E)`` of a tile or any sub-volume of it (no positions yet);
    ``encode(tokens, positions)`` adds the 1D position embedding of the tokens' *global* indices
    ``positions`` (learned, as the paper, or fixed sinusoidal, as the perf-model paper), then runs the
    pre-norm transformer blocks and a final LayerNorm; ``decode(tokens, grid)`` reshapes tokens back to a
    ``(B, E, gh, gw, gd)`` grid and runs :class:`ConvDecoder`. ``forward(x)`` composes them for one device.

Attention (``attention``)
    ``full`` (the paper's): each :class:`MultiHeadSelfAttention` computes Q, K and V for its own tokens and
    hands them, shaped ``(B, heads, n, head_dim)``, to its ``core`` module (:class:`SDPAttention`: torch's
    ``scaled_dot_product_attention``, with a fused kernel or, ``attention_kernel="math"``, the unfused one that
    holds the score matrices). Sequence parallelism replaces ``core`` from outside.

    ``axial`` (axial attention, Ho et al., the DSP seed's multi-dimensional transformer): every
    :class:`AxialTransformerBlock` has three attention stages, along H, then W, then D, each with its own
    LayerNorm, QKV and output projection, then the MLP. A stage attends over the lines of the token grid along
    its axis: a token sees the ``g_axis`` tokens that share its other two coordinates. Receptive field: after the
    H stage a token has mixed its H line, after W its (H, W) plane, after D the whole grid, so one block
    already reaches every token of the tile (by a path through other tokens, not by a direct score); the cost
    of the scores falls from ``s^2`` to ``s (gh + gw + gd)`` per head for ``s`` tokens. The stream between
    stages is a grid ``(B, gh, gw, gd, E)`` (the tokens of a box of the patch grid, row-major) and each stage's
    ``core`` (:class:`LineAttention`) takes Q, K and V shaped ``(B, heads, gh, gw, gd, head_dim)``; sequence
    parallelism replaces the cores, or (dynamic sequence parallelism) switches the stream's split between
    stages with forward pre-hooks on the stages, from outside.

Decoder (the paper's Figure 2)
    ``log2(P)`` stages, each a 3x3x3 convolution, instance normalization, ReLU and a x2 trilinear upsampling;
    the first stage maps E to ``decoder_features`` (128) channels, each later one halves them; a final 1x1x1
    convolution projects to the classes (logits). The convolutions run at the token grid's resolution
    before each upsampling, so the first one works on ``(W/P, D/P, H/P)``.
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from distmis.perf.partition import token_grid
from distmis.models.params import ViTSegParams
from distmis.models.registry import NetworkInput

PositionEmbeddingKind = Literal["learned", "sinusoidal"]
POSITION_EMBEDDINGS: tuple[str, ...] = ("learned", "sinusoidal")
AttentionKernel = Literal["fused", "math"]
ATTENTION_KERNELS: tuple[str, ...] = ("fused", "math")
AttentionMode = Literal["full", "axial"]
ATTENTION_MODES: tuple[str, ...] = ("full", "axial")
#: The grid axes an axial block attends along, in order (0 = H, 1 = W, 2 = D); as the spec's partition counts them.
AXIAL_ORDER: tuple[int, int, int] = (0, 1, 2)


def as_triple(value: int | Sequence[int], name: str) -> tuple[int, int, int]:
    """``value`` as three positive ints (an int is repeated); ValueError naming ``name`` otherwise."""
    triple = (value, value, value) if isinstance(value, int) else tuple(value)
    if len(triple) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in triple):
        raise ValueError(f"{name} must be a positive int or three positive ints (H, W, D), got {value!r}")
    return triple  # type: ignore[return-value]


def token_coordinates(indices: torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
    """Grid coordinates ``(n, 3)`` as (ih, iw, id) of the tokens at global ``indices`` on a ``grid`` (gh, gw, gd)."""
    _, gw, gd = grid
    return torch.stack((indices // (gw * gd), (indices // gd) % gw, indices % gd), dim=-1)


def sinusoidal_embedding(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Fixed 1D sin/cos encoding ``(n, dim)`` of integer ``positions``: sin on even, cos on odd features."""
    if dim % 2:
        raise ValueError(f"a sinusoidal position embedding needs an even embed_dim, got {dim}")
    frequencies = torch.exp(
        torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) * (-math.log(10000.0) / dim)
    )
    angles = positions.to(torch.float64)[:, None] * frequencies[None, :]
    table = torch.stack((torch.sin(angles), torch.cos(angles)), dim=-1).reshape(len(positions), dim)
    return table.to(torch.float32)


class PatchEmbedding3D(nn.Module):
    """Non-overlapping ``P^3`` patches of a ``(B, C, H, W, D)`` tile -> tokens ``(B, N, E)``, row-major."""

    def __init__(self, in_channels: int, embed_dim: int, patch: int) -> None:
        super().__init__()
        self.patch = patch
        self.proj = nn.Conv3d(in_channels, embed_dim, kernel_size=patch, stride=patch)

    def grid(self, spatial: Sequence[int]) -> tuple[int, int, int]:
        """The patch grid (gh, gw, gd) of a volume of ``spatial`` size (H, W, D); ValueError if not divisible."""
        return token_grid(spatial, self.patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.grid(x.shape[2:])
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, E, gh, gw, gd) -> (B, N, E), row-major

    def forward_at(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Tokens ``(B, len(indices), E)`` of the patches at global ``indices`` of the tile ``x``, in that order.

        The same convolution as :meth:`forward`, applied to the selected patches only; used when a rank's
        share of the sequence is not a box it could crop.
        """
        batch, channels = x.shape[:2]
        gh, gw, gd = self.grid(x.shape[2:])
        p = self.patch
        patches = x.reshape(batch, channels, gh, p, gw, p, gd, p).permute(0, 2, 4, 6, 1, 3, 5, 7)
        patches = patches.reshape(batch, gh * gw * gd, channels, p, p, p)[:, indices]
        tokens = self.proj(patches.reshape(batch * len(indices), channels, p, p, p))
        return tokens.reshape(batch, len(indices), -1)


class PositionEmbedding1D(nn.Module):
    """A 1D position embedding over ``num_tokens`` positions: a learned table or the fixed sinusoidal one."""

    def __init__(self, num_tokens: int, embed_dim: int, kind: PositionEmbeddingKind = "learned") -> None:
        super().__init__()
        if kind not in POSITION_EMBEDDINGS:
            raise ValueError(f"pos_embedding must be one of {POSITION_EMBEDDINGS}, got {kind!r}")
        if kind == "sinusoidal" and embed_dim % 2:
            raise ValueError(f"pos_embedding 'sinusoidal' needs an even embed_dim, got {embed_dim}")
        self.kind = kind
        self.num_tokens = num_tokens
        self.embed_dim = embed_dim
        self.weight: nn.Parameter | None = None
        if kind == "learned":
            self.weight = nn.Parameter(torch.empty(num_tokens, embed_dim))
            nn.init.trunc_normal_(self.weight, std=0.02)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        """The embeddings ``(len(indices), E)`` of the global token ``indices``."""
        if self.weight is not None:
            return self.weight[indices]
        return sinusoidal_embedding(indices, self.embed_dim).to(device=indices.device)


class SDPAttention(nn.Module):
    """The attention core: ``softmax(Q K^T / sqrt(d)) V`` on ``(B, heads, n, head_dim)`` tensors, via SDPA.

    Keys and values may hold more tokens than the queries (sequence parallelism gathers them). ``kernel``:
    ``fused`` lets torch pick its fastest kernel (flash or memory-efficient attention, whose memory grows
    linearly with the tokens); ``math`` forces the unfused one, which materializes and saves the
    ``(n x n_keys)`` probabilities per head, the setting of the SP-ViT and perf-model papers.
    """

    def __init__(self, dropout: float = 0.0, kernel: AttentionKernel = "fused") -> None:
        super().__init__()
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel must be one of {ATTENTION_KERNELS}, got {kernel!r}")
        self.dropout = dropout
        self.kernel = kernel

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        if self.kernel == "math":
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)


class MultiHeadSelfAttention(nn.Module):
    """Multi-head self-attention over tokens ``(B, n, E)``; the attention itself is the replaceable ``core``."""

    def __init__(self, embed_dim: int, heads: int, dropout: float = 0.0, kernel: AttentionKernel = "fused") -> None:
        super().__init__()
        if embed_dim % heads:
            raise ValueError(f"embed_dim {embed_dim} must be divisible by heads {heads}")
        self.heads = heads
        self.head_dim = embed_dim // heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.core: nn.Module = SDPAttention(dropout, kernel)
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.proj_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, n, embed = x.shape
        q, k, v = self.qkv(x).reshape(batch, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        out = self.core(q, k, v)  # (B, heads, n, head_dim)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(batch, n, embed)))


class MLP(nn.Sequential):
    """Linear -> GELU -> dropout -> Linear -> dropout."""

    def __init__(self, embed_dim: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__(
            nn.Linear(embed_dim, hidden), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(hidden, embed_dim), nn.Dropout(dropout),
        )


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``. Acts on each token but in attention."""

    def __init__(self, embed_dim: int, heads: int, mlp_ratio: float = 4.0, dropout: float = 0.0,
                 kernel: AttentionKernel = "fused") -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(embed_dim)
        self.attn = MultiHeadSelfAttention(embed_dim, heads, dropout, kernel)
        self.norm2 = nn.LayerNorm(embed_dim)
        self.mlp = MLP(embed_dim, int(embed_dim * mlp_ratio), dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class LineAttention(nn.Module):
    """The axial attention core: Q, K, V shaped ``(B, heads, g0, g1, g2, head_dim)`` attend along grid ``axis``.

    Every line of the grid along ``axis`` (the tokens sharing their other two coordinates) is one attention of
    ``g_axis`` queries against that line's keys, computed by ``local`` (an :class:`SDPAttention`, so the
    model's kernel choice holds). Keys and values may be longer along ``axis`` than the queries (a rank holding
    part of each line attends against the whole line); along the other two axes they match the queries.
    """

    def __init__(self, axis: int, local: nn.Module) -> None:
        super().__init__()
        if axis not in (0, 1, 2):
            raise ValueError(f"axis must be 0, 1 or 2 (H, W, D), got {axis!r}")
        self.axis = axis
        self.local = local

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dim = 2 + self.axis
        batch, heads = q.shape[:2]
        moved = q.movedim(dim, -2).shape  # (B, heads, o1, o2, g_axis, head_dim)

        def lines(t: torch.Tensor) -> torch.Tensor:  # -> (B, heads * o1 * o2, g_axis, head_dim)
            t = t.movedim(dim, -2)
            return t.reshape(batch, heads * t.shape[2] * t.shape[3], t.shape[4], t.shape[5])

        out = self.local(lines(q), lines(k), lines(v))
        return out.reshape(moved).movedim(-2, dim)


class AxialSelfAttention(nn.Module):
    """Multi-head self-attention along one ``axis`` of a token grid ``(B, g0, g1, g2, E)``; replaceable ``core``."""

    def __init__(self, embed_dim: int, heads: int, axis: int, dropout: float = 0.0,
                 kernel: AttentionKernel = "fused") -> None:
        super().__init__()
        if embed_dim % heads:
            raise ValueError(f"embed_dim {embed_dim} must be divisible by heads {heads}")
        self.heads = heads
        self.head_dim = embed_dim // heads
        self.axis = axis
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.core: nn.Module = LineAttention(axis, SDPAttention(dropout, kernel))
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.proj_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        *grid_shape, embed = x.shape  # (B, g0, g1, g2, E)
        qkv = self.qkv(x).reshape(*grid_shape, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(4, 0, 5, 1, 2, 3, 6).unbind(0)  # each (B, heads, g0, g1, g2, head_dim)
        out = self.core(q, k, v)
        return self.proj_drop(self.proj(out.permute(0, 2, 3, 4, 1, 5).reshape(*grid_shape, embed)))


class PreNormResidual(nn.Module):
    """``x + fn(norm(x))``: one stage of an axial block (its input is the residual stream)."""

    def __init__(self, embed_dim: int, fn: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(embed_dim)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fn(self.norm(x))


class AxialTransformerBlock(nn.Module):
    """Pre-norm axial block on a token grid ``(B, g0, g1, g2, E)``: attention along H, then W, then D (each
    its own norm, QKV and projection, residual around each), then the MLP. Acts on each token but in attention.

    ``axial[i]`` is the stage attending along ``AXIAL_ORDER[i]``; ``ffn`` the MLP's. Sequence parallelism may
    change the layout of a stage's input with a forward pre-hook (dynamic sequence parallelism).
    """

    def __init__(self, embed_dim: int, heads: int, mlp_ratio: float = 4.0, dropout: float = 0.0,
                 kernel: AttentionKernel = "fused") -> None:
        super().__init__()
        self.axial = nn.ModuleList(PreNormResidual(embed_dim, AxialSelfAttention(embed_dim, heads, axis, dropout,
                                                                                 kernel))
                                   for axis in AXIAL_ORDER)
        self.ffn = PreNormResidual(embed_dim, MLP(embed_dim, int(embed_dim * mlp_ratio), dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.axial:
            x = stage(x)
        return self.ffn(x)


class DecoderStage(nn.Sequential):
    """3x3x3 convolution -> instance norm -> ReLU -> x2 trilinear upsampling."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(
            nn.Conv3d(in_channels, out_channels, kernel_size=3, padding=1),
            nn.InstanceNorm3d(out_channels, affine=True),
            nn.ReLU(inplace=True),
            nn.Upsample(scale_factor=2, mode="trilinear", align_corners=False),
        )


class ConvDecoder(nn.Module):
    """Features ``(B, E, gh, gw, gd)`` -> logits ``(B, classes, gh*P, gw*P, gd*P)``: ``log2(P)`` x2 stages.

    Stage ``i`` has ``features // 2**i`` channels; a final 1x1x1 convolution maps to ``num_classes``.
    """

    def __init__(self, embed_dim: int, num_classes: int, patch: int, features: int = 128) -> None:
        super().__init__()
        if patch < 1 or patch & (patch - 1):
            raise ValueError(
                f"patch must be a power of two so the decoder's x2 upsamplings reach the tile, got {patch}"
            )
        steps = patch.bit_length() - 1
        if steps and features < 2 ** (steps - 1):
            raise ValueError(
                f"decoder_features {features} must be at least {2 ** (steps - 1)} "
                f"to halve {steps - 1} times for patch {patch}"
            )
        channels = [embed_dim] + [features // 2**i for i in range(steps)]
        self.stages = nn.Sequential(*(DecoderStage(a, b) for a, b in zip(channels[:-1], channels[1:])))
        self.head = nn.Conv3d(channels[-1], num_classes, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(x))


class ViTSeg(nn.Module):
    """ViT encoder + convolutional decoder: ``(B, C, H, W, D)`` tiles -> ``(B, classes, H, W, D)`` logits.

    Defaults are the paper's: (layers, embed_dim, heads) = (12, 768, 12), patch 16 (tile 96^3 in the paper).
    ``attention``: ``full`` (the paper's blocks) or ``axial`` (:class:`AxialTransformerBlock`). ``tile`` is one
    int or (H, W, D). The learned position embedding is sized for the tile's ``N`` tokens, so
    the model takes tiles of exactly that size (use :func:`distmis.train.inference.sliding_window`
    for larger volumes).
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        tile: int | Sequence[int],
        patch: int = 16,
        layers: int = 12,
        embed_dim: int = 768,
        heads: int = 12,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        pos_embedding: PositionEmbeddingKind = "learned",
        decoder_features: int = 128,
        attention_kernel: AttentionKernel = "fused",
        attention: AttentionMode = "full",
    ) -> None:
        super().__init__()
        for name, value in (("in_channels", in_channels), ("num_classes", num_classes), ("layers", layers),
                            ("embed_dim", embed_dim), ("heads", heads), ("patch", patch),
                            ("decoder_features", decoder_features)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.tile = as_triple(tile, "tile")
        if patch & (patch - 1):
            raise ValueError(
                f"patch must be a power of two (1, 2, 4, 8, 16, ...) so the decoder's x2 upsamplings "
                f"reach the tile, got {patch}"
            )
        token_grid(self.tile, patch)  # ValueError naming the axes the patch does not divide
        if embed_dim % heads:
            raise ValueError(f"embed_dim {embed_dim} must be divisible by heads {heads}")
        if not mlp_ratio > 0:
            raise ValueError(f"mlp_ratio must be positive, got {mlp_ratio!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must lie in [0, 1), got {dropout!r}")
        if pos_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(f"pos_embedding must be one of {POSITION_EMBEDDINGS}, got {pos_embedding!r}")
        if attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel must be one of {ATTENTION_KERNELS}, got {attention_kernel!r}")
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")

        self.in_channels, self.num_classes = in_channels, num_classes
        self.patch, self.embed_dim, self.heads = patch, embed_dim, heads
        self.grid: tuple[int, int, int] = tuple(s // patch for s in self.tile)  # type: ignore[assignment]
        self.num_tokens = math.prod(self.grid)

        self.patch_embed = PatchEmbedding3D(in_channels, embed_dim, patch)
        self.pos_embed = PositionEmbedding1D(self.num_tokens, embed_dim, pos_embedding)
        self.pos_drop = nn.Dropout(dropout)
        self.attention_kernel = attention_kernel
        self.attention = attention
        block = AxialTransformerBlock if attention == "axial" else TransformerBlock
        self.blocks = nn.ModuleList(block(embed_dim, heads, mlp_ratio, dropout, attention_kernel)
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(embed_dim)
        self.decoder = ConvDecoder(embed_dim, num_classes, patch, decoder_features)
        self.apply(_init_linear)

    # ---------------------------------------------------------------- pieces
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens ``(B, n, E)`` of a tile or a sub-volume of one, in its own row-major order; no positions."""
        return self.patch_embed(x)

    def position_embedding(self, indices: torch.Tensor) -> torch.Tensor:
        """The position embeddings ``(len(indices), E)`` of the global token ``indices``."""
        return self.pos_embed(indices)

    def encode(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
               grid: Sequence[int] | None = None) -> torch.Tensor:
        """Add the embeddings of the tokens' global ``positions`` (default ``0..n-1``), run the blocks and norm.

        ``grid``: the box of the patch grid that the tokens fill, row-major (default the tile's grid); axial
        attention needs it, full attention ignores it. Returns tokens ``(B, n, E)`` row-major over the box the
        last block's output fills: the input's, unless a sequence-parallel layout switches it between stages.
        """
        batch, n, embed = tokens.shape
        if positions is None:
            positions = torch.arange(n, device=tokens.device)
        if positions.shape != (n,):
            raise ValueError(f"positions must hold one index per token ({n}), got shape {tuple(positions.shape)}")
        x = self.pos_drop(tokens + self.position_embedding(positions).to(tokens.dtype))
        if self.attention == "axial":
            grid = tuple(self.grid if grid is None else grid)
            if len(grid) != 3 or math.prod(grid) != n:
                raise ValueError(f"axial attention needs the grid box the {n} tokens fill; grid {grid} holds "
                                 f"{math.prod(grid)}")
            x = x.reshape(batch, *grid, embed)
        for block in self.blocks:
            x = block(x)
        return self.norm(x).reshape(batch, -1, embed)

    def decode(self, tokens: torch.Tensor, grid: Sequence[int] | None = None) -> torch.Tensor:
        """Logits of tokens ``(B, n, E)`` laid out row-major on ``grid`` (default the tile's patch grid)."""
        grid = tuple(self.grid if grid is None else grid)
        batch, n, embed = tokens.shape
        if len(grid) != 3 or math.prod(grid) != n:
            raise ValueError(f"grid {grid} does not hold the {n} tokens to decode")
        return self.decoder(tokens.transpose(1, 2).reshape(batch, embed, *grid))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 5 or tuple(x.shape[2:]) != self.tile or x.shape[1] != self.in_channels:
            raise ValueError(
                f"input must be (B, {self.in_channels}, {', '.join(map(str, self.tile))}) (B, C, H, W, D), "
                f"got {tuple(x.shape)}"
            )
        return self.decode(self.encode(self.embed(x)))


def _init_linear(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def build_vit_seg(params: ViTSegParams, network: NetworkInput) -> ViTSeg:
    """The registry's builder (:mod:`distmis.models.registry`): ``model.params`` by name, built for the network
    input's tile; it returns logits."""
    return ViTSeg(network.in_channels, network.out_channels, network.tile, **params.model_dump())
