"""On-disk layouts of segmentation data sets, and reading one case.

Four layouts are supported (see :class:`Layout`):

``msd``
    Medical Segmentation Decathlon: any task, described by its ``dataset.json``
    (:mod:`~distmis.data.description`: channels from ``modality``, classes from ``labels``)::

        root/dataset.json                 # its "training" list names the cases
        root/imagesTr/BRATS_001.nii.gz    # (H, W, D, C) with C = the number of "modality" entries,
                                          #   or (H, W, D) for a one-channel task (e.g. CT)
        root/labelsTr/BRATS_001.nii.gz    # (H, W, D): the values of "labels"

    Task01_BrainTumour: FLAIR, T1w, T1gd, T2w; 0 bg, 1 edema, 2 non-enhancing tumour, 3 enhancing.

``nnunet``
    nnU-Net v2 raw data set, described by its ``dataset.json`` (``channel_names``, ``labels``,
    ``numTraining``, ``file_ending``: NIfTI only)::

        root/dataset.json
        root/imagesTr/prostate_00_0000.nii.gz   # <case>_<XXXX><file_ending>: one 3-D file per channel,
        root/imagesTr/prostate_00_0001.nii.gz   #   XXXX the channel index 0000, 0001, ...
        root/labelsTr/prostate_00.nii.gz        # <case><file_ending>

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
form: a float32 image ``(H, W, D, C)`` whose channels follow the data set's
description (:class:`~distmis.data.description.DatasetDescription`; for the
BraTS layouts and a bare MSD Task01, :data:`MODALITIES`), an int16 label
``(H, W, D)`` that keeps the data set's own label values, and the voxel spacing.
Arrays are returned as stored in the file (no reorientation), so that cases of
one data set stay comparable with each other; :func:`case_affine` and
:func:`case_orientation` give a case's geometry from its header.
:func:`check_cases` checks every case against its description from the headers
alone, before anything is converted.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

# Layout, its names and the NIfTI endings live with the data set's description (which this module reads cases
# with); they are this module's too.
from distmis.data.description import (
    NIFTI_SUFFIXES,
    DatasetDescription,
    Layout,
    coerce_layout,
    dataset_json_layout,
    describe_nnunet,
    read_json_object,
)
from distmis.data.dataset_layouts import CaseFiles, case_folder_layouts, dataset_layout, layout_description
from distmis.data.errors import DataError

__all__ = [
    "Layout",
    "NIFTI_SUFFIXES",
    "MODALITIES",
    "CaseFiles",
    "coerce_layout",
    "case_file_stems",
    "discover_cases",
    "read_case",
    "check_cases",
    "case_spatial_shape",
    "case_spacing",
    "case_affine",
    "case_orientation",
    "affine_orientation",
    "channel_file_name",
    "label_counts",
]


#: Channel order of the image arrays of the BraTS layouts and MSD Task01; this is the
#: order of the four channels of an MSD Task01 image (FLAIR, T1w, T1gd, T2w).
MODALITIES: tuple[str, ...] = ("flair", "t1", "t1ce", "t2")


# --------------------------------------------------------------------------- case folders


def case_file_stems(layout: Layout | str, case_id: str) -> tuple[tuple[str, ...], str]:
    """The file names, without ``.nii.gz``, of a case of a layout of one folder per case (BraTS, BraTS 2023).

    Returns:
        ``(modality stems in MODALITIES order, label stem)``, e.g. for ``brats2023`` and
        ``"BraTS-GLI-00000-000"``: ``(("BraTS-GLI-00000-000-t2f", ...-t1n, ...-t1c, ...-t2w), "BraTS-GLI-00000-000-seg")``.

    Raises:
        ValueError: if ``layout`` is unknown or has no case folders (``msd``).
    """
    naming = dataset_layout(layout).case_folder
    if naming is None:
        folder_layouts = ", ".join(repr(l.value) for l in case_folder_layouts())
        raise ValueError(f"layout {coerce_layout(layout).value!r} has no case folders; case-folder layouts are "
                         f"{folder_layouts}")
    return naming.stems(case_id)


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
    return manifest, read_json_object(manifest)


def _msd_training(root: Path, manifest: Path, meta: dict) -> list[CaseFiles]:
    """The cases of the manifest's "training" list, in listed order; every listed file must exist."""
    training = meta.get("training")
    if not isinstance(training, list):
        hint = ("; it has 'channel_names': an nnU-Net v2 dataset.json, use layout='nnunet'"
                if "channel_names" in meta and "training" not in meta else "")
        raise DataError(f"{str(manifest)!r} has no 'training' list of {{'image': ..., 'label': ...}} entries{hint}")
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


