"""Choosing a ViT-seg trial's parallel layout from the performance model (:mod:`distmis.perf.model`).

For ``ranks`` devices of ``memory_per_rank`` bytes, ``device_flops`` FLOP/s and ``bandwidth`` bytes/s between
ranks, every layout of a spec's model is predicted: each patch size the spec or its search space holds, each
sequence-parallel degree that divides the ranks (the rest data-parallel), each attention strategy the token grid
and heads allow (``dsp`` too, for an axial model) (:func:`distmis.perf.partition.check_sequence_parallel`). A layout's step time is its FLOPs over
the device's rate plus its bytes over the bandwidth (no overlap: an upper bound), its figure of merit the seed's
``b_s L s^2 d / T`` per rank, and it fits when its predicted peak is within the memory less what the process
itself reserves (:attr:`Machine.reserved`). The memory and bytes are those of the spec's ``training.precision``
(or another: ``precision``), by the seed's mixed-precision terms (:func:`distmis.perf.model.vit_memory`). Pure
arithmetic: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from distmis.perf.model import (
    MAGNITUDES,
    AttentionKernel,
    Precision,
    CommBytes,
    FlopCount,
    MemoryEstimate,
    SequenceLayout,
    communication_bytes,
    figure_of_merit,
    vit_flops,
    vit_memory,
)

from distmis.perf.sizing import PROCESS_RESERVE

if TYPE_CHECKING:  # pragma: no cover
    from distmis.spec.schema import Spec

__all__ = ["MAX_RANKS", "Machine", "PlannedLayout", "plan_layouts", "best_layouts", "divisors",
           "patch_sizes"]

#: The most ranks a trial is planned for (a billion devices): the degrees are the divisors of the count.
MAX_RANKS = 2**30

#: Machine fields and the ``distmis plan`` options that set them, for messages.
_OPTIONS = {"ranks": "--ranks", "memory_per_rank": "--memory-per-rank", "device_flops": "--device-flops",
            "bandwidth": "--bandwidth", "reserved": "--reserved"}


@dataclass(frozen=True)
class Machine:
    """What the planner sizes layouts for: ``ranks`` devices (one per Ray Train worker of a trial)."""

    ranks: int
    memory_per_rank: float  # bytes
    device_flops: float = 300e12  # FLOP/s a rank sustains
    bandwidth: float = 100e9  # bytes/s a rank sends
    reserved: float = PROCESS_RESERVE  # the process's own: torch's libraries (about 0.4 GB on CPU), a CUDA context

    def __post_init__(self) -> None:
        low, high = MAGNITUDES
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or not 1 <= self.ranks <= MAX_RANKS:
            raise ValueError(f"ranks ({_OPTIONS['ranks']}) must be a whole number from 1 to {MAX_RANKS}, got "
                             f"{self.ranks!r}")
        for name in ("memory_per_rank", "device_flops", "bandwidth"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high):
                raise ValueError(f"{name} ({_OPTIONS[name]}) must be a finite positive number between {low:g} and "
                                 f"{high:g}, got {value!r}")
        if not (math.isfinite(self.reserved) and 0 <= self.reserved < self.memory_per_rank):
            raise ValueError(f"reserved ({_OPTIONS['reserved']} {self.reserved:g} bytes) must lie in [0, "
                             f"memory_per_rank) ({_OPTIONS['memory_per_rank']} {self.memory_per_rank:g} bytes)")

    def rates(self) -> str:
        """The figures a step time comes from, as the options that set them, for messages."""
        return (f"{_OPTIONS['device_flops']} {self.device_flops:g} FLOP/s and {_OPTIONS['bandwidth']} "
                f"{self.bandwidth:g} B/s")

    @property
    def usable(self) -> float:
        """Bytes a training step may use: the memory per rank less :attr:`reserved`."""
        return self.memory_per_rank - self.reserved


@dataclass(frozen=True)
class PlannedLayout:
    """One layout's prediction, per rank and training step."""

    patch: int
    tokens: int
    sp: int
    dp: int
    attention: str
    flops: FlopCount
    comm: CommBytes
    memory: MemoryEstimate
    step_seconds: float
    fom: float
    fits: bool


def patch_sizes(spec: Spec) -> list[int]:
    """The spec's patch size and every one its search space gives ``model.params.patch``, in order."""
    sizes = [int(spec.model.params.patch)]  # type: ignore[union-attr]
    domain = spec.search.space.get("model.params.patch")
    if domain is not None:
        sizes += [int(v) for v in (domain.values or []) if int(v) not in sizes]
    return sizes


