"""Tests for training.augment in both frameworks: distmis.data.augment_torch (MONAI) and distmis.data.augment_tf.

The label in these tests is a known function of the image (voxels above a threshold of one channel, one label
channel per threshold), so alignment is checked exactly: after any geometric transform, with the image resampled
by nearest neighbour (which keeps its values), the label must still be that function of the image.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from distmis.data.augment import augment_seed, rotate90_planes
from distmis.data.augment_torch import TorchAugmenter
from distmis.spec.schema import AugmentSpec, TrainingSpec

THRESHOLDS = (0.3, 1.0)  # label channel k marks image channel 0 above THRESHOLDS[k]
NONE = dict(flip=0.0, rotate90=0.0, affine=0.0, elastic=0.0, intensity_scale=0.0, intensity_shift=0.0, noise=0.0)
GEOMETRIC = {
    "flip": dict(NONE, flip=1.0),
    "rotate90": dict(NONE, rotate90=1.0),
    "affine": dict(NONE, affine=1.0, rotate_degrees=30.0, scale_range=0.2),
    "elastic": dict(NONE, elastic=1.0, elastic_sigma=(2.0, 3.0), elastic_magnitude=(20.0, 40.0)),
    "all": dict(NONE, flip=0.5, rotate90=0.5, affine=1.0, elastic=1.0, elastic_sigma=(2.0, 3.0)),
}
INTENSITY = {
    "intensity_scale": dict(NONE, intensity_scale=1.0, intensity_scale_range=0.3),
    "intensity_shift": dict(NONE, intensity_shift=1.0, intensity_shift_range=0.3),
    "noise": dict(NONE, noise=1.0, noise_std=0.3),
}


def case(spatial: tuple[int, int, int] = (12, 12, 10), seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Channels-last image (h, w, d, 4) of smooth blobs, label (h, w, d, 2) = thresholds of image channel 0."""
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.linspace(-1, 1, s) for s in spatial], indexing="ij"), -1)
    image = np.stack([np.exp(-4 * ((grid - rng.uniform(-0.5, 0.5, 3)) ** 2).sum(-1)) * 2.0 for _ in range(4)], -1)
    image = (image + rng.normal(0, 0.05, image.shape)).astype(np.float32)
    return image, label_of(image)


def label_of(image: np.ndarray) -> np.ndarray:
    return np.stack([image[..., 0] > t for t in THRESHOLDS], -1).astype(np.float32)


def spec(**fields) -> AugmentSpec:
    return AugmentSpec(enabled=True, **fields)


# --------------------------------------------------------------------------- the spec
def test_augment_is_off_by_default_and_validated():
    assert not TrainingSpec().augment.enabled and not TrainingSpec().augment.active
    assert not AugmentSpec(enabled=True, **NONE).active
    with pytest.raises(ValidationError, match="elastic_sigma"):
        AugmentSpec(elastic_sigma=(8.0, 5.0))
    with pytest.raises(ValidationError, match="flip"):
        AugmentSpec(flip=1.5)
    with pytest.raises(ValueError, match="off"):
        TorchAugmenter(AugmentSpec(), (8, 8, 8))
    with pytest.raises(ValidationError, match=r"tile \[8, 6, 4\] has none"):
        TrainingSpec(tile=[8, 6, 4], augment={"enabled": True, "rotate90": 0.5})
    assert TrainingSpec(tile=[8, 8, 4], augment={"enabled": True, "rotate90": 0.5}).augment.rotate90 == 0.5


def test_rotations_only_in_planes_of_equal_extents():
    assert rotate90_planes((8, 8, 8)) == [(0, 1), (0, 2), (1, 2)]
    assert rotate90_planes((8, 8, 4)) == [(0, 1)]
    assert rotate90_planes((8, 6, 4)) == []


def test_augment_seed_mixes_seed_epoch_and_rank():
    seeds = {augment_seed(s, e, r) for s in range(3) for e in range(3) for r in range(2)}
    assert len(seeds) == 18 and all(0 <= s < 2**32 for s in seeds)


