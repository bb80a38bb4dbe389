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
