"""Synthetic 3-D segmentation data sets, written as real NIfTI files.

:func:`synthesize_dataset` writes a small data set in an on-disk layout
(:class:`~distmis.data.layouts.Layout`), so that the whole pipeline (discovery,
reading, preprocessing, TFRecords, training, prediction) can be exercised
without real data.  Two kinds of data are made (:class:`SyntheticKind`):

``brain`` (the default; the quickstart's data)
    Four-channel MRI-like brain-tumour cases (:func:`synthesize_case`):

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

    Every file has 1 mm isotropic spacing.  Layouts: MSD ``dataset.json``,
    ``imagesTr/BRATS_XXX.nii.gz`` (float32, H x W x D x 4) and
    ``labelsTr/BRATS_XXX.nii.gz`` (uint8, 1 edema, 2 non-enhancing tumour, 3
    enhancing tumour).  nnU-Net v2: ``dataset.json``,
    ``imagesTr/BRATS_XXX_000{0,1,2,3}.nii.gz`` (float32, one channel each, FLAIR,
    T1w, T1gd, T2w) and ``labelsTr/BRATS_XXX.nii.gz`` (MSD's values).  BraTS:
    ``BraTS2021_XXXXX/BraTS2021_XXXXX_{flair,t1,t1ce,t2}.nii.gz`` (int16) and
    ``..._seg.nii.gz`` (uint8, values 0, 1, 2, 4).  BraTS 2023:
    ``BraTS-GLI-XXXXX-000/BraTS-GLI-XXXXX-000-{t2f,t1n,t1c,t2w}.nii.gz`` (int16)
    and ``...-seg.nii.gz`` (uint8, values 0-3).

``ct``
    One-channel, CT-like, multi-class abdominal cases (:func:`synthesize_ct_case`),
    in Hounsfield-like units stored as int16:

    * air (about -1000 HU) around an elliptic "body" cross-section that runs
      through the whole volume, with a subcutaneous fat layer (about -100 HU), a
      muscle wall (about 50 HU) and a soft-tissue interior (20-60 HU) with fat
      pockets;
    * a spine-like rod behind the organs: vertebral bodies with a cortical shell
      (700-1000 HU) around trabecular bone (about 300 HU), separated by discs;
    * three organ classes with distinct intensity and irregular smooth shapes, as in
      a contrast-enhanced (portal venous) scan: 1 liver (about 105 HU, large, on the
      patient's right), 2 spleen (about 125 HU, left, posterior) and 3 kidney (both
      kidneys, about 160 HU inside a brighter, about 200 HU, cortex); each placed
      with per-case random jitter, and each present in every case;
    * a smooth low-frequency intensity variation, partial-volume blurring and
      Gaussian noise (standard deviation 8-15 HU per case).

    Each case has its own anisotropic voxel spacing, drawn per case: in-plane
    0.7-1.0 mm (the same along both in-plane axes) and 1.5-3.0 mm between slices,
    stored in the affine and header.  The anatomy is defined in world (mm)
    coordinates: a frame of ``shape * (0.8, 0.8, 2.0)`` mm centred on the origin,
    so it looks alike whatever the case's spacing (every volume has ``shape``
    voxels; a larger spacing shows a larger field of view).  Cases are in RAS
    orientation, except the last ``lps_cases`` ones, which are written in LPS:
    the arrays flipped along their first two axes and the affine changed to
    match, so that every anatomical point keeps its world coordinates.
    Layouts: MSD (``dataset.json`` with ``modality {"0": "CT"}``,
    ``imagesTr/ct_XXX.nii.gz`` 3-D int16, ``labelsTr/ct_XXX.nii.gz`` uint8) and
    nnU-Net v2 (``dataset.json`` with ``channel_names {"0": "CT"}``,
    ``imagesTr/ct_XXX_0000.nii.gz``, ``labelsTr/ct_XXX.nii.gz``).  The BraTS
    layouts hold only the brain kind (each layout's registry entry says which kinds it holds).

The data set is written into a temporary sibling folder and renamed into
place at the end, so an interrupted run never leaves a half-written data set.
Output is a deterministic function of ``seed`` (and ``kind``, ``cases``,
``shape`` and ``lps_cases``); the brain kind's files are the same, byte for
byte, as before the CT kind existed.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from distmis.data.case_progress import case_progress
from distmis.data.dataset_layouts import DATASET_LAYOUTS, CaseFolderNaming, SyntheticKind, dataset_layout
from distmis.data.errors import DataError
from distmis.data.layouts import MODALITIES, Layout, channel_file_name, coerce_layout

__all__ = [
    "SyntheticKind",
    "CT_LABELS",
    "CT_FRAME_SPACING",
    "coerce_kind",
    "synthesize_dataset",
    "synthesize_case",
    "synthesize_ct_case",
]


#: Label value -> class name of the CT kind (0 is background).
CT_LABELS: dict[int, str] = {0: "background", 1: "liver", 2: "spleen", 3: "kidney"}

#: Voxel spacing (mm) that maps ``shape`` onto the CT kind's anatomical frame: the anatomy of a
#: data set of spatial shape ``shape`` is laid out in a box of ``shape * CT_FRAME_SPACING`` mm.
CT_FRAME_SPACING: tuple[float, float, float] = (0.8, 0.8, 2.0)

# Per-case voxel spacing ranges of the CT kind (mm): in-plane (both axes alike), between slices.
_CT_INPLANE_SPACING = (0.7, 1.0)
_CT_SLICE_SPACING = (1.5, 3.0)

# MSD Task01's channel names (MSD "modality", and nnU-Net "channel_names" of the brain kind).
_BRAIN_CHANNELS = ("FLAIR", "T1w", "t1gd", "T2w")
_BRAIN_LABELS = {0: "background", 1: "edema", 2: "non-enhancing tumor", 3: "enhancing tumour"}


def coerce_kind(kind: SyntheticKind | str) -> SyntheticKind:
    """Return ``kind`` as a :class:`SyntheticKind`, or raise a ValueError listing the kinds."""
    if isinstance(kind, SyntheticKind):
        return kind
    try:
        return SyntheticKind(kind)
    except ValueError:
        allowed = ", ".join(repr(k.value) for k in SyntheticKind)
        raise ValueError(f"unknown synthetic kind {kind!r}; expected one of {allowed}") from None


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

    edema_value, enhancing_value, core_value = dataset_layout(layout).synthetic.brain_labels
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


def _frame_field(rng: np.random.Generator, cells: int, u: Sequence[np.ndarray]) -> np.ndarray:
    """Smooth random field with about unit standard deviation, defined in the anatomical frame.

    The field lives on a ``(cells + 1)^3`` random grid spanning ``[-1, 1]`` frame units per axis (the
    frame box is ``[-0.5, 0.5]``), and is evaluated by cubic spline at the points ``u`` (three arrays
    of frame coordinates that broadcast together), so it depends on world position, not on voxels.
    """
    from scipy import ndimage

    grid = ndimage.gaussian_filter(rng.standard_normal((cells + 1,) * 3), 0.6, mode="nearest")
    grid = (grid - grid.mean()) / grid.std()
    coords = np.stack([np.clip((c + 1.0) / 2.0 * cells, 0.0, cells) for c in np.broadcast_arrays(*u)])
    return ndimage.map_coordinates(grid, coords, order=3, mode="nearest").astype(np.float32)


def _blob(
    rng: np.random.Generator,
    u: Sequence[np.ndarray],
    centre: Sequence[float],
    radii: Sequence[float],
    *,
    jitter: float,
    roughness: float,
) -> np.ndarray:
    """Normalised radius of an irregular ellipsoid: < 1 inside. Its centre is jittered by up to
    ``jitter`` frame units per axis, its radii scaled by 0.9-1.1, its surface perturbed by a smooth field."""
    centre = np.asarray(centre) + rng.uniform(-jitter, jitter, 3)
    radii = np.asarray(radii) * rng.uniform(0.9, 1.1, 3)
    rho = np.sqrt(sum(((u[i] - centre[i]) / radii[i]) ** 2 for i in range(3)))
    return rho * (1.0 + roughness * _frame_field(rng, 10, u))


def synthesize_ct_case(
    shape: Sequence[int], rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, tuple[float, float, float]]:
    """Make one CT-like case in memory, in RAS orientation.

    The case's voxel spacing is drawn first (in-plane 0.7-1.0 mm, 1.5-3.0 mm between slices); the
    anatomy is laid out in world coordinates (see the module docstring), with the volume centred on
    the world origin (:func:`_centred_affine`).

    Returns:
        ``(image, label, spacing)``: int16 ``(H, W, D)`` Hounsfield-like intensities, a uint8
        ``(H, W, D)`` label map with values :data:`CT_LABELS` (every class present), and the voxel
        spacing ``(x, y, z)`` in mm.
    """
    from scipy import ndimage

    shape3 = tuple(int(s) for s in shape)
    if len(shape3) != 3 or min(shape3) < 8:
        raise ValueError(f"shape must be 3 integers >= 8, got {tuple(shape)!r}")
    inplane = float(rng.uniform(*_CT_INPLANE_SPACING))
    spacing = (round(inplane, 4), round(inplane, 4), round(float(rng.uniform(*_CT_SLICE_SPACING)), 4))
    # Frame coordinates of the voxel centres: world mm / frame size (the frame box is [-0.5, 0.5]^3).
    frame = np.array(shape3) * np.array(CT_FRAME_SPACING)
    u = [
        (((np.arange(n) - (n - 1) / 2.0) * s / f).astype(np.float32)).reshape([-1 if i == a else 1 for i in range(3)])
        for a, (n, s, f) in enumerate(zip(shape3, spacing, frame))
    ]
    shift = rng.uniform(-0.02, 0.02, 3)  # where the patient lies in the scanner
    u = [u[i] - np.float32(shift[i]) for i in range(3)]
    x, y, z = u  # RAS: +x towards the patient's right, +y anterior, +z superior

    # Body: an elliptic cylinder along z with an irregular outline.
    body_r = np.sqrt((x / (0.44 * rng.uniform(0.95, 1.05))) ** 2 + (y / (0.33 * rng.uniform(0.95, 1.05))) ** 2)
    body_r = body_r * (1.0 + 0.025 * _frame_field(rng, 6, u))
    body = body_r < 1.0
    fat_layer = body & (body_r >= 0.87)
    wall = body & (body_r >= 0.79) & (body_r < 0.87)
    cavity = body_r < 0.79

    # Spine: vertebral bodies (cortical shell, trabecular core) separated by discs, posterior midline.
    spine_r = np.sqrt((x / 0.06) ** 2 + ((y + 0.21 + rng.uniform(-0.01, 0.01)) / 0.055) ** 2)
    period = 0.16 * rng.uniform(0.9, 1.1)
    disc = ((z / period + rng.uniform()) % 1.0) < 0.18
    spine = spine_r < 1.0
    cortical = spine & (spine_r >= 0.72) & ~disc
    trabecular = spine & (spine_r < 0.72) & ~disc

    # Organs (frame units; RAS, so the patient's right is +x): earlier ones win where they overlap.
    liver = _blob(rng, u, (0.14, 0.03, 0.08), (0.21, 0.17, 0.19), jitter=0.025, roughness=0.12)
    spleen = _blob(rng, u, (-0.22, -0.05, 0.13), (0.11, 0.13, 0.14), jitter=0.02, roughness=0.10)
    kidneys = np.minimum(
        _blob(rng, u, (0.17, -0.14, -0.13), (0.09, 0.11, 0.16), jitter=0.015, roughness=0.08),
        _blob(rng, u, (-0.17, -0.14, -0.11), (0.09, 0.11, 0.16), jitter=0.015, roughness=0.08),
    )
    allowed = cavity & ~spine
    label = np.zeros(shape3, dtype=np.uint8)
    for value, rho in ((1, liver), (2, spleen), (3, kidneys)):
        free = allowed & (label == 0)
        inside = (rho < 1.0) & free
        if not inside.any():  # tiny volumes: never leave a class out
            inside = np.zeros(shape3, dtype=bool)
            inside[np.unravel_index(int(np.argmin(np.where(free, rho, np.inf))), shape3)] = True
        label[inside] = value

    # Intensities (HU).
    texture = _frame_field(rng, 14, u)
    soft = 38.0 + 10.0 * texture  # 20-60 HU soft tissue (bowel, muscle)
    fat_pockets = 1.0 / (1.0 + np.exp(-6.0 * (_frame_field(rng, 8, u) - 0.3)))
    nearest_organ = np.minimum(np.minimum(liver, spleen), kidneys)
    fat_pockets = np.maximum(fat_pockets, np.clip((1.25 - nearest_organ) / 0.1, 0.0, 1.0))  # fat around the organs
    hu = np.full(shape3, -1000.0, dtype=np.float32)
    hu = np.where(cavity, soft * (1.0 - fat_pockets) + (-100.0 + 8.0 * texture) * fat_pockets, hu)
    hu = np.where(wall, 50.0 + 6.0 * texture, hu)
    hu = np.where(fat_layer, -100.0 + 8.0 * texture, hu)
    hu = np.where(trabecular, 300.0 + 40.0 * texture, hu)
    hu = np.where(cortical, rng.uniform(750.0, 950.0) + 50.0 * texture, hu)
    hu = np.where(spine & disc, 90.0, hu)
    # contrast-enhanced (portal venous phase), as the MSD and nnU-Net abdominal CTs mostly are
    organ_hu = {1: 105.0 + rng.uniform(-6, 6), 2: 125.0 + rng.uniform(-6, 6), 3: 160.0 + rng.uniform(-8, 8)}
    for value, level in organ_hu.items():
        hu = np.where(label == value, level + 4.0 * texture, hu)
    hu = np.where((label == 3) & (kidneys >= 0.72), 200.0 + 8.0 * texture, hu)  # brighter cortex
    hu = hu + np.where(body, 8.0 * _frame_field(rng, 3, u), 0.0)  # low-frequency variation
    hu = ndimage.gaussian_filter(hu, 0.4, truncate=2.5)  # partial-volume edges
    hu = hu + rng.standard_normal(shape3, dtype=np.float32) * np.float32(rng.uniform(8.0, 15.0))
    image = np.clip(np.round(hu), -1024, 3071).astype(np.int16)
    return image, label, spacing


def _affine(shape: tuple[int, int, int]) -> np.ndarray:
    """1 mm isotropic affine with the volume centred on the origin."""
    affine = np.eye(4)
    affine[:3, 3] = -(np.array(shape) - 1) / 2.0
    return affine


def _centred_affine(shape: tuple[int, int, int], spacing: Sequence[float]) -> np.ndarray:
    """RAS affine with voxel ``spacing`` (mm) and the volume centred on the world origin."""
    affine = np.diag([*map(float, spacing), 1.0])
    affine[:3, 3] = -(np.array(shape) - 1) / 2.0 * np.array(spacing, dtype=np.float64)
    return affine


def _to_lps(array: np.ndarray, affine: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same voxels in LPS orientation: ``array`` (RAS) flipped along its first two axes, and an
    affine that gives every voxel the world coordinates it had."""
    flip = np.eye(4)
    for axis in (0, 1):
        flip[axis, axis] = -1.0
        flip[axis, 3] = array.shape[axis] - 1
    return np.ascontiguousarray(array[::-1, ::-1]), affine @ flip


