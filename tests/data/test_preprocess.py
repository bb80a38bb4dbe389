"""Tests for distmis.data.preprocess."""

from __future__ import annotations

import json

import numpy as np
import pytest

from distmis.data import (
    LabelMode,
    Layout,
    PreprocessConfig,
    center_crop_or_pad,
    labels_to_target,
    preprocess_case,
    preprocessed_shape,
    resize,
    zscore_nonzero,
)

# --------------------------------------------------------------------------- z-score


def test_zscore_over_nonzero_voxels() -> None:
    rng = np.random.default_rng(0)
    image = np.zeros((10, 12, 8, 4), np.float32)
    image[2:8, 3:9, 1:7] = rng.normal([100, 300, 50, 1000], [10, 40, 5, 200], size=(6, 6, 6, 4))
    out = zscore_nonzero(image)
    assert out.dtype == np.float32 and out.shape == image.shape
    for c in range(4):
        brain = image[..., c] != 0
        assert out[..., c][brain].mean() == pytest.approx(0.0, abs=1e-5)
        assert out[..., c][brain].std() == pytest.approx(1.0, abs=1e-4)
        assert np.all(out[..., c][~brain] == 0)
        expected = (image[..., c][brain] - image[..., c][brain].mean()) / image[..., c][brain].std()
        np.testing.assert_allclose(out[..., c][brain], expected, rtol=1e-4, atol=1e-5)


def test_zscore_masks_each_channel_separately() -> None:
    image = np.zeros((2, 2, 2, 2), np.float32)
    image[0, ..., 0] = [[1, 3], [1, 3]]  # channel 0 non-zero on half the voxels
    image[..., 1] = 5.0
    image[1, 1, 1, 1] = 7.0
    out = zscore_nonzero(image)
    np.testing.assert_allclose(out[0, ..., 0], [[-1, 1], [-1, 1]])
    assert np.all(out[1, ..., 0] == 0)
    assert out[1, 1, 1, 1] == pytest.approx((7 - 42 / 8) / np.std([5] * 7 + [7]))


def test_zscore_constant_and_empty_channels_are_safe() -> None:
    image = np.zeros((4, 4, 4, 3), np.float32)
    image[1:3, 1:3, 1:3, 0] = 42.0  # constant brain
    image[..., 2] = np.arange(64).reshape(4, 4, 4)  # channel 1 stays all zero
    out = zscore_nonzero(image)
    assert np.isfinite(out).all()
    assert np.all(out[..., :2] == 0)
    assert out[..., 2][image[..., 2] != 0].std() == pytest.approx(1.0, abs=1e-5)


def test_zscore_needs_channels() -> None:
    with pytest.raises(ValueError, match="H, W, D, C"):
        zscore_nonzero(np.ones((4, 4, 4)))


# --------------------------------------------------------------------------- crop / pad / resize


def test_center_crop() -> None:
    array = np.arange(10 * 9 * 8).reshape(10, 9, 8)
    out = center_crop_or_pad(array, (6, 5, 8))
    assert out.shape == (6, 5, 8)
    np.testing.assert_array_equal(out, array[2:8, 2:7, :])


def test_center_pad_symmetric_and_channels_untouched() -> None:
    array = np.ones((3, 4, 5, 2), np.float32)
    out = center_crop_or_pad(array, (7, 4, 6))
    assert out.shape == (7, 4, 6, 2) and out.dtype == np.float32
    assert out[2:5, :, 0:5].all() and out.sum() == array.sum()  # 2 before / 2 after, 0 before / 1 after
    assert not out[:2].any() and not out[5:].any() and not out[:, :, 5].any()


def test_crop_and_pad_mixed_axes() -> None:
    array = np.arange(6 * 2 * 4, dtype=np.int16).reshape(6, 2, 4)
    out = center_crop_or_pad(array, (4, 4, 4))
    assert out.shape == (4, 4, 4) and out.dtype == np.int16
    np.testing.assert_array_equal(out[:, 1:3, :], array[1:5])


def test_crop_rejects_bad_shape() -> None:
    with pytest.raises(ValueError, match="3 positive integers"):
        center_crop_or_pad(np.ones((4, 4, 4)), (4, 4))
    with pytest.raises(ValueError, match="3 positive integers"):
        center_crop_or_pad(np.ones((4, 4, 4)), (4, 0, 4))


