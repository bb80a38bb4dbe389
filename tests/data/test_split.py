from __future__ import annotations

import pytest

from distmis.data import make_split, read_split, write_split


def test_split_is_seeded_disjoint_and_complete(tmp_path):
    ids = [f"c{i:02d}" for i in range(20)]
    split = make_split(ids, train=0.7, val=0.15, test=0.15, seed=3)
    assert [len(split[k]) for k in ("train", "val", "test")] == [14, 3, 3]
    assert sorted(split["train"] + split["val"] + split["test"]) == ids
    assert split == make_split(list(reversed(ids)), train=0.7, val=0.15, test=0.15, seed=3)
    assert split["val"] != make_split(ids, train=0.7, val=0.15, test=0.15, seed=4)["val"]
    write_split(split, tmp_path / "split.json")
    assert read_split(tmp_path / "split.json") == split


def test_small_datasets_still_get_a_validation_case():
    split = make_split(["a", "b", "c"], train=0.8, val=0.1, test=0.1, seed=0)
    assert len(split["val"]) == 1 and len(split["train"]) >= 1


def test_bad_fractions_and_too_few_cases():
    with pytest.raises(ValueError, match="sum to 1"):
        make_split(["a", "b"], train=0.5, val=0.2, test=0.2, seed=0)
    with pytest.raises(ValueError, match="validation"):
        make_split(["a"], train=0.5, val=0.5, test=0.0, seed=0)
