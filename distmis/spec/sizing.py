"""``parallelism.sequence_parallel.degree: auto`` for a trial's spec: the spec's values handed to the performance
arithmetic (:func:`distmis.perf.sizing.auto_degree`), and the searched values that can change its choice.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from distmis.perf.sizing import PROCESS_RESERVE, AutoDegree, auto_degree
from distmis.spec.schema import Spec

__all__ = ["PROCESS_RESERVE", "SP_DEGREE_PATH", "AutoDegree", "auto_sp_degree", "memory_configs"]

SP_DEGREE_PATH = "parallelism.sequence_parallel.degree"
# Search-space paths whose values can change what ``degree: auto`` chooses (the model's shapes and kernel,
# the tile and batch, the SP settings).
_MEMORY_PATHS = ("model.params.", "training.tile", "training.batch_size", "training.precision",
                 "parallelism.sequence_parallel.")


def auto_sp_degree(spec: Spec, tile: Sequence[int]) -> AutoDegree:
    """The degree ``auto`` gives a trial of ``spec`` (a trial's spec) whose network input is ``tile``."""
    from distmis.models.registry import model_entry

    params = spec.model.params
    sp_spec = spec.parallelism.sequence_parallel
    entry = model_entry(spec.model.name)
    if entry.perf_shape is None:
        raise ValueError(f"degree 'auto' sizes models the performance model describes (vit-seg); model.name is "
                         f"{spec.model.name!r}")
    if sp_spec.memory_per_worker is None:
        raise ValueError("degree 'auto' needs parallelism.sequence_parallel.memory_per_worker")
    shape = entry.perf_shape(params, tile, spec.dataset.in_channels, spec.dataset.num_classes)
    return auto_degree(shape, heads=params.heads, model_attention=params.attention,  # type: ignore[union-attr]
                       attention=sp_spec.attention, decoder=sp_spec.decoder, split=sp_spec.split,
                       batch=spec.training.batch_size, kernel=params.attention_kernel,  # type: ignore[union-attr]
                       memory_per_worker=sp_spec.memory_per_worker, max_degree=sp_spec.max_degree,
                       precision=spec.training.planned_precision)


def memory_configs(spec: Spec) -> list[dict[str, Any]]:
    """Every combination of the searched values that can change ``degree: auto``'s choice (a range's two ends:
    the predicted memory grows with each of these fields), the others left as the spec has them."""
    paths = [path for path in spec.search.space if path.startswith(_MEMORY_PATHS)]
    values = [spec.search.space[path].values for path in paths]
    return [dict(zip(paths, combination)) for combination in itertools.product(*values)]
