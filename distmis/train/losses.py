"""Training losses for the TensorFlow models: soft dice, per sample and per channel."""

from __future__ import annotations

from typing import Callable, Literal

import tensorflow as tf

LossName = Literal["dice", "dice-bce"]


def soft_dice_per_sample(y_true: tf.Tensor, y_pred: tf.Tensor, *, smooth: float = 1.0) -> tf.Tensor:
    """Soft dice for every sample and channel of (B, H, W, D, C) tensors -> (B, C).

    ``(2 * sum(p * g) + smooth) / (sum(p) + sum(g) + smooth)`` over the spatial axes of each sample.
    """
    y_true = tf.cast(y_true, y_pred.dtype)
    axes = [1, 2, 3]
    intersection = tf.reduce_sum(y_true * y_pred, axis=axes)
    total = tf.reduce_sum(y_true, axis=axes) + tf.reduce_sum(y_pred, axis=axes)
    return (2.0 * intersection + smooth) / (total + smooth)


def soft_dice_loss(y_true: tf.Tensor, y_pred: tf.Tensor, *, smooth: float = 1.0) -> tf.Tensor:
    """``1 - dice`` averaged over samples and channels (a scalar)."""
    return 1.0 - tf.reduce_mean(soft_dice_per_sample(y_true, y_pred, smooth=smooth))


def dice_bce_loss(y_true: tf.Tensor, y_pred: tf.Tensor, *, smooth: float = 1.0) -> tf.Tensor:
    """Soft dice loss plus mean binary cross-entropy: steadier gradients early in training."""
    y_true = tf.cast(y_true, y_pred.dtype)
    eps = 1e-7
    p = tf.clip_by_value(y_pred, eps, 1.0 - eps)
    bce = -tf.reduce_mean(y_true * tf.math.log(p) + (1.0 - y_true) * tf.math.log(1.0 - p))
    return soft_dice_loss(y_true, y_pred, smooth=smooth) + bce


def make_loss(name: LossName, *, smooth: float = 1.0) -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    """The loss a spec's ``training.loss`` names, as ``loss(y_true, y_pred) -> scalar``."""
    if name == "dice":
        return lambda y_true, y_pred: soft_dice_loss(y_true, y_pred, smooth=smooth)
    if name == "dice-bce":
        return lambda y_true, y_pred: dice_bce_loss(y_true, y_pred, smooth=smooth)
    raise ValueError(f"loss must be 'dice' or 'dice-bce', got {name!r}")
