"""The performance model of a ViT-seg trial (issue 14): parameters, FLOPs, bytes and memory per rank. Pure arithmetic.

The seed (Sastry and Ku, docs/references.md) counts, for a 3D ViT with ``s = HWD/p^3``
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

Axial attention (``ViTShape.attention == "axial"``, the DSP seed's multi-dimensional transformer): a block has three
attention stages (H, W, D), each with its own QKV and projection, so ``3 x 4 s d^2`` projection multiply-accumulates
per block instead of ``4 s d^2``, and each token's scores run over the ``g_axis`` tokens of its line along each axis:
``2 s (gh + gw + gd) d`` for ``Q K^T`` and ``(softmax) V`` together, against full attention's ``2 s^2 d``. Every
strategy (``allgather-kv``, ``ulysses``, ``dsp``) computes ``1/SP`` of that per rank.

Softmax, norms, activations, residual additions and upsampling are elementwise and not counted in
:attr:`FlopCount.matmul` (nor by ``FlopCounterMode``); the softmax's ``s^2`` per head is reported apart as
:attr:`FlopCount.softmax`. On CPU, ``FlopCounterMode`` does not count torch's fused attention kernel
(``_scaled_dot_product_flash_attention_for_cpu``): its attention matmuls are those of the math kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

from distmis.perf.partition import dsp_schedule, partition_tokens

__all__ = [
    "ViTShape", "SequenceLayout", "FlopCount", "CommBytes", "MemoryEstimate", "vit_flops", "vit_parameters",
    "communication_bytes", "vit_memory", "seed_block_macs", "figure_of_merit", "seed_table2",
    "onednn_convolution", "process_overhead", "PROCESS_OVERHEAD", "MAGNITUDES", "Precision", "PRECISIONS",
    "activation_bytes", "parameter_bytes",
]

AttentionKind = Literal["allgather-kv", "ulysses", "dsp"]
DecoderKind = Literal["gather", "no-gather"]
ModelAttention = Literal["full", "axial"]
#: ``training.precision``: fp32, or mixed precision computing in bfloat16 or float16 (fp32 master weights).
Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")


def activation_bytes(precision: Precision = "fp32") -> int:
    """Bytes of one activation value: 4 in fp32, 2 under mixed precision (bf16, fp16), the seed's ``2``."""
    _check_precision(precision)
    return 4 if precision == "fp32" else 2


def parameter_bytes(precision: Precision = "fp32") -> dict[str, int]:
    """Bytes per parameter by part, the seed's mixed-precision terms (its section 4): the weights, ``4`` in fp32
    plus, under mixed precision, ``2`` for the 16-bit copy the forward computes with (the seed's "6 bytes for each
    model parameter"); the gradient, one fp32 value (``4``); the optimizer state, fp32: Adam's two moments (``8``;
    the seed counts its momentum alone, 4 bytes)."""
    _check_precision(precision)
    return {"weights": 4, "copy": 0 if precision == "fp32" else 2, "gradient": 4, "optimizer": 8}

