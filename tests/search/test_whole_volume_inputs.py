"""A whole volume of a data set on disk against the networks a search trains on it (issue 46, finding 1).

With ``training.tile: null`` and no ``dataset.crop`` or ``resize``, the volume a trial trains on is known only from
the cases' headers once the data set exists: every network the search may pick (``model.name`` and its grid), every
whole-volume curriculum stage, is held to its input rule there, before anything is converted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from distmis.search.input_fit import check_dataset_path, takes_whole_volumes
from distmis.spec import SpecError, validate_spec
from tests.search.test_prepare import FOUR_CASES, SHORT_CASES, msd_dataset, real_data_tree

CUBES = {f"BRATS_00{i}": (16, 16, 16) for i in range(1, 5)}


def torch_tree(data: Path, **training: Any) -> dict[str, Any]:
    """The small spec over the real folder ``data``: a torch U-Net of 3 levels on whole volumes."""
    tree = real_data_tree(data, None)
    tree["model"] = {"name": "unet3d", "framework": "torch", "params": {"base_filters": 4, "levels": 3}}
    tree["training"].update(training)
    return tree


def refusal(tree: dict[str, Any]) -> SpecError:
    spec = validate_spec(tree)  # the spec alone cannot tell: the data set on disk fixes the volume
    with pytest.raises(SpecError) as info:
        check_dataset_path(spec)
    return info.value


def test_a_searched_network_that_the_whole_volume_breaks_is_refused_naming_it_the_volume_and_its_rule(tmp_path):
    data = msd_dataset(tmp_path / "data", CUBES)
    tree = torch_tree(data)
    tree["search"]["space"] = {"model.name": {"grid": ["unet3d", "swinunetr", "basicunet"]}}
    error = refusal(tree)
    assert error.source == f"tiny (with the data at {data})"
    (swin_path, swin), (basic_path, basic) = error.problems
    case = f"case file '{data / 'imagesTr' / 'BRATS_001.nii.gz'}' (stored shape [16, 16, 16]"
    assert swin_path == basic_path == "search.space.model.name"
    assert swin.startswith("value 'swinunetr' makes training.tile (null: the whole volume) invalid: the whole volume "
                           f"[16, 16, 16] ({case}")
    assert "must divide by 32 (swinunetr: SwinUNETR's 2^3 patches and four 2x patch mergings, 2**5)" in swin
    assert basic.startswith("value 'basicunet' makes training.tile (null: the whole volume) invalid: basicunet cannot "
                            f"train on [16, 16, 16] ({case}")
    assert "deepest feature map" in basic and "single voxel" in basic
    tree["search"]["space"] = {"model.name": {"grid": ["unet3d", "segresnet"]}}  # both take 16^3
    check_dataset_path(validate_spec(tree))


def test_the_specs_own_network_and_a_whole_volume_curriculum_stage_are_held_to_the_rule(tmp_path):
    data = msd_dataset(tmp_path / "data", CUBES)
    tree = torch_tree(data)
    tree["model"] = {"name": "swinunetr", "framework": "torch", "params": {"feature_size": 12}}
    tree["search"]["space"] = {}
    (path, message), = refusal(tree).problems
    assert path == "training.tile (null: the whole volume)"
    assert "the whole volume [16, 16, 16] (case file" in message and "must divide by 32 (swinunetr:" in message
    # a curriculum's last stage on whole 16 x 16 x 12 volumes, with a U-Net of 4 levels (it pools by 8)
    data = msd_dataset(tmp_path / "short", SHORT_CASES)
    tree = torch_tree(data, curriculum=[{"tile": [8, 8, 8], "epochs": 1}, {"tile": None, "epochs": 1}])
    tree["model"]["params"]["levels"] = 4
    tree["training"].pop("epochs")
    (path, message), = refusal(tree).problems
    assert path == "training.curriculum[1]"
    assert message.startswith("training.tile (null: the whole volume): the whole volume [16, 16, 12] (case file")
    assert "must divide by 8" in message


def test_every_cases_shape_is_checked(tmp_path):
    data = msd_dataset(tmp_path / "data", FOUR_CASES)  # BRATS_003 is 16 x 16 x 12
    tree = torch_tree(data)
    check_dataset_path(validate_spec(tree))  # 3 levels: every axis divides by 4
    tree["model"]["params"]["levels"] = 4  # 8 divides 16, not 12
    (path, message), = refusal(tree).problems
    assert path == "training.tile (null: the whole volume)"
    assert f"the whole volume [16, 16, 12] (case file '{data / 'imagesTr' / 'BRATS_003.nii.gz'}'" in message
    assert "must divide by 8 (unet3d: 2**(levels-1) for levels=4)" in message


def test_only_a_whole_volume_input_needs_the_volumes(tmp_path):
    data = msd_dataset(tmp_path / "data", CUBES)
    tiled = validate_spec(real_data_tree(data, [8, 8, 8]))
    assert not takes_whole_volumes(tiled)
    tree = real_data_tree(data, [8, 8, 8])
    tree["search"]["space"] = {"training.tile": {"grid": [[8, 8, 8], None]}}
    assert takes_whole_volumes(validate_spec(tree))
    # a tile larger than the volumes is still named as such (the tile check runs first)
    tree["model"]["params"]["levels"] = 2
    tree["search"]["space"] = {"training.tile": {"grid": [[32, 16, 16], None]}}
    (path, message), = refusal(tree).problems
    assert path == "search.space.training.tile" and "is larger than the preprocessed volume [16, 16, 16]" in message
