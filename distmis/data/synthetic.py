"""Synthetic brain-tumour data sets, written as real NIfTI files.

:func:`synthesize_dataset` writes a small data set in any on-disk layout
(:class:`~distmis.data.layouts.Layout`), so that the whole pipeline (discovery,
reading, preprocessing, TFRecords, training) can be exercised without the real
MSD / BraTS data.  Each case is built as follows:

* a "brain": an ellipsoid with a slightly irregular surface, filled with a
  smooth two-tissue texture (grey-matter-like near the surface and in blobs,
  white-matter-like elsewhere); everything outside it is exactly 0, as in
  skull-stripped BraTS images;
* one tumour at a random position inside the brain, with a random size (the
  whole tumour covers roughly 3-12 % of the volume) and an irregular
  (noise-perturbed ellipsoid) shape, made of three nested compartments:
  a necrotic / non-enhancing core, an enhancing rim around it and an edema
  shell around that;
* modality-dependent contrast: FLAIR shows edema and tumour bright, T1 shows
  the tumour slightly dark, T1gd shows the enhancing rim very bright, T2 shows
  edema and core bright;
* per-case intensity scale, a mild multiplicative bias field and Gaussian noise.

MSD layout: ``dataset.json``, ``imagesTr/BRATS_XXX.nii.gz`` (float32, H x W x D x 4)
and ``labelsTr/BRATS_XXX.nii.gz`` (uint8, values 0-3).  BraTS layout:
``BraTS2021_XXXXX/BraTS2021_XXXXX_{flair,t1,t1ce,t2}.nii.gz`` (int16) and
``..._seg.nii.gz`` (uint8, values 0, 1, 2, 4).  BraTS 2023 layout:
``BraTS-GLI-XXXXX-000/BraTS-GLI-XXXXX-000-{t2f,t1n,t1c,t2w}.nii.gz`` (int16) and
``...-seg.nii.gz`` (uint8, values 0-3).  All files have 1 mm spacing.

The data set is written into a temporary sibling folder and renamed into
place at the end, so an interrupted run never leaves a half-written data set.
Output is a deterministic function of ``seed`` (and ``cases``/``shape``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from distmis.data.errors import DataError
from distmis.data.layouts import MODALITIES, Layout, case_file_stems, coerce_layout

__all__ = ["synthesize_dataset", "synthesize_case"]

# Tissue intensities (white-matter-like, grey-matter-like), per modality in MODALITIES order.
_TISSUE = np.array([[0.55, 0.68], [0.82, 0.62], [0.80, 0.64], [0.45, 0.68]], dtype=np.float32)
# Additive tumour contrast per modality for (edema, enhancing rim, necrotic core).
_TUMOUR = np.array(
    [
        [0.55, 0.45, 0.35],  # FLAIR: edema and tumour bright
        [-0.12, -0.20, -0.30],  # T1: tumour slightly dark
        [-0.08, 0.95, -0.25],  # T1gd: enhancing rim very bright
        [0.50, 0.30, 0.65],  # T2: edema and core bright
    ],
    dtype=np.float32,
)
# Typical intensity of each modality in the written files (before the per-case scale).
_SCALE = np.array([420.0, 610.0, 700.0, 520.0], dtype=np.float32)
# Label values for (edema, enhancing, necrotic/non-enhancing core) per layout.
_LABELS = {Layout.MSD: (1, 3, 2), Layout.BRATS: (2, 4, 1), Layout.BRATS2023: (2, 3, 1)}


def _smooth_noise(rng: np.random.Generator, shape: tuple[int, int, int], cells: int) -> np.ndarray:
    """Smooth random field with unit standard deviation, varying on ~``max(shape)/cells`` voxels."""
    from scipy import ndimage

    coarse_shape = tuple(max(2, round(cells * s / max(shape)) + 1) for s in shape)
    coarse = rng.standard_normal(coarse_shape).astype(np.float32)
    field = ndimage.zoom(coarse, [s / c for s, c in zip(shape, coarse_shape)], order=1, mode="nearest", grid_mode=False)
    field = ndimage.gaussian_filter(field, 0.3 * max(shape) / cells, truncate=2.0)
    std = float(field.std())
    return (field - field.mean()) / (std if std > 0 else 1.0)


def synthesize_case(
    shape: Sequence[int], layout: Layout | str, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Make one synthetic case in memory.

    Returns:
        ``(image, label)``: float32 ``(H, W, D, 4)`` intensities (0 outside the
        brain, positive inside) in :data:`~distmis.data.layouts.MODALITIES`
        order, and a uint8 ``(H, W, D)`` label map with the layout's values.
    """
    from scipy import ndimage

    layout = coerce_layout(layout)
    shape3 = tuple(int(s) for s in shape)
    if len(shape3) != 3 or min(shape3) < 8:
        raise ValueError(f"shape must be 3 integers >= 8, got {tuple(shape)!r}")
    size = np.array(shape3, dtype=np.float64)
    axes = [np.arange(s, dtype=np.float32).reshape([-1 if i == a else 1 for i in range(3)]) for a, s in enumerate(shape3)]

    # Brain: ellipsoid (radii in voxels) with a noisy surface.
    brain_radii = rng.uniform(0.84, 0.93, 3) * size / 2
    brain_centre = (size - 1) / 2 + rng.uniform(-0.02, 0.02, 3) * size
    brain_r = np.sqrt(sum(((axes[i] - brain_centre[i]) / brain_radii[i]) ** 2 for i in range(3)))
    brain = brain_r < 1.0 + 0.05 * _smooth_noise(rng, shape3, 4)

    # Tissue: grey-matter-like near the surface and in blobs, white-matter-like elsewhere.
    cortex = np.clip((brain_r - 0.78) / 0.2, 0.0, 1.0)
    grey = np.clip(1.0 / (1.0 + np.exp(-2.5 * _smooth_noise(rng, shape3, 8))) * 0.6 + 0.7 * cortex, 0.0, 1.0)
    fine = 0.035 * _smooth_noise(rng, shape3, 16)

    # Tumour: nested, noise-perturbed ellipsoids, placed so that it fits in the brain.
    fraction = rng.uniform(0.028, 0.10)
    aspect = rng.uniform(0.8, 1.25, 3)
    aspect /= np.cbrt(np.prod(aspect))
    radii = np.cbrt(3 * fraction * size.prod() / (4 * np.pi)) * aspect
    direction = rng.standard_normal(3)
    direction *= rng.uniform() ** (1 / 3) / np.linalg.norm(direction)  # uniform in the unit ball
    slack = np.maximum(brain_radii - 1.05 * radii, 0.0) * 0.8
    centre = brain_centre + direction * slack
    rho = np.sqrt(sum(((axes[i] - centre[i]) / radii[i]) ** 2 for i in range(3)))
    rho = rho * (1.0 + 0.16 * _smooth_noise(rng, shape3, 6))
    enhancing_edge = rng.uniform(0.55, 0.72)
    core_edge = enhancing_edge * rng.uniform(0.5, 0.72)
    whole = (rho < 1.0) & brain
    enhancing = (rho < enhancing_edge) & brain
    core = (rho < core_edge) & brain
    centre_voxel = tuple(int(round(c)) for c in np.clip(centre, 0, size - 1))
    if brain[centre_voxel]:  # tiny volumes: make sure the tumour is never empty
        whole[centre_voxel] = enhancing[centre_voxel] = core[centre_voxel] = True

    edema_value, enhancing_value, core_value = _LABELS[layout]
    label = np.zeros(shape3, dtype=np.uint8)
    label[whole] = edema_value
    label[enhancing] = enhancing_value
    label[core] = core_value

    # Intensities per modality.
    compartments = np.stack([whole & ~enhancing, enhancing & ~core, core], axis=0).astype(np.float32)
    case_scale = _SCALE * rng.uniform(0.75, 1.35, len(MODALITIES))
    image = np.zeros(shape3 + (len(MODALITIES),), dtype=np.float32)
    for m in range(len(MODALITIES)):
        tissue = _TISSUE[m, 0] * (1.0 - grey) + _TISSUE[m, 1] * grey + fine
        tumour = np.tensordot(_TUMOUR[m], compartments, axes=1)
        tumour = ndimage.gaussian_filter(tumour, 0.6, truncate=2.0)  # partial-volume edges
        bias = np.exp(0.08 * _smooth_noise(rng, shape3, 2))
        noise = rng.standard_normal(shape3, dtype=np.float32) * 0.025
        value = case_scale[m] * bias * np.maximum(tissue + tumour + noise, 0.05)
        image[..., m] = np.where(brain, np.maximum(value, 1.0), 0.0)
    return image, label


