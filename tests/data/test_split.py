"""Tests for distmis.data.split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distmis.data import DataError, make_split, read_split, write_split

IDS = [f"case_{i:03d}" for i in range(20)]


def test_split_is_deterministic_and_order_independent() -> None:
    a = make_split(IDS, train=0.7, val=0.15, test=0.15, seed=5)
    b = make_split(list(reversed(IDS)), train=0.7, val=0.15, test=0.15, seed=5)
    c = make_split(IDS, train=0.7, val=0.15, test=0.15, seed=6)
    assert a == b
    assert a["train"] != c["train"]


def test_split_structure_disjoint_and_complete() -> None:
    split = make_split(IDS, train=0.8, val=0.1, test=0.1, seed=0)
    assert split["seed"] == 0
    assert split["fractions"] == {"train": 0.8, "val": 0.1, "test": 0.1}
    assert (len(split["train"]), len(split["val"]), len(split["test"])) == (16, 2, 2)
    parts = [set(split[name]) for name in ("train", "val", "test")]
    assert not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])
    assert parts[0] | parts[1] | parts[2] == set(IDS)
    assert split["train"] == sorted(split["train"])


@pytest.mark.parametrize(
    "n, fractions, expected",
    [
        (10, (0.8, 0.1, 0.1), (8, 1, 1)),
        (3, (0.8, 0.1, 0.1), (1, 1, 1)),  # rounding would give val and test nothing
        (4, (0.8, 0.2, 0.0), (3, 1, 0)),
        (2, (0.8, 0.1, 0.1), (1, 1, 0)),  # too few for all three: train and val win
        (7, (0.5, 0.25, 0.25), (3, 2, 2)),  # largest remainders: 3.5, 1.75, 1.75
        (5, (1.0, 0.0, 0.0), (5, 0, 0)),
    ],
)
def test_split_counts(n: int, fractions: tuple[float, float, float], expected: tuple[int, int, int]) -> None:
    train, val, test = fractions
    split = make_split(IDS[:n], train=train, val=val, test=test, seed=1)
    assert (len(split["train"]), len(split["val"]), len(split["test"])) == expected


def test_split_errors() -> None:
    with pytest.raises(ValueError, match="sum to 1"):
        make_split(IDS, train=0.8, val=0.1, test=0.2, seed=0)
    with pytest.raises(ValueError, match="too few cases"):
        make_split(IDS[:1], train=0.8, val=0.2, test=0.0, seed=0)
    with pytest.raises(ValueError, match="between 0 and 1"):
        make_split(IDS, train=1.2, val=-0.2, test=0.0, seed=0)
    with pytest.raises(ValueError, match="unique"):
        make_split(["a", "b", "a"], train=1.0, val=0.0, test=0.0, seed=0)
    with pytest.raises(ValueError, match="empty"):
        make_split([], train=1.0, val=0.0, test=0.0, seed=0)


def test_split_fractions_tolerance() -> None:
    split = make_split(IDS, train=0.7, val=0.2, test=0.1 + 5e-7, seed=0)
    assert len(split["train"]) + len(split["val"]) + len(split["test"]) == len(IDS)


def test_write_read_round_trip(tmp_path: Path) -> None:
    split = make_split(IDS, train=0.6, val=0.2, test=0.2, seed=3)
    path = tmp_path / "sub" / "split.json"
    write_split(split, path)
    assert read_split(path) == split
    assert json.loads(path.read_text())["seed"] == 3


def test_read_split_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        read_split(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="bad.json.*not valid JSON"):
        read_split(bad)
    overlap = tmp_path / "overlap.json"
    overlap.write_text(json.dumps({"seed": 0, "train": ["a", "b"], "val": ["b"], "test": []}))
    with pytest.raises(DataError, match="'b' is in both 'train' and 'val'"):
        read_split(overlap)


# --------------------------------------------------------------------------- cross-validation folds
from distmis.data import development_cases, fold_parts, split_parts  # noqa: E402
from distmis.data.split import part_names, validate_split  # noqa: E402


@pytest.mark.parametrize("n, test, k", [(20, 0.15, 5), (11, 0.2, 3), (10, 0.0, 4), (7, 0.3, 2), (13, 0.1, 6)])
def test_folds_cover_the_development_cases_once_and_are_balanced(n: int, test: float, k: int) -> None:
    ids = IDS[:n]
    split = make_split(ids, test=test, seed=4, folds=k)
    assert set(split) == {"seed", "fractions", "folds", "test"}
    assert split["fractions"] == {"test": test} and split["seed"] == 4
    folds = split["folds"]
    assert len(folds) == k
    every = [case for fold in folds for case in fold]
    assert len(every) == len(set(every))  # no case in two folds
    assert not set(every) & set(split["test"])  # no test case in a fold
    assert set(every) | set(split["test"]) == set(ids)
    sizes = [len(fold) for fold in folds]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert all(fold == sorted(fold) for fold in folds) and split["test"] == sorted(split["test"])
    assert development_cases(split) == every


@pytest.mark.parametrize("n, test", [(20, 0.15), (11, 0.2), (10, 0.0), (7, 0.3), (13, 0.1), (3, 0.1)])
def test_the_test_set_of_a_fold_split_is_the_plain_splits(n: int, test: float) -> None:
    """The folds cut the same seeded shuffle: the test cases are those of a plain split with this test fraction
    and seed (train 1 - test, val 0 exactly; and any train / val whose rounding gives test as many cases)."""
    ids = IDS[:n]
    folded = make_split(ids, test=test, seed=7, folds=2)
    assert folded["test"] == make_split(ids, train=1 - test, val=0.0, test=test, seed=7)["test"]
    val = round(min(0.15, (1 - test) / 2), 2)
    plain = make_split(ids, train=1 - test - val, val=val, test=test, seed=7)
    if len(plain["test"]) == len(folded["test"]):  # the same count: the same cases (the shuffle's last ones)
        assert plain["test"] == folded["test"]


def test_the_default_fractions_and_folds_keep_the_same_test_cases() -> None:
    plain = make_split(IDS, train=0.7, val=0.15, test=0.15, seed=2)  # the spec's default fractions
    assert make_split(IDS, test=0.15, seed=2, folds=5)["test"] == plain["test"] and len(plain["test"]) == 3


def test_folds_are_deterministic_by_seed_and_order_independent() -> None:
    a = make_split(IDS, test=0.2, seed=5, folds=4)
    assert a == make_split(list(reversed(IDS)), test=0.2, seed=5, folds=4)
    assert a["folds"] != make_split(IDS, test=0.2, seed=6, folds=4)["folds"]


def test_fold_split_errors() -> None:
    with pytest.raises(ValueError, match=r"too few cases for 5 folds: 5 case\(s\), 1 of them test.*4 development"):
        make_split(IDS[:5], test=0.2, seed=0, folds=5)
    with pytest.raises(ValueError, match="give the test fraction .* not train and val"):
        make_split(IDS, train=0.7, val=0.1, test=0.2, seed=0, folds=3)
    with pytest.raises(ValueError, match="folds must be an integer >= 2, got 1"):
        make_split(IDS, test=0.2, seed=0, folds=1)
    with pytest.raises(ValueError, match="test=1.5"):
        make_split(IDS, test=1.5, seed=0, folds=3)
    with pytest.raises(ValueError, match="needs the train and val fractions"):
        make_split(IDS, test=0.2, seed=0)


def test_split_parts_name_the_shard_sets_in_order() -> None:
    plain = make_split(IDS, train=0.6, val=0.2, test=0.2, seed=0)
    assert list(split_parts(plain)) == ["train", "val", "test"]
    assert split_parts(plain)["val"] == plain["val"]
    folded = make_split(IDS, test=0.2, seed=0, folds=3)
    parts = split_parts(folded)
    assert list(parts) == ["fold0", "fold1", "fold2", "test"]
    assert [parts[f"fold{i}"] for i in range(3)] == folded["folds"] and parts["test"] == folded["test"]
    assert development_cases(plain) == plain["train"] + plain["val"]


def test_fold_parts_of_a_trial() -> None:
    plain = make_split(IDS, train=0.6, val=0.2, test=0.2, seed=0)
    folded = make_split(IDS, test=0.2, seed=0, folds=4)
    assert fold_parts(plain, None) == (("train",), ("val",))
    assert fold_parts(folded, 1) == (("fold0", "fold2", "fold3"), ("fold1",))
    assert fold_parts(folded, 0) == (("fold1", "fold2", "fold3"), ("fold0",))
    with pytest.raises(ValueError, match="dataset.split.fold is 1, but the split has no folds"):
        fold_parts(plain, 1)
    with pytest.raises(ValueError, match="has 4 cross-validation folds, but no fold .* one of 0 to 3"):
        fold_parts(folded, None)
    with pytest.raises(ValueError, match=r"fold 4 is not one of the split's 4 folds \(0 to 3\)"):
        fold_parts(folded, 4)
    with pytest.raises(ValueError, match="fold -1 is not one"):
        fold_parts(folded, -1)


def test_part_names() -> None:
    assert part_names("train") == ("train",)
    assert part_names(["fold0", "fold2"]) == ("fold0", "fold2")
    with pytest.raises(ValueError, match="got none"):
        part_names([])
    with pytest.raises(ValueError, match=r"name \['fold0'\] more than once"):
        part_names(["fold0", "fold1", "fold0"])
    with pytest.raises(ValueError, match="got 3"):
        part_names(["fold0", 3])  # type: ignore[list-item]


def test_a_fold_split_round_trips_and_is_checked(tmp_path: Path) -> None:
    split = make_split(IDS, test=0.2, seed=3, folds=3)
    write_split(split, tmp_path / "split.json")
    assert read_split(tmp_path / "split.json") == split

    def refused(bad: dict, match: str) -> None:
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(DataError, match=match):
            read_split(path)

    refused({"seed": 0, "folds": [["a"], ["a", "b"]], "test": []}, "'a' is in both 'fold0' and 'fold1'")
    refused({"seed": 0, "folds": [["a"], ["b"]], "test": ["b"]}, "'b' is in both 'fold1' and 'test'")
    refused({"seed": 0, "folds": [["a"], [1]], "test": []}, r"'folds'\[1\] must be a list of case id strings")
    refused({"seed": 0, "folds": [["a"]], "test": []}, "'folds' must be a list of at least 2 lists")
    refused({"seed": 0, "folds": [["a"], []], "test": []}, r"'folds'\[1\] is empty")
    refused({"seed": 0, "folds": [["a"], ["b"]]}, "'test' must be a list")
    refused({"seed": 0, "folds": [["a"], ["b"]], "train": ["c"], "val": [], "test": []},
            "either 'train' and 'val' or 'folds', not both")
    validate_split(split)
