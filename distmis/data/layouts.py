"""On-disk layouts of brain-tumour data sets, and reading one case.

Three layouts are supported (see :class:`Layout`):

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

``brats2023``
    BraTS 2023 (and later) challenge, one folder per case, ``-`` separated names::

        root/BraTS-GLI-00000-000/BraTS-GLI-00000-000-t2f.nii.gz   # FLAIR, (H, W, D) each
        root/BraTS-GLI-00000-000/BraTS-GLI-00000-000-t1n.nii.gz   # native T1
        root/BraTS-GLI-00000-000/BraTS-GLI-00000-000-t1c.nii.gz   # contrast-enhanced T1
        root/BraTS-GLI-00000-000/BraTS-GLI-00000-000-t2w.nii.gz   # T2
        root/BraTS-GLI-00000-000/BraTS-GLI-00000-000-seg.nii.gz   # 0 bg, 1 necrotic
                                                                  # core (NCR), 2 edema (ED),
                                                                  # 3 enhancing (ET)

    The modalities map onto :data:`MODALITIES` as t2f -> flair, t1n -> t1,
    t1c -> t1ce, t2w -> t2 (:func:`case_file_stems`).

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
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from distmis.data.errors import DataError

__all__ = [
    "Layout",
    "MODALITIES",
    "LABEL_VALUES",
    "CASE_FOLDER_LAYOUTS",
    "LAYOUT_NAMES",
    "CaseFiles",
    "coerce_layout",
    "case_file_stems",
    "discover_cases",
    "read_case",
    "case_spatial_shape",
    "label_counts",
]


class Layout(str, Enum):
    """How a data set is organised on disk (see the module docstring)."""

    MSD = "msd"
    BRATS = "brats"
    BRATS2023 = "brats2023"


#: Channel order of every image array returned by this package; this is the
#: order of the four channels of an MSD Task01 image (FLAIR, T1w, T1gd, T2w).
MODALITIES: tuple[str, ...] = ("flair", "t1", "t1ce", "t2")

#: Label values that may appear in a label map of each layout.
LABEL_VALUES: dict[Layout, tuple[int, ...]] = {
    Layout.MSD: (0, 1, 2, 3),  # 1 edema, 2 non-enhancing tumour, 3 enhancing tumour
    Layout.BRATS: (0, 1, 2, 4),  # 1 necrotic/non-enhancing core, 2 edema, 4 enhancing
    Layout.BRATS2023: (0, 1, 2, 3),  # 1 necrotic core (NCR), 2 edema (ED), 3 enhancing tumour (ET)
}

#: Layouts with one folder per case, named after the case, holding one 3-D file per modality.
CASE_FOLDER_LAYOUTS: tuple[Layout, ...] = (Layout.BRATS, Layout.BRATS2023)

# Per case-folder layout: the separator between case id and part, the part naming each
# modality (in MODALITIES order), and the part naming the label file.
_CASE_FOLDER_NAMING: dict[Layout, tuple[str, tuple[str, ...], str]] = {
    Layout.BRATS: ("_", ("flair", "t1", "t1ce", "t2"), "seg"),
    Layout.BRATS2023: ("-", ("t2f", "t1n", "t1c", "t2w"), "seg"),
}

#: A human-readable name of each layout, for messages.
LAYOUT_NAMES: dict[Layout, str] = {
    Layout.MSD: "MSD",
    Layout.BRATS: "BraTS 2018-2021",
    Layout.BRATS2023: "BraTS 2023",
}

#: File name endings accepted for NIfTI files, preferred first.
NIFTI_SUFFIXES: tuple[str, ...] = (".nii.gz", ".nii")


@dataclass(frozen=True)
class CaseFiles:
    """The files that make up one case.

    Attributes:
        case_id: name of the case, e.g. ``"BRATS_001"``, ``"BraTS2021_00000"`` or ``"BraTS-GLI-00000-000"``.
        images: MSD: one 4-D image file; BraTS / BraTS 2023: four files in :data:`MODALITIES` order.
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
    """Return ``layout`` as a :class:`Layout` (accepts ``"msd"`` / ``"brats"`` / ``"brats2023"``)."""
    return _coerce_enum(Layout, layout, "layout")


