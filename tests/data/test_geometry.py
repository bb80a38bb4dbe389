"""Intensities and geometry of the preprocessing (distmis.pyfunc_model): CT and MRI normalisation, reorientation,
resampling to a spacing, and every step undone on a prediction."""

from __future__ import annotations

import numpy as np
import pytest

from distmis import pyfunc_model as pm
from distmis.data.preprocess import PreprocessConfig, preprocess_case


def test_ct_normalisation_equals_a_hand_computation():
    rng = np.random.default_rng(0)
    image = rng.normal(40, 300, (6, 5, 4, 1))
    scheme = {"scheme": "ct", "lower": -150.0, "upper": 250.0, "mean": 60.0, "std": 35.0}
    out = pm.normalize_channels(image, [scheme])
    by_hand = (np.minimum(np.maximum(image, -150.0), 250.0) - 60.0) / 35.0
    np.testing.assert_allclose(out, by_hand, atol=1e-6)
    assert out.dtype == np.float32


def test_mri_zscore_is_unchanged_and_channels_take_their_own_schemes():
    rng = np.random.default_rng(1)
    image = rng.uniform(0, 500, (5, 5, 5, 2)).astype(np.float32)
    image[0] = 0
    np.testing.assert_array_equal(pm.normalize_channels(image, None), pm.zscore_nonzero(image))
    mixed = pm.normalize_channels(image, [{"scheme": "zscore"},
                                          {"scheme": "ct", "lower": 0, "upper": 100, "mean": 50, "std": 10}])
    np.testing.assert_array_equal(mixed[..., :1], pm.zscore_nonzero(image[..., :1]))
    np.testing.assert_allclose(mixed[..., 1], (np.clip(image[..., 1], 0, 100) - 50) / 10, atol=1e-6)


@pytest.mark.parametrize("source", ["LPS", "RAS", "ASL", "PIR"])
def test_reorientation_points_the_axes_to_ras_and_back(source):
    array = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    out = pm.reorient(array, source, "RAS")
    np.testing.assert_array_equal(pm.reorient(out, "RAS", source), array)
    # a voxel at the R, A, S end of each source axis lands at the high end of the RAS axes
    codes = {"R": "L", "A": "P", "S": "I"}
    assert sorted(out.shape) == sorted(array.shape)
    if source == "LPS":
        np.testing.assert_array_equal(out, array[::-1, ::-1, :])
    assert pm.reoriented_spacing((1.0, 2.0, 3.0), source, "RAS") == tuple(
        (1.0, 2.0, 3.0)[next(i for i, c in enumerate(source) if c in pair)] for pair in ("RL", "AP", "SI"))
    assert codes  # the mapping above is what the assertion on LPS spells out


def test_bad_axis_codes_are_refused():
    with pytest.raises(ValueError, match="one of R/L, A/P and S/I"):
        pm.reorient(np.zeros((2, 2, 2)), "RRS", "RAS")


def test_resampled_shape_keeps_the_field_of_view():
    assert pm.resampled_shape((100, 100, 40), (0.8, 0.8, 2.5), (1.0, 1.0, 1.0)) == (80, 80, 100)
    assert pm.resampled_shape((3, 3, 3), (0.1, 0.1, 0.1), (1.0, 1.0, 1.0)) == (1, 1, 1)


def test_an_anisotropic_grid_has_its_coarse_axis_resampled_apart():
    """nnU-Net's rule: the scan's own spacing decides first, then the target's; anisotropy over 3 with one coarsest
    axis."""
    assert pm.separate_axis((0.8, 0.8, 5.0), (1.0, 1.0, 1.0)) == 2
    assert pm.separate_axis((1.0, 1.0, 1.0), (0.7, 3.0, 0.7)) == 1  # the target's
    assert pm.separate_axis((1.0, 1.0, 2.9), (1.0, 1.0, 2.9)) is None  # under the threshold
    assert pm.separate_axis((4.0, 4.0, 1.0), None) is None  # two equally coarse axes
    # slices of distinct values along the coarse axis: resampled apart, no slice is a blend of two
    slices = np.broadcast_to(np.arange(1, 7, dtype=np.float32), (8, 8, 6)).copy()
    apart = pm.resample(slices, (12, 12, 15), order=1, axis=2)
    assert apart.shape == (12, 12, 15) and set(np.unique(apart)) <= set(range(1, 7))
    blended = pm.resample(slices, (12, 12, 15), order=1, axis=None)
    assert not set(np.unique(blended)) <= set(range(1, 7))
    # across the other axes it interpolates at the order given
    ramp = np.broadcast_to(np.arange(8, dtype=np.float32)[:, None, None], (8, 8, 6)).copy()
    assert len(np.unique(pm.resample(ramp, (15, 8, 6), order=1, axis=2))) > 8
    geometry = pm.preprocess_geometry((40, 40, 10), {"spacing": [1.0, 1.0, 1.0]}, (0.8, 0.8, 4.0))
    assert geometry["separate_axis"] == 2 and geometry["resampled"] == [32, 32, 40]


