from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from distmis.train.losses import make_loss, soft_dice_loss, soft_dice_per_sample


def test_soft_dice_per_sample_hand_computed():
    y = np.zeros((2, 2, 2, 2, 1), np.float32)
    p = np.zeros_like(y)
    y[0, 0, 0, 0] = 1
    p[0, 0, 0, 0] = 0.5
    p[0, 1, 1, 1] = 0.5  # sample 0: (2*0.5 + s) / (1 + 1 + s)
    y[1, 0, 0, :2] = 1  # sample 1: prediction empty: s / (2 + s)
    dice = soft_dice_per_sample(tf.constant(y), tf.constant(p), smooth=1.0).numpy()
    np.testing.assert_allclose(dice[:, 0], [(1 + 1) / (2 + 1), 1 / (2 + 1)], rtol=1e-6)


def test_dice_is_averaged_per_sample_not_over_the_batch():
    # A big well-predicted tumour must not hide a missed small one.
    y = np.zeros((2, 8, 8, 8, 1), np.float32)
    y[0, :6, :6, :6] = 1
    y[1, 0, 0, 0] = 1
    p = y.copy()
    p[1] = 0
    loss = float(soft_dice_loss(tf.constant(y), tf.constant(p), smooth=1e-6))
    assert loss == pytest.approx(0.5, abs=1e-4)  # (0 + 1) / 2 dice missing, global dice would be ~0.0046


def test_smoothing_epsilon_matters():
    y = tf.zeros((1, 2, 2, 2, 1))
    assert float(soft_dice_loss(y, y, smooth=1.0)) == pytest.approx(0.0)  # empty & empty: dice 1
    assert float(soft_dice_loss(y, y + 0.5, smooth=1.0)) == pytest.approx(1 - 1 / 5)


def test_make_loss():
    y = tf.ones((1, 2, 2, 2, 1))
    assert float(make_loss("dice")(y, y)) == pytest.approx(0.0, abs=1e-6)
    assert float(make_loss("dice-bce")(y, y * 0.99)) > float(make_loss("dice")(y, y * 0.99))
    with pytest.raises(ValueError, match="loss"):
        make_loss("focal")  # type: ignore[arg-type]


def test_dice_ce_of_softmax_probabilities_by_hand():
    # one sample of 2 voxels, 3 classes (0 background); voxel 0 is class 1, voxel 1 class 2 (channels-last)
    p = tf.constant(np.array([[0.2, 0.7, 0.1], [0.5, 0.1, 0.4]], np.float32).reshape(1, 1, 1, 2, 3))
    y = tf.constant(np.array([[0, 1, 0], [0, 0, 1]], np.float32).reshape(1, 1, 1, 2, 3))
    dice_1 = (2 * 0.7 + 1) / (0.7 + 0.1 + 1 + 1)  # the foreground classes only
    dice_2 = (2 * 0.4 + 1) / (0.1 + 0.4 + 1 + 1)
    ce = -(np.log(0.7) + np.log(0.4)) / 2
    assert float(make_loss("dice-ce", activation="softmax")(y, p)) == pytest.approx(1 - (dice_1 + dice_2) / 2 + ce,
                                                                                    rel=1e-6)
    assert float(make_loss("dice", activation="softmax")(y, p)) == pytest.approx(1 - (dice_1 + dice_2) / 2, rel=1e-6)
    assert float(make_loss("dice-ce")(y, p)) == float(make_loss("dice-bce")(y, p))  # sigmoid: the same loss
    with pytest.raises(ValueError, match="'dice-bce' .* is for sigmoid outputs"):
        make_loss("dice-bce", activation="softmax")


def test_softmax_losses_match_the_torch_ones():
    import torch

    from distmis.train.torch_losses import make_loss as torch_loss

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 4, 4, 4, 3)) * 2
    p = (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).astype(np.float32)  # channels-last softmax
    y = np.eye(3, dtype=np.float32)[rng.integers(0, 3, (2, 4, 4, 4))]
    to_torch = lambda a: torch.from_numpy(np.moveaxis(a, -1, 1).copy())  # noqa: E731
    for name in ("dice", "dice-ce"):
        expected = float(torch_loss(name, 0.5, activation="softmax")(to_torch(p), to_torch(y)))
        assert float(make_loss(name, smooth=0.5, activation="softmax")(y, p)) == pytest.approx(expected, rel=1e-5)
