"""Finding and reading the scans to segment, with or without labels.

:func:`~distmis.data.layouts.discover_cases` lists the cases of a training data
set, every one with its label.  A model is applied to anything from one case to
a whole data set, whose labels may be absent (a challenge's validation set has
none), so :func:`discover_scans` accepts any of these inputs and detects its
layout from the file names:

* one MSD image file (``.nii`` / ``.nii.gz``; 4-D, or 3-D for a one-channel
  model): one case named after the file;
* an MSD data set folder (with ``dataset.json``): its "training" cases and its
  "test" images;
* a folder of MSD image files and nothing case-like, e.g. ``imagesTs/``: one
  case per file;
* an nnU-Net v2 data set folder (``dataset.json`` with ``channel_names``): the
  cases of its ``imagesTr`` and ``imagesTs`` folders;
* a folder of nnU-Net channel files ``<case>_XXXX.nii.gz`` (every case with its
  ``_0000``), e.g. an nnU-Net ``imagesTs/``: one case per ``<case>``;
* one nnU-Net channel file (the case's other channel files are taken from its
  folder), or a list of channel files: their case(s);
* one BraTS (2018-2021) or BraTS 2023 case folder (see
  :mod:`~distmis.data.layouts`): one case;
* a BraTS or BraTS 2023 data set folder: every sub-folder that is a case folder,
  all of one layout.

Files named ``<case>_XXXX`` are taken for nnU-Net channel files when their
case has its ``_0000`` beside them (``BRATS_0001.nii.gz`` alone stays an MSD
image); pass ``layout="msd"`` to read them as MSD images instead.

An MSD image (or nnU-Net channel file) in a folder ``images<X>`` (``imagesTr``,
``imagesTs``) has the label of its case's name in the sibling folder
``labels<X>``, when that file exists; a case folder's label is its ``seg`` file,
when present.

:func:`read_scan` reads the image of a :class:`ScanFiles` as
:func:`~distmis.data.layouts.read_case` does, with the number of channels the
model takes, and returns the nibabel image of its (first) file, whose affine and
header a written prediction copies; :func:`read_scan_label` reads its label, when
it has one.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from distmis.data.dataset_layouts import case_folder_layouts, dataset_layout
from distmis.data.description import describe_nnunet
from distmis.data.errors import DataError
from distmis.data.layouts import (
    MODALITIES,
    NIFTI_SUFFIXES,
    Layout,
    _CHANNEL_FILE,
    _as_description,
    _as_image,
    _as_label,
    _case_folder_files,
    _case_folder_layout,
    _case_id_from_file,
    _channel_files,
    _check_headers,
    _folder_layouts,
    _is_nifti,
    _msd_manifest,
    _msd_training,
    _nnunet_case_images,
    _read_images,
    _read_label,
    _subfolders,
    case_file_stems,
    channel_file_name,
    coerce_layout,
)

if TYPE_CHECKING:  # pragma: no cover
    import nibabel as nib

    from distmis.data.description import DatasetDescription

__all__ = ["ACCEPTED_INPUTS", "ScanFiles", "check_scan", "check_scan_data", "detect_layout", "discover_scans",
           "read_scan", "read_scan_label", "scan_channels"]

#: What :func:`discover_scans` accepts, for messages.
ACCEPTED_INPUTS = (
    "accepted inputs: an MSD image file (.nii or .nii.gz; 4-D, or 3-D for one channel), an MSD data set folder "
    "(with dataset.json), a folder of MSD image files (e.g. imagesTs), an nnU-Net v2 data set folder (dataset.json "
    "with channel_names), a folder of nnU-Net channel files (<case>_0000.nii.gz, <case>_0001.nii.gz, ...) or some "
    "of those files, a BraTS case folder (<case>_flair, _t1, _t1ce, _t2 .nii.gz) or BraTS 2023 case folder "
    "(<case>-t2f, -t1n, -t1c, -t2w .nii.gz), or a folder of such case folders"
)


@dataclass(frozen=True)
class ScanFiles:
    """The files of one case to segment.

    Attributes:
        case_id: name of the case, e.g. ``"BRATS_485"``, ``"BraTS-GLI-00000-000"`` or ``"prostate_00"``.
        layout: the convention its files, and its label values, follow.
        images: MSD: one image file (4-D, or 3-D for one channel); nnU-Net: one 3-D file per channel, in channel
            order; BraTS / BraTS 2023: four files in :data:`MODALITIES` order.
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
        entry = dataset_layout(layout)
        if entry.images == "one_file" or entry.case_folder is not None:
            expected = 1 if entry.case_folder is None else len(entry.case_folder.modalities)
            if len(self.images) != expected:
                raise ValueError(f"case {self.case_id!r}: {entry.title} cases have {expected} image file(s), "
                                 f"got {len(self.images)}")
        elif not self.images:
            raise ValueError(f"case {self.case_id!r}: {entry.titled} case has one image file per channel, got none")


