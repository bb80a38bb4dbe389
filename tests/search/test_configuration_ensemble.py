"""Configuration ensembles chosen on out-of-fold predictions (distmis.search.configuration_ensemble): the options
compared, an ensemble's probabilities the mean of its members', and the choice by the mean dice, a single
configuration kept where no ensemble beats it."""

from __future__ import annotations

import numpy as np
import pytest

from distmis.search.configuration_ensemble import decide, ensemble_probabilities, option_dice, options
from tests.predict.test_ensemble import CLASSES


def test_the_options_are_the_top_three_alone_and_every_ensemble_of_them():
    assert options(["c2", "c0", "c3", "c1"]) == [("c2",), ("c0",), ("c3",), ("c2", "c0"), ("c2", "c3"),
                                                 ("c0", "c3"), ("c2", "c0", "c3")]
    assert options(["c0"]) == [("c0",)]
    assert options(["c0", "c1", "c2"], largest=2) == [("c0",), ("c1",), ("c0", "c1")]
    with pytest.raises(ValueError, match="no configuration"):
        options([])


def test_an_ensembles_probabilities_are_the_mean_of_its_members():
    rng = np.random.default_rng(0)
    a, b, c = (rng.random((4, 5, 6, 3), dtype=np.float32) for _ in range(3))
    mean = ensemble_probabilities([a, b, c])
    assert mean.shape == a.shape
    np.testing.assert_allclose(mean, (a + b + c) / 3, rtol=1e-6)
    np.testing.assert_array_equal(ensemble_probabilities([a]), a)
    with pytest.raises(ValueError, match="differ in shape"):
        ensemble_probabilities([a, a[:2]])


def _probabilities(liver: np.ndarray) -> np.ndarray:
    """Softmax-like (8, 8, 8, 3) probabilities: ``liver`` the liver's, the rest background."""
    prob = np.zeros((8, 8, 8, 3), np.float32)
    prob[..., 1] = liver
    prob[..., 0] = 1.0 - liver
    return prob


def test_the_dice_of_each_option_is_of_its_mean_probabilities():
    truth = np.zeros((8, 8, 8, 2), bool)
    truth[0:4, 0:4, 0:4, 0] = True  # liver: a 4^3 block; no spleen
    left, right = np.zeros((8, 8, 8), np.float32), np.zeros((8, 8, 8), np.float32)
    left[0:4, 0:4, 0:4] = 0.9  # configuration a: the block, and a false half-block beside it
    left[4:6, 0:4, 0:4] = 0.7
    right[0:4, 0:4, 0:4] = 0.7  # configuration b: the block, and another false half-block
    right[0:4, 4:6, 0:4] = 0.7
    probabilities = {"a": _probabilities(left), "b": _probabilities(right)}
    scores = option_dice(probabilities, truth, CLASSES, [("a",), ("b",), ("a", "b")])
    block, half = 64, 32
    alone = np.mean([2 * block / (block + half + block), 1.0])  # liver's dice, spleen's (both empty) 1
    assert scores[("a",)] == pytest.approx(alone) and scores[("b",)] == pytest.approx(alone)
    # the mean: the block 0.8, each false half-block 0.35, under the threshold: the ensemble finds the block alone
    assert scores[("a", "b")] == pytest.approx(1.0)


def test_an_ensemble_is_chosen_only_where_it_beats_every_single_configuration():
    choices = [("a",), ("b",), ("a", "b")]
    better = decide([{("a",): 0.8, ("b",): 0.7, ("a", "b"): 0.85}, {("a",): 0.6, ("b",): 0.7, ("a", "b"): 0.75}],
                    choices)
    assert better.members == ("a", "b") and better.is_ensemble and better.cases == 2
    assert better.scores[("a", "b")] == pytest.approx(0.8) and better.best_single == ("a",)
    assert better.metrics()["cv_oof_dice_of_a-b"] == pytest.approx(0.8)
    assert better.metrics()["cv_oof_dice_of_chosen"] == pytest.approx(0.8)
    assert [row["chosen"] for row in better.table()] == [True, False, False]
    tie = decide([{("a",): 0.8, ("b",): 0.7, ("a", "b"): 0.8}], choices)
    assert tie.members == ("a",) and not tie.is_ensemble  # a tie keeps the single configuration
    second = decide([{("a",): 0.7, ("b",): 0.8, ("a", "b"): 0.75}], choices)
    assert second.members == ("a",) and second.best_single == ("a",)  # no ensemble beats b: the search's best
    beats = decide([{("a",): 0.7, ("b",): 0.8, ("a", "b"): 0.85}], choices)
    assert beats.members == ("a", "b")
    three = [("a",), ("b",), ("c",), ("a", "b"), ("a", "c"), ("b", "c"), ("a", "b", "c")]
    equal = decide([{("a",): 0.5, ("b",): 0.5, ("c",): 0.5, ("a", "b"): 0.6, ("a", "c"): 0.55, ("b", "c"): 0.5,
                     ("a", "b", "c"): 0.6}], three)
    assert equal.members == ("a", "b")  # of two ensembles of equal dice, the smaller
    with pytest.raises(ValueError, match="no out-of-fold case"):
        decide([], choices)
