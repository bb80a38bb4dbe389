"""The paper's 3D U-Net in PyTorch, channels-first: the twin of :mod:`distmis.models.unet3d_tf`.

Same layers, filter counts and trainable parameters per layer as the Keras model. Resolution
level ``s`` (1-based) has ``base_filters * 2**(s-1)`` filters; with the defaults that is 8, 16, 32
and a 64-filter bottleneck. Each level is a :class:`ConvBlock`: two 3x3x3 'same' convolutions,
each followed by normalization and ReLU. Down: 2x2x2 max pooling. Up: 3x3x3 transposed convolution
with stride 2, concatenated ``[up, skip]`` on channels. Head: a 3x3x3 convolution to one channel per class,
through the output ``activation`` (``sigmoid`` per channel, the default, or ``softmax`` over the channels), so
:meth:`UNet3D.forward` returns probabilities, as the Keras model does.

Inputs are (B, C, H, W, D) and every spatial size must divide by ``2**(levels-1)``.

Keras defaults are kept where PyTorch's differ: kernels start from a truncated normal
(std 0.05, cut at two standard deviations), biases at zero, normalization epsilon is 1e-3, and
``batch_norm_momentum`` keeps Keras' meaning (weight of the old running statistic; PyTorch's
``momentum`` is the weight of the new one, so it gets ``1 - batch_norm_momentum``).

With ``deep_supervision`` it has a 1x1x1 head per decoder level but the lowest and the full resolution's
(:func:`~distmis.models.registry.supervision_heads`), and in training mode returns a list: the full-resolution
probabilities, then each head's at its level's resolution, highest first (:mod:`distmis.train.deep_supervision`);
in eval mode only the first.

The model holds no distribution logic: data parallelism (DDP, Ray Train) wraps it from outside.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from distmis.models.params import UNet3DParams
from distmis.models.registry import NetworkInput, supervision_heads

Norm = Literal["batch", "group"]
NORMS: tuple[str, ...] = ("batch", "group")
Activation = Literal["sigmoid", "softmax"]
ACTIVATIONS: tuple[str, ...] = ("sigmoid", "softmax")

KERAS_INIT_STD = 0.05  # keras.initializers.TruncatedNormal's default stddev
KERAS_NORM_EPSILON = 1e-3  # BatchNormalization's and GroupNormalization's default epsilon


def activate(logits: torch.Tensor, activation: Activation) -> torch.Tensor:
    """Probabilities from channels-first ``(B, C, ...)`` logits: ``sigmoid`` of each channel, or ``softmax`` over the
    channels (dim 1). Always in fp32: logits a mixed-precision forward computed in 16 bits are cast up first, so
    the probabilities (and the loss computed from them) keep fp32's resolution near 0 and 1."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "softmax":
        return torch.softmax(logits, dim=1)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


class MaxPool3dInInputDtype(nn.MaxPool3d):
    """``nn.MaxPool3d`` that pools in its input's dtype under autocast too. Max pooling selects values, so it is
    exact in any dtype; CPU autocast would cast a 16-bit input up to fp32 for it (its fp32 list), and autograd would
    keep that fp32 copy of every encoder level's output for the backward. Without autocast it is ``nn.MaxPool3d``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type  # (a meta tensor has no autocast)
        if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
            with torch.autocast(device, enabled=False):
                return super().forward(x)
        return super().forward(x)


def init_like_keras(layer: nn.Conv3d | nn.ConvTranspose3d) -> None:
    """Truncated-normal kernel (Keras' ``"truncated_normal"``) and zero bias, in place."""
    std = KERAS_INIT_STD
    nn.init.trunc_normal_(layer.weight, mean=0.0, std=std, a=-2 * std, b=2 * std)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)


def make_norm(norm: Norm, channels: int, *, groups: int, batch_norm_momentum: float) -> nn.Module:
    """Batch or group normalization over ``channels``; ``groups`` is capped at ``channels``."""
    if norm == "batch":
        return nn.BatchNorm3d(channels, eps=KERAS_NORM_EPSILON, momentum=1.0 - batch_norm_momentum)
    if norm == "group":
        groups = min(groups, channels)
        if channels % groups:
            raise ValueError(f"norm_groups {groups} must divide the {channels} channels of a group-normalized layer")
        return nn.GroupNorm(groups, channels, eps=KERAS_NORM_EPSILON)
    raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")


def conv3x3(in_channels: int, out_channels: int) -> nn.Conv3d:
    """A 3x3x3 'same' convolution initialized like Keras."""
    conv = nn.Conv3d(in_channels, out_channels, kernel_size=3, padding=1)
    init_like_keras(conv)
    return conv


class ConvBlock(nn.Sequential):
    """Two (3x3x3 conv -> norm -> ReLU) layers: ``in_channels`` -> ``out_channels`` -> ``out_channels``."""

    def __init__(
        self, in_channels: int, out_channels: int, *, norm: Norm, groups: int, batch_norm_momentum: float
    ) -> None:
        def norm_layer() -> nn.Module:
            return make_norm(norm, out_channels, groups=groups, batch_norm_momentum=batch_norm_momentum)

        super().__init__(
            conv3x3(in_channels, out_channels), norm_layer(), nn.ReLU(inplace=True),
            conv3x3(out_channels, out_channels), norm_layer(), nn.ReLU(inplace=True),
        )