@pytest.mark.parametrize("target", [(32, 32, 16), (8, 5, 3), (17, 23, 9)])
def test_resize_shapes(target: tuple[int, int, int]) -> None:
    image = np.random.default_rng(0).random((17, 23, 9, 4)).astype(np.float32)
    out = resize(image, target, order=1)
    assert out.shape == target + (4,) and out.dtype == np.float32


def test_resize_channels_independent_and_labels_nearest() -> None:
    image = np.zeros((8, 8, 8, 2), np.float32)
    image[..., 1] = 3.0
    out = resize(image, (12, 4, 16), order=1)
    assert np.all(out[..., 0] == 0) and np.allclose(out[..., 1], 3.0)
    label = np.zeros((8, 8, 8), np.int16)
    label[2:6, 2:6, 2:6] = 4
    label[3:5, 3:5, 3:5] = 1
    small = resize(label, (16, 16, 16), order=0)
    assert small.dtype == np.int16 and set(np.unique(small)) == {0, 1, 4}
    assert (small == 4).sum() + (small == 1).sum() == pytest.approx(8 * 64, rel=0.3)


def test_resize_same_shape_is_identity() -> None:
    array = np.random.default_rng(0).random((5, 6, 7, 4)).astype(np.float32)
    np.testing.assert_array_equal(resize(array, (5, 6, 7), order=1), array)


# --------------------------------------------------------------------------- labels

MSD_LABEL = np.array([0, 1, 2, 3], dtype=np.int16).reshape(1, 1, 4)
BRATS_LABEL = np.array([0, 1, 2, 4], dtype=np.int16).reshape(1, 1, 4)
BRATS2023_LABEL = np.array([0, 1, 2, 3], dtype=np.int16).reshape(1, 1, 4)


@pytest.mark.parametrize("layout, label", [("msd", MSD_LABEL), ("brats", BRATS_LABEL), ("brats2023", BRATS2023_LABEL)])
def test_whole_tumour(layout: str, label: np.ndarray) -> None:
    out = labels_to_target(label, layout, "whole-tumour")
    assert out.dtype == np.uint8 and out.shape == (1, 1, 4, 1)
    np.testing.assert_array_equal(out[0, 0, :, 0], [0, 1, 1, 1])


def test_regions_msd() -> None:
    out = labels_to_target(MSD_LABEL, Layout.MSD, LabelMode.REGIONS)
    assert out.dtype == np.uint8 and out.shape == (1, 1, 4, 3)
    # rows: background, edema, non-enhancing, enhancing; columns: WT, TC, ET
    np.testing.assert_array_equal(out[0, 0], [[0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]])


def test_regions_brats() -> None:
    out = labels_to_target(BRATS_LABEL, "brats", "regions")
    # rows: background, necrotic core, edema, enhancing; columns: WT, TC, ET
    np.testing.assert_array_equal(out[0, 0], [[0, 0, 0], [1, 1, 0], [1, 0, 0], [1, 1, 1]])


def test_regions_brats2023() -> None:
    out = labels_to_target(BRATS2023_LABEL, Layout.BRATS2023, "regions")
    assert out.dtype == np.uint8 and out.shape == (1, 1, 4, 3)
    # rows: background, necrotic core (NCR), edema (ED), enhancing (ET); columns: WT, TC, ET
    np.testing.assert_array_equal(out[0, 0], [[0, 0, 0], [1, 1, 0], [1, 0, 0], [1, 1, 1]])


def test_regions_agree_between_brats_layouts() -> None:
    """BraTS 2023 relabelled enhancing tumour from 4 to 3; the regions of a case do not change."""
    label = np.random.default_rng(0).choice(np.array([0, 1, 2, 4], np.int16), size=(5, 4, 3))
    relabelled = np.where(label == 4, 3, label).astype(np.int16)
    np.testing.assert_array_equal(labels_to_target(label, "brats", "regions"),
                                  labels_to_target(relabelled, "brats2023", "regions"))


def test_labels_rejects_values_of_the_other_layout() -> None:
    with pytest.raises(ValueError, match=r"\[3\].*brats"):
        labels_to_target(MSD_LABEL, "brats", "regions")
    with pytest.raises(ValueError, match=r"\[4\].*msd"):
        labels_to_target(BRATS_LABEL, "msd", "whole-tumour")
    with pytest.raises(ValueError, match=r"\[4\].*brats2023"):
        labels_to_target(BRATS_LABEL, "brats2023", "regions")
    with pytest.raises(ValueError, match="label mode"):
        labels_to_target(MSD_LABEL, "msd", "binary")


# --------------------------------------------------------------------------- config and pipeline


