"""The model recipe (preprocessing.json): made from a spec, written and read back, refused when it is not ours."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distmis.data.manifest import DataManifest
from distmis.predict.recipe import InferenceSettings, ModelRecipe, RecipeError
from distmis.spec import validate_spec
from tests.conftest import small_spec_tree


def manifest(num_classes: int = 3, **preprocess) -> DataManifest:
    return DataManifest(preprocess={"layout": "msd", "labels": "regions", "crop": [40, 40, 40], "resize": [32, 32, 32],
                                    **preprocess},
                        image_shape=(32, 32, 32, 4), label_shape=(32, 32, 32, 3), splits={}, num_classes=num_classes)


def test_a_recipe_records_what_the_trial_trained_with(tmp_path: Path):
    tree = small_spec_tree(tmp_path)
    tree["model"] = {"name": "vit-seg", "framework": "torch", "params": {"patch": 8, "embed_dim": 16, "heads": 2,
                                                                         "layers": 1, "decoder_features": 8}}
    tree["training"].update({"tile": [16, 16, 16], "inference": {"overlap": 0.25, "mode": "constant"},
                             "batch_size": 3})
    recipe = ModelRecipe.from_spec(validate_spec(tree), manifest())
    assert (recipe.framework, recipe.model, recipe.output) == ("torch", "vit-seg", "logits")
    assert (recipe.crop, recipe.resize, recipe.window) == ((40, 40, 40), (32, 32, 32), (16, 16, 16))
    assert recipe.inference == InferenceSettings(overlap=0.25, mode="constant", sigma_scale=0.125, batch_size=3)
    assert (recipe.layout, recipe.labels, recipe.num_classes) == ("msd", "regions", 3)
    assert not recipe.channels_last

    again = ModelRecipe.read(recipe.write(tmp_path / "preprocessing.json"))
    assert again == recipe
    stored = json.loads((tmp_path / "preprocessing.json").read_text())
    assert stored["modalities"] == ["flair", "t1", "t1ce", "t2"] and stored["normalisation"] == "zscore-nonzero"


def test_without_a_tile_the_window_is_the_training_volume(tmp_path: Path):
    spec = validate_spec(small_spec_tree(tmp_path))  # TensorFlow U-Net, tile null
    recipe = ModelRecipe.from_spec(spec, manifest(1, labels="whole-tumour", crop=None, resize=None))
    assert recipe.window == (32, 32, 32) and recipe.channels_last and recipe.output == "probabilities"
    assert recipe.crop is None and recipe.resize is None


@pytest.mark.parametrize("change,message", [
    ({"framework": "jax"}, "framework must be"),
    ({"num_classes": 2}, "num_classes is 2"),
    ({"labels": "tumour"}, "unknown label mode 'tumour'"),
    ({"crop": [0, 4, 4]}, "crop must be 3 positive integers"),
    ({"version": 99}, "upgrade distmis"),
    ({"colour": "red"}, "not a distmis model recipe"),
])
def test_a_recipe_that_is_not_ours_is_refused_with_the_field(tmp_path: Path, change, message):
    spec = validate_spec(small_spec_tree(tmp_path))
    data = ModelRecipe.from_spec(spec, manifest(1, labels="whole-tumour")).to_dict() | change
    path = tmp_path / "preprocessing.json"
    path.write_text(json.dumps(data))
    with pytest.raises(RecipeError, match=message):
        ModelRecipe.read(path)


def test_a_missing_or_broken_recipe_names_the_file(tmp_path: Path):
    with pytest.raises(RecipeError, match="not logged by distmis"):
        ModelRecipe.read(tmp_path / "preprocessing.json")
    (tmp_path / "preprocessing.json").write_text("{")
    with pytest.raises(RecipeError, match="is not valid JSON"):
        ModelRecipe.read(tmp_path / "preprocessing.json")


def test_the_recipe_records_the_trials_test_time_mirroring(tmp_path: Path):
    """``training.inference.mirror`` travels into the recipe (sorted) and its JSON; a spec with a bad one is refused
    naming the field and what is allowed; a recipe with a bad one is not ours."""
    from distmis.spec import SpecError

    tree = small_spec_tree(tmp_path)
    tree["training"]["inference"] = {"mirror": [2, 0]}
    recipe = ModelRecipe.from_spec(validate_spec(tree), manifest(1, labels="whole-tumour"))
    assert recipe.inference.mirror == (0, 2) and recipe.version >= 5
    stored = recipe.to_dict()
    assert stored["inference"]["mirror"] == [0, 2]
    assert ModelRecipe.read(recipe.write(tmp_path / "preprocessing.json")) == recipe
    assert ModelRecipe.from_spec(validate_spec(small_spec_tree(tmp_path)),
                                 manifest(1, labels="whole-tumour")).inference.mirror == ()  # default: off
    for bad in ([3], [0, 0], "all"):
        tree["training"]["inference"] = {"mirror": bad}
        with pytest.raises(SpecError, match=r"training\.inference\.mirror: .*distinct spatial axes 0, 1, 2"):
            validate_spec(tree)
        with pytest.raises(RecipeError, match=r"inference mirror .*distinct spatial axes 0, 1, 2"):
            ModelRecipe.from_dict(stored | {"inference": stored["inference"] | {"mirror": bad}})
