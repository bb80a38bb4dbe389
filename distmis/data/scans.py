"""Finding and reading the scans to segment, with or without labels.

:func:`~distmis.data.layouts.discover_cases` lists the cases of a training data
set, every one with its label.  A model is applied to anything from one case to
a whole data set, whose labels may be absent (a challenge's validation set has
none), so :func:`discover_scans` accepts any of these inputs and detects its
layout from the file names:

* one MSD 4-D image file (``.nii`` / ``.nii.gz``): one case named after the file;
* an MSD data set folder (with ``dataset.json``): its "training" cases and its
  "test" images;
* a folder of MSD image files and nothing case-like, e.g. ``imagesTs/``: one
  case per file;
* one BraTS (2018-2021) or BraTS 2023 case folder (see
  :mod:`~distmis.data.layouts`): one case;
* a BraTS or BraTS 2023 data set folder: every sub-folder that is a case folder,
  all of one layout.

An MSD image in a folder ``images<X>`` (``imagesTr``, ``imagesTs``) has the
label of the same name in the sibling folder ``labels<X>``, when that file
exists; a case folder's label is its ``seg`` file, when present.

:func:`read_scan` reads the image of a :class:`ScanFiles` as
:func:`~distmis.data.layouts.read_case` does, and returns the nibabel image of
its (first) file, whose affine and header a written prediction copies;
:func:`read_scan_label` reads its label, when it has one.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from distmis.data.errors import DataError
from distmis.data.layouts import (
    CASE_FOLDER_LAYOUTS,
    LABEL_VALUES,
    LAYOUT_NAMES,
    MODALITIES,
    NIFTI_SUFFIXES,
    Layout,
    _case_folder_files,
    _case_folder_layout,
    _as_image,
    _as_label,
    _case_id_from_file,
    _folder_layouts,
    _is_nifti,
    _msd_manifest,
    _msd_training,
    _read_images,
    _read_label,
    _subfolders,
    case_file_stems,
    coerce_layout,
)

if TYPE_CHECKING:  # pragma: no cover
    import nibabel as nib

__all__ = ["ACCEPTED_INPUTS", "ScanFiles", "check_scan", "check_scan_data", "detect_layout", "discover_scans",
           "read_scan", "read_scan_label"]

#: What :func:`discover_scans` accepts, for messages.
ACCEPTED_INPUTS = (
    "accepted inputs: an MSD 4-D image file (.nii or .nii.gz), an MSD data set folder (with dataset.json), "
    "a folder of MSD image files (e.g. imagesTs), a BraTS case folder (<case>_flair, _t1, _t1ce, _t2 .nii.gz) "
    "or BraTS 2023 case folder (<case>-t2f, -t1n, -t1c, -t2w .nii.gz), or a folder of such case folders"
)


@dataclass(frozen=True)
class ScanFiles:
    """The files of one case to segment.

    Attributes:
        case_id: name of the case, e.g. ``"BRATS_485"`` or ``"BraTS-GLI-00000-000"``.
        layout: the convention its files, and its label values, follow.
        images: MSD: one 4-D image file; BraTS / BraTS 2023: four files in :data:`MODALITIES` order.
        label: its label file, or None when it has none.

    A string layout and string paths are accepted and normalised on construction.
    """

    case_id: str
    layout: Layout
    images: tuple[Path, ...]
    label: Path | None = None

    def __post_init__(self) -> None:
        layout = coerce_layout(self.layout)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "images", tuple(Path(p) for p in self.images))
        if self.label is not None:
            object.__setattr__(self, "label", Path(self.label))
        expected = 1 if layout is Layout.MSD else len(MODALITIES)
        if len(self.images) != expected:
            raise ValueError(
                f"case {self.case_id!r}: {LAYOUT_NAMES[layout]} cases have {expected} image file(s), "
                f"got {len(self.images)}"
            )


# --------------------------------------------------------------------------- discovery


def _sibling_label(image: Path) -> Path | None:
    """``root/imagesTr/X.nii.gz`` -> ``root/labelsTr/X.nii.gz`` when that file exists, else None."""
    folder = image.parent
    if not folder.name.startswith("images"):
        return None
    candidate = folder.parent / f"labels{folder.name[len('images'):]}" / image.name
    return candidate if candidate.is_file() else None


def _msd_scan(image: Path) -> ScanFiles:
    return ScanFiles(_case_id_from_file(image), Layout.MSD, (image,), _sibling_label(image))


def _case_folder_scan(folder: Path, layout: Layout) -> ScanFiles:
    images, label = _case_folder_files(folder, layout, need_label=False)
    return ScanFiles(folder.name, layout, images, label)


def _visible_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))


def _scans_of_msd_root(root: Path) -> list[ScanFiles]:
    """The "training" cases (with their labels) and the "test" images of an MSD data set."""
    manifest, meta = _msd_manifest(root)
    scans = [ScanFiles(c.case_id, Layout.MSD, c.images, c.label) for c in _msd_training(root, manifest, meta)]
    test = meta.get("test", [])
    if not isinstance(test, list):
        raise DataError(f"{str(manifest)!r}: 'test' must be a list of image paths, got {test!r}")
    for index, entry in enumerate(test):
        name = entry.get("image") if isinstance(entry, dict) else entry
        if not isinstance(name, str):
            raise DataError(
                f"{str(manifest)!r}: test entry {index} must be an image path (e.g. './imagesTs/BRATS_485.nii.gz') "
                f"or an object with a string field 'image', got {entry!r}"
            )
        image = Path(os.path.normpath(root / name))
        if not image.is_file():
            raise DataError(f"{str(manifest)!r}: test entry {index} lists {name!r}, but {str(image)!r} does not exist")
        scans.append(_msd_scan(image))
    return scans


def _one_layout(root: Path, folders: list[tuple[Path, Layout]]) -> Layout:
    """The layout of a data set's case folders; DataError, with an example of each, when they differ."""
    layouts = {layout for _, layout in folders}
    if len(layouts) > 1:
        examples = "; ".join(
            f"{next(f.name for f, l in folders if l is layout)!r} is a {LAYOUT_NAMES[layout]} case folder"
            for layout in CASE_FOLDER_LAYOUTS if layout in layouts
        )
        raise DataError(f"{str(root)!r} holds case folders of several layouts ({examples}); "
                        f"a data set's cases must all follow one layout")
    return folders[0][1]


