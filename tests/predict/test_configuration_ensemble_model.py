"""A configuration ensemble's model (recipe ``configurations``): each configuration's fold ensemble in one MLflow
python_function model, its probabilities the mean of its configurations' (each its folds' mean), each configuration
predicting with its own window and inference settings; loaded by MLflow and by ``distmis predict``'s
:class:`SegmentationModel` alike; a recipe whose configurations do not share their preprocessing is refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from distmis import pyfunc_model as pm
from distmis.predict.model import SegmentationModel
from distmis.predict.recipe import InferenceSettings, ModelRecipe, RecipeError
from distmis.predict.registry import check_networks, save_model
from tests.predict.test_ensemble import classes_recipe, raw_image, unets

SMALL = (8, 8, 8)


def _members() -> list[tuple[str, ModelRecipe]]:
    """Two configurations of folds 0 and 2 over one preprocessing: c003 predicts by 8^3 windows, c001 by 12^3
    ones with other sliding-window settings; both mirror each window on axis 0."""
    best = classes_recipe()
    best = replace(best, inference=replace(best.inference, mirror=(0,)))
    other = replace(best, window=(12, 12, 12), inference=InferenceSettings(overlap=0.5, batch_size=1, mirror=(0,)))
    return [("c003", best), ("c001", other)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, ModelRecipe, list]:
    recipe = ModelRecipe.combined(_members())
    networks = unets(recipe, 4)  # c003's folds 0 and 2, then c001's
    return save_model(networks, recipe, tmp_path_factory.mktemp("configurations") / "model"), recipe, networks


def test_the_recipe_records_each_configurations_own_fields_over_the_shared_ones():
    recipe = ModelRecipe.combined(_members())
    assert recipe.names == ("c003", "c001") and recipe.network_count == 4
    first, second = recipe.members
    assert first == replace(recipe, configurations=()) and second.window == (12, 12, 12)
    assert second.inference.mirror == (0,) and second.resize == recipe.resize and second.folds == (0, 2)
    again = ModelRecipe.from_dict(recipe.to_dict())
    assert again == recipe and again.members[1] == second
    assert ModelRecipe.combined(_members()[:1]) == _members()[0][1]  # one configuration: its own recipe


def test_configurations_that_do_not_share_their_preprocessing_or_folds_are_refused():
    best, other = _members()
    with pytest.raises(RecipeError, match=r"'c001' differs from 'c003' in \['resize'\]"):
        ModelRecipe.combined([best, ("c001", replace(other[1], resize=(10, 10, 10)))])
    with pytest.raises(RecipeError, match=r"in \['folds'\]"):
        ModelRecipe.combined([best, ("c001", replace(other[1], folds=(0, 1)))])
    with pytest.raises(RecipeError, match="mirror on the same axes"):
        ModelRecipe.combined([best, ("c001", replace(other[1], inference=InferenceSettings(mirror=(0, 1))))])
    recipe = ModelRecipe.combined([best, other])
    members = recipe.to_dict()["configurations"]
    with pytest.raises(RecipeError, match="distinct names"):
        ModelRecipe.from_dict({**recipe.to_dict(), "configurations": [members[0], {**members[1], "name": "c003"}]})
    with pytest.raises(RecipeError, match="the first configuration \\('c001'\\) must be the recipe's own"):
        ModelRecipe.from_dict({**recipe.to_dict(), "configurations": members[::-1]})
    with pytest.raises(RecipeError, match="2 or more configurations"):
        ModelRecipe.from_dict({**recipe.to_dict(), "configurations": members[:1]})
    with pytest.raises(RecipeError, match="must hold exactly"):
        ModelRecipe.from_dict({**recipe.to_dict(), "configurations": [members[0], {**members[1], "threshold": 0.4}]})
    with pytest.raises(ValueError, match="a configuration ensemble of 2 configurations takes 4 network"):
        check_networks(unets(recipe, 2), recipe)


def test_the_models_probabilities_are_the_mean_of_its_configurations(saved):
    import mlflow.pyfunc

    folder, recipe, networks = saved
    artifacts = yaml.safe_load((folder / "MLmodel").read_text())["flavors"]["python_function"]["artifacts"]
    assert set(artifacts) == {"recipe", "network_c0_fold0", "network_c0_fold2", "network_c1_fold0",
                              "network_c1_fold2"}
    loaded = mlflow.pyfunc.load_model(str(folder))
    inner = loaded.unwrap_python_model()
    image = raw_image(1)
    volume = pm.prepare_image(image, inner.recipe)[0]
    (_, best), (_, other) = _members()
    # each configuration alone: its folds' mean, with its own window and mirroring
    each = [pm.mean_probabilities(networks[:2], volume, best.to_dict()),
            pm.mean_probabilities(networks[2:], volume, other.to_dict())]
    assert not np.allclose(each[0], each[1], atol=1e-3)
    np.testing.assert_allclose(inner.probabilities(volume), (each[0] + each[1]) / 2, atol=1e-5)
    # a subset of the folds: that fold of each configuration
    fold2 = [pm.network_probabilities(networks[1], volume, best.to_dict()),
             pm.network_probabilities(networks[3], volume, other.to_dict())]
    np.testing.assert_allclose(inner.probabilities(volume, folds=[2]), (fold2[0] + fold2[1]) / 2, atol=1e-5)

    labels = loaded.predict(image)
    expected = pm.segment(image, inner.recipe, lambda v: (pm.mean_probabilities(networks[:2], v, best.to_dict())
                                                          + pm.mean_probabilities(networks[2:], v, other.to_dict()))
                          / np.float32(2))
    np.testing.assert_array_equal(labels, expected)
    model = SegmentationModel.load(folder)  # distmis predict's model: the same labels, the same networks
    assert model.recipe == recipe and len(model.networks) == 4
    np.testing.assert_array_equal(model.segment(image), labels)
    direct = SegmentationModel(recipe, networks)  # the networks in hand, no folder: the same rule
    np.testing.assert_allclose(direct.probabilities(volume), inner.probabilities(volume), atol=1e-5)