def _blobs(shape: tuple[int, int, int]) -> np.ndarray:
    """A label map with three organ-like ellipsoids, values 1, 2 and 5."""
    grid = np.stack(np.meshgrid(*[np.linspace(-1, 1, n) for n in shape], indexing="ij"), -1)
    label = np.zeros(shape, np.int16)
    for value, centre, radii in ((1, (-0.3, 0.0, 0.0), (0.5, 0.6, 0.6)), (2, (0.45, 0.3, 0.1), (0.3, 0.3, 0.45)),
                                 (5, (0.45, -0.45, -0.2), (0.25, 0.25, 0.4))):
        label[(((grid - centre) / radii) ** 2).sum(-1) <= 1] = value
    return label


def test_labels_go_through_the_preprocessing_and_back_to_their_own_grid():
    label = _blobs((64, 56, 22))  # anisotropic: 0.8 x 0.9 x 2.5 mm, stored LPS
    spacing, axcodes = (0.8, 0.9, 2.5), "LPS"
    targets = {"mode": "classes", "activation": "softmax",
               "channels": [{"name": n, "key": n, "values": [v], "paint": v}
                            for n, v in (("background", 0), ("a", 1), ("b", 2), ("c", 5))]}
    config = PreprocessConfig(layout="msd", labels="classes", channels=("CT",), orientation="RAS",
                              spacing=(1.1, 1.0, 1.6), crop=(48, 48, 40), targets=targets)
    image = np.random.default_rng(0).normal(0, 1, label.shape + (1,)).astype(np.float32)
    prepared, target = preprocess_case(image, label, config, spacing, axcodes)
    assert prepared.shape == (48, 48, 40, 1) and target.shape == (48, 48, 40, 4)
    assert pm.preprocess_geometry(label.shape, config.to_dict(), spacing, axcodes)["resampled"] == [47, 50, 34]
    recipe = config.to_dict()
    geometry = pm.preprocess_geometry(label.shape, recipe, spacing, axcodes)
    restored = pm.restore_probabilities(target.astype(np.float32), recipe, geometry)
    assert restored.shape == label.shape + (4,)
    back = pm.probabilities_to_labels(restored, targets)
    for value in (1, 2, 5):
        a, b = back == value, label == value
        assert 2 * (a & b).sum() / (a.sum() + b.sum()) >= 0.95, value