def case_file_stems(layout: Layout | str, case_id: str) -> tuple[tuple[str, ...], str]:
    """The file names, without ``.nii.gz``, of a case of a case-folder layout (:data:`CASE_FOLDER_LAYOUTS`).

    Returns:
        ``(modality stems in MODALITIES order, label stem)``, e.g. for ``brats2023`` and
        ``"BraTS-GLI-00000-000"``: ``(("BraTS-GLI-00000-000-t2f", ...-t1n, ...-t1c, ...-t2w), "BraTS-GLI-00000-000-seg")``.

    Raises:
        ValueError: if ``layout`` is unknown or has no case folders (``msd``).
    """
    layout = coerce_layout(layout)
    if layout not in _CASE_FOLDER_NAMING:
        folder_layouts = ", ".join(repr(l.value) for l in CASE_FOLDER_LAYOUTS)
        raise ValueError(f"layout {layout.value!r} has no case folders; case-folder layouts are {folder_layouts}")
    separator, modalities, label = _CASE_FOLDER_NAMING[layout]
    return tuple(f"{case_id}{separator}{m}" for m in modalities), f"{case_id}{separator}{label}"


# --------------------------------------------------------------------------- discovery


def _case_id_from_file(path: Path) -> str:
    """``imagesTr/BRATS_001.nii.gz`` -> ``BRATS_001``."""
    name = path.name
    for suffix in NIFTI_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def _is_nifti(path: Path) -> bool:
    """Whether the file name ends with a NIfTI suffix (``.nii`` / ``.nii.gz``)."""
    return path.name.endswith(NIFTI_SUFFIXES)


def _check_root(root: Path) -> None:
    if not root.exists():
        raise DataError(f"data set root {str(root)!r} does not exist")
    if not root.is_dir():
        raise DataError(f"data set root {str(root)!r} is not a directory")


def _subfolders(root: Path) -> list[Path]:
    """The non-hidden sub-folders of ``root``, sorted by name."""
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def _msd_manifest(root: Path) -> tuple[Path, dict]:
    """``root/dataset.json`` and its parsed content (a JSON object)."""
    manifest = root / "dataset.json"
    if not manifest.is_file():
        hint = _wrong_layout_hint(root, Layout.MSD) or "is the layout right? BraTS data sets use layout='brats' or 'brats2023'"
        raise DataError(f"{str(manifest)!r} not found: an MSD data set root must contain dataset.json ({hint})")
    try:
        meta = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{str(manifest)!r} is not valid JSON: {exc}") from exc
    if not isinstance(meta, dict):
        raise DataError(f"{str(manifest)!r} must hold a JSON object, got {type(meta).__name__}")
    return manifest, meta


def _msd_training(root: Path, manifest: Path, meta: dict) -> list[CaseFiles]:
    """The cases of the manifest's "training" list, in listed order; every listed file must exist."""
    training = meta.get("training")
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
    return list(cases.values())


def _discover_msd(root: Path) -> list[CaseFiles]:
    manifest, meta = _msd_manifest(root)
    return sorted(_msd_training(root, manifest, meta), key=lambda case: case.case_id)


def _find_nifti(folder: Path, stem: str) -> Path | None:
    for suffix in NIFTI_SUFFIXES:
        candidate = folder / f"{stem}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def _folder_layouts(folder: Path) -> list[Layout]:
    """The case-folder layouts of which ``folder`` holds at least one file named after the folder."""
    found = []
    for layout in CASE_FOLDER_LAYOUTS:
        modalities, label = case_file_stems(layout, folder.name)
        if any(_find_nifti(folder, stem) is not None for stem in (*modalities, label)):
            found.append(layout)
    return found


def _case_folder_layout(folder: Path) -> Layout | None:
    """The case-folder layout ``folder`` follows, or None when it holds no file named after it like a case's.

    Raises:
        DataError: if it holds files of both case-folder layouts.
    """
    found = _folder_layouts(folder)
    if len(found) > 1:
        examples = ", ".join(repr(case_file_stems(l, folder.name)[0][0] + NIFTI_SUFFIXES[0]) for l in found)
        raise DataError(
            f"case folder {str(folder)!r} holds files of several layouts ({examples}); "
            f"a case folder follows one naming convention"
        )
    return found[0] if found else None