def _affine(shape: tuple[int, int, int]) -> np.ndarray:
    """1 mm isotropic affine with the volume centred on the origin."""
    affine = np.eye(4)
    affine[:3, 3] = -(np.array(shape) - 1) / 2.0
    return affine


def _save(array: np.ndarray, affine: np.ndarray, path: Path) -> None:
    import nibabel as nib

    img = nib.Nifti1Image(array, affine)
    img.header.set_xyzt_units("mm")
    img.set_qform(affine, code=1)
    img.set_sform(affine, code=1)
    nib.save(img, str(path))


def _msd_dataset_json(case_ids: list[str]) -> dict:
    return {
        "name": "BRATS",
        "description": "Synthetic brain tumour data in the MSD Task01_BrainTumour layout (distmis)",
        "reference": "synthetic",
        "licence": "CC-BY-SA 4.0",
        "tensorImageSize": "4D",
        "modality": {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"},
        "labels": {"0": "background", "1": "edema", "2": "non-enhancing tumor", "3": "enhancing tumour"},
        "numTraining": len(case_ids),
        "numTest": 0,
        "training": [{"image": f"./imagesTr/{c}.nii.gz", "label": f"./labelsTr/{c}.nii.gz"} for c in case_ids],
        "test": [],
    }


def _case_ids(layout: Layout, cases: int) -> list[str]:
    """Case ids in the style of each layout's real data sets (sorted as numbered)."""
    if layout is Layout.MSD:
        return [f"BRATS_{i + 1:03d}" for i in range(cases)]
    if layout is Layout.BRATS:
        return [f"BraTS2021_{i:05d}" for i in range(cases)]
    return [f"BraTS-GLI-{i:05d}-000" for i in range(cases)]


def synthesize_dataset(
    root: str | Path,
    layout: Layout | str,
    *,
    cases: int,
    shape: Sequence[int],
    seed: int = 0,
    progress: bool = True,
) -> list[str]:
    """Write a synthetic data set of ``cases`` cases of spatial ``shape`` to ``root``.

    Args:
        root: output folder; must not exist or be empty.
        layout: ``msd``, ``brats`` or ``brats2023`` (see the module docstring).
        cases: number of cases (>= 1).
        shape: spatial shape ``(H, W, D)``, each >= 8.
        seed: the data set is a deterministic function of the seed.
        progress: show a tqdm progress bar on stderr.

    Returns:
        the case ids, sorted.

    Raises:
        DataError: if ``root`` exists and is not an empty folder.
    """
    from tqdm import tqdm

    layout = coerce_layout(layout)
    if int(cases) < 1:
        raise ValueError(f"cases must be >= 1, got {cases!r}")
    shape3 = tuple(int(s) for s in shape)
    if len(shape3) != 3 or min(shape3) < 8:
        raise ValueError(f"shape must be 3 integers >= 8, got {tuple(shape)!r}")
    root = Path(root)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise DataError(f"output folder {str(root)!r} already exists and is not empty; choose a new folder")

    case_ids = _case_ids(layout, int(cases))
    affine = _affine(shape3)  # type: ignore[arg-type]

    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if layout is Layout.MSD:
            (tmp / "imagesTr").mkdir()
            (tmp / "labelsTr").mkdir()
        for index, case_id in enumerate(tqdm(case_ids, desc=f"synthesize ({layout.value})", unit="case", disable=not progress, file=sys.stderr)):
            image, label = synthesize_case(shape3, layout, np.random.default_rng([int(seed), index]))
            if layout is Layout.MSD:
                _save(image, affine, tmp / "imagesTr" / f"{case_id}.nii.gz")
                _save(label, affine, tmp / "labelsTr" / f"{case_id}.nii.gz")
            else:
                folder = tmp / case_id
                folder.mkdir()
                intensities = np.round(image).astype(np.int16)
                modality_stems, label_stem = case_file_stems(layout, case_id)
                for m, stem in enumerate(modality_stems):
                    _save(intensities[..., m], affine, folder / f"{stem}.nii.gz")
                _save(label, affine, folder / f"{label_stem}.nii.gz")
        if layout is Layout.MSD:
            (tmp / "dataset.json").write_text(json.dumps(_msd_dataset_json(case_ids), indent=2) + "\n")
        if root.exists():
            root.rmdir()  # checked empty above
        os.replace(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return case_ids