#: The magnitudes a machine's figures and the model's predictions lie within: beyond them a figure is no
#: device's, and a log-scale plot of the predictions overflows (the planner checks its machine and predictions
#: against them, the plan's figure what it draws).
MAGNITUDES = (1e-100, 1e100)


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
    attention: ModelAttention = "full"

    def __post_init__(self) -> None:
        if self.attention not in ("full", "axial"):
            raise ValueError(f"attention must be 'full' or 'axial', got {self.attention!r}")
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
                   num_classes=num_classes, attention=getattr(params, "attention", "full"))

    @property
    def grid(self) -> tuple[int, int, int]:
        return tuple(t // self.patch for t in self.tile)  # type: ignore[return-value]

    @property
    def tokens(self) -> int:
        """``s = HWD / p^3``."""
        return math.prod(self.grid)

    @property
    def stages(self) -> int:
        """Attention stages per block: 1 (full) or 3 (axial: H, W, D)."""
        return 3 if self.attention == "axial" else 1

    @property
    def keys_per_query(self) -> int:
        """Keys each query scores in one block: ``s`` (full) or ``gh + gw + gd`` (axial, summed over its stages)."""
        return sum(self.grid) if self.attention == "axial" else self.tokens

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
        if self.attention not in ("allgather-kv", "ulysses", "dsp"):
            raise ValueError(f"attention must be 'allgather-kv', 'ulysses' or 'dsp', got {self.attention!r}")


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
    keys = shape.keys_per_query
    embed = 2.0 * local * d * shape.in_channels * shape.patch**3
    projections = 2.0 * local * d * (shape.stages * (3 * d + d) + 2 * shape.hidden)  # QKV, output projection, MLP
    attention = 2.0 * 2 * local * keys * d  # Q K^T and (softmax) V: s/SP queries (or heads/SP heads) x their keys
    decoder = _decoder_flops(shape) / (sp if layout.decoder == "no-gather" else 1)
    return FlopCount(embed_forward=batch * embed, encoder_forward=batch * shape.layers * (projections + attention),
                     decoder_forward=batch * decoder, softmax=batch * shape.layers * shape.heads * local * keys)


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
    attention = (3 * d * d + 3 * d) + (d * d + d) + 2 * d  # QKV, projection, the stage's norm
    block = shape.stages * attention + (d * h + h) + (h * d + d) + 2 * d  # MLP and its norm
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
    # per stage; dsp: the switches' all-to-alls of the stream, forward and backward
    decoder_gather: float  # the encoder's output all-gathered for a `gather` decoder
    sp_gradients: float  # the encoder's partial gradients summed over the SP group (an all-reduce)
    dp_gradients: float  # the data-parallel gradient all-reduce

    @property
    def total(self) -> float:
        return self.attention + self.decoder_gather + self.sp_gradients + self.dp_gradients


def communication_bytes(shape: ViTShape, layout: SequenceLayout = SequenceLayout(), *, batch: int = 1, dp: int = 1,
                        bytes_per_value: int = 4, cost: CollectiveCost = "ring",
                        precision: Precision = "fp32") -> CommBytes:
    """Per-rank bytes sent in one step, with ``T = s/SP`` tokens per rank of width ``d`` and ``P`` parameters.

    Ring all-gather sends ``(k-1)/k`` of the gathered tensor, reduce-scatter the same, all-reduce twice that,
    and a pairwise all-to-all ``(k-1)/k`` of its input, over a group of ``k`` (the seed's section 5):

    - ``allgather-kv``, per layer: all-gather of K and V ``(k-1) 2Td`` forward, reduce-scatter of their
      gradients ``(k-1) 2Td`` backward; ``ulysses``, per layer: 4 all-to-alls of ``Td`` forward (Q, K, V,
      output) and 4 backward, ``8 (k-1)/k Td`` (the seed's ``8/SP O(b s d)``);
    - ``gather`` decoder input: ``(k-1) Td``; the SP gradient sum ``2 (k-1)/k P``; DP's all-reduce
      ``2 (dp-1)/dp P``.

    An axial model has three attention stages per block: ``allgather-kv`` and ``ulysses`` pay the above per stage
    (three times a full block's). ``dsp`` sends nothing inside attention; each switch of its schedule
    (:func:`~distmis.perf.partition.dsp_schedule`: ``ceil(3L/2) - 1`` switches when all three grid axes divide
    by ``k``) is one all-to-all of the stream forward and one backward, ``2 (k-1)/k Td`` in all. The DSP seed's
    Table 1 counts per block of one attention: DSP ``2M/N`` (one switch, forward and backward) against Ulysses'
    ``8M/N``, with ``M = s d`` the activation and ``N = k``; the schedule here needs one switch per two stages.

    ``cost="gloo"`` counts gloo's reduce-scatter as what it measurably sends, an all-reduce's volume
    (``benchmarks/history.md``, section ``sp_scaling.py``): ``allgather-kv``'s backward then sends
    ``(k-1) 4Td`` per layer.

    ``bytes_per_value``: the width of every value sent. ``precision`` (mixed precision: ``bf16``, ``fp16``): the
    activations and their gradients (attention's collectives, the decoder's gather) travel in 2 bytes, the dtype
    autocast computes them in (the seed's half-precision activations); the parameters' gradients are the fp32
    master weights', so the SP and DP gradient all-reduces keep ``bytes_per_value``.
    """
    _check_precision(precision)
    if cost not in ("ring", "gloo"):
        raise ValueError(f"cost must be 'ring' or 'gloo', got {cost!r}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    k = layout.sp
    t = batch * shape.tokens / k  # tokens (times samples) per rank
    d = shape.embed_dim
    if layout.attention == "dsp":
        if shape.attention != "axial":
            raise ValueError("attention 'dsp' needs an axial model (ViTShape.attention 'axial')")
        switches = dsp_schedule(shape.grid, k, shape.layers).switches if k > 1 else 0
        attention = switches * 2.0 * (k - 1) / k * t * d
    elif layout.attention == "allgather-kv":
        backward = (2.0 if cost == "gloo" else 1.0) * (k - 1) * 2 * t * d
        attention = shape.layers * shape.stages * ((k - 1) * 2 * t * d + backward)
    else:
        attention = shape.layers * shape.stages * 8.0 * (k - 1) / k * t * d
    params = vit_parameters(shape)
    gather = (k - 1) * t * d if layout.decoder == "gather" else 0.0
    sent = bytes_per_value if precision == "fp32" else activation_bytes(precision)  # an activation's bytes
    return CommBytes(attention=sent * attention, decoder_gather=sent * gather,
                     sp_gradients=bytes_per_value * 2.0 * (k - 1) / k * params,
                     dp_gradients=bytes_per_value * 2.0 * (dp - 1) / dp * params)


# --------------------------------------------------------------------------- memory
AttentionKernel = Literal["math", "fused"]

MIB = 2**20
#: File-backed pages (torch's, oneDNN's, MKL's and gloo's code) a process first touches in its first training
#: steps: the growth of ``/proc/self/statm``'s shared pages over two steps, 22-26 MiB in every configuration of
#: ``benchmarks/perf_model.py`` (torch 2.13, CPU).
CODE_PAGES = 24 * MIB
#: Anonymous memory a step adds besides tensors: OpenMP and gloo threads' stacks and buffers, oneDNN and MKL
#: scratch. Measured as the peak resident set less the tensors' peak (the profiler's) less :data:`CODE_PAGES`
#: with glibc's mmap threshold fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_=65536``: every tensor's pages are
#: returned on free): 7-15 MiB.
RUNTIME_BUFFERS = 12 * MIB
#: Freed memory glibc's heap keeps resident, at most (a step whose tensors peak lower keeps at most that peak).
#: glibc serves a block below its mmap threshold from the heap; the threshold rises to the largest mmapped block
#: freed so far, up to 32 MiB, so from the first step on every feature map under 32 MiB lives in the heap. Freed
#: heap memory goes back to the system only from the heap's top, beyond the trim threshold (twice the mmap
#: threshold: 54 MiB here, whose largest freed blocks are 27 MiB), and not at all below a live block. Measured
#: as the peak resident set with glibc's defaults less the same with a fixed 64 KiB threshold: 54 MiB at patch
#: 16, 80-107 MiB at patch 8, 90 MiB at patch 4 with the fused kernel, 216 MiB at patch 4 with the math kernel
#: (96^3, SP=1); and as the resident peak less the profiler's tensor peak less the two constants above over the
#: 20 runs of ``benchmarks/perf_model.py`` at patches 8 and 4 (gather decoder): 68-276 MiB, median 100 MiB. At
#: patch 16 and under ``no-gather`` at SP=4, whose tensors peak at 60-70 MiB, it was 65-85% of that peak.
HEAP_RETENTION = 100 * MIB
#: What a CPU process adds to a training step's tensors, at most: :data:`CODE_PAGES` + :data:`RUNTIME_BUFFERS`
#: + :data:`HEAP_RETENTION` (136 MiB).
PROCESS_OVERHEAD = CODE_PAGES + RUNTIME_BUFFERS + HEAP_RETENTION


def process_overhead(step_tensors: float) -> float:
    """Bytes a CPU process holds at a step's peak above its tensors, for a step whose tensors (the parameters
    excepted) peak at ``step_tensors`` bytes: code pages, runtime buffers, and the heap's retention up to
    :data:`HEAP_RETENTION` but no more than the tensors' peak."""
    return CODE_PAGES + RUNTIME_BUFFERS + min(HEAP_RETENTION, max(0.0, step_tensors))


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at its peak in a training step, by part, and the moment of the peak."""

    parameters: float
    gradients: float  # the parameters' gradients that exist at the peak
    optimizer: float  # Adam's two moments
    activations: float  # tensors saved for the backward (but the scores), alive at the peak
    scores: float  # attention probabilities the math kernel saves (every layer's until its backward), 0 fused
    transient: float  # unsaved tensors at the peak: forward temporaries, gradients in flight
    workspace: float = 0.0  # kernels' own buffers at the peak: convolution columns, oneDNN reorders, gloo's
    overhead: float = 0.0  # the process's, not a tensor's: code pages, thread buffers, the heap's retention
    moment: str = ""  # where in the step the peak falls
    saved: float = 0.0  # what the step made that autograd holds at the forward's end: activations and scores (the
    # input batch and the parameters and their copies aside; under mixed precision, the input's 16-bit copy in)
    parameter_copies: float = 0.0  # mixed precision: the parameters' 16-bit copies alive at the peak (2 bytes each)
    batch: float = 0.0  # the network's input batch (fp32), read by the step: not the step's, not in the peak
    precision: Precision = "fp32"

    @property
    def tensors(self) -> float:
        """The tensors' peak: what ``torch.profiler`` (``profile_memory``) sees, the parameters included."""
        return (self.parameters + self.gradients + self.optimizer + self.activations + self.scores
                + self.transient + self.workspace + self.parameter_copies)

    @property
    def activation_memory(self) -> float:
        """The seed's activation memory (its section 4, "all inputs and activations"): every tensor autograd holds
        for the backward at the forward's end but the parameters and their 16-bit copies, the network's input
        included: in fp32 the batch itself, which the first layer saves as it is; under mixed precision the
        16-bit copy autocast makes of it (in :attr:`saved`)."""
        return self.saved + (self.batch if self.precision == "fp32" else 0.0)

    @property
    def peak(self) -> float:
        return self.tensors + self.overhead

    @property
    def step(self) -> float:
        """The peak above what a process holds before its first step (the model's parameters)."""
        return self.peak - self.parameters


def vit_memory(shape: ViTShape, layout: SequenceLayout = SequenceLayout(), *, batch: int = 1,
               kernel: AttentionKernel = "math", bytes_per_value: int = 4, threads: int = 2,
               overhead: float | None = None, precision: Precision = "fp32") -> MemoryEstimate:
    """Per-rank peak memory of one training step (fp32 Adam; ``bytes_per_value`` for the activations), as
    torch 2.13 runs :class:`~distmis.models.vit_seg.ViTSeg` on a CPU: the largest of the tensors alive at each
    moment of the step where the live set can peak, plus the process's :data:`PROCESS_OVERHEAD`.

    ``precision``: ``bf16`` or ``fp16`` counts mixed precision as ``training.precision`` trains it (the forward
    under ``torch.autocast``), by the seed's mixed-precision terms (:func:`parameter_bytes`): fp32 weights, plus
    their 16-bit copies (2 bytes a parameter: autocast's casts, which autograd keeps for the backward until each
    layer's backward has run), fp32 gradients and Adam moments, and activations in 2 bytes
    (:func:`activation_bytes`). Where torch keeps fp32 under autocast on a CPU the model does too: the math
    attention kernel casts Q, K and V up to fp32 and keeps its probabilities in fp32 (so only the fused kernel
    halves attention's memory), the fused kernel's log-sum-exps are fp32, and the loss reads an fp32 copy of the
    logits. The first layer saves a 16-bit copy of the input (in fp32 it saves the batch itself, which is not the
    step's). Every half-precision convolution runs oneDNN (torch's rule for 16-bit CPU inputs), whose reorders the
    workspace counts in 2 bytes; oneDNN's own scratch buffers for the weight gradients of few-channel
    convolutions in bf16 are not counted (measured on an AMX CPU at a 96^3 tile: 78-336 MiB for the patch
    embedding and 109 MiB for the 1x1x1 head: ``benchmarks/precision_memory.py``), so the peak under mixed precision
    is a lower bound there; :attr:`MemoryEstimate.activation_memory` is not affected.

    The moments follow a second training step (Adam's moments exist; ``zero_grad(set_to_none=True)`` freed the
    gradients), in the order autograd runs it, with ``T = s/SP`` local tokens of width ``d``, ``h`` MLP features
    and ``H`` heads, per sample:

    - the forward saves, per block, the two norms' outputs, Q, K and V (one tensor), the residual sums, the MLP's
      hidden features before and after GELU and the attention output: ``(8 d + 2 h) T`` for the fused kernel
      (its output is already token-major, and it keeps ``H T`` log-sum-exps). The math kernel keeps the scaled
      Q and K, the output's token-major copy and the probabilities ``H T s`` (every layer's, until the layer's
      backward); at its softmax it holds the scores, the probabilities and a one-byte ``-inf`` mask. Under SP,
      ``allgather-kv`` keeps the gathered K and V (``2 s d``) and, at the gather, gloo's staging copies; Ulysses
      keeps the head-split Q, K and V and the output's copy, and at an all-to-all holds its input four times;
    - the decoder (the whole tile on every rank under ``gather``, ``1/SP`` of it under ``no-gather``) keeps
      each stage's input, convolution and normalised outputs, the head's input and the logits. Each 3x3x3
      convolution runs oneDNN when ``batch x channels x`` its first two spatial sizes exceed 20,480 (torch's
      rule), else torch's ``slow_conv3d``, whose forward and backward unfold the input into a
      ``27 c_in x voxels`` column buffer: the decoder's largest single allocation at patches 8 and 16 (91 MiB
      at patch 8 on 96^3). oneDNN reorders its input (channels padded to 8) instead. The 1x1x1 head runs
      oneDNN only with more than one thread (``threads``), then reorders input and output to 8 channels;
    - the backward frees each node's saved tensors as it runs: the decoder's stages from the head down (at
      each convolution: the gradient maps and the workspace), then the blocks from the last (the math kernel's
      backward holds the probabilities' gradient and the softmax's on top of every layer's probabilities).
      Gradients exist for the decoder's parameters in the decoder's backward, for all of them after.

    ``overhead`` is what the process adds to its tensors; by default :func:`process_overhead`: code pages,
    thread and library buffers, and the freed memory glibc's heap keeps (36 + up to 100 MiB on a CPU; ``0``
    counts the tensors only).
    The seed's ``(6 s d + 4 s d + 2 s^2 d)/SP`` per layer is the same count with fewer saved intermediates.

    Against ``benchmarks/perf_model.py`` (96^3 tile, L=2, d=96, 4 heads, decoder 16 features, gloo on one 2-core
    machine; its tables in ``benchmarks/history.md``, a run after the one that calibrated :data:`HEAP_RETENTION`,
    2026-11-24): the tensors (:attr:`MemoryEstimate.tensors` less the parameters) are within 2.1% of the
    profiler's tensor peak at patches 8 and 4 and within 4.7% at patch 16 (under, at SP=4);
    :attr:`MemoryEstimate.step` is within 15% of the measured resident peak at patches 8 and 4 with both kernels
    (math: -12.3% to +5.2%; fused: -11.2% to +14.4%), within 18% at patch 16, and -5% to +25% under
    ``no-gather`` at patch 8. The resident peak itself moves by up to 15% between two runs of a configuration
    (the heap's retention), which bounds what a model of it can do.

    Axial models (:meth:`_StepMemory.axial_blocks_forward`) against the same benchmark (``--axial 8,4``, 2026-11-24,
    an AVX-512 machine): the tensors are within 2% of the profiler's at SP=2 and 4 for DSP and allgather-kv, and
    within 4% for Ulysses but at patch 4, SP=2 (-9%); at SP=1 the profiler sees 46-51 MiB more, the decoder's
    oneDNN buffers with two threads on AVX-512 (channels padded to 16, not AVX2's 8), which full attention shows
    there too. The resident peak is within -6.4% to +5.9% at patch 8; at patch 4 the model is under it by up to
    28% (and 36% for Ulysses at SP=2, whose all-to-all buffers stay in glibc's heap), over it by up to 15% (DSP,
    SP=4): more of the freed heap stays resident than :data:`HEAP_RETENTION` allows.
    """
    if kernel not in ("math", "fused"):
        raise ValueError(f"kernel must be 'math' or 'fused', got {kernel!r}")
    _check_precision(precision)
    if batch < 1 or threads < 1:
        raise ValueError(f"batch and threads must be >= 1, got {batch} and {threads}")
    k, s = layout.sp, shape.tokens
    if s % k:
        raise ValueError(f"the {s} tokens of tile {list(shape.tile)} at patch {shape.patch} do not divide by SP={k}")
    params = float(vit_parameters(shape))
    step = _StepMemory(shape, layout, batch, kernel, threads, float(bytes_per_value), params, precision)
    step.run()
    extra = process_overhead(step.best) if overhead is None else float(overhead)
    peak = dict(step.peak)
    copies = float(peak.pop("copies"))
    return MemoryEstimate(parameters=4 * params, overhead=extra, saved=step.peak_saved, parameter_copies=copies,
                          batch=4.0 * batch * shape.in_channels * math.prod(shape.tile), precision=precision,
                          **peak)


def _pad8(channels: int) -> int:
    """Channels as oneDNN's blocked layout stores them on AVX2 (blocks of 8)."""
    return -(-channels // 8) * 8


def onednn_convolution(batch: int, channels: int, first_sizes: int, kernel: int, threads: int) -> bool:
    """Whether torch 2.13 runs a float CPU convolution with oneDNN (``ConvParams::use_mkldnn``): an unstrided
    ``kernel^3`` convolution of ``batch x channels`` inputs whose first two spatial sizes multiply to
    ``first_sizes``; otherwise ``slow_conv3d`` (and its column buffers)."""
    eligible = kernel != 1 or threads > 1 or batch >= 16  # 1x1x1: oneDNN only when multi-threaded
    return eligible and (kernel > 3 or batch > 1 or batch * channels * first_sizes > 20480)


class _StepMemory:
    """The live bytes of one rank's training step, moment by moment (see :func:`vit_memory`)."""

    def __init__(self, shape: ViTShape, layout: SequenceLayout, batch: int, kernel: str, threads: int,
                 value: float, params: float, precision: str = "fp32") -> None:
        self.shape, self.layout, self.b, self.kernel, self.threads = shape, layout, batch, kernel, threads
        self.mixed = precision != "fp32"
        self.v = 2.0 if self.mixed else value  # bytes per activation value
        self.f = 4.0 if self.mixed else value  # bytes of a value autocast leaves in fp32 (= v without autocast)
        self.params = params
        self.live = {"gradients": 0.0, "optimizer": 8 * params, "activations": 0.0, "scores": 0.0, "copies": 0.0}
        self.peak: dict[str, float | str] = {}
        self.best = -1.0
        self.peak_saved = 0.0  # activations and scores at the forward's end

    def moment(self, name: str, transient: float = 0.0, workspace: float = 0.0, transient32: float = 0.0) -> None:
        """A moment of the step: what is live, plus ``transient`` and ``workspace`` values (not bytes), and
        ``transient32`` values that stay fp32 under autocast."""
        parts = {**self.live, "transient": self.v * transient + self.f * transient32,
                 "workspace": self.v * workspace}
        total = sum(parts.values())
        if total > self.best:
            self.best, self.peak = total, {**parts, "moment": name}

    def save(self, values: float, part: str = "activations") -> None:
        self.live[part] += self.v * values

    def save32(self, values: float, part: str = "activations") -> None:
        """Values autocast leaves in fp32 (the math kernel's, the loss's): 4 bytes under mixed precision."""
        self.live[part] += self.f * values

    def run(self) -> None:
        shape, layout, b = self.shape, self.layout, self.b
        k, s, d = layout.sp, shape.tokens, shape.embed_dim
        t = s // k
        td, keys = b * t * d, b * s * d  # a local token tensor; a whole sequence's (the gathered tokens)

        # ---- forward: the first block's input (tokens plus positions); the patch embedding's output, which the
        # caller holds until the encoder returns. Under mixed precision autocast's 16-bit copies of the parameters
        # (kept for the backward) and of the rank's input voxels (the patch embedding saves it: in fp32 it saves
        # the batch itself, which is not the step's)
        if self.mixed:
            self.live["copies"] = 2.0 * self.params
            self.save(b * shape.in_channels * shape.patch**3 * t)
        self.save(td)
        if shape.attention == "axial":
            self.axial_blocks_forward()
        else:
            self.full_blocks_forward()

        # ---- forward: decoder; its input is the final norm's output (or the gathered tokens) seen channels
        # first, which the first convolution copies to make contiguous (its workspace, forward and backward)
        decoder_in = keys if k > 1 and layout.decoder == "gather" else td
        channels = shape.decoder_channels
        share = k if layout.decoder == "no-gather" else 1
        grid = shape.grid
        voxels, plane = b * s / share, grid[0] * grid[1] / share  # per stage: voxels; first two sizes (one sample)
        stages = []
        self.save(decoder_in)
        for c_in, c_out in zip(channels[:-1], channels[1:]):
            # a 16-bit convolution always runs oneDNN on a CPU that has the dtype (torch's rule)
            onednn = self.mixed or onednn_convolution(b, c_in, int(plane), 3, self.threads)
            work = (_pad8(c_in) + _pad8(c_out)) * voxels if onednn else 27 * c_in * voxels
            work += decoder_in if not stages else 0.0
            self.moment(f"forward: decoder convolution {c_in}->{c_out}", workspace=work)
            self.save(2 * c_out * voxels + 8 * c_out * voxels)  # convolution and norm outputs; upsampled
            stages.append((c_in, c_out, voxels, onednn))
            voxels, plane = voxels * 8, plane * 4
        c_last, classes = channels[-1], shape.num_classes
        head_onednn = self.mixed or onednn_convolution(b, c_last, int(plane), 1, self.threads)
        head_work = (_pad8(c_last) + _pad8(classes)) * voxels if head_onednn else 0.0
        self.moment("forward: decoder head", workspace=head_work)
        if self.mixed:  # the loss keeps an fp32 copy of the 16-bit logits, which live while it runs
            self.save32(classes * voxels)
            self.moment("forward: loss", transient=classes * voxels, transient32=2 * classes * voxels)
        else:
            self.save(classes * voxels)  # the logits (the loss keeps them)
            self.moment("forward: loss", transient=2 * classes * voxels)

        self.peak_saved = self.live["activations"] + self.live["scores"]

        # ---- backward: decoder, from the head down
        decoder_params = sum(27 * a * c + 3 * c for a, c in zip(channels[:-1], channels[1:]))
        decoder_params += c_last * classes + classes
        self.live["gradients"] = 4.0 * decoder_params
        grad = classes * voxels  # the logits' gradient (under mixed precision: fp32, then cast to 16 bits)
        head_work = (_pad8(c_last) + _pad8(classes)) * voxels if head_onednn else c_last * voxels
        self.moment("backward: decoder head", transient=grad + c_last * voxels, workspace=head_work,
                    transient32=grad if self.mixed else 0.0)
        if self.mixed:  # the logits' fp32 copy; the head's input (the last upsampled map)
            self.save32(-classes * voxels)
            self.save(-c_last * voxels)
        else:
            self.save(-(classes + c_last) * voxels)  # the logits; the head's input (the last upsampled map)
        grad = c_last * voxels  # the head input's gradient
        for i, (c_in, c_out, voxels, onednn) in reversed(list(enumerate(stages))):
            self.moment("backward: decoder upsampling", transient=grad + c_out * voxels)
            self.save(-2 * c_out * voxels)  # the norm and convolution outputs
            grad = c_out * voxels  # the convolution output's gradient
            work = _pad8(c_in) * voxels if onednn else 27 * c_in * voxels
            work += decoder_in if i == 0 else 0.0
            self.moment(f"backward: decoder convolution {c_in}->{c_out}", transient=grad + c_in * voxels,
                        workspace=work)
            self.save(-c_in * voxels)  # the convolution's input: the previous upsampled map, or the decoder's
            grad = c_in * voxels

        # ---- backward: blocks, from the last (the decoder's 16-bit weight copies went with its backward)
        self.live["gradients"] = 4.0 * self.params
        if self.mixed:
            self.live["copies"] = 2.0 * (self.params - decoder_params)
        if shape.attention == "axial":
            self.axial_blocks_backward()
        else:
            self.full_blocks_backward()

    # ---------------------------------------------------------------- full attention
    def full_blocks_forward(self) -> None:
        shape, layout, b, v = self.shape, self.layout, self.b, self.v
        k, s, d, h, heads = layout.sp, shape.tokens, shape.embed_dim, shape.hidden, shape.heads
        t = s // k
        math_kernel = self.kernel == "math"
        gathered = k > 1 and layout.attention == "allgather-kv"
        ulysses = k > 1 and layout.attention == "ulysses"
        td, keys = b * t * d, b * s * d  # a local token tensor; a whole sequence's (the gathered K or V)
        probs = b * heads * t * s  # one layer's attention probabilities (or scores)
        embedded = td
        for layer in range(shape.layers):
            self.save(td)  # norm1's output
            qkv = 3 * td
            # under mixed precision the math kernel keeps fp32 copies of its 16-bit Q, K and V instead
            upcast = self.mixed and math_kernel
            if gathered:  # stack K, V; a contiguous copy; the gathered output; gloo's staging of it
                self.moment("forward: all-gather of K and V", transient=embedded + qkv + 4 * td + 2 * keys,
                            workspace=2 * keys)
                if not upcast:
                    self.save(2 * keys)
            elif ulysses:  # the stacked Q, K, V, its contiguous chunks, the received chunks, their concatenation
                self.moment("forward: all-to-all of Q, K, V", transient=embedded + qkv + 12 * td)
            if ulysses and not upcast:
                self.save(3 * td)  # the head-split Q, K, V (the projection's output is freed after the block)
            elif not (gathered and math_kernel) and not upcast:
                self.save(qkv)  # Q (or V) is a view of the projection's output, which it keeps
            extra = embedded + (qkv if ulysses or (gathered and math_kernel) else 0.0)
            if upcast:  # torch's math kernel computes 16-bit inputs in fp32: scaled Q and K, V, the probabilities
                self.save32(td + 2 * (keys if gathered else td))
                self.moment(f"forward: softmax of layer {layer + 1}", transient=extra,
                            transient32=2 * probs + probs / self.f)
                self.save32(probs, "scores")
                self.save(td)  # the output's token-major copy (the projection's input)
            elif math_kernel:
                self.save(td + (keys if gathered else td))  # the scaled Q and K (K gathered under allgather-kv)
                self.moment(f"forward: softmax of layer {layer + 1}", transient=extra + 2 * probs + probs / v)
                self.save(probs, "scores")
                self.save(td)  # the output's token-major copy (the projection's input)
            else:
                self.save(td)  # the output (token-major but under Ulysses) and its log-sum-exps (fp32 always)
                self.save32(b * heads * t)
                if ulysses:
                    self.save(td)  # the output back in sequence-split, copied token-major
            self.save((3 * d + 2 * h) * b * t)  # residual, norm2, MLP hidden before and after GELU, residual


    def full_blocks_backward(self) -> None:
        """The last block's backward: its MLP part is freed before its attention's backward."""
        shape, layout, b = self.shape, self.layout, self.b
        k, s, d, h, heads = layout.sp, shape.tokens, shape.embed_dim, shape.hidden, shape.heads
        t = s // k
        math_kernel = self.kernel == "math"
        gathered = k > 1 and layout.attention == "allgather-kv"
        td, keys = b * t * d, b * s * d
        probs = b * heads * t * s
        self.save(-((3 * d + 2 * h) * b * t))
        stream = 2 * td  # the gradient flowing back and the one being formed
        if math_kernel:  # the probabilities' gradient and the softmax's (fp32 under mixed precision)
            self.moment(f"backward: softmax of layer {shape.layers}", transient=stream, transient32=2 * probs)
        elif gathered:
            self.moment(f"backward: attention of layer {shape.layers}", transient=stream + td + 2 * keys)
        else:
            self.moment(f"backward: attention of layer {shape.layers}", transient=stream + 3 * td)
        if gathered:  # the gradient of the gathered K and V, its contiguous copy, the scattered share
            self.moment(f"backward: reduce-scatter of layer {shape.layers}", transient=stream + 2 * td,
                        workspace=4 * keys)


    # ---------------------------------------------------------------- axial attention
    def axial_blocks_forward(self) -> None:
        """Per block, three stages (H, W, D) then the MLP, on ``T`` local tokens. A stage saves its input (the
        norm's), the norm's output, Q, K and V in lines (the core's copies: ``movedim`` then ``reshape``) or,
        with the math kernel, the scaled Q and K, V and the probabilities ``H T g_axis``, the fused kernel's
        output and log-sum-exps, the projection's input (a token-major copy): ``7 T d`` fused, ``6 T d`` math,
        plus the next stage's input. ``dsp``: before a switching stage, the stream, its chunks, the received
        ones and their concatenation; ``ulysses``: the stacked Q, K, V, the all-to-all's buffers and the
        head-split copy; ``allgather-kv``: the gathered K and V of the whole grid, gloo's staging of them and
        the keys of the lines through the rank's box."""
        shape, layout, b = self.shape, self.layout, self.b
        k, d, h, heads = layout.sp, shape.embed_dim, shape.hidden, shape.heads
        t = shape.tokens // k
        math_kernel = self.kernel == "math"
        td, keys = b * t * d, b * shape.tokens * d
        switches = set(dsp_schedule(shape.grid, k, shape.layers).switch_stages) if (
            k > 1 and layout.attention == "dsp") else set()
        for layer in range(shape.layers):
            for axis in range(3):
                stage = 3 * layer + axis
                name = f"block {layer + 1}, {'HWD'[axis]} stage"
                line = shape.grid[axis]
                probs = b * heads * t * line
                if stage in switches:  # the stream, its chunks, the received chunks, their concatenation
                    self.moment(f"forward: DSP switch before {name}", transient=4 * td)
                self.save(td)  # the norm's output (the stage's input is the previous save)
                lines_kv = 2 * td
                if k > 1 and layout.attention == "ulysses":
                    self.moment(f"forward: all-to-all of Q, K, V at {name}", transient=3 * td + 12 * td)
                elif k > 1 and layout.attention == "allgather-kv":
                    lines_kv = 2 * td * self.axial_line_share(axis)
                    self.moment(f"forward: all-gather of K and V at {name}",
                                transient=3 * td + 2 * td + 2 * keys + lines_kv, workspace=2 * keys)
                if math_kernel:  # under mixed precision, fp32 copies of the 16-bit Q, K, V and fp32 probabilities
                    self.save32(td + lines_kv)  # the scaled Q and K, and V
                    self.moment(f"forward: softmax at {name}", transient=3 * td,
                                transient32=2 * probs + probs / self.f)
                    self.save32(probs, "scores")
                else:
                    self.moment(f"forward: attention at {name}", transient=3 * td + td)
                    self.save(td + lines_kv + td)  # Q, K, V lines; the output
                    self.save32(b * heads * t)  # its log-sum-exps (fp32 always)
                self.save(td)  # the projection's input, token-major
                self.save(td)  # the residual sum: the next stage's input
            self.save((d + 2 * h) * b * t + td)  # the MLP's norm output, hidden before and after GELU; residual

    def axial_line_share(self, axis: int) -> float:
        """allgather-kv on an axial stage: the keys of the lines through a rank's box, in local-token units
        (the box's extent along ``axis`` is ``1/share`` of the line). The layout does not say the split: the
        ordered one when its shares are boxes, else the spatial one (what the spec allows an axial model)."""
        layout, shape = self.layout, self.shape
        shares = partition_tokens(shape.grid, layout.sp, "ordered")
        if any(share.box is None for share in shares):
            shares = partition_tokens(shape.grid, layout.sp, "spatial")
        box = shares[0].box
        assert box is not None
        return shape.grid[axis] / (box[axis][1] - box[axis][0])

    def axial_blocks_backward(self) -> None:
        """The last block's backward: its MLP part is freed, then its D stage's attention: the gradients of
        the stream, of Q, K and V in lines and in the projection's layout (and the collectives' buffers)."""
        shape, layout, b = self.shape, self.layout, self.b
        k, d, h, heads = layout.sp, shape.embed_dim, shape.hidden, shape.heads
        t = shape.tokens // k
        td, keys = b * t * d, b * shape.tokens * d
        self.save(-((d + 2 * h) * b * t + td))
        stream = 2 * td
        name = f"backward: attention at block {shape.layers}, D stage"
        if self.kernel == "math":
            probs = b * heads * t * shape.grid[2]
            self.moment(name, transient=stream + 6 * td, transient32=2 * probs)
        else:
            self.moment(name, transient=stream + 6 * td)
        if k > 1 and layout.attention == "ulysses":
            self.moment(f"backward: all-to-alls at block {shape.layers}, D stage", transient=stream + 15 * td)
        elif k > 1 and layout.attention == "allgather-kv":
            self.moment(f"backward: reduce-scatter at block {shape.layers}, D stage", transient=stream + 2 * td,
                        workspace=4 * keys)


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