def _case_folder_files(folder: Path, layout: Layout, *, need_label: bool) -> tuple[tuple[Path, ...], Path | None]:
    """The modality files (in MODALITIES order) and label file of the case folder ``folder``.

    Raises:
        DataError: naming the exact expected file, if a modality (or, with ``need_label``, the label) is missing.
    """
    case_id = folder.name
    modalities, seg = case_file_stems(layout, case_id)
    images = []
    for stem in (*modalities, seg):
        found = _find_nifti(folder, stem)
        if found is None and (stem != seg or need_label):
            expected = folder / f"{stem}{NIFTI_SUFFIXES[0]}"
            others = [l for l in _folder_layouts(folder) if l is not layout]
            hint = ""
            if others:
                example = case_file_stems(others[0], case_id)[0][0] + NIFTI_SUFFIXES[0]
                hint = f"; it holds {LAYOUT_NAMES[others[0]]} files such as {example!r}: use layout={others[0].value!r}"
            needed = ", ".join(f"{n}{NIFTI_SUFFIXES[0]}" for n in (*modalities, seg)[: None if need_label else -1])
            optional = "" if need_label else f" and may hold {seg}{NIFTI_SUFFIXES[0]}"
            raise DataError(
                f"case {case_id!r}: missing file {str(expected)!r} "
                f"(a {LAYOUT_NAMES[layout]} case folder needs {needed}{optional}){hint}"
            )
        images.append(found)
    return tuple(images[:-1]), images[-1]  # type: ignore[arg-type]


def _discover_case_folders(root: Path, layout: Layout) -> list[CaseFiles]:
    cases = []
    for folder in _subfolders(root):
        images, label = _case_folder_files(folder, layout, need_label=True)
        cases.append(CaseFiles(case_id=folder.name, images=images, label=label))  # type: ignore[arg-type]
    return cases


def _wrong_layout_hint(root: Path, layout: Layout) -> str:
    """A hint naming the layout ``root`` looks like, when that is not ``layout``; "" when there is none."""
    if layout is not Layout.MSD and (root / "dataset.json").is_file():
        return "it contains dataset.json: is it an MSD data set? use layout='msd'"
    if not root.is_dir():
        return ""
    own = _folder_layouts(root)
    if own:
        return (f"it is itself a {LAYOUT_NAMES[own[0]]} case folder: pass the folder that holds the case folders"
                + ("" if own[0] is layout else f", with layout={own[0].value!r}"))
    for folder in _subfolders(root):
        found = _folder_layouts(folder)
        if found and found[0] is not layout:
            return f"its sub-folder {folder.name!r} is a {LAYOUT_NAMES[found[0]]} case folder: use layout={found[0].value!r}"
    return ""


def discover_cases(root: str | Path, layout: Layout | str) -> list[CaseFiles]:
    """List the cases of the data set at ``root``, sorted by case id.

    Args:
        root: data set folder (see the module docstring for the layouts).
        layout: :class:`Layout` or its string value.

    Raises:
        DataError: if ``root`` or ``dataset.json`` is missing, a listed file does
            not exist, a BraTS case folder lacks a file, or no case is found.
    """
    layout = coerce_layout(layout)
    root = Path(root)
    _check_root(root)
    cases = _discover_msd(root) if layout is Layout.MSD else _discover_case_folders(root, layout)
    if not cases:
        hint = _wrong_layout_hint(root, layout)
        if not hint and layout is not Layout.MSD:
            hint = f"a {LAYOUT_NAMES[layout]} data set has one sub-folder per case"
        raise DataError(f"no cases found in {str(root)!r} for layout {layout.value!r}" + (f" ({hint})" if hint else ""))
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


def _unreadable(path: Path, exc: Exception) -> str:
    return f"cannot read {str(path)!r}: it is not a readable NIfTI file ({type(exc).__name__}: {exc})"


def _load_image(path: Path) -> Any:
    """The nibabel image of ``path`` (its header read, its voxel data not yet); DataError naming the file on failure."""
    import nibabel as nib

    try:
        return nib.load(str(path))
    except Exception as exc:  # nibabel, gzip and zlib raise many different types
        raise DataError(_unreadable(path, exc)) from exc


def _image_data(img: Any, path: Path) -> np.ndarray:
    """The voxel data of a loaded nibabel image as stored (no reorientation, nothing cached on ``img``)."""
    try:
        return np.asarray(np.asanyarray(img.dataobj))
    except Exception as exc:  # nibabel, gzip and zlib raise many different types
        raise DataError(_unreadable(path, exc)) from exc


def _header_spacing(img: Any) -> tuple[float, float, float]:
    """The voxel size of the first three axes, from a nibabel image's header (1.0 for missing axes)."""
    zooms = tuple(float(z) for z in img.header.get_zooms())
    return tuple((zooms + (1.0, 1.0, 1.0))[:3])  # type: ignore[return-value]


