"""The performance model of a ViT-seg trial (issue 14), part one: parameters and FLOPs per rank. Pure arithmetic.

The seed (``../shared/seeds/perf-model-3d-vit.txt``, Sastry and Ku) counts, for a 3D ViT with ``s = HWD/p^3``
tokens of width ``d`` under sequence parallelism of degree ``SP``, the forward multiply-accumulates of one
transformer block and one sample (its equations 4-20)::

    QKV 3sd^2/SP + Q K^T s^2 d/SP + softmax s^2 + (softmax) V s^2 d/SP + projection sd^2/SP + MLP 8sd^2/SP

and the backward as about twice the forward. This module counts what the real model
(:class:`~distmis.models.vit_seg.ViTSeg`) runs, per rank, in FLOPs (2 per multiply-accumulate, as
``torch.utils.flop_counter.FlopCounterMode`` counts them), and adds what the seed leaves out:

- the patch embedding, a ``p^3`` convolution from the input channels to ``d`` (the seed starts at the tokens);
- an MLP of ``mlp_ratio x d`` hidden features (the seed's 4);
- the convolutional decoder: ``log2(p)`` stages of a 3x3x3 convolution at the token grid's resolution doubled
  each stage, then a 1x1x1 head; under ``gather`` every rank decodes the whole tile, under ``no-gather`` its
  ``1/SP`` sub-volume;
- the backward exactly: twice the forward for every matmul and convolution (input and weight gradients), but
  the patch embedding's, whose input needs no gradient (once);
- how the sequence is shared: a rank computes Q, K, V, the projection and the MLP for its ``s/SP`` tokens, and
  attention scores of ``s/SP`` queries against all ``s`` keys (``allgather-kv``) or of all ``s`` queries for
  ``heads/SP`` heads (``ulysses``): the same ``2 s^2 d / SP`` multiply-accumulates either way.

Softmax, norms, activations, residual additions and upsampling are elementwise and not counted in
:attr:`FlopCount.matmul` (nor by ``FlopCounterMode``); the softmax's ``s^2`` per head is reported apart as
:attr:`FlopCount.softmax`. On CPU, ``FlopCounterMode`` does not count torch's fused attention kernel
(``_scaled_dot_product_flash_attention_for_cpu``): its attention matmuls are those of the math kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

__all__ = [
    "ViTShape", "SequenceLayout", "FlopCount", "CommBytes", "MemoryEstimate", "vit_flops", "vit_parameters",
    "communication_bytes", "vit_memory", "seed_block_macs", "figure_of_merit", "seed_table2",
]

AttentionKind = Literal["allgather-kv", "ulysses"]
DecoderKind = Literal["gather", "no-gather"]


@dataclass(frozen=True)
class ViTShape:
    """What the model's arithmetic depends on: a ViT-seg on ``tile`` volumes of ``in_channels`` channels."""

    tile: tuple[int, int, int]
    patch: int
    layers: int
    embed_dim: int
    heads: int
    mlp_ratio: float = 4.0
    decoder_features: int = 128
    in_channels: int = 4
    num_classes: int = 3

    def __post_init__(self) -> None:
        if len(self.tile) != 3 or any(t % self.patch for t in self.tile):
            raise ValueError(f"tile {list(self.tile)} must be 3 sizes that divide by the patch {self.patch}")
        if self.patch < 1 or self.patch & (self.patch - 1):
            raise ValueError(f"patch must be a power of two, got {self.patch}")
        if self.embed_dim % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide embed_dim ({self.embed_dim})")

    @classmethod
    def of(cls, params: object, tile: Sequence[int], *, in_channels: int = 4, num_classes: int = 3) -> ViTShape:
        """From a spec's ``model.params`` (:class:`~distmis.spec.schema.ViTSegParams`) and the trial's tile."""
        return cls(tile=tuple(int(t) for t in tile), patch=params.patch, layers=params.layers,  # type: ignore[attr-defined]
                   embed_dim=params.embed_dim, heads=params.heads, mlp_ratio=params.mlp_ratio,  # type: ignore[attr-defined]
                   decoder_features=params.decoder_features, in_channels=in_channels,  # type: ignore[attr-defined]
                   num_classes=num_classes)

    @property
    def grid(self) -> tuple[int, int, int]:
        return tuple(t // self.patch for t in self.tile)  # type: ignore[return-value]

    @property
    def tokens(self) -> int:
        """``s = HWD / p^3``."""
        return math.prod(self.grid)

    @property
    def hidden(self) -> int:
        """The MLP's hidden features (as the model rounds them)."""
        return int(self.embed_dim * self.mlp_ratio)

    @property
    def decoder_channels(self) -> list[int]:
        """Channels into each decoder stage, then out of the last: ``[d, f, f/2, ...]``."""
        steps = self.patch.bit_length() - 1
        return [self.embed_dim] + [self.decoder_features // 2**i for i in range(steps)]


@dataclass(frozen=True)
class SequenceLayout:
    """How one trial's ranks share the work that matters here: the SP degree, attention and decoder input."""

    sp: int = 1
    attention: AttentionKind = "allgather-kv"
    decoder: DecoderKind = "gather"

    def __post_init__(self) -> None:
        if self.sp < 1:
            raise ValueError(f"sp must be >= 1, got {self.sp}")


@dataclass(frozen=True)
class FlopCount:
    """FLOPs (2 per multiply-accumulate) of one training step of one rank, by part."""

    embed_forward: float
    encoder_forward: float  # the transformer blocks
    decoder_forward: float
    softmax: float  # exponentials of the attention scores, forward; not in matmul

    @property
    def forward(self) -> float:
        return self.embed_forward + self.encoder_forward + self.decoder_forward

    @property
    def backward(self) -> float:
        """Input and weight gradients of every matmul and convolution, the patch embedding's weights only."""
        return 2.0 * self.forward - self.embed_forward

    @property
    def matmul(self) -> float:
        """Forward and backward: what ``FlopCounterMode`` counts (with the math attention kernel)."""
        return self.forward + self.backward


def vit_flops(shape: ViTShape, layout: SequenceLayout = SequenceLayout(), batch: int = 1) -> FlopCount:
    """Per-rank FLOPs of one training step on ``batch`` tiles per rank (see the module docstring)."""
    s, d, sp = shape.tokens, shape.embed_dim, layout.sp
    if s % sp:
        raise ValueError(f"the {s} tokens of tile {list(shape.tile)} at patch {shape.patch} do not divide by SP={sp}")
    local = s // sp
    embed = 2.0 * local * d * shape.in_channels * shape.patch**3
    projections = 2.0 * local * d * (3 * d + d + 2 * shape.hidden)  # QKV, output projection, MLP
    attention = 2.0 * 2 * local * s * d  # Q K^T and (softmax) V: s/SP queries (or heads/SP heads) x s keys
    decoder = _decoder_flops(shape) / (sp if layout.decoder == "no-gather" else 1)
    return FlopCount(embed_forward=batch * embed, encoder_forward=batch * shape.layers * (projections + attention),
                     decoder_forward=batch * decoder, softmax=batch * shape.layers * shape.heads * local * s)


def _decoder_flops(shape: ViTShape) -> float:
    voxels = shape.tokens
    channels = shape.decoder_channels
    total = 0.0
    for c_in, c_out in zip(channels[:-1], channels[1:]):
        total += 2.0 * voxels * 27 * c_in * c_out  # a 3x3x3 convolution at this stage's resolution
        voxels *= 8  # x2 trilinear upsampling
    return total + 2.0 * voxels * channels[-1] * shape.num_classes  # the 1x1x1 head


def vit_parameters(shape: ViTShape, *, learned_positions: bool = True) -> int:
    """Trainable parameters of the model (``psi``): the seed's ``12 L d^2`` plus biases, norms, the patch
    embedding, the position table and the decoder."""
    d, h = shape.embed_dim, shape.hidden
    block = (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d) + 2 * 2 * d  # QKV, proj, MLP, 2 norms
    embed = d * shape.in_channels * shape.patch**3 + d + (shape.tokens * d if learned_positions else 0)
    channels = shape.decoder_channels
    decoder = sum(27 * a * b + b + 2 * b for a, b in zip(channels[:-1], channels[1:]))  # conv, bias, norm affine
    decoder += channels[-1] * shape.num_classes + shape.num_classes
    return shape.layers * block + embed + 2 * d + decoder  # + the final norm


def seed_block_macs(tokens: int, embed_dim: int, sp: int = 1) -> float:
    """The seed's forward count of one block and sample, equation 20: ``(12 s d^2 + 2 s^2 d) / SP``
    multiply-accumulates (its softmax ``s^2`` left out, as in its equation)."""
    return (12.0 * tokens * embed_dim**2 + 2.0 * tokens**2 * embed_dim) / sp


# --------------------------------------------------------------------------- communication
CollectiveCost = Literal["ring", "gloo"]


@dataclass(frozen=True)
class CommBytes:
    """Bytes one rank sends in one training step, by collective."""

    attention: float  # allgather-kv: K, V all-gathered, their gradients reduce-scattered; ulysses: 8 all-to-alls
    decoder_gather: float  # the encoder's output all-gathered for a `gather` decoder
    sp_gradients: float  # the encoder's partial gradients summed over the SP group (an all-reduce)
    dp_gradients: float  # the data-parallel gradient all-reduce

    @property
    def total(self) -> float:
        return self.attention + self.decoder_gather + self.sp_gradients + self.dp_gradients


def communication_bytes(shape: ViTShape, layout: SequenceLayout = SequenceLayout(), *, batch: int = 1, dp: int = 1,
                        bytes_per_value: int = 4, cost: CollectiveCost = "ring") -> CommBytes:
    """Per-rank bytes sent in one step, with ``T = s/SP`` tokens per rank of width ``d`` and ``P`` parameters.

    Ring all-gather sends ``(k-1)/k`` of the gathered tensor, reduce-scatter the same, all-reduce twice that,
    and a pairwise all-to-all ``(k-1)/k`` of its input, over a group of ``k`` (the seed's section 5):

    - ``allgather-kv``, per layer: all-gather of K and V ``(k-1) 2Td`` forward, reduce-scatter of their
      gradients ``(k-1) 2Td`` backward; ``ulysses``, per layer: 4 all-to-alls of ``Td`` forward (Q, K, V,
      output) and 4 backward, ``8 (k-1)/k Td`` (the seed's ``8/SP O(b s d)``);
    - ``gather`` decoder input: ``(k-1) Td``; the SP gradient sum ``2 (k-1)/k P``; DP's all-reduce
      ``2 (dp-1)/dp P``.

    ``cost="gloo"`` counts gloo's reduce-scatter as what it measurably sends, an all-reduce's volume
    (``benchmarks/README.md``, section ``sp_scaling.py``): ``allgather-kv``'s backward then sends
    ``(k-1) 4Td`` per layer.
    """
    if cost not in ("ring", "gloo"):
        raise ValueError(f"cost must be 'ring' or 'gloo', got {cost!r}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    k = layout.sp
    t = batch * shape.tokens / k  # tokens (times samples) per rank
    d = shape.embed_dim
    if layout.attention == "allgather-kv":
        backward = (2.0 if cost == "gloo" else 1.0) * (k - 1) * 2 * t * d
        per_layer = (k - 1) * 2 * t * d + backward
    else:
        per_layer = 8.0 * (k - 1) / k * t * d
    params = vit_parameters(shape)
    gather = (k - 1) * t * d if layout.decoder == "gather" else 0.0
    return CommBytes(attention=bytes_per_value * shape.layers * per_layer, decoder_gather=bytes_per_value * gather,
                     sp_gradients=bytes_per_value * 2.0 * (k - 1) / k * params,
                     dp_gradients=bytes_per_value * 2.0 * (dp - 1) / dp * params)


# --------------------------------------------------------------------------- memory
AttentionKernel = Literal["math", "fused"]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at its peak in a training step, by part."""

    parameters: float
    gradients: float
    optimizer: float  # Adam's two moments
    activations: float  # saved for the backward: encoder, decoder and the input, at the forward's end
    scores: float  # attention probabilities the math kernel saves (every layer's), 0 for a fused kernel
    transient: float  # what the backward adds at its peak: the score gradients of one layer, or decoder gradients

    @property
    def peak(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.scores + self.transient

    @property
    def step(self) -> float:
        """The peak above what a process holds before its first step (the model's parameters)."""
        return self.peak - self.parameters


def vit_memory(shape: ViTShape, layout: SequenceLayout = SequenceLayout(), *, batch: int = 1,
               kernel: AttentionKernel = "math", bytes_per_value: int = 4) -> MemoryEstimate:
    """Per-rank peak memory of one training step, fp32 Adam (``bytes_per_value`` for the activations).

    Parameters, gradients and Adam's moments are ``4 + 4 + 8`` bytes per parameter on every rank (SP and DP
    replicate them; the seed's ``6 P`` optimizer state is for mixed precision). Activations, per sample, with
    ``T = s/SP`` local tokens of width ``d`` and ``h`` MLP features, what autograd saves per block: the block's
    input and its two norms' outputs, Q, K and V, the attention output before and after its reshape, the first
    residual sum, the MLP's hidden features before and after GELU (``(9 d + 2 h) T``); ``allgather-kv`` adds the
    gathered K and V (``2 s d``), Ulysses' head-split Q, K and V (``3 T d``) replace nothing; the seed's
    ``(6 s d + 4 s d)/SP`` is the same count with ``h = 4d`` and fewer saved intermediates. The math kernel
    saves each layer's attention probabilities, ``heads x T x s`` (the seed's ``s^2`` term), and its backward
    adds two more such matrices for the layer it differentiates; a fused kernel saves ``heads x T`` statistics.
    The decoder (whole tile under ``gather``, ``1/SP`` of it under ``no-gather``) saves each stage's input,
    convolution and normalised outputs, and the head's logits with the loss's intermediates; its backward adds
    the gradients of its largest feature map twice over.

    Against the peaks ``benchmarks/sp_scaling.py`` measured (2026-11-22, its table in ``benchmarks/README.md``;
    96^3 tile, L=2, d=96, 4 heads, math kernel), :attr:`MemoryEstimate.step` is within 4% at patch 4 for SP 1,
    2 and 4 (12.0, 6.2, 3.2 GB: the scores dominate), but 24% under at patch 8 with SP=1 and 45-65% under at
    patch 16 and at patch 8 with SP 2 and 4, where a step's peak is 100-180 MB above what autograd holds: the
    CPU allocator's retained and fragmented blocks, thread scratch buffers and gloo's buffers, which are not
    modelled yet.
    """
    if kernel not in ("math", "fused"):
        raise ValueError(f"kernel must be 'math' or 'fused', got {kernel!r}")
    k, s, d, h = layout.sp, shape.tokens, shape.embed_dim, shape.hidden
    if s % k:
        raise ValueError(f"the {s} tokens of tile {list(shape.tile)} at patch {shape.patch} do not divide by SP={k}")
    t = s // k
    params = float(vit_parameters(shape))
    block = (9 * d + 2 * h) * t
    if k > 1:
        block += 2 * s * d if layout.attention == "allgather-kv" else 3 * t * d
    voxels = math.prod(shape.tile)
    embed = shape.in_channels * voxels / k + t * d  # the input share and its tokens
    encoder = shape.layers * block + 2 * t * d  # and the final norm
    share = k if layout.decoder == "no-gather" else 1
    decoder, largest = _decoder_activations(shape)
    decoder_input = (2 * s * d if layout.decoder == "gather" and k > 1 else 0)  # gathered tokens and their grid
    activations = batch * (embed + encoder + decoder / share + decoder_input)
    score = batch * shape.heads * t * s if kernel == "math" else 0.0
    scores = shape.layers * score
    transient = max(2 * score, 2 * batch * largest / share)
    b = bytes_per_value
    return MemoryEstimate(parameters=4 * params, gradients=4 * params, optimizer=8 * params,
                          activations=b * activations, scores=b * scores, transient=b * transient)


def _decoder_activations(shape: ViTShape) -> tuple[float, float]:
    """Values the decoder saves for one sample, and its largest single feature map."""
    voxels = shape.tokens
    channels = shape.decoder_channels
    saved, largest = 0.0, 0.0
    for c_in, c_out in zip(channels[:-1], channels[1:]):
        saved += c_in * voxels + 2 * c_out * voxels  # convolution input; its output and the normalised one
        voxels *= 8
        largest = max(largest, c_out * voxels)
    saved += channels[-1] * voxels + 3 * shape.num_classes * voxels  # the head's input, logits and the loss's
    return saved, largest


# --------------------------------------------------------------------------- the seed's summary
def figure_of_merit(shape: ViTShape, *, batch: int, seconds: float) -> float:
    """The seed's equation 27: ``FOM = b_s L s^2 d / T`` for a step of ``seconds`` on ``batch`` samples."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    return batch * shape.layers * shape.tokens**2 * shape.embed_dim / seconds


def seed_table2(shape: ViTShape, *, n: int, batch: int = 1) -> dict[str, dict[str, float]]:
    """The seed's Table 2 for one transformer block, computed: per strategy over ``n`` devices, the parameter
    and activation communication volumes (elements) and the optimizer-state and activation memory factors.

    ``SP-Ulysses``: an all-reduce of the ``12 d^2`` block parameters' gradients and 8 all-to-alls of
    ``8/N b s d``; ``DP``: the all-reduce only; ``ZeRO3``: two all-gathers and a reduce-scatter, ``18 d^2``.
    Memory: parameters and gradients ``P + G`` (``/N`` for ZeRO3), optimizer state ``6P`` (``/N``), activations
    ``A/N`` for all three.
    """
    d, s = shape.embed_dim, shape.tokens
    psi = 12.0 * d * d
    return {
        "SP-Ulysses": {"param_comm": psi, "activation_comm": 8.0 / n * batch * s * d, "pg_memory": 2 * psi,
                       "optimizer_memory": 6 * psi, "activation_memory_fraction": 1.0 / n},
        "DP": {"param_comm": psi, "activation_comm": 0.0, "pg_memory": 2 * psi, "optimizer_memory": 6 * psi,
               "activation_memory_fraction": 1.0 / n},
        "ZeRO3": {"param_comm": 1.5 * psi, "activation_comm": 0.0, "pg_memory": 2 * psi / n,
                  "optimizer_memory": 6 * psi / n, "activation_memory_fraction": 1.0 / n},
    }
