"""``training.augment`` for the torch trainers: MONAI's dictionary transforms on one training input at a time.

MONAI's dictionary transforms are made for this job: one draw moves the image and the label together (the
image interpolated bilinearly, the label by nearest neighbour, so it stays binary), and every randomized
transform draws from a ``numpy.random.RandomState`` of its own, which :meth:`TorchAugmenter.reseed` sets from
``(training.seed, epoch, rank)``: an epoch's augmented inputs are a function of those and of the data order,
so a resumed trial sees what an uninterrupted one would have. The TensorFlow pipeline applies the same
transforms with graph ops (:mod:`distmis.data.augment_tf`).

Inputs are channels-first tensors of one case, ``image`` (C, h, w, d) and ``label`` (K, h, w, d) float.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

import torch

from distmis.data.augment import augment_seed, rotate90_planes

if TYPE_CHECKING:  # pragma: no cover
    from distmis.spec.schema import AugmentSpec

__all__ = ["ImageMode", "TorchAugmenter"]

#: How geometric transforms resample the image: ``bilinear`` in training; ``nearest`` keeps the image's own values
#: (so a label that is a function of the image stays exactly that function: the alignment tests).
ImageMode = Literal["bilinear", "nearest"]
KEYS = ("image", "label")


class TorchAugmenter:
    """The ``training.augment`` transforms for inputs of one spatial size, as one MONAI ``Compose``.

    Args:
        augment: the spec's ``training.augment`` section (``enabled`` and at least one probability above 0).
        spatial: the inputs' spatial size (the tile, or the volume when training on whole volumes).
        image_mode: the image's interpolation in geometric transforms (see :data:`ImageMode`).
    """

    def __init__(self, augment: AugmentSpec, spatial: tuple[int, int, int], *, image_mode: ImageMode = "bilinear"):
        from monai.transforms import (
            Compose,
            Rand3DElasticd,
            RandAffined,
            RandFlipd,
            RandGaussianNoised,
            RandRotate90d,
            RandScaleIntensityd,
            RandShiftIntensityd,
        )

        if not augment.active:
            raise ValueError("training.augment is off (enabled false, or every probability 0): nothing to build")
        if image_mode not in ("bilinear", "nearest"):
            raise ValueError(f"image_mode must be 'bilinear' or 'nearest', got {image_mode!r}")
        keys, modes = list(KEYS), (image_mode, "nearest")
        transforms: list = []
        if augment.flip:
            transforms += [RandFlipd(keys, prob=augment.flip, spatial_axis=axis) for axis in range(3)]
        if augment.rotate90:
            transforms += [RandRotate90d(keys, prob=augment.rotate90, max_k=3, spatial_axes=plane)
                           for plane in rotate90_planes(spatial)]
        if augment.affine:
            angle = math.radians(augment.rotate_degrees)
            transforms.append(RandAffined(
                keys, prob=augment.affine, rotate_range=(angle,) * 3, scale_range=(augment.scale_range,) * 3,
                mode=modes, padding_mode="zeros"))
        if augment.elastic:
            transforms.append(Rand3DElasticd(
                keys, prob=augment.elastic, sigma_range=augment.elastic_sigma,
                magnitude_range=augment.elastic_magnitude, mode=modes, padding_mode="zeros"))
        if augment.intensity_scale:
            transforms.append(RandScaleIntensityd("image", prob=augment.intensity_scale,
                                                  factors=augment.intensity_scale_range))
        if augment.intensity_shift:
            transforms.append(RandShiftIntensityd("image", prob=augment.intensity_shift,
                                                  offsets=augment.intensity_shift_range))
        if augment.noise:
            transforms.append(RandGaussianNoised("image", prob=augment.noise, mean=0.0, std=augment.noise_std))
        self.spatial = tuple(spatial)
        self.transform = Compose(transforms)

    def reseed(self, seed: int, epoch: int, rank: int = 0) -> None:
        """Start the draws of ``epoch`` on ``rank`` (every transform gets a generator seeded from these)."""
        self.transform.set_random_state(seed=augment_seed(seed, epoch, rank))

    def __call__(self, image: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One input's augmented ``(image, label)``: plain contiguous float32 tensors of the input's shapes."""
        if tuple(image.shape[1:]) != self.spatial or tuple(label.shape[1:]) != self.spatial:
            raise ValueError(f"augmenter built for inputs of {list(self.spatial)}, got image "
                             f"{list(image.shape)} and label {list(label.shape)}")
        out = self.transform({"image": image, "label": label})
        return _plain(out["image"]), _plain(out["label"])


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """MONAI hands back ``MetaTensor``s: the plain tensor underneath, float32 and contiguous."""
    if hasattr(tensor, "as_tensor"):
        tensor = tensor.as_tensor()
    return torch.as_tensor(tensor, dtype=torch.float32).contiguous()
