"""The smallest sequence-parallel degree that fits a memory budget (``parallelism.sequence_parallel.degree: auto``).

For a ViT of arithmetic shape :class:`~distmis.perf.model.ViTShape`: every degree from 1 to ``max_degree`` that the
token grid and heads allow (:func:`~distmis.perf.partition.check_sequence_parallel`) is predicted
(:func:`~distmis.perf.model.vit_memory`: the attention kernel, the per-worker batch, the training precision), and
the smallest one whose
per-rank peak fits ``memory_per_worker`` less :data:`PROCESS_RESERVE` is chosen. Pure arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from distmis.perf.model import AttentionKernel, Precision, SequenceLayout, ViTShape, vit_memory
from distmis.perf.partition import check_sequence_parallel

__all__ = ["PROCESS_RESERVE", "AutoDegree", "auto_degree"]

#: Bytes a training process holds besides its step: torch's libraries (about 0.4 GB on CPU), a CUDA context.
PROCESS_RESERVE = 512 * 2**20


@dataclass(frozen=True)
class AutoDegree:
    """What ``degree: auto`` decided for one trial: the degree, or None when none fits."""

    degree: int | None
    shape: ViTShape
    peaks: dict[int, float]  # predicted per-rank peak (bytes) of every degree the tokens and heads allow
    memory_per_worker: float
    max_degree: int
    kernel: str
    precision: str = "fp32"

    @property
    def usable(self) -> float:
        """Bytes a worker's training step may use: ``memory_per_worker`` less :data:`PROCESS_RESERVE`."""
        return self.memory_per_worker - PROCESS_RESERVE

    def reason(self) -> str:
        """Why no degree fits: the tile, the patch, the memory needed and what there is."""
        tile = "x".join(map(str, self.shape.tile))
        if not self.peaks:
            return (f"no degree up to {self.max_degree} splits the {self.shape.tokens} tokens of tile {tile} at "
                    f"patch {self.shape.patch} (and the heads, for ulysses)")
        sp, need = min(self.peaks.items(), key=lambda item: item[1])
        return (f"no degree up to {self.max_degree} fits tile {tile} at patch {self.shape.patch} "
                f"({self.shape.tokens} tokens, {self.kernel} attention kernel"
                f"{'' if self.precision == 'fp32' else ', ' + self.precision}): the smallest predicted peak is "
                f"{need / 2**30:.2f} GiB per worker at SP={sp}, and a worker has {self.usable / 2**30:.2f} GiB "
                f"({self.memory_per_worker / 2**30:.2f} GiB memory_per_worker less "
                f"{PROCESS_RESERVE / 2**30:.2f} GiB for the process); raise memory_per_worker or max_degree, "
                "use a larger patch or the fused attention kernel")


def auto_degree(shape: ViTShape, *, heads: int, model_attention: Literal["full", "axial"], attention: str,
                decoder: str, split: str, batch: int, kernel: AttentionKernel, memory_per_worker: float,
                max_degree: int, precision: Precision = "fp32") -> AutoDegree:
    """The smallest degree up to ``max_degree`` that splits ``shape``'s tokens (and ``heads``, for ulysses) with the
    given SP ``attention``, ``decoder`` and ``split`` and whose predicted peak for ``batch`` samples, trained in
    ``precision``, fits."""
    peaks: dict[int, float] = {}
    for sp in range(1, max_degree + 1):
        try:
            check_sequence_parallel(shape.grid, heads, sp, attention=attention, decoder=decoder, split=split,
                                    model_attention=model_attention)
        except ValueError:
            continue  # the tokens, the heads or the split do not suit this degree
        layout = SequenceLayout(sp=sp, attention=attention, decoder=decoder)  # type: ignore[arg-type]
        peaks[sp] = vit_memory(shape, layout, batch=batch, kernel=kernel, precision=precision).peak
    usable = memory_per_worker - PROCESS_RESERVE
    degree = next((sp for sp, peak in peaks.items() if peak <= usable), None)
    return AutoDegree(degree, shape, peaks, memory_per_worker, max_degree, kernel, precision)