def test_synthetic_ct_labels_survive_the_preprocessing_at_the_median_spacing_and_back(tmp_path):
    """The issue's round trip: anisotropic spacings that differ between cases, one case stored LPS; with
    ``spacing: auto`` (the median spacing) and RAS, each label preprocessed and restored matches itself."""
    from distmis.data.dataset_layouts import describe_dataset
    from distmis.data.layouts import discover_cases, read_case
    from distmis.data.layouts import case_orientation
    from distmis.data.statistics import median_spacing
    from distmis.data.synthetic import synthesize_dataset
    from distmis.data.targets import target_scheme

    root = tmp_path / "ct"
    synthesize_dataset(root, "nnunet", cases=4, shape=(128, 128, 64), seed=3, kind="ct", lps_cases=1, progress=False)
    description = describe_dataset(root, "nnunet")
    cases = discover_cases(root, "nnunet")
    assert sorted(case_orientation(c) for c in cases) == ["LPS", "RAS", "RAS", "RAS"]
    spacing = median_spacing(cases, "RAS")
    targets = target_scheme(description, "classes")
    config = PreprocessConfig(layout="nnunet", labels="classes", channels=description.channels, orientation="RAS",
                              spacing=spacing, targets=targets)
    recipe = config.to_dict()
    seen_spacings = set()
    for case in cases:
        image, label, case_spacing = read_case(case, description)
        seen_spacings.add(tuple(round(s, 3) for s in case_spacing))
        assert max(case_spacing) / min(case_spacing) > 1.4  # anisotropic
        axcodes = case_orientation(case)
        _, onehot = preprocess_case(image, label, config, case_spacing, axcodes)
        geometry = pm.preprocess_geometry(label.shape, recipe, case_spacing, axcodes)
        assert onehot.shape[:3] == tuple(geometry["resampled"]) != label.shape
        back = pm.probabilities_to_labels(pm.restore_probabilities(onehot.astype(np.float32), recipe, geometry),
                                          targets)
        assert back.shape == label.shape
        for value in (1, 2, 3):
            a, b = back == value, label == value
            assert b.any() and 2 * (a & b).sum() / (a.sum() + b.sum()) >= 0.95, (case.case_id, value)
    assert len(seen_spacings) == len(cases)  # every case has its own spacing


def test_a_scan_cropped_to_its_non_zero_region_keeps_its_labels_and_comes_back_in_place():
    """``crop_to_nonzero``: a skull-stripped MRI-like scan (zero outside an off-centre head) is cropped to the head
    before resampling, the centre crop then centres the head in the network's shape, and every step, the box
    included, is undone on the prediction: the labels land where they were, background outside the box."""
    shape, spacing, axcodes = (70, 60, 30), (1.0, 1.0, 2.0), "LPS"
    label = np.zeros(shape, np.int16)
    label[14:54, 4:44, 12:28] = _blobs((40, 40, 16))
    image = np.zeros(shape + (2,), np.float32)
    rng = np.random.default_rng(2)
    image[10:58, 2:48, 10:30] = rng.uniform(1, 100, (48, 46, 20, 2))  # the head: off-centre, touching the top slice
    targets = {"mode": "classes", "activation": "softmax",
               "channels": [{"name": n, "key": n, "values": [v], "paint": v}
                            for n, v in (("background", 0), ("a", 1), ("b", 2), ("c", 5))]}
    config = PreprocessConfig(layout="msd", labels="classes", channels=("T1", "T2"), orientation="RAS",
                              spacing=(1.0, 1.0, 1.0), crop=(48, 48, 40), crop_to_nonzero=True, targets=targets)
    recipe = config.to_dict()
    prepared, onehot = preprocess_case(image, label, config, spacing, axcodes)
    assert prepared.shape == (48, 48, 40, 2) and onehot.shape == (48, 48, 40, 4)
    geometry = pm.preprocess_geometry(shape, recipe, spacing, axcodes, pm.nonzero_box(image))
    assert geometry["box"] == [[10, 58], [2, 48], [10, 30]] and geometry["resampled"] == [48, 46, 40]
    # the head fills the network's input: no voxel of it was cut, and the padding is the 2 columns 46 -> 48
    assert np.count_nonzero(np.any(prepared != 0, axis=-1)) == 48 * 46 * 40
    assert pm.prepare_image(image, recipe, spacing, axcodes)[1] == geometry
    # every label voxel survives the crop, and a prediction equal to the targets comes back onto the labels
    back = pm.probabilities_to_labels(pm.restore_probabilities(onehot.astype(np.float32), recipe, geometry), targets)
    assert back.shape == shape
    np.testing.assert_array_equal(back, label)
    # without it, the same centre crop cuts into the off-centre head
    plain = PreprocessConfig(layout="msd", labels="classes", channels=("T1", "T2"), orientation="RAS",
                             spacing=(1.0, 1.0, 1.0), crop=(48, 48, 40), targets=targets)
    assert np.count_nonzero(np.any(preprocess_case(image, label, plain, spacing, axcodes)[0] != 0, axis=-1)) \
        < 48 * 46 * 40


def test_a_nonzero_crop_without_a_common_shape_is_refused():
    with pytest.raises(ValueError, match="crop_to_nonzero needs crop"):
        PreprocessConfig(layout="msd", crop_to_nonzero=True)