def _save(array: np.ndarray, affine: np.ndarray, path: Path) -> None:
    import nibabel as nib

    path.parent.mkdir(parents=True, exist_ok=True)
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


def _ct_msd_dataset_json(case_ids: list[str]) -> dict:
    return {
        "name": "SyntheticCT",
        "description": "Synthetic CT-like abdomen (liver, spleen, kidney) in the MSD layout (distmis)",
        "reference": "synthetic",
        "licence": "CC-BY-SA 4.0",
        "tensorImageSize": "3D",
        "modality": {"0": "CT"},
        "labels": {str(v): name for v, name in CT_LABELS.items()},
        "numTraining": len(case_ids),
        "numTest": 0,
        "training": [{"image": f"./imagesTr/{c}.nii.gz", "label": f"./labelsTr/{c}.nii.gz"} for c in case_ids],
        "test": [],
    }


def _nnunet_dataset_json(kind: SyntheticKind, case_ids: list[str]) -> dict:
    brain = kind is SyntheticKind.BRAIN
    channels, labels = (_BRAIN_CHANNELS, _BRAIN_LABELS) if brain else (("CT",), CT_LABELS)
    what = "brain tumour (MSD Task01-like)" if brain else "CT-like abdomen (liver, spleen, kidney)"
    return {
        "name": "BrainTumour" if brain else "SyntheticCT",
        "description": f"Synthetic {what} data in the nnU-Net v2 raw layout (distmis)",
        "channel_names": {str(i): name for i, name in enumerate(channels)},
        "labels": {name: value for value, name in labels.items()},
        "numTraining": len(case_ids),
        "file_ending": ".nii.gz",
    }


