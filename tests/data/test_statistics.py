"""What the preprocessing learns once from the training split: CT intensity statistics and the median spacing; and
the CT normalisation the TFRecords hold, against a hand computation from the raw NIfTI files."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from distmis.data.dataset_layouts import describe_dataset
from distmis.data.errors import DataError
from distmis.data.layouts import discover_cases
from distmis.data.split import make_split
from distmis.data.statistics import ct_statistics, median_spacing
from distmis.data.synthetic import synthesize_dataset
from distmis.data.tfrecord import convert_to_tfrecords, iter_cases
from distmis.search.data_config import preprocess_config, with_statistics
from distmis.spec.schema import DatasetSpec


@pytest.fixture(scope="module")
def ct_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ct") / "data"
    synthesize_dataset(root, "msd", cases=6, shape=(24, 24, 16), seed=5, kind="ct", progress=False)
    return root


def raw(path: Path) -> np.ndarray:
    return np.asarray(nib.load(str(path)).dataobj, dtype=np.float64)


def test_the_ct_normalisation_of_the_tfrecords_equals_a_hand_computation(ct_root: Path, tmp_path: Path):
    cases = discover_cases(ct_root, "msd")
    split = make_split([c.case_id for c in cases], train=0.5, val=0.25, test=0.25, seed=0)
    dataset = DatasetSpec(path=str(ct_root), layout="msd", labels="classes")
    description = describe_dataset(ct_root, "msd")
    config = preprocess_config(dataset, description, cases, split)
    assert [n["scheme"] for n in config.normalization] == ["ct"]  # by the channel's name, CT
    config = with_statistics(config, cases, split, description)

    # by hand, from the files: the training cases' foreground voxels
    by_id = {c.case_id: c for c in cases}
    foreground = np.concatenate([raw(by_id[i].images[0])[raw(by_id[i].label) > 0] for i in split["train"]])
    lower, upper = np.percentile(foreground, [0.5, 99.5])
    mean, std = foreground.mean(), foreground.std()
    stats = config.normalization[0]
    assert stats["lower"] == pytest.approx(lower, abs=1e-9) and stats["upper"] == pytest.approx(upper, abs=1e-9)
    assert stats["mean"] == pytest.approx(mean, abs=1e-9) and stats["std"] == pytest.approx(std, abs=1e-9)

    manifest = convert_to_tfrecords(cases, split, config, tmp_path / "records", workers=1, progress=False,
                                    description=description)
    assert manifest.preprocess["normalization"][0]["mean"] == pytest.approx(mean)
    assert manifest.channels == ("CT",) and manifest.dataset["classes"][1] == {"name": "liver", "value": 1}
    for split_name in ("train", "test"):
        for case_id, image, label in iter_cases(tmp_path / "records", split_name):
            expected = (np.clip(raw(by_id[case_id].images[0]), lower, upper) - mean) / std
            np.testing.assert_allclose(image[..., 0], expected, atol=1e-6)
            truth = raw(by_id[case_id].label).astype(int)
            np.testing.assert_array_equal(np.argmax(label, -1), truth)  # one-hot, background first


def test_ct_statistics_need_foreground(ct_root: Path, tmp_path: Path):
    cases = discover_cases(ct_root, "msd")[:1]
    empty = tmp_path / "label.nii.gz"
    original = nib.load(str(cases[0].label))
    nib.save(nib.Nifti1Image(np.zeros(original.shape, np.uint8), original.affine), str(empty))
    case = type(cases[0])(cases[0].case_id, cases[0].images, empty)
    with pytest.raises(DataError, match="no.*foreground|none"):
        ct_statistics([case], describe_dataset(ct_root, "msd"), [0])


def test_median_spacing_is_per_axis_and_follows_the_reorientation(ct_root: Path):
    cases = discover_cases(ct_root, "msd")
    spacings = np.array([nib.load(str(c.images[0])).header.get_zooms()[:3] for c in cases], np.float64)
    assert median_spacing(cases) == pytest.approx(tuple(np.median(spacings, axis=0)))
    assert median_spacing(cases, "RAS") == pytest.approx(tuple(np.median(spacings, axis=0)))  # all stored RAS


def test_with_folds_the_ct_statistics_come_from_every_development_case(ct_root: Path):
    """Cross-validation: no one training split, so (as nnU-Net's fingerprint) every non-test case, never a test one."""
    from distmis.data.split import development_cases

    cases = discover_cases(ct_root, "msd")
    split = make_split([c.case_id for c in cases], test=0.34, seed=0, folds=2)
    assert len(split["test"]) == 2 and [len(f) for f in split["folds"]] == [2, 2]
    dataset = DatasetSpec(path=str(ct_root), layout="msd", labels="classes")
    description = describe_dataset(ct_root, "msd")
    config = with_statistics(preprocess_config(dataset, description, cases, split), cases, split, description)
    by_id = {c.case_id: c for c in cases}
    development = development_cases(split)
    assert sorted(development) == sorted(split["folds"][0] + split["folds"][1])
    foreground = np.concatenate([raw(by_id[i].images[0])[raw(by_id[i].label) > 0] for i in development])
    stats = config.normalization[0]
    assert stats["mean"] == pytest.approx(foreground.mean(), abs=1e-9)
    assert stats["std"] == pytest.approx(foreground.std(), abs=1e-9)
    one_fold = np.concatenate([raw(by_id[i].images[0])[raw(by_id[i].label) > 0] for i in split["folds"][0]])
    assert stats["mean"] != pytest.approx(one_fold.mean(), abs=1e-6)


def test_anisotropic_data_gets_nnunets_target_spacing_along_its_coarse_axis():
    from distmis.data.statistics import anisotropic_target

    # thin in-plane, thick slices (ratio > 3), and few of them: the coarse axis takes its 10th percentile
    spacings = np.array([[0.8, 0.8, z] for z in (2.5, 3.0, 4.0, 5.0, 5.0, 5.0, 5.0, 6.0, 6.0, 7.0)])
    shapes = np.array([[512, 512, 40]] * 10)
    target = anisotropic_target(spacings, shapes)
    assert target[:2] == (0.8, 0.8) and target[2] == pytest.approx(np.percentile(spacings[:, 2], 10)) != 5.0
    # as many slices as in-plane voxels: the median stays (nnU-Net's second condition)
    assert anisotropic_target(spacings, np.array([[128, 128, 128]] * 10))[2] == 5.0
    # spacings within a factor of 3: the median everywhere
    assert anisotropic_target(np.array([[1.0, 1.0, 2.5], [1.0, 1.0, 2.0]]), np.array([[256, 256, 40]] * 2)) == (
        1.0, 1.0, 2.25)
    # the 10th percentile never below the other axes' spacing
    low = np.array([[1.0, 1.0, 0.5]] * 5 + [[1.0, 1.0, 7.0]] * 5)  # median 3.75: anisotropic; 10th percentile 0.5
    assert anisotropic_target(low, np.array([[400, 400, 30]] * 10))[2] == 1.0
