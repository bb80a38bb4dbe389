"""What the preprocessing learns from the training data once, before conversion: nnU-Net's fingerprint, in part.

* :func:`ct_statistics`: for each CT channel, the 0.5 and 99.5 percentiles, mean and standard deviation of its
  intensities over the foreground voxels (label > 0) of the training cases, as nnU-Net's CT normalisation uses
  them (clip to the percentiles, then z-score with the foreground mean and standard deviation, both of the
  unclipped values).
* :func:`median_spacing`: the per-axis median voxel spacing of the cases, read from their NIfTI headers (and
  permuted as the reorientation permutes the axes), with nnU-Net's rule for anisotropic data
  (:func:`anisotropic_target`): ``dataset.spacing: auto``.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from distmis.data.case_progress import case_progress
from distmis.data.errors import DataError
from distmis.data.layouts import CaseFiles, case_orientation, case_spacing, read_case

__all__ = ["ANISOTROPY_THRESHOLD", "FOREGROUND_SAMPLES_PER_CASE", "anisotropic_target", "ct_statistics",
           "median_spacing"]

#: nnU-Net's threshold: an axis whose spacing is more than this many times the others' is anisotropic.
ANISOTROPY_THRESHOLD = 3.0

#: At most this many foreground voxels of a case enter the statistics (a seeded uniform sample of the case's
#: foreground beyond that, so that a data set of large livers holds no more than this per case in memory).
FOREGROUND_SAMPLES_PER_CASE = 1_000_000


def _foreground_values(image: np.ndarray, label: np.ndarray, channels: Sequence[int], case_id: str) -> np.ndarray:
    """``(n, len(channels))`` float64 intensities of the case's foreground voxels, sampled down to
    :data:`FOREGROUND_SAMPLES_PER_CASE` with a generator seeded by the case id."""
    mask = label > 0
    values = image[mask][:, list(channels)].astype(np.float64)
    if len(values) > FOREGROUND_SAMPLES_PER_CASE:
        rng = np.random.default_rng(zlib.crc32(case_id.encode()))
        values = values[np.sort(rng.choice(len(values), FOREGROUND_SAMPLES_PER_CASE, replace=False))]
    return values


def ct_statistics(cases: Sequence[CaseFiles], dataset: Any, channels: Sequence[int], *,
                  progress: bool = False) -> dict[int, dict[str, float]]:
    """``{channel index: {"lower", "upper", "mean", "std"}}`` over the foreground voxels of ``cases`` (the training
    split's): the 0.5 / 99.5 percentiles (numpy's linear interpolation), mean and standard deviation of the channel's
    intensities where the case's label is non-zero.

    ``dataset``: the data set's description (or layout), as :func:`~distmis.data.layouts.read_case` takes it.

    Raises:
        DataError: when no training case has any foreground voxel (nothing to learn the statistics from).
    """
    if not channels:
        return {}
    parts = []
    for case in case_progress(cases, "ct statistics", enabled=progress):
        image, label, _ = read_case(case, dataset)
        parts.append(_foreground_values(image, label, channels, case.case_id))
    values = np.concatenate(parts) if parts else np.empty((0, len(channels)))
    if len(values) == 0:
        raise DataError("dataset.normalization 'ct' needs foreground voxels (label > 0) in the training cases to "
                        f"learn its intensity statistics from, and the {len(cases)} training case(s) have none")
    out = {}
    for column, channel in enumerate(channels):
        column_values = values[:, column]
        lower, upper = np.percentile(column_values, [0.5, 99.5])
        out[int(channel)] = {"lower": float(lower), "upper": float(upper), "mean": float(column_values.mean()),
                             "std": float(column_values.std())}
    return out


def anisotropic_target(spacings: np.ndarray, shapes: np.ndarray) -> tuple[float, float, float]:
    """The target spacing of cases of ``spacings`` and ``shapes`` (one row per case, per axis), by nnU-Net's rule:
    the per-axis median, except on anisotropic data. When the median spacing's coarsest axis is more than
    :data:`ANISOTROPY_THRESHOLD` times the finest of the others, and the median shape has fewer than a third of the
    others' smallest voxel count along it, that axis gets the 10th percentile of its spacings instead (no finer
    than the other axes): resampling every case to the median there would stretch the thin cases' few slices into
    many interpolated ones. (nnU-Net takes the shapes after its crop to the non-zero region; these are the stored
    shapes, read from the headers alone.)"""
    target = np.median(spacings, axis=0)
    size = np.median(shapes, axis=0)
    worst = int(np.argmax(target))
    others = [axis for axis in range(3) if axis != worst]
    coarse = max(target[axis] for axis in others)
    if target[worst] > ANISOTROPY_THRESHOLD * coarse and size[worst] * ANISOTROPY_THRESHOLD < min(size[others]):
        target[worst] = max(float(np.percentile(spacings[:, worst], 10)), coarse)
    return tuple(float(v) for v in target)  # type: ignore[return-value]


def median_spacing(cases: Sequence[CaseFiles], orientation: str | None = None) -> tuple[float, float, float]:
    """The target voxel spacing (mm) of ``cases`` from their headers: the per-axis median, with nnU-Net's rule
    for anisotropic data (:func:`anisotropic_target`); with ``orientation``, each case's spacing and shape are
    first permuted as reorienting it there permutes its axes."""
    from distmis.data.layouts import case_spatial_shape
    from distmis.pyfunc_model import reoriented_spacing

    if not cases:
        raise DataError("dataset.spacing 'auto' needs cases to take the median spacing of, and there are none")
    spacings, shapes = [], []
    for case in cases:
        spacing, shape = case_spacing(case), case_spatial_shape(case)
        if orientation is not None:
            spacing = reoriented_spacing(spacing, case_orientation(case), orientation)
            shape = reoriented_spacing(shape, case_orientation(case), orientation)  # the axes permuted alike
        spacings.append(spacing)
        shapes.append(shape)
    return anisotropic_target(np.asarray(spacings, dtype=np.float64), np.asarray(shapes, dtype=np.float64))
