"""On-disk layouts of brain-tumour data sets, and reading one case.

Two layouts are supported (see :class:`Layout`):

``msd``
    Medical Segmentation Decathlon, Task01_BrainTumour::

        root/dataset.json                 # its "training" list names the cases
        root/imagesTr/BRATS_001.nii.gz    # (H, W, D, 4): FLAIR, T1w, T1gd, T2w
        root/labelsTr/BRATS_001.nii.gz    # (H, W, D): 0 bg, 1 edema,
                                          #   2 non-enhancing tumour, 3 enhancing

``brats``
    BraTS challenge (2018-2021), one folder per case::

        root/BraTS2021_00000/BraTS2021_00000_flair.nii.gz   # (H, W, D) each
        root/BraTS2021_00000/BraTS2021_00000_t1.nii.gz
        root/BraTS2021_00000/BraTS2021_00000_t1ce.nii.gz
        root/BraTS2021_00000/BraTS2021_00000_t2.nii.gz
        root/BraTS2021_00000/BraTS2021_00000_seg.nii.gz     # 0 bg, 1 necrotic /
                                                            # non-enhancing core,
                                                            # 2 edema, 4 enhancing

:func:`discover_cases` lists the cases of a data set as :class:`CaseFiles`, and
:func:`read_case` loads one of them as numpy arrays, in a layout-independent
form: a float32 image ``(H, W, D, 4)`` whose channels follow
:data:`MODALITIES`, an int16 label ``(H, W, D)`` that keeps the layout's own
label values, and the voxel spacing.  Arrays are returned as stored in the
file (no reorientation), so that cases of one data set stay comparable with
each other.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TypeVar

import numpy as np

from distmis.data.errors import DataError

__all__ = [
    "Layout",
    "MODALITIES",
    "LABEL_VALUES",
    "CaseFiles",
    "coerce_layout",
    "discover_cases",
    "read_case",
    "case_spatial_shape",
    "label_counts",
]


class Layout(str, Enum):
    """How a data set is organised on disk (see the module docstring)."""

    MSD = "msd"
    BRATS = "brats"


#: Channel order of every image array returned by this package; this is the
#: order of the four channels of an MSD Task01 image (FLAIR, T1w, T1gd, T2w).
MODALITIES: tuple[str, ...] = ("flair", "t1", "t1ce", "t2")

#: Label values that may appear in a label map of each layout.
LABEL_VALUES: dict[Layout, tuple[int, ...]] = {
    Layout.MSD: (0, 1, 2, 3),  # 1 edema, 2 non-enhancing tumour, 3 enhancing tumour
    Layout.BRATS: (0, 1, 2, 4),  # 1 necrotic/non-enhancing core, 2 edema, 4 enhancing
}

#: File name endings accepted for NIfTI files, preferred first.
NIFTI_SUFFIXES: tuple[str, ...] = (".nii.gz", ".nii")


@dataclass(frozen=True)
class CaseFiles:
    """The files that make up one case.

    Attributes:
        case_id: name of the case, e.g. ``"BRATS_001"`` or ``"BraTS2021_00000"``.
        images: MSD: one 4-D image file; BraTS: four files in :data:`MODALITIES` order.
        label: the label (segmentation) file.
    """

    case_id: str
    images: tuple[Path, ...]
    label: Path


# --------------------------------------------------------------------------- enums

E = TypeVar("E", bound=Enum)


def _coerce_enum(enum_cls: type[E], value: E | str, what: str) -> E:
    """Return ``value`` as a member of ``enum_cls``, or raise a ValueError listing the options."""
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_cls)  # type: ignore[attr-defined]
        raise ValueError(f"unknown {what} {value!r}; expected one of {allowed}") from None


def coerce_layout(layout: Layout | str) -> Layout:
    """Return ``layout`` as a :class:`Layout` (accepts ``"msd"`` / ``"brats"``)."""
    return _coerce_enum(Layout, layout, "layout")


# --------------------------------------------------------------------------- discovery


def _case_id_from_file(path: Path) -> str:
    """``imagesTr/BRATS_001.nii.gz`` -> ``BRATS_001``."""
    name = path.name
    for suffix in NIFTI_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def _check_root(root: Path) -> None:
    if not root.exists():
        raise DataError(f"data set root {str(root)!r} does not exist")
    if not root.is_dir():
        raise DataError(f"data set root {str(root)!r} is not a directory")


def _discover_msd(root: Path) -> list[CaseFiles]:
    manifest = root / "dataset.json"
    if not manifest.is_file():
        raise DataError(
            f"{str(manifest)!r} not found: an MSD data set root must contain dataset.json "
            f"(is the layout right? a BraTS data set uses layout='brats')"
        )
    try:
        meta = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{str(manifest)!r} is not valid JSON: {exc}") from exc
    training = meta.get("training") if isinstance(meta, dict) else None
    if not isinstance(training, list):
        raise DataError(f"{str(manifest)!r} has no 'training' list of {{'image': ..., 'label': ...}} entries")

    cases: dict[str, CaseFiles] = {}
    for index, entry in enumerate(training):
        if not (isinstance(entry, dict) and isinstance(entry.get("image"), str) and isinstance(entry.get("label"), str)):
            raise DataError(
                f"{str(manifest)!r}: training entry {index} must be an object with string fields "
                f"'image' and 'label', got {entry!r}"
            )
        image = Path(os.path.normpath(root / entry["image"]))
        label = Path(os.path.normpath(root / entry["label"]))
        for kind, path in (("image", image), ("label", label)):
            if not path.is_file():
                raise DataError(
                    f"{str(manifest)!r}: training entry {index} lists {kind} {entry[kind]!r}, "
                    f"but {str(path)!r} does not exist"
                )
        case_id = _case_id_from_file(image)
        if case_id in cases:
            raise DataError(f"{str(manifest)!r}: case {case_id!r} is listed more than once")
        cases[case_id] = CaseFiles(case_id=case_id, images=(image,), label=label)
    return [cases[k] for k in sorted(cases)]


def _find_nifti(folder: Path, stem: str) -> Path | None:
    for suffix in NIFTI_SUFFIXES:
        candidate = folder / f"{stem}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def _discover_brats(root: Path) -> list[CaseFiles]:
    cases = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        case_id = folder.name
        files = []
        for part in (*MODALITIES, "seg"):
            found = _find_nifti(folder, f"{case_id}_{part}")
            if found is None:
                expected = folder / f"{case_id}_{part}{NIFTI_SUFFIXES[0]}"
                raise DataError(
                    f"case {case_id!r}: missing file {str(expected)!r} "
                    f"(a BraTS case folder needs {', '.join(f'{case_id}_{m}.nii.gz' for m in (*MODALITIES, 'seg'))})"
                )
            files.append(found)
        cases.append(CaseFiles(case_id=case_id, images=tuple(files[:4]), label=files[4]))
    return cases


def discover_cases(root: str | Path, layout: Layout | str) -> list[CaseFiles]:
    """List the cases of the data set at ``root``, sorted by case id.

    Args:
        root: data set folder (see the module docstring for both layouts).
        layout: :class:`Layout` or its string value.

    Raises:
        DataError: if ``root`` or ``dataset.json`` is missing, a listed file does
            not exist, a BraTS case folder lacks a file, or no case is found.
    """
    layout = coerce_layout(layout)
    root = Path(root)
    _check_root(root)
    cases = _discover_msd(root) if layout is Layout.MSD else _discover_brats(root)
    if not cases:
        hint = ""
        if layout is Layout.BRATS and (root / "dataset.json").is_file():
            hint = " (it contains dataset.json: is it an MSD data set? use layout='msd')"
        elif layout is Layout.BRATS:
            hint = " (a BraTS data set has one sub-folder per case)"
        raise DataError(f"no cases found in {str(root)!r} for layout {layout.value!r}{hint}")
    return cases


# --------------------------------------------------------------------------- reading


def label_counts(label: np.ndarray) -> dict[int, int]:
    """Return ``{value: number of voxels}`` for the values present in an integer label map."""
    if label.dtype.kind not in "iub":
        raise TypeError(f"label_counts expects an integer array, got dtype {label.dtype}")
    flat = label.ravel()
    if flat.size and label.dtype.kind != "b" and np.dtype(label.dtype).itemsize <= 4:
        low, high = int(flat.min()), int(flat.max())
        if low >= 0 and high < 1 << 16:  # fast path: a histogram instead of a sort
            counts = np.bincount(flat, minlength=high + 1)
            present = np.flatnonzero(counts)
            return {int(v): int(counts[v]) for v in present}
    values, counts = np.unique(flat, return_counts=True)
    return {int(v): int(c) for v, c in zip(values, counts)}


def _load_nifti(path: Path) -> tuple[np.ndarray, tuple[float, float, float]]:
    """Load a NIfTI file as stored (no reorientation); DataError naming the file on failure."""
    import nibabel as nib

    try:
        img = nib.load(str(path))
        data = np.asanyarray(img.dataobj)
        zooms = img.header.get_zooms()
    except Exception as exc:  # nibabel, gzip and zlib raise many different types
        raise DataError(f"cannot read NIfTI file {str(path)!r}: {type(exc).__name__}: {exc}") from exc
    spacing = tuple(float(z) for z in (tuple(zooms) + (1.0, 1.0, 1.0))[:3])
    return np.asarray(data), spacing  # type: ignore[return-value]


def case_spatial_shape(case: CaseFiles) -> tuple[int, int, int]:
    """The stored spatial shape ``(H, W, D)`` of a case's image, read from its NIfTI header only.

    The voxel data is not read (nor, for ``.nii.gz``, decompressed beyond the header), so this is cheap
    for a whole data set. MSD: the first three axes of the 4-D image; BraTS: those of the first modality.

    Raises:
        DataError: naming the file, if its header cannot be read or it has fewer than 3 axes.
    """
    import nibabel as nib

    path = case.images[0]
    try:
        shape = tuple(int(s) for s in nib.load(str(path)).header.get_data_shape())
    except Exception as exc:  # nibabel, gzip and zlib raise many different types
        raise DataError(f"cannot read the NIfTI header of {str(path)!r}: {type(exc).__name__}: {exc}") from exc
    if len(shape) < 3:
        raise DataError(f"image file {str(path)!r} has shape {shape}; an image needs 3 spatial axes (H, W, D)")
    return shape[:3]  # type: ignore[return-value]


def case_spacing(case: CaseFiles) -> tuple[float, float, float]:
    """The voxel spacing (mm) of a case's image along its three spatial axes, from its NIfTI header only.

    Raises:
        DataError: naming the file, if its header cannot be read.
    """
    import nibabel as nib

    path = case.images[0]
    try:
        zooms = tuple(float(z) for z in nib.load(str(path)).header.get_zooms())
    except Exception as exc:  # nibabel, gzip and zlib raise many different types
        raise DataError(f"cannot read the NIfTI header of {str(path)!r}: {type(exc).__name__}: {exc}") from exc
    return tuple((zooms + (1.0, 1.0, 1.0))[:3])  # type: ignore[return-value]


def _squeeze_trailing(array: np.ndarray, ndim: int) -> np.ndarray:
    """Drop trailing singleton axes beyond ``ndim`` (some tools write (H, W, D, 1))."""
    while array.ndim > ndim and array.shape[-1] == 1:
        array = array[..., 0]
    return array


def _as_image(array: np.ndarray, path: Path) -> np.ndarray:
    image = np.asarray(array, dtype=np.float32)
    if not np.isfinite(image).all():
        raise DataError(f"image file {str(path)!r} contains NaN or infinite values")
    return image


def _as_label(array: np.ndarray, path: Path, layout: Layout) -> np.ndarray:
    """Validate label values against the layout and return them as int16."""
    allowed = LABEL_VALUES[layout]
    if array.dtype.kind == "f":
        if not np.isfinite(array).all() or not np.array_equal(array, np.round(array)):
            raise DataError(
                f"label file {str(path)!r} contains non-integer values; allowed values for "
                f"layout {layout.value!r} are {list(allowed)}"
            )
        found = sorted(float(v) for v in np.unique(array))
        found_int = [int(v) for v in found]
    elif array.dtype.kind in "iub":
        found_int = sorted(label_counts(array))
    else:
        raise DataError(f"label file {str(path)!r} has unsupported data type {array.dtype}")
    bad = [v for v in found_int if v not in allowed]
    if bad:
        raise DataError(
            f"label file {str(path)!r} contains values {bad} not allowed for layout {layout.value!r} "
            f"(found {found_int}, allowed {list(allowed)}; MSD uses 0-3, BraTS uses 0, 1, 2, 4: "
            f"is the layout right?)"
        )
    return array.astype(np.int16)


def read_case(
    case: CaseFiles, layout: Layout | str
) -> tuple[np.ndarray, np.ndarray, tuple[float, float, float]]:
    """Read one case as ``(image, label, spacing)``.

    Returns:
        image: float32 ``(H, W, D, 4)``, channels in :data:`MODALITIES` order.
        label: int16 ``(H, W, D)`` with the layout's own values (:data:`LABEL_VALUES`).
        spacing: voxel size of the first three axes, from the image header.

    Raises:
        DataError: naming the file, if a file cannot be read, an MSD image is not
            ``(H, W, D, 4)``, BraTS modalities differ in shape, image and label
            shapes differ, the image holds NaN/inf, or a label value is not
            allowed for ``layout``.
    """
    layout = coerce_layout(layout)
    if layout is Layout.MSD:
        if len(case.images) != 1:
            raise DataError(f"case {case.case_id!r}: an MSD case has exactly one 4-D image file, got {len(case.images)}")
        path = case.images[0]
        data, spacing = _load_nifti(path)
        if data.ndim != 4 or data.shape[3] != len(MODALITIES):
            raise DataError(
                f"image file {str(path)!r} has shape {data.shape}; an MSD image must be 4-D "
                f"(H, W, D, {len(MODALITIES)}) with channels {', '.join(MODALITIES)}"
            )
        image = _as_image(data, path)
    else:
        if len(case.images) != len(MODALITIES):
            raise DataError(
                f"case {case.case_id!r}: a BraTS case has {len(MODALITIES)} image files "
                f"({', '.join(MODALITIES)}), got {len(case.images)}"
            )
        volumes = []
        spacing = (1.0, 1.0, 1.0)
        for index, path in enumerate(case.images):
            data, file_spacing = _load_nifti(path)
            data = _squeeze_trailing(data, 3)
            if data.ndim != 3:
                raise DataError(f"image file {str(path)!r} has shape {data.shape}; a BraTS modality must be 3-D")
            if volumes and data.shape != volumes[0].shape:
                raise DataError(
                    f"case {case.case_id!r}: modality file {str(path)!r} has shape {data.shape} but "
                    f"{str(case.images[0])!r} has shape {volumes[0].shape}; all modalities must match"
                )
            if index == 0:
                spacing = file_spacing
            volumes.append(_as_image(data, path))
        image = np.stack(volumes, axis=-1)

    label_data, _ = _load_nifti(case.label)
    label_data = _squeeze_trailing(label_data, 3)
    if label_data.shape != image.shape[:3]:
        raise DataError(
            f"label file {str(case.label)!r} has shape {label_data.shape} but the image of case "
            f"{case.case_id!r} ({str(case.images[0])!r}) has spatial shape {image.shape[:3]}"
        )
    label = _as_label(label_data, case.label, layout)
    return image, label, spacing
