from __future__ import annotations

import pytest

from distmis.data import DataError
from distmis.search.prepare import prepare_data
from distmis.spec import SpecError, validate_spec
from tests.conftest import small_spec_tree


def test_prepare_generates_converts_and_reuses(tmp_path):
    spec = validate_spec(small_spec_tree(tmp_path / "data"))
    first = prepare_data(spec, tmp_path / "out", progress=False)
    assert first.generated and (first.tfrecord_dir / "manifest.json").is_file()
    assert first.manifest["image_shape"] == [16, 16, 16, 4]
    assert sorted(first.split["train"] + first.split["val"] + first.split["test"]) == [f"BRATS_{i:03d}" for i in range(1, 7)]
    mtime = (first.tfrecord_dir / "manifest.json").stat().st_mtime_ns
    second = prepare_data(spec, tmp_path / "out", progress=False)
    assert not second.generated and second.tfrecord_dir == first.tfrecord_dir
    assert (second.tfrecord_dir / "manifest.json").stat().st_mtime_ns == mtime  # reused, not rewritten
    tree = small_spec_tree(tmp_path / "data")
    tree["dataset"]["split"]["seed"] = 1
    assert prepare_data(validate_spec(tree), tmp_path / "out", progress=False).tfrecord_dir != first.tfrecord_dir


def test_shape_checked_against_real_data(tmp_path):
    prepare_data(validate_spec(small_spec_tree(tmp_path / "data")), tmp_path / "out", progress=False)
    # The dataset now exists, so the spec alone no longer fixes the volume shape; the data does.
    tree = small_spec_tree(tmp_path / "data")
    tree["model"]["params"]["levels"] = 6  # 16 does not divide by 32
    with pytest.raises(SpecError, match="divide by 32"):
        prepare_data(validate_spec(tree), tmp_path / "out", progress=False)


def test_too_few_cases_for_the_split(tmp_path):
    from distmis.data import synthesize_dataset

    synthesize_dataset(tmp_path / "data", "msd", cases=1, shape=(16, 16, 16), progress=False)
    tree = small_spec_tree(tmp_path / "data")
    del tree["dataset"]["synthetic"]
    with pytest.raises(DataError, match="dataset.split.*too few cases"):
        prepare_data(validate_spec(tree), tmp_path / "out", progress=False)
