"""Training losses for the TensorFlow models (channels-last ``(B, H, W, D, C)``): soft dice, per sample and per
channel, and its cross-entropy variants; the twins of :mod:`distmis.train.torch_losses`.

``sigmoid`` outputs (``whole-tumour``, ``regions``): dice over every channel; ``dice-bce`` adds the mean binary
cross-entropy, and ``dice-ce`` is the same loss. ``softmax`` outputs (``classes``, channel 0 the background): dice
over the foreground channels only; ``dice-ce`` adds the categorical cross-entropy over every channel (as MONAI's
``DiceCELoss(softmax=True, include_background=False)``); ``dice-bce`` is refused.
"""

from __future__ import annotations

from typing import Callable, Literal

import tensorflow as tf

LossName = Literal["dice", "dice-bce", "dice-ce"]
LOSSES: tuple[str, ...] = ("dice", "dice-bce", "dice-ce")
Activation = Literal["sigmoid", "softmax"]
ACTIVATIONS: tuple[str, ...] = ("sigmoid", "softmax")
EPSILON = 1e-7  # Keras' clipping of probabilities before the logarithm


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
    eps = EPSILON
    p = tf.clip_by_value(y_pred, eps, 1.0 - eps)
    bce = -tf.reduce_mean(y_true * tf.math.log(p) + (1.0 - y_true) * tf.math.log(1.0 - p))
    return soft_dice_loss(y_true, y_pred, smooth=smooth) + bce


def foreground_dice_loss(y_true: tf.Tensor, y_pred: tf.Tensor, *, smooth: float = 1.0) -> tf.Tensor:
    """:func:`soft_dice_loss` of softmax probabilities over the foreground channels (all but channel 0, the
    background) of a one-hot ``y_true``."""
    return soft_dice_loss(y_true[..., 1:], y_pred[..., 1:], smooth=smooth)


def categorical_cross_entropy(y_true: tf.Tensor, y_pred: tf.Tensor) -> tf.Tensor:
    """``-sum_c g_c log p_c`` averaged over samples and voxels: the negative log-likelihood of softmax
    probabilities (clipped below at 1e-7) against a one-hot ``y_true``."""
    y_true = tf.cast(y_true, y_pred.dtype)
    p = tf.maximum(y_pred, EPSILON)
    return -tf.reduce_mean(tf.reduce_sum(y_true * tf.math.log(p), axis=-1))


def dice_ce_loss(y_true: tf.Tensor, y_pred: tf.Tensor, *, smooth: float = 1.0) -> tf.Tensor:
    """Foreground soft dice loss plus categorical cross-entropy over every channel, of softmax probabilities."""
    return foreground_dice_loss(y_true, y_pred, smooth=smooth) + categorical_cross_entropy(y_true, y_pred)


def make_loss(name: LossName, *, smooth: float = 1.0,
              activation: Activation = "sigmoid") -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    """The loss a spec's ``training.loss`` names, as ``loss(y_true, y_pred) -> scalar``, for a model whose output
    goes through ``activation`` (``sigmoid`` per channel, or ``softmax`` over the channels: see the module's text)."""
    if name not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {name!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if activation == "softmax":
        if name == "dice-bce":
            raise ValueError("loss 'dice-bce' (binary cross-entropy per channel) is for sigmoid outputs; mutually "
                             "exclusive classes (softmax) take 'dice-ce' or 'dice'")
        if name == "dice":
            return lambda y_true, y_pred: foreground_dice_loss(y_true, y_pred, smooth=smooth)
        return lambda y_true, y_pred: dice_ce_loss(y_true, y_pred, smooth=smooth)
    if name == "dice":
        return lambda y_true, y_pred: soft_dice_loss(y_true, y_pred, smooth=smooth)
    return lambda y_true, y_pred: dice_bce_loss(y_true, y_pred, smooth=smooth)  # dice-bce, dice-ce