def _misnamed_case(files: list[Path]) -> tuple[Layout, str] | None:
    """A case-folder layout and case id whose modality files all lie among ``files``, if any."""
    stems = {_case_id_from_file(p) for p in files}
    for layout in CASE_FOLDER_LAYOUTS:
        first = case_file_stems(layout, "")[0][0]  # e.g. "_flair"
        for stem in sorted(stems):
            if stem.endswith(first) and len(stem) > len(first):
                case_id = stem[: -len(first)]
                if set(case_file_stems(layout, case_id)[0]) <= stems:
                    return layout, case_id
    return None


def _classify_folder(folder: Path) -> tuple[str, Layout, Callable[[], list[ScanFiles]]]:
    if (folder / "dataset.json").is_file():
        return "an MSD data set with dataset.json", Layout.MSD, functools.partial(_scans_of_msd_root, folder)
    own = _case_folder_layout(folder)
    if own is not None:
        return f"a {LAYOUT_NAMES[own]} case folder", own, lambda: [_case_folder_scan(folder, own)]
    case_folders = [(sub, found) for sub in _subfolders(folder) if (found := _case_folder_layout(sub)) is not None]
    nifti_files = [p for p in _visible_files(folder) if _is_nifti(p)]
    if case_folders and nifti_files:
        raise DataError(
            f"{str(folder)!r} holds both case folders (e.g. {case_folders[0][0].name!r}) and NIfTI files "
            f"(e.g. {nifti_files[0].name!r}); pass the case folders' data set or a folder of image files, not a mix"
        )
    if case_folders:
        layout = _one_layout(folder, case_folders)
        return (f"a {LAYOUT_NAMES[layout]} data set", layout,
                lambda: [_case_folder_scan(sub, layout) for sub, _ in case_folders])
    if nifti_files:
        misnamed = _misnamed_case(nifti_files)
        if misnamed is not None:
            layout, case_id = misnamed
            raise DataError(
                f"{str(folder)!r} holds the modality files of {LAYOUT_NAMES[layout]} case {case_id!r}, but a case "
                f"folder must be named after its case: rename the folder to {case_id!r}"
            )
        return "a folder of MSD image files", Layout.MSD, lambda: [_msd_scan(p) for p in nifti_files]
    images = [sub.name for sub in _subfolders(folder) if sub.name.startswith("images")]
    hint = f" (to read the MSD images in {images[0]!r}, pass that folder)" if images else ""
    raise DataError(f"found no scans in {str(folder)!r}: it holds no dataset.json, case folder or NIfTI file{hint}; "
                    f"{ACCEPTED_INPUTS}")