class UpBlock(nn.Module):
    """Double the resolution with a stride-2 transposed conv, concatenate the skip, then a :class:`ConvBlock`."""

    def __init__(
        self, in_channels: int, out_channels: int, *, norm: Norm, groups: int, batch_norm_momentum: float
    ) -> None:
        super().__init__()
        # padding=1 with output_padding=1 makes the output exactly twice the input, like Keras' 'same'.
        self.transpose = nn.ConvTranspose3d(
            in_channels, out_channels, kernel_size=3, stride=2, padding=1, output_padding=1
        )
        init_like_keras(self.transpose)
        self.block = ConvBlock(
            2 * out_channels, out_channels, norm=norm, groups=groups, batch_norm_momentum=batch_norm_momentum
        )

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.block(torch.cat([self.transpose(x), skip], dim=1))


def _check_arguments(
    *, in_channels: int, num_classes: int, base_filters: int, levels: int, norm: str, norm_groups: int,
    batch_norm_momentum: float, activation: str = "sigmoid",
) -> None:
    """Raise ValueError naming the first bad argument, before any layer is built."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if levels < 2:
        raise ValueError(f"levels must be >= 2, got {levels}")
    if in_channels < 1 or num_classes < 1 or base_filters < 1:
        raise ValueError(
            "in_channels, num_classes and base_filters must be >= 1, "
            f"got {in_channels}, {num_classes}, {base_filters}"
        )
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if norm_groups < 1:
        raise ValueError(f"norm_groups must be >= 1, got {norm_groups}")
    if norm == "group" and base_filters % min(norm_groups, base_filters):
        raise ValueError(f"norm_groups ({norm_groups}) must divide base_filters ({base_filters}) for group norm")
    if not 0.0 < batch_norm_momentum < 1.0:
        raise ValueError(f"batch_norm_momentum must lie in (0, 1) (Keras' meaning), got {batch_norm_momentum}")


class UNet3D(nn.Module):
    """The 3D U-Net: (B, in_channels, H, W, D) -> probabilities (B, num_classes, H, W, D), through ``activation``
    (``sigmoid`` per channel, or ``softmax`` over the channels). The activation has no parameters: a state dict
    loads into either."""

    def __init__(
        self,
        *,
        in_channels: int = 4,
        num_classes: int = 1,
        base_filters: int = 8,
        levels: int = 4,
        norm: Norm = "batch",
        norm_groups: int = 4,
        batch_norm_momentum: float = 0.9,
        activation: Activation = "sigmoid",
        deep_supervision: bool = False,
    ) -> None:
        super().__init__()
        _check_arguments(
            in_channels=in_channels, num_classes=num_classes, base_filters=base_filters, levels=levels,
            norm=norm, norm_groups=norm_groups, batch_norm_momentum=batch_norm_momentum, activation=activation,
        )
        self.levels = levels
        self.activation: Activation = activation
        self.in_channels = in_channels
        block = dict(norm=norm, groups=norm_groups, batch_norm_momentum=batch_norm_momentum)
        filters = [base_filters * 2**s for s in range(levels)]  # last one is the bottleneck

        self.down = nn.ModuleList()
        channels = in_channels
        for f in filters[:-1]:
            self.down.append(ConvBlock(channels, f, **block))
            channels = f
        self.pool = MaxPool3dInInputDtype(kernel_size=2)
        self.bottleneck = ConvBlock(channels, filters[-1], **block)
        self.up = nn.ModuleList(
            UpBlock(filters[s + 1], filters[s], **block) for s in range(levels - 2, -1, -1)
        )
        self.head = conv3x3(filters[0], num_classes)
        # deep supervision: a 1x1x1 convolution to the classes at decoder levels 1 .. supervision_heads(levels)
        # (nnU-Net's segmentation layers), highest resolution first
        heads = supervision_heads(levels) if deep_supervision else 0
        self.supervision = nn.ModuleList(nn.Conv3d(filters[level], num_classes, kernel_size=1)
                                         for level in range(1, heads + 1))
        for head in self.supervision:
            init_like_keras(head)

    @property
    def pooling_factor(self) -> int:
        """Every spatial input size must divide by this."""
        return 2 ** (self.levels - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 5 or any(size % self.pooling_factor for size in x.shape[2:]):
            raise ValueError(
                f"input must be (B, C, H, W, D) with H, W, D divisible by {self.pooling_factor}, got {tuple(x.shape)}"
            )
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        decoded = []  # each decoder level's features, lowest resolution first
        for up, skip in zip(self.up, reversed(skips)):
            x = up(x, skip)
            decoded.append(x)
        out = activate(self.head(x), self.activation)
        if not (self.training and len(self.supervision)):
            return out
        # deep supervision: the full resolution's output, then level 1's, 2's, ... at their own resolution
        levels = decoded[-2::-1]  # level 1 first
        return [out, *(activate(head(features), self.activation) for head, features in zip(self.supervision, levels))]


def count_trainable_parameters(model: nn.Module) -> int:
    """Number of trainable values (batch norm's running statistics are buffers, not counted)."""
    return int(sum(p.numel() for p in model.parameters() if p.requires_grad))


def build_unet3d(params: UNet3DParams, network: NetworkInput) -> UNet3D:
    """The registry's builder (:mod:`distmis.models.registry`): ``model.params`` by name, the target scheme's
    activation inside."""
    return UNet3D(in_channels=network.in_channels, num_classes=network.out_channels, activation=network.activation,
                  deep_supervision=network.deep_supervision, **params.model_dump())
