"""Cross-validation folds in the TFRecords: one shard set per fold, and the readers over several parts."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distmis.data import (
    DataError,
    PreprocessConfig,
    convert_to_tfrecords,
    discover_cases,
    iter_cases,
    make_dataset,
    make_split,
    read_manifest,
    verify_checksums,
)
from distmis.data.cases import SplitCases
from distmis.data.tfrecord import _is_written_file

BRATS_CONFIG = PreprocessConfig(layout="brats", labels="regions", crop=(12, 12, 12))


@pytest.fixture(scope="module")
def folds_tfr(brats_root: Path,
              tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """The 5-case BraTS set split into 3 folds (2, 1, 1 cases) and 1 test case, 2 shards a part at most."""
    cases = discover_cases(brats_root, "brats")
    split = make_split([c.case_id for c in cases], test=0.2, seed=0, folds=3)
    out = tmp_path_factory.mktemp("tfr") / "folds_tfr"
    manifest = convert_to_tfrecords(cases, split, BRATS_CONFIG, out, shards_per_split=2, workers=1, progress=False)
    return out, manifest, split


def test_a_fold_split_writes_a_shard_set_per_fold(folds_tfr) -> None:
    out, manifest, split = folds_tfr
    assert [len(f) for f in split["folds"]] == [2, 1, 1] and len(split["test"]) == 1
    assert list(manifest.splits) == ["fold0", "fold1", "fold2", "test"]
    assert manifest.split == split and manifest.split["folds"] == split["folds"]
    assert read_manifest(out) == manifest
    for index, ids in enumerate(split["folds"]):
        info = manifest.splits[f"fold{index}"]
        assert info["case_ids"] == ids and info["num_cases"] == len(ids)
    assert manifest.splits["test"]["case_ids"] == split["test"]
    assert [s["file"] for s in manifest.splits["fold0"]["shards"]] == [
        "fold0-00000-of-00002.tfrecord", "fold0-00001-of-00002.tfrecord"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["manifest.json", "fold0-00000-of-00002.tfrecord", "fold0-00001-of-00002.tfrecord",
         "fold1-00000-of-00001.tfrecord", "fold2-00000-of-00001.tfrecord", "test-00000-of-00001.tfrecord"])
    verify_checksums(out)
    assert _is_written_file("fold12-00000-of-00001.tfrecord") and not _is_written_file("foldx-00000-of-00001.tfrecord")


def test_iter_cases_and_split_cases_over_several_folds_are_their_union_in_order(folds_tfr) -> None:
    out, _, split = folds_tfr
    folds = split["folds"]
    read = list(iter_cases(out, ["fold2", "fold0"]))
    assert [c for c, _, _ in read] == folds[2] + folds[0]  # part after part, in the order given
    singles = {c: (image, label) for part in ("fold0", "fold2") for c, image, label in iter_cases(out, part)}
    for case_id, image, label in read:
        np.testing.assert_array_equal(image, singles[case_id][0])
        np.testing.assert_array_equal(label, singles[case_id][1])
    cases = SplitCases(out, ("fold1", "fold2"), label_dtype=np.float32)
    assert cases.parts == ("fold1", "fold2") and len(cases) == 2
    assert cases.case_ids == folds[1] + folds[2]
    assert [c[0] for c in cases] == cases.case_ids and cases[1][2].dtype == np.float32
    np.testing.assert_array_equal(cases[0][1], next(iter(iter_cases(out, "fold1")))[1])
    assert cases[1:].case_ids == folds[2]
    assert repr(cases).endswith("['fold1', 'fold2']: 2 cases)")
    with pytest.raises(IndexError, match=r"out of range for 2 cases of split \['fold1', 'fold2'\]"):
        cases[2]
    assert SplitCases(out, ["fold0"]).case_ids == SplitCases(out, "fold0").case_ids == folds[0]


def _ids(ds, stored: dict[str, np.ndarray]) -> list[str]:
    return [next(c for c, i in stored.items() if np.array_equal(i, x)) for batch, _ in ds for x in batch.numpy()]


def test_make_dataset_over_several_folds_reads_each_case_once(folds_tfr) -> None:
    out, _, split = folds_tfr
    folds = split["folds"]
    training = ["fold0", "fold2"]  # fold 1's trial
    stored = {c: image for c, image, _ in iter_cases(out, training)}
    ds = make_dataset(out, training, batch_size=2, shuffle=True, seed=3)
    first, second = _ids(ds, stored), _ids(ds, stored)
    assert sorted(first) == sorted(second) == sorted(folds[0] + folds[2])  # every case once an epoch
    again = _ids(make_dataset(out, training, batch_size=2, shuffle=True, seed=3), stored)
    assert again == first  # deterministic for a seed
    shards = [_ids(make_dataset(out, training, batch_size=1, shard=(2, k)), stored) for k in range(2)]
    assert [len(s) for s in shards] == [2, 1] and sorted(shards[0] + shards[1]) == sorted(stored)
    tiles = make_dataset(out, ("fold1",), batch_size=4, tile=(4, 4, 4))
    assert [x.shape for x, _ in tiles] == [(1, 4, 4, 4, 4)]


def test_readers_refuse_unknown_missing_or_repeated_parts(folds_tfr) -> None:
    out, _, _ = folds_tfr
    with pytest.raises(DataError, match=r"split 'train' is not in .*available: \['fold0', 'fold1', 'fold2', 'test'\]"):
        make_dataset(out, "train", batch_size=1)
    with pytest.raises(DataError, match="split 'fold3' is not in"):
        list(iter_cases(out, ["fold0", "fold3"]))
    with pytest.raises(DataError, match="split 'val' is not in"):
        SplitCases(out, ["fold0", "val"])
    with pytest.raises(ValueError, match="got none"):
        make_dataset(out, [], batch_size=1)
    with pytest.raises(ValueError, match=r"name \['fold1'\] more than once"):
        SplitCases(out, ["fold1", "fold1"])


def test_a_fold_folder_is_replaced_by_overwrite(brats_root: Path, folds_tfr, tmp_path: Path) -> None:
    """Its fold shards are files distmis wrote (the manifest lists them): overwrite replaces them."""
    out, _, split = folds_tfr
    target = Path(shutil.copytree(out, tmp_path / "tfr"))
    cases = discover_cases(brats_root, "brats")
    plain = make_split([c.case_id for c in cases], train=0.6, val=0.2, test=0.2, seed=0)
    manifest = convert_to_tfrecords(cases, plain, BRATS_CONFIG, target, workers=1, progress=False, overwrite=True)
    assert list(manifest.splits) == ["train", "val", "test"] and "folds" not in manifest.split
    assert not list(target.glob("fold*")) and sorted(p.name for p in tmp_path.iterdir()) == ["tfr"]
    again = convert_to_tfrecords(cases, split, BRATS_CONFIG, target, workers=1, progress=False, overwrite=True)
    assert list(again.splits) == ["fold0", "fold1", "fold2", "test"] and not list(target.glob("train-*"))