def _classify_file(path: Path) -> tuple[str, Layout, Callable[[], list[ScanFiles]]]:
    if not _is_nifti(path):
        raise DataError(f"{str(path)!r} is not a NIfTI file (.nii or .nii.gz); {ACCEPTED_INPUTS}")
    for layout in _folder_layouts(path.parent):
        modalities, label = case_file_stems(layout, path.parent.name)
        if _case_id_from_file(path) in (*modalities, label):
            raise DataError(
                f"{str(path)!r} is one file of the {LAYOUT_NAMES[layout]} case folder {str(path.parent)!r}: "
                f"pass that folder to read the case's {len(MODALITIES)} modalities"
            )
    return "an MSD image file", Layout.MSD, lambda: [_msd_scan(path)]


def discover_scans(path: str | Path, layout: Layout | str | None = None) -> list[ScanFiles]:
    """List the scans at ``path``, one case or a whole data set (see the module docstring), sorted by case id.

    Args:
        path: an image file, a case folder or a data set folder.
        layout: the layout ``path`` must follow; None: detect it from the file names.

    Raises:
        DataError: naming the path, if it does not exist, is not a NIfTI file, holds no scan, holds case folders
            of several layouts or a mix of case folders and image files, a case folder lacks a modality (naming
            the expected file), a file listed in dataset.json is missing, two scans have one case id, or
            ``layout`` is not the layout found.
        ValueError: if ``layout`` is not a known layout.
    """
    wanted = None if layout is None else coerce_layout(layout)
    path = Path(path)
    if not path.exists():
        raise DataError(f"{str(path)!r} does not exist; {ACCEPTED_INPUTS}")
    what, found, collect = _classify_folder(path) if path.is_dir() else _classify_file(path)
    if wanted is not None and wanted is not found:
        raise DataError(f"{str(path)!r} is {what} (layout {found.value!r}), but layout {wanted.value!r} was given")
    scans = collect()
    if not scans:
        raise DataError(f"found no scans in {str(path)!r}: it is {what} that lists no case; {ACCEPTED_INPUTS}")
    by_id: dict[str, ScanFiles] = {}
    for scan in scans:
        if scan.case_id in by_id:
            raise DataError(
                f"two scans in {str(path)!r} have the case id {scan.case_id!r}: {str(by_id[scan.case_id].images[0])!r} "
                f"and {str(scan.images[0])!r}; case ids must be unique"
            )
        by_id[scan.case_id] = scan
    return [by_id[case_id] for case_id in sorted(by_id)]


# --------------------------------------------------------------------------- reading


