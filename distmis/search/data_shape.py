"""What a trial's network sees of the data set (:class:`DataShape`, :func:`data_shape`) and whose rules its processes
follow (:func:`trial_device`): what the memory checks and the planners read before any work."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from distmis.spec.schema import Spec

__all__ = ["DataShape", "Tile", "data_shape", "trial_device"]

Tile = tuple[int, int, int]


@dataclass(frozen=True)
class DataShape:
    """What a trial's network sees of the data set: its channels in and out, the output's activation, the volume
    every case's tile must fit (each side the smallest over the cases) and the data set's voxels."""

    channels: tuple[int, int]
    activation: Literal["sigmoid", "softmax"]
    volume: Tile
    voxels: int


def trial_device(spec: Spec) -> tuple[Literal["cpu", "cuda"], int]:
    """The rules and threads of one of a trial's processes: a GPU's when it is given one, else its CPUs'."""
    from distmis.spec.load import trial_gpus

    par = spec.parallelism
    workers = par.mode != "experiment" or par.workers_per_trial > 1
    cpus = (par.resources_per_worker if workers else par.resources_per_trial).cpu
    return ("cuda" if trial_gpus(spec) > 0 else "cpu"), max(1, int(cpus))


def data_shape(spec: Spec) -> DataShape:
    """The data set's :class:`DataShape`, from its ``dataset.json`` and NIfTI headers (no voxel data).
    ValueError when no case's volume can be read."""
    from distmis.data.targets import target_scheme
    from distmis.search.data_config import dataset_description
    from distmis.search.input_fit import preprocessed_volumes

    description = dataset_description(spec)
    targets = target_scheme(description, spec.dataset.labels)
    shapes = [volume.shape for volume in preprocessed_volumes(spec)]
    if not shapes:
        raise ValueError(f"no case's preprocessed volume can be read at dataset.path {spec.dataset.path!r} (a "
                         "synthetic data set resampled to a spacing is known once generated)")
    volume = tuple(min(axis) for axis in zip(*shapes))
    voxels = sum(math.prod(shape) for shape in shapes)
    if spec.dataset.synthetic is not None and not Path(spec.dataset.path).exists():  # one shape for every case
        voxels *= spec.dataset.synthetic.cases
    return DataShape((len(description.channels), len(targets["channels"])), targets["activation"],
                     volume, voxels)  # type: ignore[arg-type]