def _load_nifti(path: Path) -> tuple[np.ndarray, tuple[float, float, float]]:
    """Load a NIfTI file as stored (no reorientation); DataError naming the file on failure."""
    img = _load_image(path)
    return _image_data(img, path), _header_spacing(img)


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
            f"(found {found_int}, allowed {list(allowed)}; MSD and BraTS 2023 use 0-3, BraTS 2018-2021 "
            f"uses 0, 1, 2, 4: is the layout right?)"
        )
    return array.astype(np.int16)


def _read_images(case_id: str, images: Sequence[Path], layout: Layout) -> tuple[np.ndarray, Any]:
    """A case's float32 ``(H, W, D, 4)`` image in MODALITIES order, and the nibabel image of ``images[0]``.

    Raises:
        DataError: naming the file, if a file cannot be read, an MSD image is not ``(H, W, D, 4)``,
            a modality of a case-folder layout is not 3-D or differs in shape from the first, or the
            image holds NaN/inf.
    """
    if layout is Layout.MSD:
        if len(images) != 1:
            raise DataError(f"case {case_id!r}: an MSD case has exactly one 4-D image file, got {len(images)}")
        path = images[0]
        reference = _load_image(path)
        data = _image_data(reference, path)
        if data.ndim != 4 or data.shape[3] != len(MODALITIES):
            hint = (" (a BraTS case is a folder of four 3-D files, one per modality: pass that folder)"
                    if data.ndim == 3 else "")
            raise DataError(
                f"image file {str(path)!r} has shape {data.shape}; an MSD image must be 4-D "
                f"(H, W, D, {len(MODALITIES)}) with channels {', '.join(MODALITIES)}{hint}"
            )
        return _as_image(data, path), reference

    if len(images) != len(MODALITIES):
        raise DataError(
            f"case {case_id!r}: a {LAYOUT_NAMES[layout]} case has {len(MODALITIES)} image files "
            f"({', '.join(MODALITIES)}), got {len(images)}"
        )
    volumes: list[np.ndarray] = []
    reference = None
    for path in images:
        img = _load_image(path)
        data = _squeeze_trailing(_image_data(img, path), 3)
        if data.ndim != 3:
            raise DataError(
                f"image file {str(path)!r} has shape {data.shape}; a {LAYOUT_NAMES[layout]} modality must be 3-D"
            )
        if volumes and data.shape != volumes[0].shape:
            raise DataError(
                f"case {case_id!r}: modality file {str(path)!r} has shape {data.shape} but "
                f"{str(images[0])!r} has shape {volumes[0].shape}; all modalities must match"
            )
        reference = img if reference is None else reference
        volumes.append(_as_image(data, path))
    return np.stack(volumes, axis=-1), reference


def _read_label(path: Path, shape: Sequence[int], layout: Layout, case_id: str, image_path: Path) -> np.ndarray:
    """A case's int16 label map, validated against ``layout`` and the image's spatial ``shape``."""
    data, _ = _load_nifti(path)
    data = _squeeze_trailing(data, 3)
    if data.shape != tuple(shape):
        raise DataError(
            f"label file {str(path)!r} has shape {data.shape} but the image of case "
            f"{case_id!r} ({str(image_path)!r}) has spatial shape {tuple(shape)}"
        )
    return _as_label(data, path, layout)


def read_case(
    case: CaseFiles, layout: Layout | str
) -> tuple[np.ndarray, np.ndarray, tuple[float, float, float]]:
    """Read one case as ``(image, label, spacing)``.

    Returns:
        image: float32 ``(H, W, D, 4)``, channels in :data:`MODALITIES` order.
        label: int16 ``(H, W, D)`` with the layout's own values (:data:`LABEL_VALUES`).
        spacing: voxel size of the first three axes, from the (first) image's header.

    Raises:
        DataError: naming the file, if a file cannot be read, an MSD image is not
            ``(H, W, D, 4)``, BraTS modalities differ in shape, image and label
            shapes differ, the image holds NaN/inf, or a label value is not
            allowed for ``layout``.
    """
    layout = coerce_layout(layout)
    image, reference = _read_images(case.case_id, case.images, layout)
    label = _read_label(case.label, image.shape[:3], layout, case.case_id, case.images[0])
    return image, label, _header_spacing(reference)