def _case_ids(kind: SyntheticKind, layout: Layout, cases: int) -> list[str]:
    """Case ids in the style of each layout's real data sets (sorted as numbered)."""
    if kind is SyntheticKind.CT:
        return [f"ct_{i:03d}" for i in range(cases)]
    return [dataset_layout(layout).synthetic.brain_case_id(i) for i in range(cases)]


def _check_kind_layout(kind: SyntheticKind, layout: Layout) -> None:
    if kind not in dataset_layout(layout).synthetic.kinds:
        allowed = ", ".join(repr(l.value) for l, e in DATASET_LAYOUTS.items() if kind in e.synthetic.kinds)
        raise ValueError(f"synthetic kind {kind.value!r} cannot be written in layout {layout.value!r}; "
                         f"kind {kind.value!r} is written in layouts {allowed}")


def write_msd_case(folder: Path, case_id: str, image: np.ndarray, label: np.ndarray, affine: np.ndarray) -> None:
    """One MSD case: ``imagesTr/<case>.nii.gz`` (3-D, or 4-D with the channels last) and ``labelsTr/<case>.nii.gz``."""
    _save(image, affine, folder / "imagesTr" / f"{case_id}.nii.gz")
    _save(label, affine, folder / "labelsTr" / f"{case_id}.nii.gz")


