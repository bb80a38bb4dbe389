"""Segment scans with a model: the scan's own grid and header in, a label map in its data set's convention out.

Per case: read the modalities (:func:`~distmis.data.scans.read_scan`) and hand the raw image to the model
(:meth:`~distmis.predict.model.SegmentationModel.segment`): for a model saved as an MLflow python_function model,
its own ``predict`` - exactly what ``mlflow.pyfunc.load_model(...).predict(image)`` returns; for a model saved
before, the same functions (:mod:`distmis.pyfunc_model`) around its network. Either way the recipe is followed:
each channel normalised, reoriented and resampled where the model asks, centre crop / pad, resize, sliding
windows, every geometric step undone on the probabilities, thresholded (regions) or argmaxed (classes) and
written in the data set's label values. Then ``<case>_seg.nii.gz`` is written
with the scan's affine and header. Every file appears whole or not at all (written under a temporary name, then
renamed). With ``score``, the written labels are scored against the case's own label file.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from distmis.data.case_progress import case_progress
from distmis.data.errors import DataError
from distmis.predict.model import SegmentationModel
from distmis.predict.recipe import ModelRecipe

__all__ = ["CaseResult", "output_path", "check_output_folder", "check_outputs", "check_scans", "segment",
           "scan_spacing", "write_segmentation", "predict_scans"]

SEG_SUFFIX = "_seg.nii.gz"


@dataclass(frozen=True)
class CaseResult:
    """One segmented case: its file, the seconds it took (reading to writing) and, when scored, its metrics
    (``dice_<region>``, ``hd95_<region>`` in mm at the scan's spacing)."""

    case_id: str
    output: Path
    seconds: float
    scores: dict[str, float] | None = None


def output_path(output_dir: str | Path, case_id: str) -> Path:
    return Path(output_dir) / f"{case_id}{SEG_SUFFIX}"


def check_output_folder(output_dir: str | Path) -> Path:
    """``output_dir`` as a folder segmentations can be written to: an existing folder, or one that can be made
    in the nearest folder above it that exists. DataError naming the path when it, or a path above it, is a file
    (or anything else that is not a folder), or that folder is not writable. Nothing is left here: whether the folder
    takes a file is tried with an empty file, removed at once."""
    output_dir = Path(output_dir)
    allowed = "--output must be a folder: an existing one, or a new one in a folder you can write to"
    existing = output_dir
    while not existing.exists() and not existing.is_symlink() and existing != existing.parent:
        existing = existing.parent
    if existing.is_symlink() and not existing.exists():
        raise DataError(f"--output {str(output_dir)!r}: {str(existing)!r} is a broken symbolic link; {allowed}")
    if not existing.is_dir():
        where = "is a file" if existing.is_file() else "is not a folder"
        what = f"{str(existing)!r} {where}" if existing == output_dir else f"{str(existing)!r}, above it, {where}"
        raise DataError(f"--output {str(output_dir)!r}: {what}; {allowed}")
    if not os.access(existing, os.W_OK | os.X_OK) or not _can_create_in(existing):
        raise DataError(f"--output {str(output_dir)!r}: the folder {str(existing)!r} is not writable by this user; "
                        f"{allowed}")
    return output_dir


def _can_create_in(folder: Path) -> bool:
    """Whether a file can be made in ``folder``, tried for real: permission bits do not tell root, a read-only
    mount or an immutable folder apart from a writable one. The probe (an empty hidden file) is removed at once."""
    import tempfile

    try:
        handle, probe = tempfile.mkstemp(prefix=".distmis-probe-", dir=folder)
    except OSError:
        return False
    os.close(handle)
    os.unlink(probe)
    return True


def check_outputs(scans: Sequence[Any], output_dir: str | Path, *, overwrite: bool) -> list[Path]:
    """The files ``predict_scans`` will write; DataError, before anything is written, when ``output_dir`` cannot
    be a folder (:func:`check_output_folder`), a file exists (unless ``overwrite``) or is one of the inputs (never
    overwritten: a label file in a case folder, for instance)."""
    check_output_folder(output_dir)
    outputs = [output_path(output_dir, scan.case_id) for scan in scans]
    inputs = {Path(p).resolve() for scan in scans for p in (*scan.images, scan.label) if p is not None}
    clash = [str(p) for p in outputs if p.resolve() in inputs]
    if clash:
        raise DataError(f"--output {str(output_dir)!r} would overwrite input file(s) {clash[:3]}: choose another "
                        "output folder")
    existing = [str(p) for p in outputs if p.exists()]
    if existing and not overwrite:
        more = f" and {len(existing) - 3} more" if len(existing) > 3 else ""
        raise DataError(f"{', '.join(existing[:3])}{more} already exist(s); pass --overwrite to replace them, or "
                        "choose another --output folder")
    return outputs


def segment(model: SegmentationModel, image: np.ndarray, layout: str,
            spacing: Sequence[float] | None = None, orientation: str | None = None,
            folds: Sequence[int] | None = None, mirror: Sequence[int] | None = None) -> np.ndarray:
    """The label map ``(H, W, D)`` of a scan's image ``(H, W, D, C)``, in the data set's label values (brain-tumour
    label modes: ``layout``'s); ``spacing``: the scan's voxel spacing (mm), ``orientation``: its axis codes;
    ``folds``: a fold ensemble's folds to average (default all); ``mirror``: the axes each sliding window is
    test-time mirrored on (default the model's recipe's; ``()``: none)."""
    return model.segment(image, layout, spacing, orientation, folds=folds, mirror=mirror)


def scan_spacing(reference: Any) -> tuple[float, float, float]:
    """The voxel spacing (mm) of a scan, from its NIfTI header (1.0 for a missing axis)."""
    return tuple(float(z) for z in (tuple(reference.header.get_zooms()) + (1.0, 1.0, 1.0))[:3])  # type: ignore


def scan_orientation(reference: Any) -> str:
    """Where a scan's array axes point (e.g. ``"RAS"``, ``"LPS"``), from its NIfTI affine."""
    import nibabel as nib

    return "".join(nib.aff2axcodes(reference.affine))


def write_segmentation(labels: np.ndarray, reference: Any, path: str | Path) -> Path:
    """Write ``labels`` as NIfTI at ``path`` with ``reference``'s affine and header (data type uint8, or uint16 for label values above 255; no scaling,
    the spatial shape of the labels), whole or not at all."""
    import nibabel as nib

    path = Path(path)
    if tuple(labels.shape) != tuple(reference.shape[:3]):
        raise ValueError(f"labels {labels.shape} do not have the scan's spatial shape {reference.shape[:3]}")
    dtype = np.uint8 if labels.size == 0 or int(labels.max()) <= 255 else np.uint16
    header = reference.header.copy()
    header.set_data_dtype(dtype)
    image = nib.Nifti1Image(np.asarray(labels, dtype=dtype), reference.affine, header)
    image.header.set_slope_inter(1, 0)
    image.header["cal_min"], image.header["cal_max"] = 0, float(labels.max()) if labels.size else 0
    if isinstance(reference, nib.Nifti1Image):  # keep how the scan states its orientation
        image.set_qform(reference.affine, int(reference.header["qform_code"]))
        image.set_sform(reference.affine, int(reference.header["sform_code"]))
    staging = path.with_name(f".{path.name.removesuffix(SEG_SUFFIX)}.{os.getpid()}.partial.nii.gz")
    try:
        nib.save(image, str(staging))
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
    return path


def _scores(labels: np.ndarray, scan: Any, reference: Any, recipe: ModelRecipe) -> dict[str, float]:
    """Dice and HD95 of each scored channel of the model's target scheme (``dice_<key>``, ``hd95_<key>``): the
    written label map against the case's own, both in the data set's label values, at the scan's spacing."""
    from distmis.data.scans import read_scan_label
    from distmis.data.targets import foreground, label_channels, legacy_targets
    from distmis.pyfunc_model import EDEMA_VALUE
    from distmis.train.evaluation import case_metrics

    targets = recipe.scheme
    if recipe.brain_tumour and scan.layout.value != recipe.layout and scan.layout.value in EDEMA_VALUE:
        targets = legacy_targets(scan.layout.value, targets["mode"])  # written in the scan's layout's values
    scored = foreground(targets)
    first = len(targets["channels"]) - len(scored)  # a softmax scheme's background channel is not scored
    truth = label_channels(read_scan_label(scan, labels.shape, scan_dataset(scan, recipe)), targets)[..., first:]
    pred = label_channels(labels.astype(np.int32), targets)[..., first:]
    return case_metrics(pred.astype(bool), truth.astype(bool), scan_spacing(reference), [c["key"] for c in scored])


def scan_dataset(scan: Any, recipe: ModelRecipe | None) -> Any:
    """Whose label values a scan's label file holds: the scan's own layout's for a brain-tumour model (or none
    known), else the model's training data set's (its description)."""
    if recipe is None or recipe.brain_tumour:
        return None
    return recipe.description


def check_scans(scans: Sequence[Any], *, labels: bool = False, progress: bool = False,
                recipe: ModelRecipe | None = None) -> None:
    """Every scan's headers (:func:`~distmis.data.scans.check_scan`: the channels ``recipe`` takes), then every
    scan's voxel data, read once and not kept (:func:`~distmis.data.scans.check_scan_data`; with ``labels``, the
    label files' too, in the model's data set's label values). DataError naming the first bad file."""
    from distmis.data.scans import check_scan, check_scan_data

    channels = recipe.modalities if recipe is not None else None
    for scan in scans:  # the headers first: cheap, and most bad input shows there
        check_scan(scan, channels)
    for scan in case_progress(scans, "check", enabled=progress):
        check_scan_data(scan, label=labels, dataset=scan_dataset(scan, recipe))


def predict_scans(model: SegmentationModel, scans: Sequence[Any], output_dir: str | Path, *, score: bool = False,
                  progress: bool = True, overwrite: bool = False, checked: bool = False,
                  folds: Sequence[int] | None = None, mirror: Sequence[int] | None = None) -> list[CaseResult]:
    """Segment every scan into ``output_dir/<case>_seg.nii.gz``; with ``score``, also score the cases that have a
    label file. ``folds``, checked before anything else (:meth:`SegmentationModel.check_folds`): the folds of a fold
    ensemble to average (default all); ``mirror``, checked as well (:meth:`SegmentationModel.check_mirror`): the
    axes each sliding window is test-time mirrored on (default the model's recipe's; ``()``: none). The outputs
    (:func:`check_outputs`) and every scan's headers and voxel data (:func:`check_scans`) are checked before the
    first segmentation is written; ``checked``: the caller already ran :func:`check_scans` on these scans (with
    ``labels=score``), so their data is not read twice."""
    from distmis.data.scans import read_scan

    folds, mirror = model.check_folds(folds), model.check_mirror(mirror)
    output_dir = Path(output_dir)
    outputs = check_outputs(scans, output_dir, overwrite=overwrite)
    if not checked:  # every file before the first case: bad input stops the command before it writes
        check_scans(scans, labels=score, progress=progress, recipe=model.recipe)
    output_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for scan, path in zip(case_progress(scans, "predict", enabled=progress), outputs):
        start = time.perf_counter()
        image, reference = read_scan(scan, model.recipe.modalities)
        labels = segment(model, image, scan.layout, scan_spacing(reference), scan_orientation(reference), folds,
                         mirror)
        write_segmentation(labels, reference, path)
        scores = _scores(labels, scan, reference, model.recipe) if score and scan.label is not None else None
        results.append(CaseResult(scan.case_id, path, time.perf_counter() - start, scores))
    return results
