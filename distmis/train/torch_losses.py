"""Training losses for the PyTorch models (channels-first ``(B, C, H, W, D)``): the twins of
:mod:`distmis.train.losses` (TensorFlow, channels-last).

What a loss compares depends on the output activation (the target scheme's, :mod:`distmis.data.targets`):

- ``sigmoid`` (``whole-tumour``, ``regions``: overlapping channels): soft dice over every channel; ``dice-bce`` adds
  the mean binary cross-entropy; ``dice-ce`` is the same loss as ``dice-bce`` (the cross-entropy of a sigmoid
  channel is the binary one).
- ``softmax`` (``classes``: mutually exclusive classes, channel 0 the background): soft dice over the foreground
  channels only (the background, most of a volume, would dominate the mean: nnU-Net leaves it out too); ``dice-ce``
  adds the categorical cross-entropy over all channels, MONAI's ``DiceCELoss(softmax=True,
  include_background=False)``. ``dice-bce`` is refused: mutually exclusive classes take ``dice-ce``.

Every loss is a mean over samples (and channels): a pipeline's micro-batches average to the batch's loss.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch
import torch.nn.functional as F

__all__ = [
    "LossName",
    "LOSSES",
    "Activation",
    "BCE_EPSILON",
    "soft_dice_per_sample",
    "soft_dice_loss",
    "dice_bce_loss",
    "dice_bce_with_logits_loss",
    "foreground_dice_loss",
    "categorical_cross_entropy",
    "dice_ce_loss",
    "make_loss",
]

LossName = Literal["dice", "dice-bce", "dice-ce"]
LOSSES: tuple[str, ...] = ("dice", "dice-bce", "dice-ce")
Activation = Literal["sigmoid", "softmax"]
ACTIVATIONS: tuple[str, ...] = ("sigmoid", "softmax")
BCE_EPSILON = 1e-7  # Keras' clipping of probabilities before the logarithm


def soft_dice_per_sample(pred: torch.Tensor, target: torch.Tensor, smooth: float = 1.0) -> torch.Tensor:
    """Soft dice for every sample and channel of channels-first (B, C, H, W, D) tensors -> (B, C).

    ``(2 * sum(p * g) + smooth) / (sum(p) + sum(g) + smooth)`` over the spatial axes of each sample,
    as :func:`distmis.train.losses.soft_dice_per_sample` (which is channels-last).
    """
    target = target.to(pred.dtype)
    axes = tuple(range(2, pred.ndim))
    intersection = (pred * target).sum(dim=axes)
    total = pred.sum(dim=axes) + target.sum(dim=axes)
    return (2.0 * intersection + smooth) / (total + smooth)


def soft_dice_loss(pred: torch.Tensor, target: torch.Tensor, smooth: float = 1.0) -> torch.Tensor:
    """``1 - dice`` averaged over samples and channels (a scalar)."""
    return 1.0 - soft_dice_per_sample(pred, target, smooth).mean()


def dice_bce_loss(pred: torch.Tensor, target: torch.Tensor, smooth: float = 1.0) -> torch.Tensor:
    """Soft dice loss plus mean binary cross-entropy, with probabilities clipped to [1e-7, 1 - 1e-7]."""
    target = target.to(pred.dtype)
    p = pred.clamp(BCE_EPSILON, 1.0 - BCE_EPSILON)
    bce = -(target * torch.log(p) + (1.0 - target) * torch.log(1.0 - p)).mean()
    return soft_dice_loss(pred, target, smooth) + bce


def dice_bce_with_logits_loss(logits: torch.Tensor, target: torch.Tensor, smooth: float = 1.0) -> torch.Tensor:
    """:func:`dice_bce_loss` of ``sigmoid(logits)``, its cross-entropy computed from the logits: no clipping,
    so a confidently wrong voxel (a logit beyond about +-16) still has a gradient."""
    target = target.to(logits.dtype)
    bce = F.binary_cross_entropy_with_logits(logits, target)
    return soft_dice_loss(torch.sigmoid(logits), target, smooth) + bce


def _check_classes(pred: torch.Tensor) -> None:
    if pred.ndim < 3 or pred.shape[1] < 2:
        raise ValueError(f"a softmax output needs a background and at least one class channel (B, C >= 2, ...), "
                         f"got shape {tuple(pred.shape)}")


def foreground_dice_loss(prob: torch.Tensor, target: torch.Tensor, smooth: float = 1.0) -> torch.Tensor:
    """:func:`soft_dice_loss` of softmax probabilities over the foreground channels (all but channel 0, the
    background) of a one-hot ``target``."""
    _check_classes(prob)
    return soft_dice_loss(prob[:, 1:], target[:, 1:], smooth)


def categorical_cross_entropy(prob: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``-sum_c g_c log p_c``, averaged over samples and voxels: the negative log-likelihood of softmax
    probabilities (clipped below at 1e-7) against a one-hot ``target``."""
    _check_classes(prob)
    target = target.to(prob.dtype)
    return -(target * torch.log(prob.clamp(min=BCE_EPSILON))).sum(dim=1).mean()