def write_nnunet_case(folder: Path, case_id: str, image: np.ndarray, label: np.ndarray, affine: np.ndarray) -> None:
    """One nnU-Net v2 case: ``imagesTr/<case>_XXXX.nii.gz``, one 3-D file per channel, and its label."""
    channels = image[..., np.newaxis] if image.ndim == 3 else image
    for c in range(channels.shape[-1]):
        _save(np.ascontiguousarray(channels[..., c]), affine, folder / "imagesTr" / channel_file_name(case_id, c))
    _save(label, affine, folder / "labelsTr" / f"{case_id}.nii.gz")


def write_case_folder_case(folder: Path, case_id: str, image: np.ndarray, label: np.ndarray, affine: np.ndarray, *,
                           naming: CaseFolderNaming) -> None:
    """One case of a layout of one folder per case: ``<case>/`` holding a 3-D int16 file per modality and the
    label, named as ``naming`` (:class:`~distmis.data.dataset_layouts.CaseFolderNaming`) says."""
    case_folder = folder / case_id
    case_folder.mkdir()
    intensities = np.round(image).astype(np.int16)
    modality_stems, label_stem = naming.stems(case_id)
    for m, stem in enumerate(modality_stems):
        _save(intensities[..., m], affine, case_folder / f"{stem}.nii.gz")
    _save(label, affine, case_folder / f"{label_stem}.nii.gz")


