"""``training.recipe`` (distmis.spec.recipes): nnU-Net v2's defaults filled in where a spec leaves them unset, never
over a value it gives, the optimizer as one unit, deep supervision only where the network has heads."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from distmis.spec import SpecError, validate_spec
from distmis.spec.load import apply_config
from distmis.spec.recipes import NNUNET, RECIPES
from distmis.spec.schema import RecipeName
from tests.conftest import small_spec_tree

DOCS = Path(__file__).resolve().parents[2] / "docs" / "spec.md"


def _tree(tmp_path: Path, framework: str = "torch", **training) -> dict:
    tree = small_spec_tree(tmp_path / "data")
    tree["model"] = {"name": "unet3d", "framework": framework, "params": {"base_filters": 4, "levels": 4}}
    tree["training"] = {"epochs": 2, "batch_size": 2, "tile": [8, 8, 8], "recipe": "nnunet", **training}
    return tree


def test_the_schema_names_the_registered_recipes():
    assert set(typing.get_args(RecipeName)) == set(RECIPES)


def test_nnunet_fills_its_values_where_the_spec_leaves_them_unset(tmp_path: Path):
    spec = validate_spec(_tree(tmp_path))
    t = spec.training
    assert (t.optimizer.name, t.optimizer.lr, t.optimizer.momentum, t.optimizer.effective_nesterov,
            t.optimizer.effective_weight_decay) == ("sgd", 1e-2, 0.99, True, 3e-5)
    assert (t.lr_schedule.name, t.lr_schedule.power, t.loss.name, t.loss.smooth) == ("poly", 0.9, "dice-ce", 1e-5)
    assert t.deep_supervision and t.tile_sampling == 0.33 and t.inference.mirror == [0, 1, 2]
    assert t.augment.enabled and (t.augment.rotate_degrees, t.augment.scale_range, t.augment.elastic) == (30, 0.3, 0)
    assert (spec.search.selection, spec.search.smoothing) == ("moving-average", 0.9)
    # a trial's spec (its sections dumped and validated again) is the same spec: nothing is filled twice
    assert apply_config(spec, {"training.epochs": 2}) == spec


def test_a_given_value_stays_and_a_given_optimizer_takes_nothing_of_the_recipes(tmp_path: Path):
    spec = validate_spec(_tree(tmp_path, optimizer={"name": "adam", "lr": 3e-4}, loss={"name": "dice"},
                               deep_supervision=False))
    t = spec.training
    assert (t.optimizer.name, t.optimizer.lr, t.optimizer.effective_weight_decay) == ("adam", 3e-4, 0.0)
    assert t.loss.name == "dice" and t.loss.smooth == 1e-5 and not t.deep_supervision
    tree = _tree(tmp_path)
    tree["search"]["space"] = {"training.optimizer.name": {"grid": ["adam", "sgd"]}}  # searched: the spec's
    searched = validate_spec(tree)
    assert searched.training.optimizer.name == "adam" and searched.training.optimizer.effective_weight_decay == 0
    assert apply_config(searched, {"training.optimizer.name": "sgd"}).training.optimizer.momentum == 0.99
    tree["search"]["selection"] = "epoch"
    assert validate_spec(tree).search.selection == "epoch"


def test_what_a_spec_cannot_take_is_left_out(tmp_path: Path):
    tensorflow = validate_spec(_tree(tmp_path, framework="tensorflow"))  # its U-Net has no heads
    assert not tensorflow.training.deep_supervision and tensorflow.training.optimizer.name == "sgd"
    whole_volumes = _tree(tmp_path)
    del whole_volumes["training"]["tile"]
    assert validate_spec(whole_volumes).training.tile_sampling == 0  # foreground tiles need tiles


def test_an_unknown_recipe_is_refused_by_name(tmp_path: Path):
    with pytest.raises((SpecError, ValueError), match="no training recipe 'nnUNet'; registered: nnunet"):
        validate_spec(_tree(tmp_path, recipe="nnUNet"))


def test_the_docs_list_every_value_of_the_recipe():
    text = DOCS.read_text()
    section = text[text.index("### `training.recipe`"):]
    section = section[:section.index("\n## ")]
    for entry in NNUNET.values:
        assert f"`{entry.path.removeprefix('training.')}`" in section or f"`{entry.path}`" in section, entry.path