# --------------------------------------------------------------------------- discovery


def _sibling_label(image: Path, name: str | None = None) -> Path | None:
    """``root/imagesTr/X.nii.gz`` -> ``root/labelsTr/X.nii.gz`` (or ``labelsTr/<name>``) when that file exists,
    else None."""
    folder = image.parent
    if not folder.name.startswith("images"):
        return None
    candidate = folder.parent / f"labels{folder.name[len('images'):]}" / (name or image.name)
    return candidate if candidate.is_file() else None


def _msd_scan(image: Path) -> ScanFiles:
    return ScanFiles(_case_id_from_file(image), Layout.MSD, (image,), _sibling_label(image))


def _case_folder_scan(folder: Path, layout: Layout) -> ScanFiles:
    images, label = _case_folder_files(folder, layout, need_label=False)
    return ScanFiles(folder.name, layout, images, label)


def _visible_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))


def scans_of_msd_root(root: Path) -> list[ScanFiles]:
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


# ---- nnU-Net


def _channel_groups(files: Sequence[Path]) -> tuple[dict[str, dict[int, Path]], list[Path], str]:
    """``files`` (NIfTI) grouped as nnU-Net channel files ``{case: {index: file}}``, the files not named
    ``<case>_XXXX``, and the files' ending. DataError when one case's channel is given twice, or the files mix
    ``.nii`` and ``.nii.gz``."""
    groups: dict[str, dict[int, Path]] = {}
    misnamed = []
    endings = {next(s for s in NIFTI_SUFFIXES if p.name.endswith(s)) for p in files}
    for path in files:
        stem = _case_id_from_file(path)
        match = _CHANNEL_FILE.match(stem)
        if match is None:
            misnamed.append(path)
            continue
        found = groups.setdefault(match["case"], {})
        index = int(match["index"])
        if index in found:
            raise DataError(f"channel {index:04d} of case {match['case']!r} is given twice: {str(found[index])!r} and "
                            f"{str(path)!r}")
        found[index] = path
    return groups, misnamed, (endings.pop() if len(endings) == 1 else "")


def _looks_nnunet(groups: dict[str, dict[int, Path]], misnamed: list[Path]) -> bool:
    """Whether NIfTI files grouped by :func:`_channel_groups` are nnU-Net channel files: all named
    ``<case>_XXXX``, and every case has its channel 0000."""
    return bool(groups) and not misnamed and all(0 in found for found in groups.values())


def _folder_description(folder: Path) -> DatasetDescription | None:
    """The nnU-Net description of the data set ``folder`` (e.g. its imagesTs) lies in, when its parent holds an
    nnU-Net dataset.json that reads."""
    from distmis.data.description import dataset_json_layout

    manifest = folder.parent / "dataset.json"
    if not manifest.is_file():
        return None
    try:
        meta = json.loads(manifest.read_text())
        if not isinstance(meta, dict) or dataset_json_layout(meta) is not Layout.NNUNET:
            return None
        return describe_nnunet(folder.parent)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, DataError):
        return None