def discover_msd(root: Path) -> list[CaseFiles]:
    """An MSD data set's cases: its dataset.json's ``training`` list."""
    manifest, meta = _msd_manifest(root)
    return sorted(_msd_training(root, manifest, meta), key=lambda case: case.case_id)


# nnU-Net: <case>_<XXXX><file_ending>, XXXX the 4-digit channel index
_CHANNEL_FILE = re.compile(r"^(?P<case>.+)_(?P<index>\d{4})$")


def channel_file_name(case_id: str, index: int, file_ending: str = ".nii.gz") -> str:
    """The nnU-Net file name of channel ``index`` of a case: ``channel_file_name("la_003", 1)`` is
    ``"la_003_0001.nii.gz"``."""
    return f"{case_id}_{index:04d}{file_ending}"


def _channel_files(folder: Path, file_ending: str) -> tuple[dict[str, dict[int, Path]], list[Path]]:
    """The nnU-Net channel files in ``folder``, as ``{case: {channel index: file}}``, and the non-hidden files
    ending with ``file_ending`` that are not named ``<case>_XXXX<file_ending>``."""
    groups: dict[str, dict[int, Path]] = {}
    misnamed = []
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or not path.is_file() or not path.name.endswith(file_ending):
            continue
        match = _CHANNEL_FILE.match(path.name[: -len(file_ending)])
        if match is None:
            misnamed.append(path)
            continue
        groups.setdefault(match["case"], {})[int(match["index"])] = path
    return groups, misnamed


def _nnunet_case_images(case_id: str, found: dict[int, Path], folder: Path, channels: Sequence[str],
                        file_ending: str, source: str) -> tuple[Path, ...]:
    """The channel files of one nnU-Net case in channel order; DataError naming the missing or extra file.

    ``source`` says where the channel count comes from, for messages (e.g. "dataset.json lists").
    """
    listing = ", ".join(f"{i:04d} {name}" for i, name in enumerate(channels))
    for index in range(len(channels)):
        if index not in found:
            expected = folder / channel_file_name(case_id, index, file_ending)
            raise DataError(f"case {case_id!r}: missing channel file {str(expected)!r} (channel {index:04d}, "
                            f"{channels[index]!r}); {source} {len(channels)} channel(s): {listing}")
    extra = sorted(i for i in found if i >= len(channels))
    if extra:
        raise DataError(f"case {case_id!r}: channel file {str(found[extra[0]])!r} has the channel index "
                        f"{extra[0]:04d}, but {source} {len(channels)} channel(s): {listing}")
    return tuple(found[i] for i in range(len(channels)))


def discover_nnunet(root: Path) -> list[CaseFiles]:
    """An nnU-Net v2 data set's cases: imagesTr/'s channel files with their labelsTr/ labels."""
    if not (root / "dataset.json").is_file() and (hint := _wrong_layout_hint(root, Layout.NNUNET)):
        raise DataError(f"{str(root / 'dataset.json')!r} not found: an nnU-Net v2 data set root holds "
                        f"dataset.json, imagesTr/ and labelsTr/ ({hint})")
    description = describe_nnunet(root)
    ending = description.file_ending
    images_dir, labels_dir = root / "imagesTr", root / "labelsTr"
    for folder in (images_dir, labels_dir):
        if not folder.is_dir():
            raise DataError(f"{str(folder)!r} not found: an nnU-Net v2 data set root holds dataset.json, imagesTr/ "
                            f"(<case>_XXXX{ending}, one file per channel) and labelsTr/ (<case>{ending})")
    groups, misnamed = _channel_files(images_dir, ending)
    if misnamed:
        raise DataError(f"image file {str(misnamed[0])!r} is not named <case>_XXXX{ending}: an nnU-Net image file "
                        f"holds one channel, XXXX its 4-digit index (0000 for {description.channels[0]!r})")
    source = f"{str(root / 'dataset.json')!r} lists"
    cases = []
    for case_id in sorted(groups):
        images = _nnunet_case_images(case_id, groups[case_id], images_dir, description.channels, ending, source)
        label = labels_dir / f"{case_id}{ending}"
        if not label.is_file():
            raise DataError(f"case {case_id!r}: missing label file {str(label)!r} (an nnU-Net training case has "
                            f"its label in labelsTr/<case>{ending})")
        cases.append(CaseFiles(case_id=case_id, images=images, label=label))
    for label in sorted(labels_dir.iterdir()):
        if label.name.startswith(".") or not label.name.endswith(ending) or not label.is_file():
            continue
        case_id = label.name[: -len(ending)]
        if case_id not in groups:
            expected = images_dir / channel_file_name(case_id, 0, ending)
            raise DataError(f"label file {str(label)!r} has no image: missing channel file {str(expected)!r} "
                            f"(channel 0000, {description.channels[0]!r})")
    if cases and description.num_training is not None and len(cases) != description.num_training:
        raise DataError(f"{str(root / 'dataset.json')!r} states numTraining {description.num_training}, but "
                        f"{str(images_dir)!r} holds {len(cases)} case(s) with their labels; they must agree")
    if not cases:
        others = [s for s in NIFTI_SUFFIXES if s != ending and any(images_dir.glob(f"*{s}"))]
        if others:
            raise DataError(f"no cases found in {str(images_dir)!r}: dataset.json's file_ending is {ending!r}, but "
                            f"the files there end with {others[0]!r}")
    return cases


