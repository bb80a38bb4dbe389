"""The paper's 3D U-Net in Keras 3 (TensorFlow backend), channels-last.

Resolution level ``s`` (1-based) has ``base_filters * 2**(s-1)`` filters; with the defaults that is
8, 16, 32 and a 64-filter bottleneck. Each level is two 3x3x3 'same' convolutions, each followed by
normalization and ReLU. Down: 2x2x2 max pooling. Up: 3x3x3 transposed convolution with stride 2,
concatenated with the skip. Head: a 3x3x3 convolution to one channel per class, through the output ``activation``:
``sigmoid`` (each channel on its own: overlapping targets, the default) or ``softmax`` over the channels (mutually
exclusive classes, background included). The head's parameters are the same either way.

TensorFlow's CPU Conv3D has no channels-first kernel, so inputs are (B, H, W, D, C) where the paper
transposed to channels-first for its GPUs; the arithmetic is the same.
"""

from __future__ import annotations

import os
from typing import Literal

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
from keras import layers  # noqa: E402

Norm = Literal["batch", "group"]
Activation = Literal["sigmoid", "softmax"]
ACTIVATIONS: tuple[str, ...] = ("sigmoid", "softmax")


def _norm(norm: Norm, *, groups: int, momentum: float, name: str) -> layers.Layer:
    if norm == "batch":
        return layers.BatchNormalization(axis=-1, momentum=momentum, name=name)
    if norm == "group":
        return layers.GroupNormalization(groups=groups, axis=-1, name=name)
    raise ValueError(f"norm must be 'batch' or 'group', got {norm!r}")


def conv_block(x, filters: int, *, norm: Norm, groups: int, momentum: float, name: str):
    """Two (3x3x3 conv -> norm -> ReLU) layers."""
    for i in (1, 2):
        x = layers.Conv3D(
            filters, 3, padding="same", kernel_initializer="truncated_normal", name=f"{name}_conv{i}"
        )(x)
        x = _norm(norm, groups=min(groups, filters), momentum=momentum, name=f"{name}_norm{i}")(x)
        x = layers.ReLU(name=f"{name}_relu{i}")(x)
    return x


def build_unet3d(
    *,
    in_channels: int = 4,
    num_classes: int = 1,
    base_filters: int = 8,
    levels: int = 4,
    norm: Norm = "batch",
    norm_groups: int = 4,
    batch_norm_momentum: float = 0.9,
    input_shape: tuple[int | None, int | None, int | None] = (None, None, None),
    activation: Activation = "sigmoid",
) -> keras.Model:
    """Build the U-Net. Spatial input dims may be ``None`` (any size divisible by 2**(levels-1)). ``activation``: the
    head's, ``sigmoid`` per channel or ``softmax`` over the channels (the last axis)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if levels < 2:
        raise ValueError(f"levels must be >= 2, got {levels}")
    if in_channels < 1 or num_classes < 1 or base_filters < 1:
        raise ValueError(
            f"in_channels, num_classes and base_filters must be >= 1, got {in_channels}, {num_classes}, {base_filters}"
        )
    block = dict(norm=norm, groups=norm_groups, momentum=batch_norm_momentum)

    inputs = keras.Input(shape=(*input_shape, in_channels), name="image")
    x = inputs
    skips = []
    for s in range(1, levels):
        x = conv_block(x, base_filters * 2 ** (s - 1), name=f"down{s}", **block)
        skips.append(x)
        x = layers.MaxPooling3D(pool_size=2, name=f"pool{s}")(x)

    x = conv_block(x, base_filters * 2 ** (levels - 1), name="bottleneck", **block)

    for s in range(levels - 1, 0, -1):
        filters = base_filters * 2 ** (s - 1)
        x = layers.Conv3DTranspose(
            filters, 3, strides=2, padding="same", kernel_initializer="truncated_normal", name=f"up{s}_transpose"
        )(x)
        x = layers.Concatenate(axis=-1, name=f"up{s}_concat")([x, skips[s - 1]])
        x = conv_block(x, filters, name=f"up{s}", **block)

    outputs = layers.Conv3D(
        num_classes, 3, padding="same", activation=activation, kernel_initializer="truncated_normal", name="head"
    )(x)
    return keras.Model(inputs, outputs, name="unet3d")


def count_trainable_parameters(model: keras.Model) -> int:
    return int(sum(int(w.numpy().size) for w in model.trainable_weights))
