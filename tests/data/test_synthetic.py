from __future__ import annotations

import numpy as np
import pytest

from distmis.data import DataError, discover_cases, read_case, synthesize_dataset


def test_tumours_are_learnable_structures(tmp_path):
    synthesize_dataset(tmp_path / "d", "msd", cases=4, shape=(32, 32, 32), seed=0, progress=False)
    for case in discover_cases(tmp_path / "d", "msd"):
        image, label, _ = read_case(case, "msd")
        fraction = (label > 0).mean()
        assert 0.01 < fraction < 0.15
        assert {1, 3} <= set(np.unique(label))  # edema shell and enhancing rim at least
        brain = image[..., 0] > 0
        tumour = label > 0
        # FLAIR is brighter in the tumour than in the rest of the brain; T1gd brightest in the enhancing rim.
        assert image[tumour, 0].mean() > 1.2 * image[brain & ~tumour, 0].mean()
        assert image[label == 3, 2].mean() > image[label == 1, 2].mean()


def test_deterministic_and_varied(tmp_path):
    synthesize_dataset(tmp_path / "a", "brats", cases=2, shape=(16, 16, 16), seed=5, progress=False)
    synthesize_dataset(tmp_path / "b", "brats", cases=2, shape=(16, 16, 16), seed=5, progress=False)
    (ca0, ca1), (cb0, _) = discover_cases(tmp_path / "a", "brats"), discover_cases(tmp_path / "b", "brats")
    np.testing.assert_array_equal(read_case(ca0, "brats")[0], read_case(cb0, "brats")[0])
    assert not np.array_equal(read_case(ca0, "brats")[1], read_case(ca1, "brats")[1])


def test_refuses_a_non_empty_folder(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match="not empty"):
        synthesize_dataset(tmp_path / "d", "msd", cases=1, shape=(8, 8, 8), progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["d"]  # no temporary folder left behind