def _find_nifti(folder: Path, stem: str) -> Path | None:
    for suffix in NIFTI_SUFFIXES:
        candidate = folder / f"{stem}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def _folder_layouts(folder: Path) -> list[Layout]:
    """The case-folder layouts of which ``folder`` holds at least one file named after the folder."""
    found = []
    for layout in case_folder_layouts():
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
                hint = (f"; it holds {dataset_layout(others[0]).title} files such as {example!r}: "
                        f"use layout={others[0].value!r}")
            needed = ", ".join(f"{n}{NIFTI_SUFFIXES[0]}" for n in (*modalities, seg)[: None if need_label else -1])
            optional = "" if need_label else f" and may hold {seg}{NIFTI_SUFFIXES[0]}"
            raise DataError(
                f"case {case_id!r}: missing file {str(expected)!r} "
                f"(a {dataset_layout(layout).title} case folder needs {needed}{optional}){hint}"
            )
        images.append(found)
    return tuple(images[:-1]), images[-1]  # type: ignore[arg-type]


def discover_case_folders(root: Path, layout: Layout) -> list[CaseFiles]:
    """The cases of a layout of one folder per case: its sub-folders, each named after its case."""
    cases = []
    for folder in _subfolders(root):
        images, label = _case_folder_files(folder, layout, need_label=True)
        cases.append(CaseFiles(case_id=folder.name, images=images, label=label))  # type: ignore[arg-type]
    return cases