def _write_json(path: Path, meta: dict) -> None:
    path.write_text(json.dumps(meta, indent=2) + "\n")


def write_msd_index(folder: Path, kind: SyntheticKind, case_ids: list[str]) -> None:
    """An MSD data set's dataset.json."""
    _write_json(folder / "dataset.json",
                _msd_dataset_json(case_ids) if kind is SyntheticKind.BRAIN else _ct_msd_dataset_json(case_ids))


def write_nnunet_index(folder: Path, kind: SyntheticKind, case_ids: list[str]) -> None:
    """An nnU-Net v2 data set's dataset.json."""
    _write_json(folder / "dataset.json", _nnunet_dataset_json(kind, case_ids))


def synthesize_dataset(
    root: str | Path,
    layout: Layout | str,
    *,
    cases: int,
    shape: Sequence[int],
    seed: int = 0,
    progress: bool = True,
    kind: SyntheticKind | str = SyntheticKind.BRAIN,
    lps_cases: int = 0,
) -> list[str]:
    """Write a synthetic data set of ``cases`` cases of spatial ``shape`` to ``root``.

    Args:
        root: output folder; must not exist or be empty.
        layout: ``msd``, ``nnunet``, ``brats`` or ``brats2023`` (see the module docstring); the
            ``ct`` kind is written in ``msd`` and ``nnunet`` only (their registry entries' ``synthetic.kinds``).
        cases: number of cases (>= 1).
        shape: spatial shape ``(H, W, D)``, each >= 8.
        seed: the data set is a deterministic function of the seed.
        progress: show the progress on stderr (:mod:`~distmis.data.case_progress`).
        kind: ``brain`` (four-channel MRI-like brain tumours, 1 mm spacing; the default) or ``ct``
            (one-channel CT-like abdomen with liver / spleen / kidney classes and per-case
            anisotropic spacing).
        lps_cases: how many cases, the last ones, to write in LPS orientation instead of RAS
            (0 to ``cases``); their anatomy keeps its world coordinates.

    Returns:
        the case ids, sorted.

    Raises:
        ValueError: an unknown layout or kind, a kind the layout cannot hold, ``cases < 1``, a bad
            ``shape`` or ``lps_cases`` outside ``[0, cases]``.
        DataError: if ``root`` exists and is not an empty folder.
    """
    layout = coerce_layout(layout)
    kind = coerce_kind(kind)
    _check_kind_layout(kind, layout)
    if int(cases) < 1:
        raise ValueError(f"cases must be >= 1, got {cases!r}")
    if not 0 <= int(lps_cases) <= int(cases):
        raise ValueError(f"lps_cases must be between 0 and cases ({int(cases)}), got {lps_cases!r}")
    shape3 = tuple(int(s) for s in shape)
    if len(shape3) != 3 or min(shape3) < 8:
        raise ValueError(f"shape must be 3 integers >= 8, got {tuple(shape)!r}")
    root = Path(root)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise DataError(f"output folder {str(root)!r} already exists and is not empty; choose a new folder")

    case_ids = _case_ids(kind, layout, int(cases))
    first_lps = int(cases) - int(lps_cases)

    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()  # in the try: a Ctrl-C the moment the folder is made still removes it
        writer = dataset_layout(layout).synthetic
        desc = f"synthesize {kind.value} ({layout.value})"
        for index, case_id in enumerate(case_progress(case_ids, desc, enabled=progress)):
            if kind is SyntheticKind.BRAIN:
                image, label = synthesize_case(shape3, layout, np.random.default_rng([int(seed), index]))
                affine = _affine(shape3)  # type: ignore[arg-type]
            else:
                image, label, spacing = synthesize_ct_case(shape3, np.random.default_rng([int(seed), index, 1]))
                affine = _centred_affine(shape3, spacing)  # type: ignore[arg-type]
            if index >= first_lps:
                image, _ = _to_lps(image, affine)
                label, affine = _to_lps(label, affine)
            writer.write_case(tmp, case_id, image, label, affine)
        writer.write_index(tmp, kind, case_ids)
        if root.exists():
            root.rmdir()  # checked empty above
        os.replace(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return case_ids
