from __future__ import annotations

import numpy as np
import pytest

from distmis.data import (
    LabelMode, Layout, PreprocessConfig, center_crop_or_pad, labels_to_target, preprocess_case, resize, zscore_nonzero,
)


def test_zscore_over_nonzero_voxels_only():
    rng = np.random.default_rng(0)
    image = np.zeros((8, 8, 8, 2), np.float32)
    image[2:6, 2:6, 2:6, 0] = rng.normal(500, 40, (4, 4, 4))
    image[2:6, 2:6, 2:6, 1] = 7.0  # constant inside the brain
    out = zscore_nonzero(image)
    brain = out[2:6, 2:6, 2:6, 0]
    assert brain.mean() == pytest.approx(0, abs=1e-5) and brain.std() == pytest.approx(1, abs=1e-4)
    assert (out[image[..., 0] == 0, 0] == 0).all()  # background stays 0
    assert np.isfinite(out).all() and (out[..., 1] == 0).all()


def test_crop_and_pad():
    a = np.arange(10 * 6 * 4).reshape(10, 6, 4)
    out = center_crop_or_pad(a, (6, 8, 4))
    assert out.shape == (6, 8, 4)
    np.testing.assert_array_equal(out[:, 1:7, :], a[2:8])  # cropped 2 each side of H, padded 1 each side of W
    assert (out[:, 0] == 0).all() and (out[:, 7] == 0).all()
    assert center_crop_or_pad(np.ones((4, 4, 4, 3)), (2, 2, 2)).shape == (2, 2, 2, 3)


def test_resize_shapes_and_nearest_labels():
    label = np.zeros((8, 8, 8), np.int16)
    label[:4] = 2
    out = resize(label, (4, 16, 5), order=0)
    assert out.shape == (4, 16, 5) and set(np.unique(out)) == {0, 2}
    assert resize(np.ones((8, 8, 8, 4), np.float32), (5, 6, 7), order=1).shape == (5, 6, 7, 4)


@pytest.mark.parametrize(
    "layout, values",
    [("msd", {"edema": 1, "core": 2, "enhancing": 3}), ("brats", {"edema": 2, "core": 1, "enhancing": 4})],
)
def test_label_mapping(layout, values):
    label = np.zeros((4, 1, 1), np.int16)
    label[1, 0, 0], label[2, 0, 0], label[3, 0, 0] = values["edema"], values["core"], values["enhancing"]
    whole = labels_to_target(label, layout, "whole-tumour")
    assert whole.shape == (4, 1, 1, 1) and whole.dtype == np.uint8
    np.testing.assert_array_equal(whole[:, 0, 0, 0], [0, 1, 1, 1])
    regions = labels_to_target(label, layout, "regions")[:, 0, 0]
    np.testing.assert_array_equal(regions[:, 0], [0, 1, 1, 1])  # WT
    np.testing.assert_array_equal(regions[:, 1], [0, 0, 1, 1])  # TC: core + enhancing
    np.testing.assert_array_equal(regions[:, 2], [0, 0, 0, 1])  # ET


def test_label_value_outside_layout():
    with pytest.raises(ValueError, match=r"\[4\].*'msd'"):
        labels_to_target(np.full((2, 2, 2), 4, np.int16), "msd", "regions")


def test_preprocess_case_pipeline_and_config_round_trip():
    rng = np.random.default_rng(1)
    image = rng.uniform(1, 100, (10, 12, 8, 4)).astype(np.float32)
    label = np.zeros((10, 12, 8), np.int16)
    label[2:8, 3:10, 2:7] = 3
    config = PreprocessConfig(layout=Layout.MSD, labels=LabelMode.REGIONS, crop=(8, 8, 8), resize=(4, 4, 4))
    out_image, target = preprocess_case(image, label, config)
    assert out_image.shape == (4, 4, 4, 4) and out_image.dtype == np.float32
    assert target.shape == (4, 4, 4, 3) and target.dtype == np.uint8 and target.max() == 1
    assert config.num_classes == 3
    assert PreprocessConfig.from_dict(config.to_dict()) == config