def read_scan(scan: ScanFiles) -> tuple[np.ndarray, nib.Nifti1Image]:
    """Read a scan's image, validated like :func:`~distmis.data.layouts.read_case`.

    Returns:
        ``(image, reference)``: the float32 ``(H, W, D, 4)`` image, channels in :data:`MODALITIES` order and
        as stored (no reorientation), and the nibabel image of ``scan.images[0]`` (header and affine; its
        voxel data is not cached), whose geometry a prediction written for the scan copies.

    Raises:
        DataError: naming the file, if it is not a readable NIfTI file, an MSD image is not ``(H, W, D, 4)``,
            a BraTS modality is not 3-D (trailing singleton axes aside) or differs in shape from the first,
            or the image holds NaN/inf.
    """
    return _read_images(scan.case_id, scan.images, scan.layout)


def read_scan_label(scan: ScanFiles, shape: tuple[int, int, int]) -> np.ndarray:
    """Read a scan's label as int16 ``(H, W, D)``, with the values of ``scan.layout`` (:data:`LABEL_VALUES`).

    Args:
        scan: a scan with a label file.
        shape: the spatial shape of its image (``read_scan(scan)[0].shape[:3]``), which the label must have.

    Raises:
        DataError: naming the file, if the scan has no label, the label cannot be read, has another shape,
            or holds a value that is not allowed for the scan's layout.
    """
    if scan.label is None:
        if scan.layout is Layout.MSD:
            where = f"an MSD label lies in labelsTr/ beside imagesTr/, named like the image {scan.images[0].name!r}"
        else:
            where = f"its folder holds no {case_file_stems(scan.layout, scan.case_id)[1]}{NIFTI_SUFFIXES[0]}"
        raise DataError(f"case {scan.case_id!r} ({str(scan.images[0])!r}) has no label file ({where})")
    spatial = tuple(int(s) for s in shape)
    if len(spatial) != 3:
        raise ValueError(f"shape must be the 3 spatial sizes (H, W, D) of the image, got {tuple(shape)!r}")
    return _read_label(scan.label, spatial, scan.layout, scan.case_id, scan.images[0])


def check_scan(scan: ScanFiles) -> tuple[int, int, int]:
    """Check a scan from its files' headers alone (no voxel data is read) and return its spatial shape.

    What :func:`read_scan` would refuse for its shape is refused here, so that a command over many scans stops
    before it has done anything: a file that is not a readable NIfTI file, an MSD image that is not
    ``(H, W, D, 4)``, a modality that is not 3-D or differs in shape from the first, a label of another shape.

    Raises:
        DataError: naming the file.
    """
    from distmis.data.layouts import _load_image

    def shape_of(path: Path) -> tuple[int, ...]:
        shape = tuple(int(s) for s in _load_image(path).header.get_data_shape())
        while len(shape) > 3 and shape[-1] == 1:  # some tools write (H, W, D, 1)
            shape = shape[:-1]
        return shape

    if scan.layout is Layout.MSD:
        path = scan.images[0]
        shape = tuple(int(s) for s in _load_image(path).header.get_data_shape())
        if len(shape) != 4 or shape[3] != len(MODALITIES):
            raise DataError(f"image file {str(path)!r} has shape {shape}; an MSD image must be 4-D "
                            f"(H, W, D, {len(MODALITIES)}) with channels {', '.join(MODALITIES)}")
        spatial = shape[:3]
    else:
        shapes = [shape_of(path) for path in scan.images]
        for path, shape in zip(scan.images, shapes):
            if len(shape) != 3:
                raise DataError(f"image file {str(path)!r} has shape {shape}; a {LAYOUT_NAMES[scan.layout]} "
                                "modality must be 3-D")
            if shape != shapes[0]:
                raise DataError(f"case {scan.case_id!r}: modality file {str(path)!r} has shape {shape} but "
                                f"{str(scan.images[0])!r} has shape {shapes[0]}; all modalities must match")
        spatial = shapes[0]
    if scan.label is not None and shape_of(scan.label) != spatial:
        raise DataError(f"label file {str(scan.label)!r} has shape {shape_of(scan.label)} but the image of case "
                        f"{scan.case_id!r} ({str(scan.images[0])!r}) has spatial shape {spatial}")
    return spatial  # type: ignore[return-value]


#: Bytes of decompressed voxel data :func:`check_scan_data` holds at a time.
DATA_CHUNK_BYTES = 16 * 2**20


