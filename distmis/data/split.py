"""Seeded train / validation / test splits of case ids, and cross-validation folds.

:func:`make_split` shuffles the case ids with ``numpy.random.default_rng(seed)``
and cuts the shuffled list by the requested fractions.  The result is a plain
JSON-friendly dict, stored next to the TFRecords (and in their manifest) so
that every trial of a search sees exactly the same cases::

    {"seed": 0, "fractions": {"train": 0.8, "val": 0.1, "test": 0.1},
     "train": ["BRATS_001", ...], "val": [...], "test": [...]}

With ``folds=k`` (cross-validation) the test cases are cut from the same seeded
shuffle by the ``test`` fraction alone, and the other (development) cases are
cut into k folds whose sizes differ by at most one; a trial trains on k - 1
folds and validates on the one left out (:func:`fold_parts`)::

    {"seed": 0, "fractions": {"test": 0.2},
     "folds": [["BRATS_002", ...], [...], ...], "test": [...]}

The parts written as TFRecord shard sets (:func:`split_parts`) are then
``fold0``, ..., ``fold{k-1}`` and ``test`` instead of ``train``, ``val`` and ``test``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from distmis.data.errors import DataError

__all__ = [
    "SPLIT_NAMES",
    "make_split",
    "split_counts",
    "validate_split",
    "write_split",
    "read_split",
    "split_parts",
    "fold_parts",
    "fold_part",
    "part_names",
    "development_cases",
]

#: The split names, in the order in which rounding leftovers are handed out.
SPLIT_NAMES: tuple[str, ...] = ("train", "val", "test")


def fold_part(index: int) -> str:
    """The name of fold ``index``'s TFRecord part: ``fold0``, ``fold1``, ..."""
    return f"fold{int(index)}"


def split_counts(num_cases: int, fractions: Mapping[str, float]) -> dict[str, int]:
    """Number of cases per split for ``num_cases`` cases.

    Largest-remainder rounding of ``fraction * num_cases``; then every split
    with a non-zero fraction that got no case takes one from the largest split,
    as long as there are enough cases (priority: train, val, test).

    Raises:
        ValueError: if the validation fraction is non-zero but there are too
            few cases to give it one (it would then be silently empty).
    """
    raw = {name: fractions[name] * num_cases for name in SPLIT_NAMES}
    counts = {name: math.floor(raw[name] + 1e-9) for name in SPLIT_NAMES}
    leftover = num_cases - sum(counts.values())
    by_remainder = sorted(SPLIT_NAMES, key=lambda n: (-(raw[n] - counts[n]), SPLIT_NAMES.index(n)))
    for name in by_remainder[:leftover]:
        counts[name] += 1
    for name in SPLIT_NAMES:  # give every non-empty fraction at least one case
        if fractions[name] > 0 and counts[name] == 0:
            donor = max(SPLIT_NAMES, key=lambda n: (counts[n], -SPLIT_NAMES.index(n)))
            if counts[donor] > 1 or (counts[donor] == 1 and fractions[donor] == 0):
                counts[donor] -= 1
                counts[name] += 1
    if fractions["val"] > 0 and counts["val"] == 0:
        raise ValueError(
            f"too few cases ({num_cases}) for a non-empty validation split with fractions "
            f"{dict(fractions)}; add cases or set val=0"
        )
    return counts


