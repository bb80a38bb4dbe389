"""Postprocessing chosen on cross-validation: the largest connected component kept exactly, applied only to what
cross-validation chose (distmis.pyfunc_model.postprocess_masks), the choice made by nnU-Net's rule
(distmis.search.postprocessing), and the model's recipe carrying it into its label maps."""

from __future__ import annotations

import numpy as np
import pytest

from distmis import pyfunc_model as pm
from distmis.predict.recipe import ModelRecipe, RecipeError
from distmis.search.postprocessing import case_scores, decide
from tests.predict.test_ensemble import CLASSES, classes_recipe

REGIONS = {"mode": "regions", "activation": "sigmoid",
           "channels": [{"name": n, "key": n, "values": v, "paint": p}
                        for n, v, p in (("WT", [1, 2, 3], 2), ("TC", [2, 3], 1), ("ET", [3], 3))]}


def test_the_largest_component_is_kept_exactly_with_26_connectivity():
    mask = np.zeros((8, 8, 8), dtype=bool)
    mask[0:2, 0:2, 0:2] = True  # 8 voxels
    mask[2, 2, 2] = True  # touches the cube at a corner only: the same component (26-connectivity)
    mask[5:7, 5:7, 5] = True  # 4 voxels, apart
    mask[7, 0, 7] = True  # 1 voxel, apart
    kept = pm.largest_component(mask)
    expected = np.zeros_like(mask)
    expected[0:2, 0:2, 0:2] = True
    expected[2, 2, 2] = True
    np.testing.assert_array_equal(kept, expected)
    assert not pm.largest_component(np.zeros((3, 3, 3), bool)).any()
    single = np.zeros((4, 4, 4), bool)
    single[1:3, 1:3, 1:3] = True
    np.testing.assert_array_equal(pm.largest_component(single), single)


def _classes_masks() -> np.ndarray:
    """One-hot (8, 8, 8, 3) masks: liver a big block and a stray voxel, spleen two blobs."""
    label = np.zeros((8, 8, 8), dtype=int)
    label[0:3, 0:3, 0:3] = 1
    label[7, 7, 7] = 1
    label[3:6, 0:2, 0:2] = 2  # touches the liver block
    label[0, 6, 6] = 2
    return label[..., None] == np.arange(3)


def test_only_the_chosen_classes_lose_their_small_components_and_become_background():
    masks = _classes_masks()
    out = pm.postprocess_masks(masks, CLASSES, {"foreground": False, "channels": ["liver"]})
    assert not out[7, 7, 7, 1] and out[7, 7, 7, 0]  # liver's stray voxel: background now
    np.testing.assert_array_equal(out[..., 2], masks[..., 2])  # spleen untouched
    assert (out.sum(axis=-1) == 1).all()  # still one class per voxel
    whole = pm.postprocess_masks(masks, CLASSES, {"foreground": True, "channels": []})
    # the foreground as a whole: liver's block and spleen's big blob touch; the strays go
    assert not whole[7, 7, 7, 1] and not whole[0, 6, 6, 2] and whole[5, 0, 0, 2] and whole[0, 0, 0, 1]
    assert pm.postprocess_masks(masks, CLASSES, None) is masks
    with pytest.raises(ValueError, match=r"channel\(s\) \['kidney'\].*scores \['liver', 'spleen'\]"):
        pm.postprocess_masks(masks, CLASSES, {"foreground": False, "channels": ["kidney"]})


def test_a_sigmoid_region_loses_its_small_components_and_stays_off_there():
    masks = np.zeros((6, 6, 6, 3), dtype=bool)
    masks[0:3, 0:3, 0:3, 0] = True
    masks[5, 5, 5, 0] = True
    masks[1, 1, 1, 1] = masks[5, 5, 5, 1] = True
    out = pm.postprocess_masks(masks, REGIONS, {"foreground": False, "channels": ["TC"]})
    assert out[5, 5, 5, 0] and not out[5, 5, 5, 1] and out[1, 1, 1, 1]


def test_the_choice_follows_nnunets_rule_on_the_mean_dice():
    keys = ["liver", "spleen"]
    scores = [{"plain": np.array([0.8, 0.6]), "foreground": np.array([0.79, 0.6]),
               "own": np.array([0.9, 0.6]), "foreground_own": np.array([0.9, 0.6])}] * 3
    choice = decide(scores, keys)
    # the foreground's removal lowers the mean: not kept; liver's own raises liver: kept; spleen's is equal: not
    assert choice.postprocessing == {"foreground": False, "channels": ["liver"]}
    assert choice.before == pytest.approx({"liver": 0.8, "spleen": 0.6})
    assert choice.after == pytest.approx({"liver": 0.9, "spleen": 0.6})
    assert choice.metrics()["cv_oof_dice_mean_postprocessed"] == pytest.approx(0.75)
    helped = [{"plain": np.array([0.5, 0.5]), "foreground": np.array([0.7, 0.6]),
               "own": np.array([0.9, 0.9]), "foreground_own": np.array([0.7, 0.65])}]
    assert decide(helped, keys).postprocessing == {"foreground": True, "channels": ["spleen"]}  # on top of it


def test_the_case_scores_count_each_way_of_postprocessing():
    truth_masks = _classes_masks()
    truth_masks[7, 7, 7] = [True, False, False]  # the truth has no stray liver voxel
    prob = _classes_masks().astype(np.float32)
    scores = case_scores(prob, truth_masks[..., 1:], CLASSES)
    liver_plain = 2 * 27 / (28 + 27)
    assert scores["plain"][0] == pytest.approx(liver_plain) and scores["own"][0] == pytest.approx(1.0)
    assert scores["own"][1] == pytest.approx(2 * 12 / (12 + 13))  # spleen's stray is in the truth too


def test_the_recipe_carries_the_choice_and_the_model_applies_it():
    recipe = classes_recipe()
    chosen = ModelRecipe.from_dict({**recipe.to_dict(), "postprocessing": {"foreground": False,
                                                                          "channels": ["liver"]}})
    assert chosen.postprocessing == {"foreground": False, "channels": ["liver"]}
    assert ModelRecipe.from_dict(recipe.to_dict()).postprocessing is None  # none chosen: none applied
    with pytest.raises(RecipeError, match="kidney"):
        ModelRecipe.from_dict({**recipe.to_dict(), "postprocessing": {"channels": ["kidney"]}})
    masks = _classes_masks().astype(np.float32)
    plain = pm.probabilities_to_labels(masks, CLASSES)
    cleaned = pm.probabilities_to_labels(masks, CLASSES, postprocessing=chosen.postprocessing)
    assert plain[7, 7, 7] == 1 and cleaned[7, 7, 7] == 0 and (cleaned[plain != 1] == plain[plain != 1]).all()