# --------------------------------------------------------------------------- torch (MONAI)
def torch_case(spatial=(12, 12, 10), seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    image, label = case(spatial, seed)
    return torch.from_numpy(np.moveaxis(image, -1, 0).copy()), torch.from_numpy(np.moveaxis(label, -1, 0).copy())


@pytest.mark.parametrize("name", sorted(GEOMETRIC))
def test_torch_geometric_transforms_keep_the_label_aligned(name):
    image, label = torch_case()
    augmenter = TorchAugmenter(spec(**GEOMETRIC[name]), (12, 12, 10), image_mode="nearest")
    moved = 0
    for epoch in range(4):
        augmenter.reseed(seed=1, epoch=epoch)
        out_image, out_label = augmenter(image, label)
        assert out_image.shape == image.shape and out_label.shape == label.shape
        expected = torch.from_numpy(np.moveaxis(label_of(np.moveaxis(out_image.numpy(), 0, -1)), -1, 0))
        assert torch.equal(out_label, expected)  # exactly: every voxel
        assert set(out_label.unique().tolist()) <= {0.0, 1.0}
        moved += not torch.equal(out_label, label)
    assert moved >= 3  # the transforms did move the voxels


def test_torch_bilinear_image_stays_close_to_the_nearest_label():
    """In training the image is interpolated: its threshold then agrees with the label nearly everywhere."""
    image, label = torch_case((16, 16, 16))
    augmenter = TorchAugmenter(spec(**GEOMETRIC["affine"]), (16, 16, 16))
    augmenter.reseed(seed=0, epoch=0)
    out_image, out_label = augmenter(image, label)
    expected = np.moveaxis(label_of(np.moveaxis(out_image.numpy(), 0, -1)), -1, 0)
    assert (expected == out_label.numpy()).mean() > 0.97


@pytest.mark.parametrize("name", sorted(INTENSITY))
def test_torch_intensity_transforms_leave_the_label(name):
    image, label = torch_case()
    augmenter = TorchAugmenter(spec(**INTENSITY[name]), (12, 12, 10))
    augmenter.reseed(seed=0, epoch=0)
    out_image, out_label = augmenter(image, label)
    assert torch.equal(out_label, label)
    assert not torch.equal(out_image, image)


def test_torch_same_seed_same_augmented_inputs():
    image, label = torch_case()
    recipe = dict(GEOMETRIC["all"], intensity_scale=0.5, noise=0.5)

    def run(seed: int, epoch: int, rank: int = 0) -> list[torch.Tensor]:
        augmenter = TorchAugmenter(spec(**recipe), (12, 12, 10))
        augmenter.reseed(seed, epoch, rank)
        return [t for _ in range(3) for t in augmenter(image, label)]

    first, again = run(3, 1), run(3, 1)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    for other in (run(3, 2), run(4, 1), run(3, 1, rank=1)):
        assert not all(torch.equal(a, b) for a, b in zip(first, other))


def test_torch_rejects_inputs_of_another_size():
    image, label = torch_case((8, 8, 8))
    with pytest.raises(ValueError, match=r"built for inputs of \[12, 12, 10\]"):
        TorchAugmenter(spec(flip=1.0), (12, 12, 10))(image, label)


# --------------------------------------------------------------------------- TensorFlow (graph ops)
def tf_apply(fields: dict, image: np.ndarray, label: np.ndarray, draw: int, *, mode: str = "nearest", seed: int = 0):
    import tensorflow as tf

    from distmis.data.augment_tf import augmenter

    apply = tf.function(augmenter(tf, spec(**fields), image.shape[:3], seed, image_mode=mode))
    out_image, out_label = apply(tf.constant(image), tf.constant(label), tf.constant(draw, tf.int64))
    return out_image.numpy(), out_label.numpy()


@pytest.mark.parametrize("name", sorted(GEOMETRIC))
def test_tf_geometric_transforms_keep_the_label_aligned(name):
    image, label = case()
    moved = 0
    for draw in range(4):
        out_image, out_label = tf_apply(GEOMETRIC[name], image, label, draw)
        assert out_image.shape == image.shape and out_label.shape == label.shape
        np.testing.assert_array_equal(out_label, label_of(out_image))  # exactly: every voxel
        moved += not np.array_equal(out_label, label)
    assert moved >= 3


def test_tf_flips_and_rotations_move_voxels_as_numpy_does():
    image, label = case((8, 8, 8))
    out_image, out_label = tf_apply(dict(NONE, rotate90=1.0), image, label, draw=5)
    candidates = [image]  # any composition of quarter turns in the three planes
    for plane in rotate90_planes((8, 8, 8)):
        candidates = [np.rot90(c, k, axes=plane) for c in candidates for k in range(4)]
    assert any(np.array_equal(out_image, c) for c in candidates)
    flipped, _ = tf_apply(dict(NONE, flip=1.0), image, label, draw=0)
    np.testing.assert_array_equal(flipped, image[::-1, ::-1, ::-1])


def test_tf_linear_image_stays_close_to_the_nearest_label():
    image, label = case((16, 16, 16))
    out_image, out_label = tf_apply(GEOMETRIC["affine"], image, label, draw=1, mode="linear")
    assert (label_of(out_image) == out_label).mean() > 0.97
    # trilinear interpolation at the voxels themselves gives the voxels back (the identity map)
    same, _ = tf_apply(dict(NONE, affine=1.0, rotate_degrees=0.0, scale_range=0.0), image, label, draw=1, mode="linear")
    np.testing.assert_allclose(same, image, atol=1e-5)


@pytest.mark.parametrize("name", sorted(INTENSITY))
def test_tf_intensity_transforms_leave_the_label(name):
    image, label = case()
    out_image, out_label = tf_apply(INTENSITY[name], image, label, draw=0)
    np.testing.assert_array_equal(out_label, label)
    assert not np.array_equal(out_image, image)
