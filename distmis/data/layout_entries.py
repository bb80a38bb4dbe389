"""The entries of the data layout registry (:mod:`~distmis.data.dataset_layouts`): MSD, nnU-Net v2, BraTS
2018-2021 and BraTS 2023, each bound to its own discover, describe and synthetic writer functions.

Imported by ``distmis/data/__init__.py``, so that the registry is full before any reader asks it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

from distmis.data.dataset_layouts import (
    CaseFolderNaming, DatasetLayout, SyntheticKind, SyntheticLayout, register_dataset_layout,
)
from distmis.data.description import DatasetDescription, Layout, describe_msd, describe_nnunet
from distmis.data.layouts import discover_case_folders, discover_msd, discover_nnunet
from distmis.data.synthetic import (
    write_case_folder_case, write_msd_case, write_msd_index, write_nnunet_case, write_nnunet_index,
)

__all__: list[str] = []

_BRATS_CHANNELS = ("flair", "t1", "t1ce", "t2")
#: MSD Task01_BrainTumour: FLAIR, T1w, t1gd, T2w; 1 edema, 2 non-enhancing tumour, 3 enhancing tumour.
_MSD_TASK01 = DatasetDescription(Layout.MSD, ("FLAIR", "T1w", "t1gd", "T2w"),
                                 (("background", 0), ("edema", 1), ("non-enhancing tumor", 2), ("enhancing tumour", 3)))
#: BraTS 2018-2021: 1 necrotic / non-enhancing core, 2 edema, 4 enhancing tumour.
_BRATS = DatasetDescription(Layout.BRATS, _BRATS_CHANNELS,
                            (("background", 0), ("necrotic core", 1), ("edema", 2), ("enhancing tumour", 4)))
#: BraTS 2023: t2f, t1n, t1c, t2w as flair, t1, t1ce, t2; 1 necrotic core (NCR), 2 edema (ED), 3 enhancing (ET).
_BRATS2023 = DatasetDescription(Layout.BRATS2023, _BRATS_CHANNELS,
                                (("background", 0), ("necrotic core", 1), ("edema", 2), ("enhancing tumour", 3)))
_BOTH_KINDS = (SyntheticKind.BRAIN, SyntheticKind.CT)


def _always(description: DatasetDescription) -> Callable[[Path], DatasetDescription]:
    """The describe function of a layout whose data are always described alike (BraTS: no dataset.json)."""
    return lambda root: description


def _no_index(folder: Path, kind: SyntheticKind, case_ids: list[str]) -> None:
    """A layout of one folder per case has no index: its folders are its cases."""


def _msd_case_id(index: int) -> str:
    return f"BRATS_{index + 1:03d}"


def _case_folder_layout(layout: Layout, title: str, description: DatasetDescription, naming: CaseFolderNaming,
                        case_id: Callable[[int], str], brain_labels: tuple[int, int, int]) -> DatasetLayout:
    return DatasetLayout(
        layout, title, "a", "one sub-folder per case", "file_per_channel", "modality file",
        discover=functools.partial(discover_case_folders, layout=layout), describe=_always(description),
        own=description, case_folder=naming,
        synthetic=SyntheticLayout((SyntheticKind.BRAIN,), case_id, brain_labels,
                                  functools.partial(write_case_folder_case, naming=naming), _no_index))


for _entry in (
    DatasetLayout(
        Layout.MSD, "MSD", "an", "dataset.json (its 'training' list names the cases)", "one_file", "image file",
        discover=discover_msd, describe=describe_msd, own=_MSD_TASK01, case_folder=None,
        synthetic=SyntheticLayout(_BOTH_KINDS, _msd_case_id, (1, 3, 2), write_msd_case, write_msd_index)),
    DatasetLayout(
        Layout.NNUNET, "nnU-Net v2", "an", "dataset.json, imagesTr/ and labelsTr/", "file_per_channel",
        "channel file", discover=discover_nnunet, describe=describe_nnunet, own=None, case_folder=None,
        synthetic=SyntheticLayout(_BOTH_KINDS, _msd_case_id, (1, 3, 2), write_nnunet_case, write_nnunet_index)),
    _case_folder_layout(Layout.BRATS, "BraTS 2018-2021", _BRATS, CaseFolderNaming("_", _BRATS_CHANNELS, "seg"),
                        lambda i: f"BraTS2021_{i:05d}", (2, 4, 1)),
    _case_folder_layout(Layout.BRATS2023, "BraTS 2023", _BRATS2023,
                        CaseFolderNaming("-", ("t2f", "t1n", "t1c", "t2w"), "seg"),
                        lambda i: f"BraTS-GLI-{i:05d}-000", (2, 3, 1)),
):
    register_dataset_layout(_entry)