def _wrong_layout_hint(root: Path, layout: Layout) -> str:
    """A hint naming the layout ``root`` looks like, when that is not ``layout``; "" when there is none."""
    if (root / "dataset.json").is_file():
        try:
            meta = json.loads((root / "dataset.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            meta = None
        looks = dataset_json_layout(meta) if isinstance(meta, dict) else Layout.MSD
        if looks is not layout:
            return (f"it contains dataset.json: is it {dataset_layout(looks).titled} data set? "
                    f"use layout={looks.value!r}")
    if not root.is_dir():
        return ""
    own = _folder_layouts(root)
    if own:
        return (f"it is itself a {dataset_layout(own[0]).title} case folder: pass the folder that holds the case "
                "folders"
                + ("" if own[0] is layout else f", with layout={own[0].value!r}"))
    for folder in _subfolders(root):
        found = _folder_layouts(folder)
        if found and found[0] is not layout:
            return (f"its sub-folder {folder.name!r} is a {dataset_layout(found[0]).title} case folder: "
                    f"use layout={found[0].value!r}")
    return ""


def discover_cases(root: str | Path, layout: Layout | str) -> list[CaseFiles]:
    """List the cases of the data set at ``root``, sorted by case id.

    Args:
        root: data set folder (see the module docstring for the layouts).
        layout: :class:`Layout` or its string value.

    Raises:
        DataError: if ``root`` or ``dataset.json`` is missing, a listed file does
            not exist, a BraTS case folder lacks a file, an nnU-Net case lacks a
            channel file or its label (naming the file), an nnU-Net image file is
            misnamed, the number of nnU-Net cases differs from ``numTraining``
            (naming both), or no case is found.
    """
    entry = dataset_layout(layout)
    root = Path(root)
    _check_root(root)
    cases = entry.discover(root)
    if not cases:
        hint = _wrong_layout_hint(root, entry.layout)
        if not hint and entry.case_folder is not None:
            hint = f"{entry.titled} data set has {entry.root_holds}"
        raise DataError(f"no cases found in {str(root)!r} for layout {entry.layout.value!r}"
                        + (f" ({hint})" if hint else ""))
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


def _as_description(dataset: DatasetDescription | Layout | str) -> DatasetDescription:
    """``dataset`` as a description: itself, or its layout's own
    (:func:`~distmis.data.dataset_layouts.layout_description`)."""
    if isinstance(dataset, DatasetDescription):
        return dataset
    return layout_description(coerce_layout(dataset))


def _label_hint(description: DatasetDescription) -> str:
    """What a wrong label value may mean: for the brain-tumour layouts' own values, the other layouts' values."""
    if description == dataset_layout(description.layout).own:
        return "; MSD and BraTS 2023 use 0-3, BraTS 2018-2021 uses 0, 1, 2, 4: is the layout right?"
    return "; the allowed values are the data set's labels in its dataset.json"


def _as_label(array: np.ndarray, path: Path, description: DatasetDescription) -> np.ndarray:
    """Validate label values against the description's :attr:`label_values` and return them as int16."""
    allowed = description.label_values
    layout = description.layout
    if array.dtype.kind == "f":
        if not np.isfinite(array).all() or not np.array_equal(array, np.round(array)):
            raise DataError(
                f"label file {str(path)!r} contains non-integer values; allowed values for "
                f"layout {layout.value!r} are {list(allowed)} ({description.describe_values()})"
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
            f"(found {found_int}, allowed {list(allowed)}: {description.describe_values()}{_label_hint(description)})"
        )
    return array.astype(np.int16)


def _channel_list(channels: Sequence[str]) -> str:
    return ", ".join(channels)


def _read_images(case_id: str, images: Sequence[Path], layout: Layout,
                 channels: Sequence[str] = MODALITIES) -> tuple[np.ndarray, Any]:
    """A case's float32 ``(H, W, D, C)`` image, C = ``len(channels)`` in file order, and the nibabel image of
    ``images[0]``.

    MSD: one file, 4-D ``(H, W, D, C)``, or 3-D when C is 1. nnU-Net and BraTS: one 3-D file per channel, stacked.

    Raises:
        DataError: naming the file, if a file cannot be read, an MSD image does not hold C channels, a channel
            file is not 3-D or differs in shape from the first, or the image holds NaN/inf.
    """
    count = len(channels)
    entry = dataset_layout(layout)
    if entry.images == "one_file":
        if len(images) != 1:
            raise DataError(f"case {case_id!r}: {entry.titled} case has exactly one image file, got {len(images)}")
        path = images[0]
        reference = _load_image(path)
        data = _image_data(reference, path)
        if count == 1 and data.ndim == 3:
            data = data[..., np.newaxis]
        if data.ndim != 4 or data.shape[3] != count:
            raise DataError(f"image file {str(path)!r} has shape {data.shape}; {_msd_shape_rule(channels, data.ndim)}")
        return _as_image(data, path), reference

    what = entry.channel_file
    if len(images) != count:
        raise DataError(
            f"case {case_id!r}: {entry.titled} case of this data set has {count} image "
            f"files ({_channel_list(channels)}), got {len(images)}"
        )
    volumes: list[np.ndarray] = []
    reference = None
    for path in images:
        img = _load_image(path)
        data = _squeeze_trailing(_image_data(img, path), 3)
        if data.ndim != 3:
            raise DataError(
                f"image file {str(path)!r} has shape {data.shape}; {entry.titled} {what} "
                "must be 3-D"
            )
        if volumes and data.shape != volumes[0].shape:
            raise DataError(
                f"case {case_id!r}: {what} {str(path)!r} has shape {data.shape} but "
                f"{str(images[0])!r} has shape {volumes[0].shape}; all {what}s must match"
            )
        reference = img if reference is None else reference
        volumes.append(_as_image(data, path))
    return np.stack(volumes, axis=-1), reference


def _msd_shape_rule(channels: Sequence[str], ndim: int) -> str:
    """What an MSD image of ``channels`` must look like, for messages."""
    if len(channels) == 1:
        return (f"an MSD image of one channel ({channels[0]}) must be 3-D (H, W, D) or (H, W, D, 1); does the "
                "data set's dataset.json list its channels in 'modality'?")
    hint = (" (a BraTS case is a folder of four 3-D files, one per modality: pass that folder)"
            if ndim == 3 and tuple(channels) in (MODALITIES, ("FLAIR", "T1w", "t1gd", "T2w")) else "")
    return (f"an MSD image must be 4-D (H, W, D, {len(channels)}) with channels "
            f"{_channel_list(channels)}{hint}")


def _read_label(path: Path, shape: Sequence[int], description: DatasetDescription, case_id: str,
                image_path: Path) -> np.ndarray:
    """A case's int16 label map, validated against ``description`` and the image's spatial ``shape``."""
    data, _ = _load_nifti(path)
    data = _squeeze_trailing(data, 3)
    if data.shape != tuple(shape):
        raise DataError(
            f"label file {str(path)!r} has shape {data.shape} but the image of case "
            f"{case_id!r} ({str(image_path)!r}) has spatial shape {tuple(shape)}"
        )
    return _as_label(data, path, description)


def read_case(
    case: CaseFiles, dataset: DatasetDescription | Layout | str
) -> tuple[np.ndarray, np.ndarray, tuple[float, float, float]]:
    """Read one case as ``(image, label, spacing)``.

    Args:
        case: from :func:`discover_cases`.
        dataset: the data set's :class:`~distmis.data.description.DatasetDescription`
            (:func:`~distmis.data.dataset_layouts.describe_dataset`), or a layout, which stands for its own
            description (:func:`~distmis.data.dataset_layouts.layout_description`: BraTS, BraTS 2023, MSD Task01).

    Returns:
        image: float32 ``(H, W, D, C)``, the description's channels in order (nnU-Net: its channel files stacked).
        label: int16 ``(H, W, D)`` with the data set's own values (``description.label_values``).
        spacing: voxel size of the first three axes, from the (first) image's header.

    Raises:
        DataError: naming the file, if a file cannot be read, an MSD image does not hold the description's
            channels, channel files differ in shape, image and label shapes differ, the image holds NaN/inf,
            or a label value is not one of the description's (naming the bad values and the allowed ones).
        ValueError: if ``dataset`` is the layout ``nnunet`` (its description comes from its dataset.json).
    """
    description = _as_description(dataset)
    image, reference = _read_images(case.case_id, case.images, description.layout, description.channels)
    label = _read_label(case.label, image.shape[:3], description, case.case_id, case.images[0])
    return image, label, _header_spacing(reference)


# --------------------------------------------------------------------------- headers: checks and geometry


def _header_shape(path: Path) -> tuple[int, ...]:
    """The data shape in a NIfTI header; DataError naming the file when it cannot be read."""
    return tuple(int(s) for s in _load_image(path).header.get_data_shape())


def _squeezed(shape: tuple[int, ...], ndim: int = 3) -> tuple[int, ...]:
    """``shape`` without trailing singleton axes beyond ``ndim`` (some tools write (H, W, D, 1))."""
    while len(shape) > ndim and shape[-1] == 1:
        shape = shape[:-1]
    return shape


def _mm(spacing: Sequence[float]) -> str:
    return "(" + ", ".join(f"{float(v):g}" for v in spacing) + ") mm"


def _same_spacing(a: Sequence[float], b: Sequence[float]) -> bool:
    return bool(np.allclose(a, b, rtol=1e-4, atol=1e-6))


def _check_headers(case_id: str, images: Sequence[Path], label: Path | None, layout: Layout,
                   channels: Sequence[str], source: str = "the data set has") -> tuple[int, int, int]:
    """Check one case's files against its channels from their headers alone, and return its spatial shape.

    Refused (DataError naming the file and the values): a file that is not a readable NIfTI file; an image
    whose channel count is not ``len(channels)`` (MSD: the 4-D last axis, 3-D for one channel; else the number
    of channel files); a channel file that is not 3-D, or whose shape or spacing differs from the first's;
    a label whose spatial shape or spacing differs from the image's.
    """
    count = len(channels)
    entry = dataset_layout(layout)
    if entry.images == "one_file":
        if len(images) != 1:
            raise DataError(f"case {case_id!r}: {entry.titled} case has exactly one image file, got {len(images)}")
        path = images[0]
        img = _load_image(path)
        shape = tuple(int(s) for s in img.header.get_data_shape())
        found = 1 if len(shape) == 3 else (shape[3] if len(shape) == 4 else None)
        if found != count:
            got = (f"{found} channel(s)" if found is not None else f"{len(shape)} axes")
            raise DataError(f"image file {str(path)!r} has shape {shape}, {got}, but {source} {count} "
                            f"channel(s) ({_channel_list(channels)}); {_msd_shape_rule(channels, len(shape))}")
        spatial, spacing, first = shape[:3], _header_spacing(img), path
    else:
        what = entry.channel_file
        if len(images) != count:
            raise DataError(f"case {case_id!r} has {len(images)} image file(s) ({', '.join(p.name for p in images)}) "
                            f"but {source} {count} channel(s) ({_channel_list(channels)}): one 3-D file each")
        spatial = spacing = None
        first = images[0]
        for path in images:
            img = _load_image(path)
            shape = _squeezed(tuple(int(s) for s in img.header.get_data_shape()))
            if len(shape) != 3:
                raise DataError(f"image file {str(path)!r} has shape {shape}; {entry.titled} "
                                f"{what} must be 3-D")
            zooms = _header_spacing(img)
            if spatial is None:
                spatial, spacing = shape, zooms
            elif shape != spatial:
                raise DataError(f"case {case_id!r}: {what} {str(path)!r} has shape {shape} but {str(first)!r} has "
                                f"shape {spatial}; all {what}s must match")
            elif not _same_spacing(zooms, spacing):  # type: ignore[arg-type]
                raise DataError(f"case {case_id!r}: {what} {str(path)!r} has voxel spacing {_mm(zooms)} but "
                                f"{str(first)!r} has {_mm(spacing)}; a case's channels must lie on one grid")
    if label is not None:
        img = _load_image(label)
        shape = _squeezed(tuple(int(s) for s in img.header.get_data_shape()))
        if shape != tuple(spatial):  # type: ignore[arg-type]
            raise DataError(f"label file {str(label)!r} has shape {shape} but the image of case {case_id!r} "
                            f"({str(first)!r}) has spatial shape {tuple(spatial)}")  # type: ignore[arg-type]
        zooms = _header_spacing(img)
        if not _same_spacing(zooms, spacing):  # type: ignore[arg-type]
            raise DataError(f"label file {str(label)!r} has voxel spacing {_mm(zooms)} but the image of case "
                            f"{case_id!r} ({str(first)!r}) has {_mm(spacing)}; image and label must lie on one grid")
    return tuple(spatial)  # type: ignore[return-value, arg-type]


def check_cases(cases: Sequence[CaseFiles], dataset: DatasetDescription | Layout | str) -> None:
    """Check every case against its data set's description from the NIfTI headers alone (no voxel data is read,
    so this is cheap for a whole data set): run it before a conversion starts.

    Refused, naming the file and the values: a channel count that differs from the description's (an MSD
    image's 4-D last axis, 3-D meaning one channel; the number of nnU-Net or BraTS channel files); channel files
    whose shapes or spacings differ; a label whose spatial shape or voxel spacing differs from its image's; a
    file whose header cannot be read. Label values outside the description's labels need the voxel data:
    :func:`read_case` refuses them, naming the file.

    Raises:
        DataError: for the first bad case.
        ValueError: if ``dataset`` is the layout ``nnunet`` (pass its description).
    """
    description = _as_description(dataset)
    for case in cases:
        _check_headers(case.case_id, case.images, case.label, description.layout, description.channels)


def case_affine(case: CaseFiles) -> np.ndarray:
    """The 4x4 voxel-to-world affine of a case's (first) image file, from its NIfTI header only.

    Raises:
        DataError: naming the file, if its header cannot be read.
    """
    return np.array(_load_image(case.images[0]).affine, dtype=np.float64)


def case_orientation(case: CaseFiles) -> str:
    """The anatomical orientation of a case's image axes, from its header's affine: nibabel's axis codes
    joined, e.g. ``"RAS"`` or ``"LPS"`` (``"?"`` for an axis the affine leaves undefined).

    Raises:
        DataError: naming the file, if its header cannot be read.
    """
    return affine_orientation(case_affine(case))


def affine_orientation(affine: np.ndarray) -> str:
    """``"RAS"``, ``"LPS"``, ...: the axis codes of a 4x4 affine (nibabel's ``aff2axcodes``), ``"?"`` for an
    axis it leaves undefined."""
    import nibabel as nib

    return "".join(code or "?" for code in nib.aff2axcodes(np.asarray(affine)))