def test_config_coerces_and_round_trips() -> None:
    config = PreprocessConfig(layout="brats", labels="regions", crop=[16, 16, 12], resize=(8, 8, 8))
    assert config.layout is Layout.BRATS and config.labels is LabelMode.REGIONS
    assert config.crop == (16, 16, 12) and config.num_classes == 3
    data = json.loads(json.dumps(config.to_dict()))
    assert {k: data[k] for k in ("layout", "labels", "crop", "resize")} == {
        "layout": "brats", "labels": "regions", "crop": [16, 16, 12], "resize": [8, 8, 8]}
    assert [c["name"] for c in data["targets"]["channels"]] == ["WT", "TC", "ET"]
    assert data["normalization"] is None and data["spacing"] is None and data["orientation"] is None
    assert PreprocessConfig.from_dict(data) == config
    default = PreprocessConfig(layout=Layout.MSD)
    assert default.num_classes == 1 and default.crop is None and default.resize is None
    assert PreprocessConfig.from_dict(default.to_dict()) == default
    brats2023 = PreprocessConfig(layout="brats2023", labels="regions")
    assert brats2023.layout is Layout.BRATS2023 and PreprocessConfig.from_dict(brats2023.to_dict()) == brats2023


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="unknown layout"):
        PreprocessConfig(layout="nifti")
    with pytest.raises(ValueError, match="PreprocessConfig.crop"):
        PreprocessConfig(layout="msd", crop=(16, 16))
    with pytest.raises(ValueError, match=r"unknown PreprocessConfig field\(s\) \['spacings'\]"):
        PreprocessConfig.from_dict({"layout": "msd", "spacings": [1, 1, 1]})


def test_preprocess_case_is_zscore_then_crop_then_resize() -> None:
    rng = np.random.default_rng(3)
    image = np.zeros((20, 18, 14, 4), np.float32)
    image[3:17, 3:15, 2:12] = rng.uniform(10, 100, (14, 12, 10, 4))
    label = np.zeros((20, 18, 14), np.int16)
    label[6:14, 5:13, 3:11] = 2
    label[8:12, 7:11, 5:9] = 4
    config = PreprocessConfig(layout="brats", labels="regions", crop=(16, 16, 16), resize=(8, 8, 8))
    out_image, out_target = preprocess_case(image, label, config)
    assert out_image.shape == (8, 8, 8, 4) and out_image.dtype == np.float32
    assert out_target.shape == (8, 8, 8, 3) and out_target.dtype == np.uint8
    expected_image = resize(center_crop_or_pad(zscore_nonzero(image), (16, 16, 16)), (8, 8, 8), order=1)
    expected_label = resize(center_crop_or_pad(label, (16, 16, 16)), (8, 8, 8), order=0)
    np.testing.assert_array_equal(out_image, expected_image)
    np.testing.assert_array_equal(out_target, labels_to_target(expected_label, "brats", "regions"))
    assert out_target[..., 0].any() and out_target[..., 2].any()


def test_preprocess_case_without_geometry_keeps_shape() -> None:
    image = np.ones((6, 6, 6, 4), np.float32)
    label = np.zeros((6, 6, 6), np.int16)
    out_image, out_target = preprocess_case(image, label, PreprocessConfig(layout="msd"))
    assert out_image.shape == (6, 6, 6, 4) and out_target.shape == (6, 6, 6, 1)
    with pytest.raises(ValueError, match="does not match"):
        preprocess_case(image, label[:5], PreprocessConfig(layout="msd"))


@pytest.mark.parametrize(
    "crop, resize_to",
    [(None, None), ((16, 16, 16), None), (None, (8, 12, 6)), ((16, 8, 20), (8, 8, 8)), ((8, 30, 10), None)],
)
def test_preprocessed_shape_is_what_preprocess_case_gives(crop, resize_to) -> None:
    image = np.ones((20, 18, 14, 4), np.float32)
    label = np.zeros((20, 18, 14), np.int16)
    config = PreprocessConfig(layout="msd", crop=crop, resize=resize_to)
    out_image, out_target = preprocess_case(image, label, config)
    assert preprocessed_shape((20, 18, 14), config) == out_image.shape[:3] == out_target.shape[:3]
    assert preprocessed_shape((20, 18, 14, 4), config) == out_image.shape[:3]  # an MSD header's 4-D shape


def test_preprocessed_shape_rejects_a_bad_shape() -> None:
    with pytest.raises(ValueError, match="image spatial shape must be 3 positive integers"):
        preprocessed_shape((20, 18), PreprocessConfig(layout="msd"))