def _nnunet_scans(groups: dict[str, dict[int, Path]], ending: str, *,
                  description: DatasetDescription | None = None, where: str = "") -> list[ScanFiles]:
    """One scan per case of ``groups`` (from :func:`_channel_groups`), its channel files complete: the
    description's channels, else as many as the folder's cases have. Labels from the ``labels<X>`` sibling."""
    if description is not None:
        channels = description.channels
        source = f"the data set's dataset.json ({str(description.name)!r}) lists"
    else:
        count = max(max(found) for found in groups.values()) + 1
        channels = tuple(f"channel {i}" for i in range(count))
        source = f"the cases {where}have" if where else "the cases given have"
    scans = []
    for case_id in sorted(groups):
        found = groups[case_id]
        folder = next(iter(found.values())).parent
        images = _nnunet_case_images(case_id, found, folder, channels, ending, source)
        scans.append(ScanFiles(case_id, Layout.NNUNET, images, _sibling_label(images[0], f"{case_id}{ending}")))
    return scans


def scans_of_nnunet_root(root: Path) -> list[ScanFiles]:
    """The cases of an nnU-Net data set's imagesTr (with their labels) and imagesTs (with labelsTs, if any)."""
    description = describe_nnunet(root)
    ending = description.file_ending
    scans: list[ScanFiles] = []
    for name in ("imagesTr", "imagesTs"):
        folder = root / name
        if not folder.is_dir():
            continue
        groups, misnamed = _channel_files(folder, ending)
        if misnamed:
            raise DataError(f"image file {str(misnamed[0])!r} is not named <case>_XXXX{ending}: an nnU-Net image file "
                            f"holds one channel, XXXX its 4-digit index (0000 for {description.channels[0]!r})")
        scans += _nnunet_scans(groups, ending, description=description)
    return scans


#: The scans of a data set root with a dataset.json, by the layout its dataset.json follows.
_DATASET_JSON_SCANS: dict[Layout, Callable[[Path], list[ScanFiles]]] = {
    Layout.MSD: scans_of_msd_root,
    Layout.NNUNET: scans_of_nnunet_root,
}


def _nnunet_folder(folder: Path, nifti_files: list[Path]) -> Callable[[], list[ScanFiles]]:
    """The scans of a folder of nnU-Net channel files."""
    def collect() -> list[ScanFiles]:
        groups, misnamed, ending = _channel_groups(nifti_files)
        if misnamed:
            raise DataError(f"{str(misnamed[0])!r} is not named <case>_XXXX.nii.gz, as an nnU-Net channel file is "
                            f"(e.g. {nifti_files[0].name!r}); a folder holds either nnU-Net channel files or MSD "
                            "images")
        if not ending:
            raise DataError(f"{str(folder)!r} mixes .nii and .nii.gz channel files; an nnU-Net data set has one "
                            "file_ending")
        return _nnunet_scans(groups, ending, description=_folder_description(folder), where=f"in {str(folder)!r} ")
    return collect


def _nnunet_files(paths: Sequence[Path]) -> list[ScanFiles]:
    """The scans of a list of nnU-Net channel files (one case, or several)."""
    groups, misnamed, ending = _channel_groups(paths)
    if misnamed:
        raise DataError(f"{str(misnamed[0])!r} is not named <case>_XXXX.nii.gz: several files are read as the channel "
                        "files of nnU-Net cases, <case>_0000.nii.gz, <case>_0001.nii.gz, ...")
    if not ending:
        raise DataError("the files given mix .nii and .nii.gz; an nnU-Net case's channel files share one ending")
    folders = {p.parent for p in paths}
    description = _folder_description(folders.pop()) if len(folders) == 1 else None
    return _nnunet_scans(groups, ending, description=description)


def _case_of_channel_file(path: Path) -> Callable[[], list[ScanFiles]]:
    """The nnU-Net case one of whose channel files ``path`` is: its channel files from the file's folder."""
    def collect() -> list[ScanFiles]:
        ending = next(s for s in NIFTI_SUFFIXES if path.name.endswith(s))
        case_id = _CHANNEL_FILE.match(_case_id_from_file(path))["case"]  # type: ignore[index]
        groups, _ = _channel_files(path.parent, ending)
        description = _folder_description(path.parent)
        return _nnunet_scans({case_id: groups[case_id]}, ending, description=description,
                             where=f"{case_id!r} in {str(path.parent)!r} ")
    return collect