def _voxel_chunks(path: Path) -> Iterator[np.ndarray]:
    """The voxel values of the NIfTI file at ``path`` as stored, scaled by its header's slope and intercept,
    ``DATA_CHUNK_BYTES`` at a time, read to the end of the file (so that a gzip stream's end marker and checksum
    are checked too). DataError naming the file when it cannot be read, holds fewer bytes than its header
    promises, or its compressed stream is corrupt."""
    from nibabel.openers import ImageOpener

    from distmis.data.layouts import _load_image

    proxy = _load_image(path).dataobj  # nibabel's ArrayProxy: where, and how, nibabel reads the data
    dtype, shape = np.dtype(proxy.dtype), tuple(int(s) for s in proxy.shape)
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    offset = int(proxy.offset)
    slope, inter = float(proxy.slope), float(proxy.inter)
    scaled = (slope, inter) != (1.0, 0.0)
    step = max(dtype.itemsize, DATA_CHUNK_BYTES // dtype.itemsize * dtype.itemsize)
    source = proxy.file_like if isinstance(proxy.file_like, str) else str(path)
    got = 0
    try:
        with ImageOpener(source, "rb") as stream:
            if len(stream.read(offset)) < offset:
                raise DataError(f"cannot read {str(path)!r}: the file ends before its voxel data starts (byte "
                                f"{offset}); it is cut short: copy or download it again")
            while True:
                block = stream.read(min(step, expected - got) if got < expected else step)
                if not block:
                    break
                if got < expected:
                    values = np.frombuffer(block, dtype=dtype, count=len(block) // dtype.itemsize)
                    yield values * slope + inter if scaled else values
                got += len(block)
    except DataError:
        raise
    except Exception as exc:  # gzip's BadGzipFile and EOFError, zlib.error, OSError: a corrupt or cut file
        raise DataError(f"cannot read the voxel data of {str(path)!r} ({type(exc).__name__}: {exc}): the file is "
                        "corrupt or cut short; copy or download it again") from exc
    if got < expected:
        raise DataError(f"cannot read {str(path)!r}: its header promises {expected} bytes of voxel data "
                        f"(shape {shape}, {dtype}) but the file holds {got}; it is cut short: copy or download it "
                        "again")


def check_scan_data(scan: ScanFiles, *, label: bool = False) -> None:
    """Read the voxel data of every image file of ``scan`` (and, with ``label``, of its label file) once, in
    chunks, holding no whole volume: what :func:`read_scan` (and :func:`read_scan_label`) would refuse for the
    data is refused here, so that a command over many scans stops before it writes anything. A file that
    nibabel opens by its header alone may still be cut short or corrupt in its data.

    Refused: data shorter than the header promises, a corrupt compressed stream (gzip's checksum and end marker
    are checked), image values that are NaN or infinite as float32, label values the layout does not allow.

    Raises:
        DataError: naming the file.
    """
    for path in scan.images:
        for values in _voxel_chunks(path):
            _as_image(values, path)
    if label and scan.label is not None:
        allowed = set(LABEL_VALUES[scan.layout])
        for values in _voxel_chunks(scan.label):
            if values.dtype.kind in "iub" and set(np.unique(values).tolist()) <= allowed:
                continue  # the common case, without _as_label's int16 copy
            _as_label(values, scan.label, scan.layout)


def detect_layout(root: str | Path) -> Layout:
    """The layout of the data set (or case) at ``root``, from its file names alone: ``msd`` for a folder with
    dataset.json or of MSD image files, ``brats`` or ``brats2023`` for a case folder or a folder of them.

    Raises:
        DataError: naming ``root``, as :func:`discover_scans` does, when it holds no scan or a mix of layouts.
    """
    path = Path(root)
    if not path.exists():
        raise DataError(f"{str(path)!r} does not exist; {ACCEPTED_INPUTS}")
    return (_classify_folder(path) if path.is_dir() else _classify_file(path))[1]