def plan_layouts(spec: Spec, machine: Machine, *, kernel: AttentionKernel | None = None,
                 precision: Precision | None = None) -> list[PlannedLayout]:
    """Every layout of ``spec``'s ViT-seg on ``machine`` that its shapes allow, fitting or not (see
    :attr:`PlannedLayout.fits`); ``kernel`` defaults to the model's ``attention_kernel``, ``precision`` to the
    spec's ``training.precision``."""
    from distmis.spec.load import network_input
    from distmis.perf.partition import check_sequence_parallel
    from distmis.spec.layout import TrialLayout

    params, entry = spec.model.params, spec.model.entry
    if entry.perf_shape is None or entry.token_attention is None:
        raise ValueError("the planner sizes the sequence-parallel trials of networks the performance model describes; "
                         f"model.name {spec.model.name!r} is not one")
    tile = network_input(spec)
    if tile is None:
        raise ValueError("the network input is unknown: set training.tile (or dataset.crop / resize)")
    kernel = kernel or params.attention_kernel
    precision = precision or spec.training.planned_precision  # type: ignore[assignment]
    sp_spec = spec.parallelism.sequence_parallel
    batch = spec.training.batch_size
    rows: list[PlannedLayout] = []
    for patch in patch_sizes(spec):
        if any(t % patch for t in tile):
            continue
        shape = entry.perf_shape(params.model_copy(update={"patch": patch}), tile, spec.dataset.in_channels,
                                 spec.dataset.num_classes)
        strategies = ("allgather-kv", "ulysses") + (("dsp",) if shape.attention == "axial" else ())
        for sp in divisors(machine.ranks):
            for attention in strategies if sp > 1 else ("allgather-kv",):
                try:
                    check_sequence_parallel(shape.grid, shape.heads, sp, attention=attention,
                                            decoder=sp_spec.decoder, split=sp_spec.split,
                                            model_attention=shape.attention)
                except ValueError:
                    continue  # tokens, heads or the split do not suit this degree
                layout = SequenceLayout(sp=sp, attention=attention, decoder=sp_spec.decoder)  # type: ignore[arg-type]
                dp = TrialLayout.for_ranks(machine.ranks, sp=sp).dp
                flops = vit_flops(shape, layout, batch)
                comm = communication_bytes(shape, layout, batch=batch, dp=dp, precision=precision)
                memory = vit_memory(shape, layout, batch=batch, kernel=kernel, precision=precision)
                seconds = flops.matmul / machine.device_flops + comm.total / machine.bandwidth
                row = PlannedLayout(patch, shape.tokens, sp, dp, attention, flops, comm, memory, seconds,
                                    figure_of_merit(shape, batch=batch, seconds=seconds), memory.peak <= machine.usable)
                _check_prediction(row, machine)
                rows.append(row)
    return rows


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` in increasing order (found up to its square root)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def _check_prediction(row: PlannedLayout, machine: Machine) -> None:
    """ValueError, naming the figures it comes from, when a prediction is not a finite positive number within
    :data:`MAGNITUDES` (a step time) or not finite (the figure of merit)."""
    low, high = MAGNITUDES
    layout = f"patch {row.patch}, SP {row.sp} x DP {row.dp}, {row.attention}"
    if not (math.isfinite(row.step_seconds) and low <= row.step_seconds <= high):
        raise ValueError(f"the predicted step time of {layout} is {row.step_seconds:.3g} s, outside {low:g} to "
                         f"{high:g} s: {machine.rates()} are no device's (e.g. 300e12 FLOP/s and 100e9 B/s)")
    if not math.isfinite(row.fom):
        raise ValueError(f"the figure of merit of {layout} overflows (step time {row.step_seconds:.3g} s): "
                         f"{machine.rates()} are no device's (e.g. 300e12 FLOP/s and 100e9 B/s)")
    if not (math.isfinite(row.memory.peak) and low <= row.memory.peak <= high):
        raise ValueError(f"the predicted peak memory of {layout} is {row.memory.peak:.3g} bytes, outside {low:g} to "
                         f"{high:g}: the spec's model, tile or batch size is out of range")


def best_layouts(rows: list[PlannedLayout]) -> dict[int, PlannedLayout]:
    """Per patch size (a hyperparameter, not a layout), the fitting layout that trains the most samples a second
    over all ranks (``dp x batch / step``; the fewer SP ranks on a tie). Patch sizes where nothing fits are absent."""
    best: dict[int, PlannedLayout] = {}
    for row in rows:
        if row.fits and (row.patch not in best or (row.step_seconds / row.dp, row.sp)
                         < (best[row.patch].step_seconds / best[row.patch].dp, best[row.patch].sp)):
            best[row.patch] = row
    return best
