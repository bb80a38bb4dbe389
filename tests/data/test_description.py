"""Tests for distmis.data.description: a data set's channels and classes from its own dataset.json.

The writers of tiny MSD tasks and nnU-Net v2 data sets at the top are shared with the layout, scan and inspect
tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distmis.data import DataError, DatasetDescription, Layout, Region, describe_dataset, layout_description

from .conftest import write_nifti

SPLEEN_JSON = {"name": "Spleen", "modality": {"0": "CT"}, "labels": {"0": "background", "1": "spleen"}}
PROSTATE_NNUNET_JSON = {"channel_names": {"0": "T2", "1": "ADC"}, "labels": {"background": 0, "PZ": 1, "TZ": 2},
                        "file_ending": ".nii.gz"}
BRATS_REGIONS_JSON = {
    "channel_names": {"0": "T1", "1": "T1ce", "2": "T2", "3": "FLAIR"},
    "labels": {"background": 0, "whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing tumor": [3]},
    "regions_class_order": [1, 2, 3],
    "file_ending": ".nii.gz",
}


def write_msd_task(root: Path, cases: dict[str, tuple[np.ndarray, np.ndarray]], meta: dict[str, Any] | None = None,
                   affines: dict[str, np.ndarray] | None = None) -> Path:
    """An MSD task at ``root``: ``imagesTr/<case>.nii.gz`` (the image as given, 3-D or 4-D), ``labelsTr/<case>``,
    and a dataset.json of ``meta`` (default: the spleen task's) with its training list and numTraining."""
    affines = affines or {}
    training = []
    for case_id, (image, label) in cases.items():
        write_nifti(root / "imagesTr" / f"{case_id}.nii.gz", image, affines.get(case_id))
        write_nifti(root / "labelsTr" / f"{case_id}.nii.gz", label, affines.get(case_id))
        training.append({"image": f"./imagesTr/{case_id}.nii.gz", "label": f"./labelsTr/{case_id}.nii.gz"})
    content = {**(SPLEEN_JSON if meta is None else meta), "numTraining": len(cases), "training": training}
    (root / "dataset.json").write_text(json.dumps(content))
    return root


def write_nnunet_dataset(root: Path, cases: dict[str, tuple[list[np.ndarray], np.ndarray]],
                         meta: dict[str, Any] | None = None, affines: dict[str, np.ndarray] | None = None,
                         ending: str = ".nii.gz", folder: str = "Tr") -> Path:
    """An nnU-Net v2 data set at ``root``: ``images<folder>/<case>_XXXX<ending>`` (one file per channel),
    ``labels<folder>/<case><ending>``, and a dataset.json of ``meta`` (default: the prostate one) with numTraining."""
    affines = affines or {}
    for case_id, (channels, label) in cases.items():
        for index, channel in enumerate(channels):
            write_nifti(root / f"images{folder}" / f"{case_id}_{index:04d}{ending}", channel, affines.get(case_id))
        write_nifti(root / f"labels{folder}" / f"{case_id}{ending}", label, affines.get(case_id))
    content = {**(PROSTATE_NNUNET_JSON if meta is None else meta)}
    content.setdefault("numTraining", len(cases))
    (root / "dataset.json").write_text(json.dumps(content))
    return root


def write_json(root: Path, content: dict[str, Any]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "dataset.json").write_text(json.dumps(content))
    return root


def msd_json(**changes: Any) -> dict[str, Any]:
    return {**SPLEEN_JSON, "training": [], **changes}


def nnunet_json(**changes: Any) -> dict[str, Any]:
    return {**PROSTATE_NNUNET_JSON, "numTraining": 3, **changes}


# --------------------------------------------------------------------------- MSD


def test_msd_one_channel_task(tmp_path: Path) -> None:
    description = describe_dataset(write_json(tmp_path / "Task09_Spleen", msd_json(numTraining=41)), "msd")
    assert description == DatasetDescription(Layout.MSD, ("CT",), (("background", 0), ("spleen", 1)),
                                             num_training=41, name="Spleen")
    assert description.num_channels == 1 and description.label_values == (0, 1)
    assert description.file_ending == ".nii.gz" and description.regions == ()


def test_msd_channels_in_numeric_order_and_classes_by_value(tmp_path: Path) -> None:
    modality = {str(i): f"m{i}" for i in reversed(range(11))}  # "10" sorts before "2" as a string
    labels = {"3": "c", "0": "background", "10": "k", "2": "b"}
    content = {"modality": modality, "labels": labels, "training": []}
    description = describe_dataset(write_json(tmp_path / "Task99_Made", content), Layout.MSD)
    assert description.channels == tuple(f"m{i}" for i in range(11))
    assert description.classes == (("background", 0), ("b", 2), ("c", 3), ("k", 10))
    assert description.label_values == (0, 2, 3, 10)
    assert description.name == "Task99_Made" and description.num_training is None  # the folder's name
    assert description.describe_values() == "0 background, 2 b, 3 c, 10 k"


def test_msd_task01_reads_as_the_msd_layouts_own(tmp_path: Path) -> None:
    task01 = {"modality": {"0": "FLAIR", "1": "T1w", "2": "t1gd", "3": "T2w"},
              "labels": {"0": "background", "1": "edema", "2": "non-enhancing tumor", "3": "enhancing tumour"},
              "training": []}
    description = describe_dataset(write_json(tmp_path / "t", task01), "msd")
    own = layout_description("msd")
    assert (description.channels, description.classes) == (own.channels, own.classes)


@pytest.mark.parametrize("key", ["modality", "labels", "training"])
def test_msd_missing_key_is_named(tmp_path: Path, key: str) -> None:
    content = msd_json()
    del content[key]
    with pytest.raises(DataError) as info:
        describe_dataset(write_json(tmp_path, content), "msd")
    message = str(info.value)
    assert "dataset.json" in message and f"lacks the required key {key!r}" in message
    assert "'modality', 'labels', 'training'" in message


@pytest.mark.parametrize("changes,pattern", [
    ({"modality": ["CT"]}, r"key 'modality' is \[\"CT\"\], a list; expected an object of channel index -> name"),
    ({"modality": {}}, r"key 'modality' lists no channel"),
    ({"modality": {"0": "CT", "2": "PET"}}, r"channel indices \[0, 2\]; expected 0..1"),
    ({"modality": {"zero": "CT"}}, r"channel index 'zero', not a number"),
    ({"modality": {"0": 7}}, r"modality\['0'\] is 7; a channel's name must be a non-empty string"),
    ({"labels": {"1": "spleen"}}, r"no background, value 0.*label 0 must be background"),
    ({"labels": {"0": "background", "one": "spleen"}}, r"label value 'one', not a whole number"),
    ({"labels": {"0": "background", "1": "organ", "2": "organ"}}, r"names several values 'organ' \(\[1, 2\]\)"),
    ({"labels": {"0": "background", "70000": "x"}}, r"labels\['70000'\] is 70000; a label value is a whole number"),
    ({"training": {"image": "x"}}, r"key 'training' is .*a dict; expected a list"),
    ({"numTraining": "41"}, r"key 'numTraining' is \"41\", a str; expected a non-negative whole number"),
])
def test_msd_ill_typed_keys_are_named(tmp_path: Path, changes: dict, pattern: str) -> None:
    with pytest.raises(DataError, match=r"dataset\.json.*" + pattern):
        describe_dataset(write_json(tmp_path, msd_json(**changes)), "msd")


def test_missing_or_broken_dataset_json(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"dataset\.json' not found: an MSD data set root holds dataset\.json"):
        describe_dataset(tmp_path, "msd")
    with pytest.raises(DataError, match=r"not found: an nnU-Net v2 data set root holds dataset\.json, imagesTr/"):
        describe_dataset(tmp_path, "nnunet")
    (tmp_path / "dataset.json").write_text("{not json")
    with pytest.raises(DataError, match=r"dataset\.json' is not valid JSON"):
        describe_dataset(tmp_path, "msd")
    (tmp_path / "dataset.json").write_text("[1, 2]")
    with pytest.raises(DataError, match=r"must hold a JSON object, got list"):
        describe_dataset(tmp_path, "nnunet")


def test_the_other_layouts_json_is_pointed_at(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"lacks the required key 'modality'.*nnU-Net v2 dataset\.json: use "
                                        r"layout='nnunet'"):
        describe_dataset(write_json(tmp_path / "a", nnunet_json()), "msd")
    with pytest.raises(DataError, match=r"lacks the required key 'channel_names'.*MSD dataset\.json: use layout='msd'"):
        describe_dataset(write_json(tmp_path / "b", msd_json()), "nnunet")


# --------------------------------------------------------------------------- nnU-Net


def test_nnunet_plain_labels(tmp_path: Path) -> None:
    description = describe_dataset(write_json(tmp_path / "Dataset005_Prostate", nnunet_json(numTraining=32)),
                                   "nnunet")
    assert description == DatasetDescription(Layout.NNUNET, ("T2", "ADC"), (("background", 0), ("PZ", 1),
                                                                            ("TZ", 2)),
                                             file_ending=".nii.gz", num_training=32, name="Dataset005_Prostate")
    assert description.label_values == (0, 1, 2)
    nii = describe_dataset(write_json(tmp_path / "b", nnunet_json(file_ending=".nii", name="P")), "nnunet")
    assert nii.file_ending == ".nii" and nii.name == "P"


def test_nnunet_region_based_labels(tmp_path: Path) -> None:
    description = describe_dataset(write_json(tmp_path / "Dataset137_BraTS", {**BRATS_REGIONS_JSON,
                                                                              "numTraining": 5}), "nnunet")
    assert description.regions == (Region("whole tumor", (1, 2, 3), 1), Region("tumor core", (2, 3), 2),
                                   Region("enhancing tumor", (3,), 3))
    assert description.classes == (("background", 0), ("whole tumor", 1), ("tumor core", 2), ("enhancing tumor", 3))
    assert description.label_values == (0, 1, 2, 3)
    assert description.channels == ("T1", "T1ce", "T2", "FLAIR")
    assert description.value_names() == {0: "background", 1: "in whole tumor", 2: "in whole tumor, tumor core",
                                         3: "in whole tumor, tumor core, enhancing tumor"}
    # a plain value beside lists is a region of that value alone, painted in regions_class_order
    mixed = {**BRATS_REGIONS_JSON, "labels": {"background": 0, "edema": 2, "core": [1, 3]},
             "regions_class_order": [2, 1], "numTraining": 1}
    regions = describe_dataset(write_json(tmp_path / "m", mixed), "nnunet").regions
    assert regions == (Region("edema", (2,), 2), Region("core", (1, 3), 1))


@pytest.mark.parametrize("key", ["channel_names", "labels", "numTraining", "file_ending"])
def test_nnunet_missing_key_is_named(tmp_path: Path, key: str) -> None:
    content = nnunet_json()
    del content[key]
    with pytest.raises(DataError) as info:
        describe_dataset(write_json(tmp_path, content), "nnunet")
    message = str(info.value)
    assert "dataset.json" in message and f"lacks the required key {key!r}" in message
    assert "'channel_names', 'labels', 'numTraining', 'file_ending'" in message


@pytest.mark.parametrize("ending", [".png", ".nrrd", ".mha", ".tif"])
def test_nnunet_other_file_endings_are_refused_as_not_nifti(tmp_path: Path, ending: str) -> None:
    with pytest.raises(DataError) as info:
        describe_dataset(write_json(tmp_path, nnunet_json(file_ending=ending)), "nnunet")
    message = str(info.value)
    assert f"file_ending is {ending!r}" in message and "NIfTI only" in message and "'.nii.gz' or '.nii'" in message


@pytest.mark.parametrize("changes,pattern", [
    ({"labels": {"PZ": 1, "TZ": 2}}, r"no background, value 0.*label 0 must be background"),
    ({"labels": {"background": 0, "PZ": 1, "TZ": 1}}, r"gives the value 1 to several classes \('PZ', 'TZ'\)"),
    ({"labels": {"background": 0, "PZ": "1"}}, r"labels\['PZ'\] is \"1\"; a label value is a whole number"),
    ({"labels": {"background": 0, "PZ": True}}, r"labels\['PZ'\] is true; a label value is a whole number"),
    ({"labels": {"background": 0, "PZ": -1}}, r"labels\['PZ'\] is -1"),
    ({"labels": {"background": 0, "PZ": []}}, r"labels\['PZ'\] is an empty list"),
    ({"numTraining": -2}, r"key 'numTraining' is -2; expected a non-negative whole number"),
    ({"numTraining": 2.5}, r"key 'numTraining' is 2.5, a float"),
    ({"file_ending": 5}, r"key 'file_ending' is 5, a int; expected the files' ending"),
    ({"channel_names": {"1": "T2"}}, r"channel indices \[1\]; expected 0..0"),
])
def test_nnunet_ill_typed_keys_are_named(tmp_path: Path, changes: dict, pattern: str) -> None:
    with pytest.raises(DataError, match=r"dataset\.json.*" + pattern):
        describe_dataset(write_json(tmp_path, nnunet_json(**changes)), "nnunet")


def test_nnunet_regions_need_their_class_order(tmp_path: Path) -> None:
    content = {**BRATS_REGIONS_JSON, "numTraining": 1}
    del content["regions_class_order"]
    with pytest.raises(DataError, match=r"lacks the required key 'regions_class_order': with region-based labels, a "
                                        r"list of 3 label values.*'whole tumor', 'tumor core', 'enhancing tumor'"):
        describe_dataset(write_json(tmp_path / "a", content), "nnunet")
    content["regions_class_order"] = [1, 2]
    with pytest.raises(DataError, match=r"'regions_class_order' has 2 value\(s\) \(\[1, 2\]\) but 'labels' has 3 "
                                        r"region\(s\) besides background"):
        describe_dataset(write_json(tmp_path / "b", content), "nnunet")
    content["regions_class_order"] = [1, 1, 3]
    with pytest.raises(DataError, match=r"'regions_class_order' is \[1, 1, 3\]; every region needs its own"):
        describe_dataset(write_json(tmp_path / "c", content), "nnunet")
    content["labels"] = {"background": [0], "whole tumor": [1, 2, 3]}
    content["regions_class_order"] = [1]
    with pytest.raises(DataError, match=r"no background, value 0.*a plain 0 \(not a list\)"):
        describe_dataset(write_json(tmp_path / "d", content), "nnunet")


# --------------------------------------------------------------------------- the layouts' own, and round trips


def test_layout_descriptions() -> None:
    brats, brats2023, msd = (layout_description(l) for l in ("brats", "brats2023", Layout.MSD))
    assert brats.channels == brats2023.channels == ("flair", "t1", "t1ce", "t2")
    assert brats.classes == (("background", 0), ("necrotic core", 1), ("edema", 2), ("enhancing tumour", 4))
    assert brats2023.label_values == (0, 1, 2, 3) and brats.label_values == (0, 1, 2, 4)
    assert msd.channels == ("FLAIR", "T1w", "t1gd", "T2w")
    assert msd.classes == (("background", 0), ("edema", 1), ("non-enhancing tumor", 2), ("enhancing tumour", 3))
    with pytest.raises(ValueError, match="an nnU-Net v2 data set is described by its dataset.json"):
        layout_description("nnunet")
    with pytest.raises(ValueError, match="unknown layout 'decathlon'"):
        layout_description("decathlon")


def test_describe_a_brats_folder_gives_the_layouts_own(tmp_path: Path) -> None:
    assert describe_dataset(tmp_path, "brats2023") == layout_description("brats2023")  # no dataset.json needed


def test_json_round_trip(tmp_path: Path) -> None:
    regions = describe_dataset(write_json(tmp_path / "r", {**BRATS_REGIONS_JSON, "numTraining": 2}), "nnunet")
    for description in (regions, layout_description("brats"), describe_dataset(write_json(tmp_path / "m", msd_json()),
                                                                                "msd")):
        data = json.loads(json.dumps(description.to_dict()))
        assert DatasetDescription.from_dict(data) == description
    assert regions.to_dict()["regions"][0] == {"name": "whole tumor", "values": [1, 2, 3], "paint": 1}
    with pytest.raises(ValueError, match="lacks 'classes'"):
        DatasetDescription.from_dict({"layout": "msd", "channels": ["CT"]})
    with pytest.raises(ValueError, match="'classes' must be a list of"):
        DatasetDescription.from_dict({"layout": "msd", "channels": ["CT"], "classes": [["background", 0]]})


def test_description_checks_itself() -> None:
    with pytest.raises(ValueError, match="must include background, value 0"):
        DatasetDescription("msd", ("CT",), (("spleen", 1),))
    with pytest.raises(ValueError, match="at least one channel"):
        DatasetDescription("msd", (), (("background", 0),))
    with pytest.raises(ValueError, match=r"file_ending must be one of \['.nii.gz', '.nii'\] \(NIfTI\), got '.png'"):
        DatasetDescription("nnunet", ("CT",), (("background", 0),), file_ending=".png")
    with pytest.raises(ValueError, match="class values must be unique"):
        DatasetDescription("msd", ("CT",), (("background", 0), ("a", 1), ("b", 1)))
    listed = DatasetDescription("msd", ["CT"], [["spleen", 1], ["background", 0]])  # lists accepted, sorted by value
    assert listed.channels == ("CT",) and listed.classes == (("background", 0), ("spleen", 1))
