"""``parallelism.sequence_parallel.degree: auto``: a trial's SP degree sized by the performance model.

For one trial's spec, the smallest degree from 1 to ``max_degree`` that the token grid and heads allow
(:func:`distmis.spec.partition.check_sequence_parallel`) and whose predicted per-rank peak memory
(:func:`distmis.spec.perf_model.vit_memory`: the model's attention kernel, the per-worker batch) fits
``memory_per_worker`` less :data:`PROCESS_RESERVE`. Pure arithmetic, like the spec package it belongs to: the
performance model imports nothing but the standard library.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

from distmis.spec.perf_model import SequenceLayout, ViTShape, vit_memory
from distmis.spec.partition import check_sequence_parallel
from distmis.spec.schema import Spec, ViTSegParams

__all__ = ["PROCESS_RESERVE", "SP_DEGREE_PATH", "AutoDegree", "auto_sp_degree", "memory_configs"]

#: Bytes a training process holds besides its step: torch's libraries (about 0.4 GB on CPU), a CUDA context.
PROCESS_RESERVE = 512 * 2**20
SP_DEGREE_PATH = "parallelism.sequence_parallel.degree"
# Search-space paths whose values can change what ``degree: auto`` chooses (the model's shapes and kernel,
# the tile and batch, the SP settings).
_MEMORY_PATHS = ("model.params.", "training.tile", "training.batch_size", "parallelism.sequence_parallel.")


@dataclass(frozen=True)
class AutoDegree:
    """What ``degree: auto`` decided for one trial's spec: the degree, or None when none fits."""

    degree: int | None
    shape: ViTShape
    peaks: dict[int, float]  # predicted per-rank peak (bytes) of every degree the tokens and heads allow
    memory_per_worker: float
    max_degree: int
    kernel: str

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
                f"({self.shape.tokens} tokens, {self.kernel} attention kernel): the smallest predicted peak is "
                f"{need / 2**30:.2f} GiB per worker at SP={sp}, and a worker has {self.usable / 2**30:.2f} GiB "
                f"({self.memory_per_worker / 2**30:.2f} GiB memory_per_worker less "
                f"{PROCESS_RESERVE / 2**30:.2f} GiB for the process); raise memory_per_worker or max_degree, "
                "use a larger patch or the fused attention kernel")


def auto_sp_degree(spec: Spec, tile: Sequence[int]) -> AutoDegree:
    """The degree ``auto`` gives a trial of ``spec`` (a trial's spec) whose network input is ``tile``."""
    params = spec.model.params
    sp_spec = spec.parallelism.sequence_parallel
    if not isinstance(params, ViTSegParams):
        raise ValueError(f"degree 'auto' sizes vit-seg trials; model.name is {spec.model.name!r}")
    if sp_spec.memory_per_worker is None:
        raise ValueError("degree 'auto' needs parallelism.sequence_parallel.memory_per_worker")
    shape = ViTShape.of(params, tile, in_channels=spec.dataset.in_channels, num_classes=spec.dataset.num_classes)
    peaks: dict[int, float] = {}
    for sp in range(1, sp_spec.max_degree + 1):
        try:
            check_sequence_parallel(shape.grid, params.heads, sp, attention=sp_spec.attention,
                                    decoder=sp_spec.decoder, split=sp_spec.split, model_attention=params.attention)
        except ValueError:
            continue  # the tokens, the heads or the split do not suit this degree
        layout = SequenceLayout(sp=sp, attention=sp_spec.attention, decoder=sp_spec.decoder)
        peaks[sp] = vit_memory(shape, layout, batch=spec.training.batch_size, kernel=params.attention_kernel).peak
    choice = AutoDegree(None, shape, peaks, sp_spec.memory_per_worker, sp_spec.max_degree, params.attention_kernel)
    degree = next((sp for sp, peak in peaks.items() if peak <= choice.usable), None)
    return AutoDegree(degree, shape, peaks, choice.memory_per_worker, choice.max_degree, choice.kernel)


def memory_configs(spec: Spec) -> list[dict[str, Any]]:
    """Every combination of the searched values that can change ``degree: auto``'s choice (a range's two ends:
    the predicted memory grows with each of these fields), the others left as the spec has them."""
    paths = [path for path in spec.search.space if path.startswith(_MEMORY_PATHS)]
    values = [spec.search.space[path].values for path in paths]
    return [dict(zip(paths, combination)) for combination in itertools.product(*values)]
