"""The paper's 3D U-Net in Keras 3 (TensorFlow backend), channels-last.

Resolution level ``s`` (1-based) has ``base_filters * 2**(s-1)`` filters; with the defaults that is
8, 16, 32 and a 64-filter bottleneck. Each level is two 3x3x3 'same' convolutions, each followed by
normalization and ReLU. Down: 2x2x2 max pooling. Up: 3x3x3 transposed convolution with stride 2,
concatenated with the skip. Head: a 3x3x3 convolution to one channel per class, through the output ``activation``:
``sigmoid`` (each channel on its own: overlapping targets, the default) or ``softmax`` over the channels (mutually
exclusive classes, background included). The head's parameters are the same either way.

TensorFlow's CPU Conv3D has no channels-first kernel, so inputs are (B, H, W, D, C) where the paper
transposed to channels-first for its GPUs; the arithmetic is the same.

Mixed precision (``dtype_policy``: ``mixed_bfloat16`` or ``mixed_float16``): every layer but the head computes in
the policy's 16-bit dtype with float32 variables, each layer given the policy itself (Keras's global policy is
never set, so no other model built in the process changes); the head, whose activation gives the probabilities,
stays float32, as Keras's mixed-precision guide has the last layer, so the outputs and the loss are float32.
"""

from __future__ import annotations

import os
from typing import Literal

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
from keras import layers  # noqa: E402

from distmis.models.params import UNet3DParams  # noqa: E402
from distmis.models.registry import NetworkInput  # noqa: E402
from distmis.models.tf_layers import GroupNormalization  # noqa: E402

Norm = Literal["batch", "group"]
Activation = Literal["sigmoid", "softmax"]
ACTIVATIONS: tuple[str, ...] = ("sigmoid", "softmax")


#: The Keras dtype policies a U-Net may be built with: float32, or mixed precision (float32 variables).
DTYPE_POLICIES: tuple[str, ...] = ("float32", "mixed_bfloat16", "mixed_float16")


def _norm(norm: Norm, *, groups: int, momentum: float, name: str, dtype: str | None = None) -> layers.Layer:
    if norm == "batch":
        return layers.BatchNormalization(axis=-1, momentum=momentum, name=name, dtype=dtype)
    if norm == "group":
        return GroupNormalization(groups=groups, axis=-1, name=name, dtype=dtype)  # Keras's, faster to train
    raise ValueError(f"norm must be 'batch' or 'group', got {norm!r}")


def conv_block(x, filters: int, *, norm: Norm, groups: int, momentum: float, name: str, dtype: str | None = None):
    """Two (3x3x3 conv -> norm -> ReLU) layers (``dtype``: the layers' dtype policy, None for Keras's default)."""
    for i in (1, 2):
        x = layers.Conv3D(
            filters, 3, padding="same", kernel_initializer="truncated_normal", name=f"{name}_conv{i}", dtype=dtype
        )(x)
        x = _norm(norm, groups=min(groups, filters), momentum=momentum, name=f"{name}_norm{i}", dtype=dtype)(x)
        x = layers.ReLU(name=f"{name}_relu{i}", dtype=dtype)(x)
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
    dtype_policy: str | None = None,
) -> keras.Model:
    """Build the U-Net. Spatial input dims may be ``None`` (any size divisible by 2**(levels-1)). ``activation``: the
    head's, ``sigmoid`` per channel or ``softmax`` over the channels (the last axis). ``dtype_policy``: one of
    :data:`DTYPE_POLICIES` for every layer but the float32 head (None: Keras's default, float32)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if dtype_policy is not None and dtype_policy not in DTYPE_POLICIES:
        raise ValueError(f"dtype_policy must be one of {DTYPE_POLICIES}, got {dtype_policy!r}")
    if levels < 2:
        raise ValueError(f"levels must be >= 2, got {levels}")
    if in_channels < 1 or num_classes < 1 or base_filters < 1:
        raise ValueError(
            f"in_channels, num_classes and base_filters must be >= 1, got {in_channels}, {num_classes}, {base_filters}"
        )
    block = dict(norm=norm, groups=norm_groups, momentum=batch_norm_momentum, dtype=dtype_policy)

    inputs = keras.Input(shape=(*input_shape, in_channels), name="image")
    x = inputs
    skips = []
    for s in range(1, levels):
        x = conv_block(x, base_filters * 2 ** (s - 1), name=f"down{s}", **block)
        skips.append(x)
        x = layers.MaxPooling3D(pool_size=2, name=f"pool{s}", dtype=dtype_policy)(x)

    x = conv_block(x, base_filters * 2 ** (levels - 1), name="bottleneck", **block)

    for s in range(levels - 1, 0, -1):
        filters = base_filters * 2 ** (s - 1)
        x = layers.Conv3DTranspose(
            filters, 3, strides=2, padding="same", kernel_initializer="truncated_normal", name=f"up{s}_transpose",
            dtype=dtype_policy,
        )(x)
        x = layers.Concatenate(axis=-1, name=f"up{s}_concat", dtype=dtype_policy)([x, skips[s - 1]])
        x = conv_block(x, filters, name=f"up{s}", **block)

    outputs = layers.Conv3D(  # float32 under any policy: the probabilities and the loss in float32
        num_classes, 3, padding="same", activation=activation, kernel_initializer="truncated_normal", name="head",
        dtype=None if dtype_policy is None else "float32",
    )(x)
    return keras.Model(inputs, outputs, name="unet3d")


def count_trainable_parameters(model: keras.Model) -> int:
    return int(sum(int(w.numpy().size) for w in model.trainable_weights))


#: The Keras dtype policy of each ``training.precision`` (None: Keras's default, float32).
KERAS_POLICIES: dict[str, str | None] = {"fp32": None, "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


def build_keras_unet3d(params: UNet3DParams, network: NetworkInput) -> keras.Model:
    """The registry's builder (:mod:`distmis.networks`): ``model.params`` by name, the target scheme's activation
    in its head, its layers in the dtype policy of ``network.precision`` (:data:`KERAS_POLICIES`)."""
    return build_unet3d(in_channels=network.in_channels, num_classes=network.out_channels,
                        activation=network.activation, dtype_policy=KERAS_POLICIES[network.precision],
                        **params.model_dump())
