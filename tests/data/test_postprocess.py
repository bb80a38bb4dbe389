"""Undoing preprocessing: a prediction on the network's grid goes back voxel for voxel onto the scan's grid."""

from __future__ import annotations

import numpy as np
import pytest

from distmis.data.dataset_layouts import layout_description
from distmis.data.layouts import Layout
from distmis.data.postprocess import restore_geometry, target_to_labels
from distmis.data.preprocess import PreprocessConfig, center_crop_or_pad, labels_to_target, preprocess_case, resize


def coordinates(shape: tuple[int, int, int]) -> np.ndarray:
    """A float volume whose every voxel holds a distinct value (its flat index + 1), channels-last."""
    return (np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + 1)[..., None]


@pytest.mark.parametrize("shape,crop", [
    ((23, 19, 17), (16, 24, 17)),  # crop one odd axis, pad another, keep the third
    ((20, 21, 9), (11, 21, 14)),   # odd differences both ways
    ((8, 8, 8), (8, 8, 8)),
])
def test_a_crop_and_pad_is_undone_voxel_for_voxel(shape, crop):
    config = PreprocessConfig(layout="msd", crop=crop)
    volume = coordinates(shape)
    restored = restore_geometry(center_crop_or_pad(volume, crop), shape, config)
    assert restored.shape == shape + (1,)
    kept = restored[..., 0] > 0
    # every voxel the crop kept is back where it came from; the ones it cut away are 0
    np.testing.assert_array_equal(restored[kept], volume[kept])
    expected_kept = [min(s, c) for s, c in zip(shape, crop)]
    assert kept.sum() == np.prod(expected_kept)
    start = [(s - c) // 2 if s > c else 0 for s, c in zip(shape, crop)]
    box = tuple(slice(b, b + n) for b, n in zip(start, expected_kept))
    assert kept[box].all()


def test_a_resize_is_undone_to_the_cropped_shape_then_the_crop():
    shape, crop, size = (31, 27, 19), (24, 24, 24), (16, 16, 16)
    config = PreprocessConfig(layout="msd", crop=crop, resize=size)
    sphere = np.zeros(shape, dtype=np.float32)
    grid = np.indices(shape)
    sphere[((grid - np.array([15, 13, 9])[:, None, None, None]) ** 2).sum(0) <= 6 ** 2] = 1
    network_grid = resize(center_crop_or_pad(sphere[..., None], crop), size, order=1)
    restored = restore_geometry(network_grid, shape, config)
    assert restored.shape == shape + (1,)
    found = restored[..., 0] >= 0.5
    dice = 2 * (found & (sphere > 0)).sum() / (found.sum() + sphere.sum())
    assert dice > 0.9


def test_restore_geometry_refuses_a_prediction_of_another_grid():
    config = PreprocessConfig(layout="msd", resize=(16, 16, 16))
    with pytest.raises(ValueError, match=r"preprocessing .* gives \[16, 16, 16\]"):
        restore_geometry(np.zeros((8, 8, 8, 1), np.float32), (20, 20, 20), config)


@pytest.mark.parametrize("layout", [l for l in Layout if l is not Layout.NNUNET])  # the brain-tumour layouts
def test_regions_go_back_to_the_layouts_own_label_values(layout):
    rng = np.random.default_rng(0)
    labels = rng.choice(layout_description(layout).label_values, size=(9, 7, 5)).astype(np.int16)
    target = labels_to_target(labels, layout, "regions")
    np.testing.assert_array_equal(target_to_labels(target, layout, "regions"), labels)
    whole = target_to_labels(labels_to_target(labels, layout, "whole-tumour"), layout, "whole-tumour")
    np.testing.assert_array_equal(whole, (labels > 0).astype(np.uint8))


def test_nesting_is_imposed_from_the_enhancing_tumour_outwards():
    target = np.zeros((1, 1, 3, 3), dtype=bool)
    target[0, 0, 0] = [False, False, True]  # enhancing only: still enhancing tumour
    target[0, 0, 1] = [False, True, False]  # core without whole tumour: core
    target[0, 0, 2] = [True, False, False]  # whole tumour only: edema
    assert target_to_labels(target, "brats", "regions").ravel().tolist() == [4, 1, 2]
    assert target_to_labels(target, "msd", "regions").ravel().tolist() == [3, 2, 1]


def test_preprocess_then_restore_keeps_the_label_of_a_cropped_padded_resized_case():
    shape = (29, 23, 15)
    image = np.zeros(shape + (4,), dtype=np.float32)
    image[3:26, 2:21, 1:14] = 1.0
    label = np.zeros(shape, dtype=np.int16)
    label[10:20, 8:16, 4:11] = 3
    config = PreprocessConfig(layout="msd", labels="regions", crop=(24, 24, 16), resize=(16, 16, 16))
    _, target = preprocess_case(image, label, config)
    restored = target_to_labels(restore_geometry(target.astype(np.float32), shape, config) >= 0.5, "msd", "regions")
    assert restored.shape == shape
    truth = label == 3
    dice = 2 * ((restored == 3) & truth).sum() / ((restored == 3).sum() + truth.sum())
    assert dice > 0.85
