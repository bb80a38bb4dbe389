"""Seeded train / validation / test splits of case ids.

:func:`make_split` shuffles the case ids with ``numpy.random.default_rng(seed)``
and cuts the shuffled list by the requested fractions.  The result is a plain
JSON-friendly dict, stored next to the TFRecords (and in their manifest) so
that every trial of a search sees exactly the same cases::

    {"seed": 0, "fractions": {"train": 0.8, "val": 0.1, "test": 0.1},
     "train": ["BRATS_001", ...], "val": [...], "test": [...]}
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from distmis.data.errors import DataError

__all__ = ["SPLIT_NAMES", "make_split", "split_counts", "validate_split", "write_split", "read_split"]

#: The split names, in the order in which rounding leftovers are handed out.
SPLIT_NAMES: tuple[str, ...] = ("train", "val", "test")


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


def make_split(case_ids: Sequence[str], *, train: float, val: float, test: float, seed: int) -> dict[str, Any]:
    """Split ``case_ids`` into train / val / test by a seeded shuffle.

    The ids are sorted before shuffling, so the result depends only on the set
    of ids, the fractions and the seed (not on the input order).  Each split's
    list is returned sorted.

    Args:
        case_ids: unique case ids.
        train, val, test: non-negative fractions summing to 1 (within 1e-6).
        seed: seed of ``numpy.random.default_rng``.

    Returns:
        ``{"seed", "fractions", "train", "val", "test"}`` (see the module docstring).

    Raises:
        ValueError: on bad fractions, duplicate or no ids, or too few cases for
            a non-empty validation split.
    """
    fractions = {"train": float(train), "val": float(val), "test": float(test)}
    for name, value in fractions.items():
        if not math.isfinite(value) or value < 0 or value > 1:
            raise ValueError(f"split fraction {name}={value!r} must be between 0 and 1")
    total = sum(fractions.values())
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"split fractions must sum to 1, got {fractions} (sum {total:.6g})")
    ids = [str(c) for c in case_ids]
    if not ids:
        raise ValueError("cannot split an empty list of case ids")
    duplicates = sorted({c for c in ids if ids.count(c) > 1}) if len(set(ids)) != len(ids) else []
    if duplicates:
        raise ValueError(f"case ids must be unique; duplicated: {duplicates[:10]}")

    counts = split_counts(len(ids), fractions)
    order = np.random.default_rng(seed).permutation(len(ids))
    shuffled = [sorted(ids)[i] for i in order]
    result: dict[str, Any] = {"seed": int(seed), "fractions": fractions}
    start = 0
    for name in SPLIT_NAMES:
        result[name] = sorted(shuffled[start : start + counts[name]])
        start += counts[name]
    return result


def validate_split(split: Mapping[str, Any], *, source: str = "split") -> None:
    """Check that ``split`` has train/val/test lists of unique, disjoint case ids.

    Raises:
        DataError: naming ``source`` and the problem.
    """
    if not isinstance(split, Mapping):
        raise DataError(f"{source}: a split must be a JSON object, got {type(split).__name__}")
    seen: dict[str, str] = {}
    for name in SPLIT_NAMES:
        ids = split.get(name)
        if not isinstance(ids, list) or not all(isinstance(c, str) for c in ids):
            raise DataError(f"{source}: {name!r} must be a list of case id strings, got {ids!r}")
        for case_id in ids:
            if case_id in seen:
                raise DataError(f"{source}: case {case_id!r} is in both {seen[case_id]!r} and {name!r}")
            seen[case_id] = name


def write_split(split: Mapping[str, Any], path: str | Path) -> None:
    """Write ``split`` as indented JSON to ``path`` (parent folders are created)."""
    validate_split(split, source=str(path))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(split), indent=2) + "\n")


def read_split(path: str | Path) -> dict[str, Any]:
    """Read a split written by :func:`write_split`.

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
