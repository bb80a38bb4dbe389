"""The registry of on-disk data set layouts: one :class:`DatasetLayout` entry per :class:`Layout`.

An entry says how a layout's files look (its title, how a case's image is stored, its case folders' naming, its
data's own description where it has one) and binds the functions that read and write them: list a data set's
cases, describe its channels and classes, and write a synthetic data set. The readers
(:mod:`~distmis.data.layouts`, :mod:`~distmis.data.scans`, :mod:`~distmis.data.synthetic`) ask this registry for a
layout's entry (:func:`dataset_layout`) instead of branching on its name.

The entries themselves are made in :mod:`distmis.data.layout_entries`, next to nothing else, from the functions
of the modules of each job (discovery in layouts, description in description, writing in synthetic); importing
``distmis.data`` (which importing any of its modules does first) registers them. This module imports none of
those modules, so they may all import it.

Adding a layout: a :class:`Layout` member, its entry in :mod:`~distmis.data.layout_entries` (with its discover,
describe and writer functions, in the modules of their jobs), and its test: ``tests/data/test_dataset_layouts.py``
runs every entry through discovery, description, reading and synthesis.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable, Literal

import numpy as np

from distmis.data.description import DatasetDescription, Layout, coerce_layout

__all__ = ["CaseFiles", "SyntheticKind", "CaseFolderNaming", "SyntheticLayout", "DatasetLayout", "DATASET_LAYOUTS",
           "register_dataset_layout", "dataset_layout", "case_folder_layouts", "layout_description",
           "describe_dataset"]


@dataclass(frozen=True)
class CaseFiles:
    """The files that make up one case.

    Attributes:
        case_id: name of the case, e.g. ``"BRATS_001"``, ``"BraTS2021_00000"`` or ``"BraTS-GLI-00000-000"``.
        images: MSD: one image file (4-D, or 3-D for one channel); nnU-Net: one 3-D file per channel, in channel
            order; BraTS / BraTS 2023: four files in :data:`~distmis.data.layouts.MODALITIES` order.
        label: the label (segmentation) file.
    """

    case_id: str
    images: tuple[Path, ...]
    label: Path


class SyntheticKind(str, Enum):
    """What :func:`~distmis.data.synthetic.synthesize_dataset` makes (see that module's docstring)."""

    BRAIN = "brain"  # four-channel MRI-like brain tumours (the quickstart's data)
    CT = "ct"  # one-channel CT-like abdomen with liver, spleen and kidney classes


@dataclass(frozen=True)
class CaseFolderNaming:
    """How a case folder's files are named: ``<case><separator><part>.nii.gz``, one part per modality (in
    :data:`~distmis.data.layouts.MODALITIES` order) and one for the label."""

    separator: str
    modalities: tuple[str, ...]
    label: str

    def stems(self, case_id: str) -> tuple[tuple[str, ...], str]:
        """The file names, without ``.nii.gz``, of case ``case_id``: ``(modality stems, label stem)``."""
        return (tuple(f"{case_id}{self.separator}{m}" for m in self.modalities),
                f"{case_id}{self.separator}{self.label}")


@dataclass(frozen=True)
class SyntheticLayout:
    """How :func:`~distmis.data.synthetic.synthesize_dataset` writes a data set in a layout.

    Attributes:
        kinds: the synthetic kinds the layout holds (a BraTS layout holds only four-channel brains).
        brain_case_id: the id of the brain kind's case ``index`` (0-based), in the style of the layout's real data.
        brain_labels: the label values of edema, enhancing tumour and (non-enhancing / necrotic) core.
        write_case: writes one case ``(folder, case_id, image, label, affine)``; ``image`` is ``(H, W, D)`` or
            ``(H, W, D, C)``.
        write_index: writes the data set's own index (its ``dataset.json``), ``(folder, kind, case_ids)``.
    """

    kinds: tuple[SyntheticKind, ...]
    brain_case_id: Callable[[int], str]
    brain_labels: tuple[int, int, int]
    write_case: Callable[[Path, str, np.ndarray, np.ndarray, np.ndarray], None]
    write_index: Callable[[Path, SyntheticKind, list[str]], None]


@dataclass(frozen=True)
class DatasetLayout:
    """One on-disk layout of a segmentation data set.

    Attributes:
        layout: its name in specs (``dataset.layout``).
        title: its name in messages ("MSD", "nnU-Net v2", "BraTS 2023").
        article: "a" or "an", as the title is spoken ("an MSD case").
        root_holds: what its data set root holds, for messages.
        images: how a case's image is stored: ``one_file`` (3-D, or 4-D with the channels last) or
            ``file_per_channel`` (one 3-D file each).
        channel_file: what one channel's file is called in messages ("channel file", "modality file").
        discover: the cases of a data set root, sorted by case id (:func:`~distmis.data.layouts.discover_cases`
            checks the root first, and names the layout the root looks like when none is found).
        describe: the root's :class:`~distmis.data.description.DatasetDescription` (its dataset.json, or its own).
        own: the description of the layout's own data where it has one (BraTS; MSD Task01); None where the data
            describe themselves only (nnU-Net), whose channels are then one per file.
        case_folder: the naming of its case folders, for layouts of one folder per case.
        synthetic: how a synthetic data set is written in it.
    """

    layout: Layout
    title: str
    article: Literal["a", "an"]
    root_holds: str
    images: Literal["one_file", "file_per_channel"]
    channel_file: str
    discover: Callable[[Path], list[CaseFiles]]
    describe: Callable[[Path], DatasetDescription]
    own: DatasetDescription | None
    case_folder: CaseFolderNaming | None
    synthetic: SyntheticLayout

    @property
    def titled(self) -> str:
        """The title with its article: "an MSD", "a BraTS 2023"."""
        return f"{self.article} {self.title}"


#: Every layout distmis reads, by name (filled by :mod:`distmis.data.layout_entries`).
DATASET_LAYOUTS: dict[Layout, DatasetLayout] = {}


def register_dataset_layout(entry: DatasetLayout) -> None:
    """Add ``entry`` to :data:`DATASET_LAYOUTS`; ValueError when its layout has one already."""
    if entry.layout in DATASET_LAYOUTS:
        raise ValueError(f"layout {entry.layout.value!r} is registered already")
    DATASET_LAYOUTS[entry.layout] = entry


def dataset_layout(layout: Layout | str) -> DatasetLayout:
    """The registry's entry of ``layout`` (a :class:`Layout` or its name); ValueError listing the layouts when
    there is no such layout."""
    layout = coerce_layout(layout)
    if layout not in DATASET_LAYOUTS:  # only while distmis.data is still being imported
        raise ValueError(f"layout {layout.value!r} has no registry entry (import distmis.data first)")
    return DATASET_LAYOUTS[layout]


def case_folder_layouts() -> tuple[Layout, ...]:
    """The layouts of one folder per case (BraTS, BraTS 2023), in registry order."""
    return tuple(entry.layout for entry in DATASET_LAYOUTS.values() if entry.case_folder is not None)


def layout_description(layout: Layout | str) -> DatasetDescription:
    """The description of a layout's own data (its entry's ``own``): BraTS (2018-2021), BraTS 2023, or
    MSD Task01_BrainTumour.

    ``brats``: channels flair, t1, t1ce, t2; 0 background, 1 necrotic core, 2 edema, 4 enhancing tumour.
    ``brats2023``: the same channels (t2f, t1n, t1c, t2w); 0 background, 1 necrotic core (NCR), 2 edema (ED),
    3 enhancing tumour (ET). ``msd``: Task01's FLAIR, T1w, t1gd, T2w; 0 background, 1 edema,
    2 non-enhancing tumor, 3 enhancing tumour.

    Raises:
        ValueError: for a layout whose data describe themselves only (``nnunet``: its dataset.json,
            :func:`describe_dataset`), or an unknown layout.
    """
    entry = dataset_layout(layout)
    if entry.own is None:
        raise ValueError(f"layout {entry.layout.value!r} has no fixed channels and classes: {entry.titled} data set "
                         f"is described by its dataset.json (describe_dataset(root, {entry.layout.value!r}))")
    return entry.own


def describe_dataset(root: str | Path, layout: Layout | str) -> DatasetDescription:
    """The description of the data set at ``root``, from its ``dataset.json`` (MSD, nnU-Net v2), or the
    layout's own (:func:`layout_description`) for the BraTS layouts.

    Required keys: MSD ``modality``, ``labels``, ``training``; nnU-Net v2 ``channel_names``, ``labels``,
    ``numTraining``, ``file_ending`` (``.nii.gz`` or ``.nii``), and ``regions_class_order`` when a label is a list
    of values (a region).

    Raises:
        DataError: naming dataset.json and the key, when the file is missing or not a JSON object, a required
            key is missing or ill-typed, label 0 (background) is missing, two classes share a value, channel
            indices are not 0..n-1, or file_ending is not NIfTI's.
        ValueError: if ``layout`` is unknown.
    """
    return dataset_layout(layout).describe(Path(root))