def dice_ce_loss(prob: torch.Tensor, target: torch.Tensor, smooth: float = 1.0) -> torch.Tensor:
    """Foreground soft dice loss plus categorical cross-entropy over every channel, of softmax probabilities (a
    U-Net whose head has the softmax)."""
    return foreground_dice_loss(prob, target, smooth) + categorical_cross_entropy(prob, target)


def _monai_dice_ce(smooth: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """MONAI's ``DiceCELoss`` on logits: softmax, dice over the foreground channels (``include_background=False``,
    per sample and channel, ``smooth`` in numerator and denominator as :func:`soft_dice_per_sample`) plus the
    cross-entropy of the logits over every channel (``log_softmax``: no clipping)."""
    from monai.losses import DiceCELoss

    loss = DiceCELoss(softmax=True, include_background=False, smooth_nr=smooth, smooth_dr=smooth)

    def dice_ce_with_logits(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        _check_classes(logits)
        return loss(logits, target.to(logits.dtype))

    return dice_ce_with_logits


def make_loss(
    name: LossName, smooth: float = 1.0, *, from_logits: bool = False, activation: Activation = "sigmoid"
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss a spec's ``training.loss`` names, as ``loss(pred, target) -> scalar``, for a model whose outputs go
    through ``activation`` (``sigmoid`` per channel or ``softmax`` over the channels; see the module's text).

    ``pred`` holds probabilities, or logits with ``from_logits`` (for a model whose head has no activation: the
    ViT). Note the argument order: prediction first, as PyTorch's own losses (the TF losses take the target
    first, as Keras does).
    """
    if name not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {name!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if activation == "softmax":
        if name == "dice-bce":
            raise ValueError("loss 'dice-bce' (binary cross-entropy per channel) is for sigmoid outputs; mutually "
                             "exclusive classes (softmax) take 'dice-ce' or 'dice'")
        if name == "dice":
            if from_logits:
                return lambda logits, target: foreground_dice_loss(torch.softmax(logits, dim=1), target, smooth)
            return lambda prob, target: foreground_dice_loss(prob, target, smooth)
        if from_logits:
            return _monai_dice_ce(smooth)
        return lambda prob, target: dice_ce_loss(prob, target, smooth)
    if name == "dice":
        if from_logits:
            return lambda logits, target: soft_dice_loss(torch.sigmoid(logits), target, smooth)
        return lambda pred, target: soft_dice_loss(pred, target, smooth)
    # dice-bce, and dice-ce of sigmoid outputs: the cross-entropy of one sigmoid channel is the binary one
    if from_logits:
        return lambda logits, target: dice_bce_with_logits_loss(logits, target, smooth)
    return lambda pred, target: dice_bce_loss(pred, target, smooth)