def _check_fraction(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0 or value > 1:
        raise ValueError(f"split fraction {name}={value!r} must be between 0 and 1")
    return value


def make_split(case_ids: Sequence[str], *, train: float | None = None, val: float | None = None, test: float,
               seed: int, folds: int | None = None) -> dict[str, Any]:
    """Split ``case_ids`` into train / val / test, or into k folds and test, by a seeded shuffle.

    The ids are sorted before shuffling, so the result depends only on the set
    of ids, the fractions and the seed (not on the input order).  Each list is
    returned sorted.

    Without ``folds`` the shuffled ids are cut into train, val and test in that
    order (:func:`split_counts`). With ``folds=k`` the same shuffle is used: the
    last ``n_test`` ids are the test set, where ``n_test`` is the test count of
    the fractions ``(1 - test, 0, test)`` (so the test set equals that of
    ``make_split(ids, train=1 - test, val=0, test=test, seed=seed)``, and that of
    any plain split with this ``test`` fraction and seed whose rounding gives
    the test set as many cases, which is the usual case); the development ids
    before them are cut, in shuffled order, into k consecutive folds, the first
    ``n_dev % k`` folds one case larger.

    Args:
        case_ids: unique case ids.
        train, val: non-negative fractions (without ``folds`` only, where they are
            required); ``train + val + test`` must be 1 (within 1e-6).
        test: the fraction of test cases.
        seed: seed of ``numpy.random.default_rng``.
        folds: the number of cross-validation folds (k >= 2), or None.

    Returns:
        ``{"seed", "fractions", "train", "val", "test"}`` or, with folds,
        ``{"seed", "fractions": {"test"}, "folds", "test"}`` (see the module docstring).

    Raises:
        ValueError: on bad fractions or folds, duplicate or no ids, too few
            cases for a non-empty validation split, or fewer development cases
            than folds.
    """
    ids = [str(c) for c in case_ids]
    if folds is not None:
        if train is not None or val is not None:
            given = " and ".join(name for name, value in (("train", train), ("val", val)) if value is not None)
            raise ValueError(f"with folds={folds} every non-test case is in one fold: give the test fraction (and "
                             f"the seed) only, not {given}")
        if isinstance(folds, bool) or not isinstance(folds, (int, np.integer)) or folds < 2:
            raise ValueError(f"folds must be an integer >= 2, got {folds!r}")
        fractions = {"train": 1.0 - _check_fraction("test", test), "val": 0.0, "test": float(test)}
    else:
        if train is None or val is None:
            raise ValueError(f"a split without folds needs the train and val fractions, got train={train!r}, "
                             f"val={val!r}")
        fractions = {"train": _check_fraction("train", train), "val": _check_fraction("val", val),
                     "test": _check_fraction("test", test)}
        total = sum(fractions.values())
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"split fractions must sum to 1, got {fractions} (sum {total:.6g})")
    if not ids:
        raise ValueError("cannot split an empty list of case ids")
    duplicates = sorted({c for c in ids if ids.count(c) > 1}) if len(set(ids)) != len(ids) else []
    if duplicates:
        raise ValueError(f"case ids must be unique; duplicated: {duplicates[:10]}")

    counts = split_counts(len(ids), fractions)
    order = np.random.default_rng(seed).permutation(len(ids))
    shuffled = [sorted(ids)[i] for i in order]
    if folds is not None:
        k = int(folds)
        development = shuffled[: len(ids) - counts["test"]]
        if len(development) < k:
            raise ValueError(
                f"too few cases for {k} folds: {len(ids)} case(s), {counts['test']} of them test cases (test "
                f"fraction {fractions['test']:g}), leave {len(development)} development case(s); every fold needs at "
                f"least one: use at most {len(development)} folds, a smaller test fraction, or more cases"
            )
        base, extra = divmod(len(development), k)
        cut: list[list[str]] = []
        start = 0
        for index in range(k):
            size = base + (1 if index < extra else 0)
            cut.append(sorted(development[start : start + size]))
            start += size
        return {"seed": int(seed), "fractions": {"test": fractions["test"]}, "folds": cut,
                "test": sorted(shuffled[len(development) :])}
    result: dict[str, Any] = {"seed": int(seed), "fractions": fractions}
    start = 0
    for name in SPLIT_NAMES:
        result[name] = sorted(shuffled[start : start + counts[name]])
        start += counts[name]
    return result


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(c, str) for c in value)


def validate_split(split: Mapping[str, Any], *, source: str = "split") -> None:
    """Check that ``split`` has train/val/test lists, or folds (a list of at least two lists) and test, of unique,
    disjoint case id strings.

    Raises:
        DataError: naming ``source`` and the problem.
    """
    if not isinstance(split, Mapping):
        raise DataError(f"{source}: a split must be a JSON object, got {type(split).__name__}")
    if "folds" in split:
        both = [name for name in ("train", "val") if name in split]
        if both:
            raise DataError(f"{source}: a split has either 'train' and 'val' or 'folds', not both; it has 'folds' "
                            f"and {both}")
        folds = split["folds"]
        if not isinstance(folds, list) or len(folds) < 2:
            raise DataError(f"{source}: 'folds' must be a list of at least 2 lists of case id strings, got "
                            f"{folds!r}")
        for index, ids in enumerate(folds):
            if not _is_ids(ids):
                raise DataError(f"{source}: 'folds'[{index}] must be a list of case id strings, got {ids!r}")
            if not ids:
                raise DataError(f"{source}: 'folds'[{index}] is empty: every fold needs at least one case")
        parts: dict[str, Any] = {fold_part(index): ids for index, ids in enumerate(folds)}
        parts["test"] = split.get("test")
    else:
        parts = {name: split.get(name) for name in SPLIT_NAMES}
    seen: dict[str, str] = {}
    for name, ids in parts.items():
        if not _is_ids(ids):
            raise DataError(f"{source}: {name!r} must be a list of case id strings, got {ids!r}")
        for case_id in ids:
            if case_id in seen:
                raise DataError(f"{source}: case {case_id!r} is in both {seen[case_id]!r} and {name!r}")
            seen[case_id] = name