# ---- classification


def _one_layout(root: Path, folders: list[tuple[Path, Layout]]) -> Layout:
    """The layout of a data set's case folders; DataError, with an example of each, when they differ."""
    layouts = {layout for _, layout in folders}
    if len(layouts) > 1:
        examples = "; ".join(
            f"{next(f.name for f, l in folders if l is layout)!r} is a {dataset_layout(layout).title} case folder"
            for layout in case_folder_layouts() if layout in layouts
        )
        raise DataError(f"{str(root)!r} holds case folders of several layouts ({examples}); "
                        f"a data set's cases must all follow one layout")
    return folders[0][1]


def _misnamed_case(files: list[Path]) -> tuple[Layout, str] | None:
    """A case-folder layout and case id whose modality files all lie among ``files``, if any."""
    stems = {_case_id_from_file(p) for p in files}
    for layout in case_folder_layouts():
        first = case_file_stems(layout, "")[0][0]  # e.g. "_flair"
        for stem in sorted(stems):
            if stem.endswith(first) and len(stem) > len(first):
                case_id = stem[: -len(first)]
                if set(case_file_stems(layout, case_id)[0]) <= stems:
                    return layout, case_id
    return None


def _dataset_json_layout(folder: Path) -> Layout:
    """``nnunet`` when ``folder/dataset.json`` has ``channel_names``, else ``msd`` (an unreadable file is left to
    the MSD reader, which names the problem)."""
    from distmis.data.description import dataset_json_layout

    try:
        meta = json.loads((folder / "dataset.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return Layout.MSD
    return dataset_json_layout(meta) if isinstance(meta, dict) else Layout.MSD


def _classify_folder(folder: Path, wanted: Layout | None = None) -> tuple[str, Layout, Callable[[], list[ScanFiles]]]:
    if (folder / "dataset.json").is_file():
        indexed = _dataset_json_layout(folder)
        return (f"{dataset_layout(indexed).titled} data set with dataset.json", indexed,
                functools.partial(_DATASET_JSON_SCANS[indexed], folder))
    own = _case_folder_layout(folder)
    if own is not None:
        return f"a {dataset_layout(own).title} case folder", own, lambda: [_case_folder_scan(folder, own)]
    case_folders = [(sub, found) for sub in _subfolders(folder) if (found := _case_folder_layout(sub)) is not None]
    nifti_files = [p for p in _visible_files(folder) if _is_nifti(p)]
    if case_folders and nifti_files:
        raise DataError(
            f"{str(folder)!r} holds both case folders (e.g. {case_folders[0][0].name!r}) and NIfTI files "
            f"(e.g. {nifti_files[0].name!r}); pass the case folders' data set or a folder of image files, not a mix"
        )
    if case_folders:
        layout = _one_layout(folder, case_folders)
        return (f"{dataset_layout(layout).titled} data set", layout,
                lambda: [_case_folder_scan(sub, layout) for sub, _ in case_folders])
    if nifti_files:
        misnamed = _misnamed_case(nifti_files)
        if misnamed is not None:
            layout, case_id = misnamed
            raise DataError(
                f"{str(folder)!r} holds the modality files of {dataset_layout(layout).title} case {case_id!r}, but a "
                f"case folder must be named after its case: rename the folder to {case_id!r}"
            )
        if wanted is Layout.NNUNET or (wanted is not Layout.MSD and _looks_nnunet(*_channel_groups(nifti_files)[:2])):
            return "a folder of nnU-Net channel files", Layout.NNUNET, _nnunet_folder(folder, nifti_files)
        return "a folder of MSD image files", Layout.MSD, lambda: [_msd_scan(p) for p in nifti_files]
    images = [sub.name for sub in _subfolders(folder) if sub.name.startswith("images")]
    hint = ""
    if images:
        inside = [p for p in _visible_files(folder / images[0]) if _is_nifti(p)]
        try:
            kind = "nnU-Net channel files" if _looks_nnunet(*_channel_groups(inside)[:2]) else "MSD images"
        except DataError:  # a channel given twice: the folder itself says so when passed
            kind = "images"
        hint = f" (to read the {kind} in {images[0]!r}, pass that folder)"
    raise DataError(f"found no scans in {str(folder)!r}: it holds no dataset.json, case folder or NIfTI file{hint}; "
                    f"{ACCEPTED_INPUTS}")


def _classify_file(path: Path, wanted: Layout | None = None) -> tuple[str, Layout, Callable[[], list[ScanFiles]]]:
    if not _is_nifti(path):
        raise DataError(f"{str(path)!r} is not a NIfTI file (.nii or .nii.gz); {ACCEPTED_INPUTS}")
    for layout in _folder_layouts(path.parent):
        modalities, label = case_file_stems(layout, path.parent.name)
        if _case_id_from_file(path) in (*modalities, label):
            raise DataError(
                f"{str(path)!r} is one file of the {dataset_layout(layout).title} case folder {str(path.parent)!r}: "
                f"pass that folder to read the case's {len(MODALITIES)} modalities"
            )
    match = _CHANNEL_FILE.match(_case_id_from_file(path))
    if match is not None and wanted is not Layout.MSD:
        ending = next(s for s in NIFTI_SUFFIXES if path.name.endswith(s))
        if wanted is Layout.NNUNET or 0 in _channel_files(path.parent, ending)[0].get(match["case"], {}):
            return "an nnU-Net channel file", Layout.NNUNET, _case_of_channel_file(path)
    return "an MSD image file", Layout.MSD, lambda: [_msd_scan(path)]


def _classify_files(paths: Sequence[Path], wanted: Layout | None) -> tuple[str, Layout, Callable[[], list[ScanFiles]]]:
    """Several paths: nnU-Net channel files (grouped by case), or MSD image files (one case each)."""
    for path in paths:
        if not path.is_file():
            raise DataError(f"{str(path)!r} is not a file: several paths given are the image files of the cases; "
                            f"{ACCEPTED_INPUTS}")
        if not _is_nifti(path):
            raise DataError(f"{str(path)!r} is not a NIfTI file (.nii or .nii.gz); {ACCEPTED_INPUTS}")
    if wanted is Layout.NNUNET or (wanted is None and _looks_nnunet(*_channel_groups(paths)[:2])):
        return "a list of nnU-Net channel files", Layout.NNUNET, lambda: _nnunet_files(paths)
    return "a list of MSD image files", Layout.MSD, lambda: [_msd_scan(p) for p in paths]


def discover_scans(path: str | Path | Sequence[str | Path], layout: Layout | str | None = None) -> list[ScanFiles]:
    """List the scans at ``path``, one case or a whole data set (see the module docstring), sorted by case id.

    Args:
        path: an image file, a case folder or a data set folder; or several image files (nnU-Net channel files,
            grouped by case, or MSD images).
        layout: the layout ``path`` must follow; None: detect it from the file names. ``msd`` reads files named
            ``<case>_XXXX`` as MSD images, ``nnunet`` as channel files.

    Raises:
        DataError: naming the path, if it does not exist, is not a NIfTI file, holds no scan, holds case folders
            of several layouts or a mix of case folders and image files, a case folder lacks a modality or an
            nnU-Net case a channel file (naming the expected file), a file listed in dataset.json is missing,
            two scans have one case id, or ``layout`` is not the layout found.
        ValueError: if ``layout`` is not a known layout.
    """
    wanted = None if layout is None else coerce_layout(layout)
    if isinstance(path, (str, os.PathLike)):
        paths = [Path(path)]
    else:
        paths = [Path(p) for p in path]
        if not paths:
            raise DataError(f"no path given; {ACCEPTED_INPUTS}")
    for one in paths:
        if not one.exists():
            raise DataError(f"{str(one)!r} does not exist; {ACCEPTED_INPUTS}")
    if len(paths) > 1:
        what, found, collect = _classify_files(paths, wanted)
        path = paths[0].parent
    else:
        path = paths[0]
        what, found, collect = _classify_folder(path, wanted) if path.is_dir() else _classify_file(path, wanted)
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


def scan_channels(scan: ScanFiles, channels: int | Sequence[str] | None = None) -> tuple[str, ...]:
    """The channel names a scan is read with: ``channels`` (names, or a count, named ``channel 0``, ...), or by
    default the layout's: the four modalities for MSD and BraTS, one per file for nnU-Net."""
    if channels is None:
        if dataset_layout(scan.layout).own is None:  # its channels are its data set's: one per file
            return tuple(f"channel {i}" for i in range(len(scan.images)))
        return _as_description(scan.layout).channels
    if isinstance(channels, int):
        if isinstance(channels, bool) or channels < 1:
            raise ValueError(f"channels must be a positive number or the channel names, got {channels!r}")
        return tuple(f"channel {i}" for i in range(channels))
    names = tuple(str(c) for c in channels)
    if not names:
        raise ValueError("channels must name at least one channel")
    return names


def read_scan(scan: ScanFiles, channels: int | Sequence[str] | None = None) -> tuple[np.ndarray, nib.Nifti1Image]:
    """Read a scan's image, validated like :func:`~distmis.data.layouts.read_case`.

    Args:
        scan: from :func:`discover_scans`.
        channels: the channels the model takes (the recipe's channel names, or their number); None: the
            layout's (:func:`scan_channels`: MSD and BraTS the four modalities, nnU-Net one per file).

    Returns:
        ``(image, reference)``: the float32 ``(H, W, D, C)`` image, channels in file order and as stored (no
        reorientation), and the nibabel image of ``scan.images[0]`` (header and affine; its voxel data is not
        cached), whose geometry a prediction written for the scan copies.

    Raises:
        DataError: naming the file, if it is not a readable NIfTI file, an MSD image does not hold C channels
            (3-D is one channel), the number of nnU-Net channel files is not C, a BraTS modality or nnU-Net channel
            file is not 3-D (trailing singleton axes aside) or differs in shape from the first, or the image holds
            NaN/inf.
    """
    names = scan_channels(scan, channels)
    if dataset_layout(scan.layout).own is None and len(scan.images) != len(names):
        raise DataError(_channel_count_message(scan, names))
    return _read_images(scan.case_id, scan.images, scan.layout, names)


def _channel_count_message(scan: ScanFiles, names: Sequence[str]) -> str:
    files = ", ".join(repr(p.name) for p in scan.images)
    return (f"case {scan.case_id!r} has {len(scan.images)} channel file(s) ({files}) but the model takes "
            f"{len(names)} channel(s) ({', '.join(names)}): one file each, "
            f"{channel_file_name(scan.case_id, 0)} to {channel_file_name(scan.case_id, len(names) - 1)}")


def _scan_description(scan: ScanFiles, dataset: DatasetDescription | Layout | str | None) -> DatasetDescription:
    if dataset is not None:
        return _as_description(dataset)
    entry = dataset_layout(scan.layout)
    if entry.own is None:
        raise ValueError(f"case {scan.case_id!r} is {entry.titled} case: its label values come from its data set's "
                         f"description (pass dataset=, e.g. describe_dataset(root, {scan.layout.value!r}))")
    return _as_description(scan.layout)


def read_scan_label(scan: ScanFiles, shape: tuple[int, int, int],
                    dataset: DatasetDescription | Layout | str | None = None) -> np.ndarray:
    """Read a scan's label as int16 ``(H, W, D)``, with the values its data set allows.

    Args:
        scan: a scan with a label file.
        shape: the spatial shape of its image (``read_scan(scan)[0].shape[:3]``), which the label must have.
        dataset: the description whose ``label_values`` the label may hold (the model's data set), or a layout
            (its own description); None: the scan's layout's own
            (:func:`~distmis.data.dataset_layouts.layout_description`).

    Raises:
        DataError: naming the file, if the scan has no label, the label cannot be read, has another shape,
            or holds a value that is not allowed.
        ValueError: if ``dataset`` is None for an nnU-Net scan (it has no fixed label values).
    """
    if scan.label is None:
        entry = dataset_layout(scan.layout)
        if entry.case_folder is not None:
            where = f"its folder holds no {case_file_stems(scan.layout, scan.case_id)[1]}{NIFTI_SUFFIXES[0]}"
        elif entry.images == "one_file":
            where = (f"{entry.titled} label lies in labelsTr/ beside imagesTr/, named like the image "
                     f"{scan.images[0].name!r}")
        else:
            ending = next((s for s in NIFTI_SUFFIXES if scan.images[0].name.endswith(s)), NIFTI_SUFFIXES[0])
            where = f"{entry.titled} label lies in labelsTr/ beside imagesTr/, named {scan.case_id}{ending}"
        raise DataError(f"case {scan.case_id!r} ({str(scan.images[0])!r}) has no label file ({where})")
    spatial = tuple(int(s) for s in shape)
    if len(spatial) != 3:
        raise ValueError(f"shape must be the 3 spatial sizes (H, W, D) of the image, got {tuple(shape)!r}")
    return _read_label(scan.label, spatial, _scan_description(scan, dataset), scan.case_id, scan.images[0])


def check_scan(scan: ScanFiles, channels: int | Sequence[str] | None = None) -> tuple[int, int, int]:
    """Check a scan from its files' headers alone (no voxel data is read) and return its spatial shape.

    What :func:`read_scan` would refuse for its shape is refused here, so that a command over many scans stops
    before it has done anything: a file that is not a readable NIfTI file, an image that does not hold the
    ``channels`` (:func:`scan_channels`) - an MSD image's last axis, the number of channel files -, a modality or
    channel file that is not 3-D or differs in shape or spacing from the first, a label of another shape or
    spacing than its image.

    Raises:
        DataError: naming the file.
    """
    names = scan_channels(scan, channels)
    if dataset_layout(scan.layout).own is None and len(scan.images) != len(names):
        raise DataError(_channel_count_message(scan, names))
    source = "the model takes" if channels is not None else "the layout's images have"
    return _check_headers(scan.case_id, scan.images, scan.label, scan.layout, names, source)


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


def check_scan_data(scan: ScanFiles, *, label: bool = False,
                    dataset: DatasetDescription | Layout | str | None = None) -> None:
    """Read the voxel data of every image file of ``scan`` (and, with ``label``, of its label file) once, in
    chunks, holding no whole volume: what :func:`read_scan` (and :func:`read_scan_label`) would refuse for the
    data is refused here, so that a command over many scans stops before it writes anything. A file that
    nibabel opens by its header alone may still be cut short or corrupt in its data.

    Refused: data shorter than the header promises, a corrupt compressed stream (gzip's checksum and end marker
    are checked), image values that are NaN or infinite as float32, label values that ``dataset`` (as
    :func:`read_scan_label` takes it; None: the scan's layout's) does not allow.

    Raises:
        DataError: naming the file.
        ValueError: with ``label``, if ``dataset`` is None for an nnU-Net scan that has a label.
    """
    description = _scan_description(scan, dataset) if label and scan.label is not None else None
    for path in scan.images:
        for values in _voxel_chunks(path):
            _as_image(values, path)
    if description is not None and scan.label is not None:
        allowed = set(description.label_values)
        for values in _voxel_chunks(scan.label):
            if values.dtype.kind in "iub" and set(np.unique(values).tolist()) <= allowed:
                continue  # the common case, without _as_label's int16 copy
            _as_label(values, scan.label, description)


def detect_layout(root: str | Path) -> Layout:
    """The layout of the data set (or case) at ``root``, from its file names alone: ``nnunet`` for a folder whose
    dataset.json has ``channel_names`` or of nnU-Net channel files (``<case>_0000.nii.gz``, ...), ``msd`` for a
    folder with another dataset.json or of MSD image files, ``brats`` or ``brats2023`` for a case folder or a
    folder of them.

    Raises:
        DataError: naming ``root``, as :func:`discover_scans` does, when it holds no scan or a mix of layouts.
    """
    path = Path(root)
    if not path.exists():
        raise DataError(f"{str(path)!r} does not exist; {ACCEPTED_INPUTS}")
    return (_classify_folder(path) if path.is_dir() else _classify_file(path))[1]