def split_parts(split: Mapping[str, Any]) -> dict[str, list[str]]:
    """The parts of ``split`` written as TFRecord shard sets, in order, with their case ids: ``train``, ``val``,
    ``test``, or with folds ``fold0``, ..., ``fold{k-1}``, ``test``. (No checks: see :func:`validate_split`.)"""
    if "folds" in split:
        parts = {fold_part(index): list(ids) for index, ids in enumerate(split["folds"])}
        parts["test"] = list(split.get("test", []))
        return parts
    return {name: list(split.get(name, [])) for name in SPLIT_NAMES}


def fold_parts(split: Mapping[str, Any], fold: int | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The (training parts, validation parts) of one trial: ``(("train",), ("val",))`` for a split without folds
    and no ``fold``; with folds and ``fold`` i, every other fold's part and ``("fold{i}",)``.

    Raises:
        ValueError: naming the mismatch: a fold for a split without folds, a split with folds and no fold, or a
            fold that is not one of the split's.
    """
    folds = split.get("folds")
    if folds is None:
        if fold is not None:
            raise ValueError(f"dataset.split.fold is {fold}, but the split has no folds (it is a train / val / test "
                             f"split): set dataset.split.folds to cross-validate, or leave fold unset")
        return ("train",), ("val",)
    k = len(folds)
    if fold is None:
        raise ValueError(f"the split has {k} cross-validation folds, but no fold to validate on was given "
                         f"(dataset.split.fold, set by the search for each trial): give one of 0 to {k - 1}")
    if isinstance(fold, bool) or not isinstance(fold, (int, np.integer)) or not 0 <= fold < k:
        raise ValueError(f"dataset.split.fold {fold!r} is not one of the split's {k} folds (0 to {k - 1})")
    return tuple(fold_part(j) for j in range(k) if j != fold), (fold_part(int(fold)),)


def part_names(split: str | Sequence[str]) -> tuple[str, ...]:
    """The part names a reader is given (one, ``"train"``, or several, ``["fold0", "fold2"]``) as a tuple.

    Raises:
        ValueError: no part, a name that is not a string, or one named twice (its cases would be read twice).
    """
    parts = (split,) if isinstance(split, str) else tuple(split)
    if not parts:
        raise ValueError("split must name a part ('train', 'val', 'test', 'fold0', ...) or several, got none")
    bad = [part for part in parts if not isinstance(part, str)]
    if bad:
        raise ValueError(f"split parts must be names such as 'train' or 'fold0', got {bad[0]!r} in {list(parts)}")
    twice = sorted({part for part in parts if parts.count(part) > 1})
    if twice:
        raise ValueError(f"split parts {list(parts)} name {twice} more than once")
    return parts


def development_cases(split: Mapping[str, Any]) -> list[str]:
    """Every case that is not a test case: ``train`` then ``val``, or the folds in order."""
    return [case_id for name, ids in split_parts(split).items() if name != "test" for case_id in ids]


def write_split(split: Mapping[str, Any], path: str | Path) -> None:
    """Write ``split`` as indented JSON to ``path`` (parent folders are created)."""
    validate_split(split, source=str(path))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(split), indent=2) + "\n")


def read_split(path: str | Path) -> dict[str, Any]:
    """Read a split written by :func:`write_split` (with or without folds).

    Raises:
        DataError: if the file is missing, not JSON, or not a valid split.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"split file {str(path)!r} does not exist")
    try:
        split = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"split file {str(path)!r} is not valid JSON: {exc}") from exc
    validate_split(split, source=f"split file {str(path)!r}")
    return split
