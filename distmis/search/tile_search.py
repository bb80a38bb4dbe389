"""The search behind ``training.tile: auto`` and ``batch_size: auto`` (:mod:`distmis.search.input_plan`) and the
largest tile a refused step is told of (:mod:`distmis.search.memory_fit`), on any step peak: the tiles nnU-Net's
rule considers for a volume, largest first (:func:`tile_candidates`), searched by bisection for the first that
fits, then the batch (:func:`plan_inputs`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

__all__ = ["DATASET_SHARE", "MIN_BATCH", "Candidate", "NothingFits", "Tile", "mib", "plan_inputs", "tile_candidates"]

Tile = tuple[int, int, int]
#: nnU-Net's cap on the batch: its tiles hold at most this share of the data set's voxels.
DATASET_SHARE = 0.05
MIN_BATCH = 2


def mib(value: float) -> str:
    """Bytes as whole MiB, with thousands separated: ``1,024``."""
    return f"{value / 2**20:,.0f}"


class NothingFits(ValueError):
    """Not even the smallest tile and batch the planner may choose fits the memory."""


@dataclass(frozen=True)
class Candidate:
    """A tile and batch the planner traced: ``peak`` the largest predicted step peak (bytes) over the search's
    networks, ``fits`` whether it is at most the usable memory."""

    tile: Tile
    batch: int
    peak: float
    fits: bool
    reason: str = ""  # why the step could not be traced (its peak then infinite)


def tile_candidates(volume: Sequence[int], multiple: int, *, equal_pair: bool = False) -> list[Tile]:
    """The tiles the planner considers for ``volume``, largest first: each side a multiple of ``multiple`` and at
    most the volume's; each next tile shortens the side longest against the volume's by ``multiple``. With
    ``equal_pair`` the volume's two longest sides are kept equal (shortened together). ValueError when a side of
    the volume is shorter than ``multiple``."""
    if any(v < multiple for v in volume):
        raise ValueError(f"the preprocessed volume {list(volume)} has a side shorter than {multiple}, the multiple "
                         "every side of the network's input must divide by")
    tile = [v // multiple * multiple for v in volume]
    pair: tuple[int, ...] = ()
    if equal_pair:
        pair = tuple(sorted(sorted(range(3), key=lambda a: (-volume[a], a))[:2]))
        tile[pair[0]] = tile[pair[1]] = min(tile[a] for a in pair)
    out = [tuple(tile)]
    while True:
        shorter = [a for a in range(3) if tile[a] > multiple]
        if not shorter:
            return out  # type: ignore[return-value]
        axis = max(shorter, key=lambda a: (tile[a] / volume[a], tile[a], -a))
        for a in (pair if axis in pair else (axis,)):
            tile[a] -= multiple
        out.append(tuple(tile))


def _first_fitting(count: int, fits: Callable[[int], bool]) -> int | None:
    """The first index in ``range(count)`` where ``fits`` holds, for a ``fits`` false then true along the range
    (a step's memory falls as its tile shrinks): the first itself when it fits (a roomy worker: one trace), else
    by bisection. None when none fits."""
    if count and fits(0):
        return 0
    low, high = 1, count  # the answer is in [low, high]; high: none
    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    return low if low < count else None


def plan_inputs(volume: Sequence[int], multiple: int, peak: Callable[[Tile, int], float], usable: float, *,
                tile: Tile | None = None, batch: int | None = None, batch_cap: Callable[[Tile], int] | None = None,
                batch_multiple: int = 1, equal_pair: bool = False,
                valid: Callable[[Tile, int], bool] = lambda tile, batch: True,
                preferred: Callable[[Tile], bool] = lambda tile: True) -> tuple[Tile, int, list[Candidate]]:
    """The tile (``tile`` None: planned) and batch (``batch`` None: planned, up to ``batch_cap`` of the tile, a
    multiple of ``batch_multiple``) whose ``peak(tile, batch)`` fits ``usable`` bytes, and every candidate traced
    (``valid``: whether the network takes a tile at a batch; ``preferred``: the tiles searched first, the others
    only when none of those is valid).
    :class:`NothingFits`, naming the smallest candidate's need, when none fits."""
    traced: dict[tuple[Tile, int], Candidate] = {}

    def fits(candidate: Tile, n: int) -> bool:
        if (candidate, n) not in traced:
            try:
                need = float(peak(candidate, n))
                traced[(candidate, n)] = Candidate(candidate, n, need, need <= usable)
            except (ValueError, RuntimeError) as exc:  # a network that cannot train it (a norm over one value)
                traced[(candidate, n)] = Candidate(candidate, n, math.inf, False, str(exc).splitlines()[0])
        return traced[(candidate, n)].fits

    sequence = [tile] if tile is not None else tile_candidates(volume, multiple, equal_pair=equal_pair)
    if tile is None:
        sequence = [t for t in sequence if preferred(t)] or sequence
    start = batch if batch is not None else max(MIN_BATCH, batch_multiple) // batch_multiple * batch_multiple
    tiles = [t for t in sequence if valid(t, start)]
    if not tiles:
        raise ValueError(f"no tile of the volume {list(volume)} whose sides divide by {multiple} is one the network "
                         f"takes at batch {start}: set training.tile")
    first = _first_fitting(len(tiles), lambda i: fits(tiles[i], start))
    if first is None and batch is None and start > batch_multiple:  # below nnU-Net's 2 only when nothing else fits
        start = batch_multiple
        tiles = [t for t in sequence if valid(t, start)] or tiles[-1:]
        first = _first_fitting(len(tiles), lambda i: fits(tiles[i], start))
    if first is None:
        finite = [c for c in traced.values() if c.batch == start and c.peak < math.inf]
        smallest = min(finite, key=lambda c: c.peak) if finite else traced[(tiles[-1], start)]
        where = f"the smallest, tile {list(smallest.tile)} at batch {smallest.batch}"
        if smallest.reason:
            raise NothingFits(f"no training step fits: {where}, cannot be trained ({smallest.reason})")
        raise NothingFits(f"no training step fits: {where}, is predicted to need {mib(smallest.peak)} MiB, and a "
                          f"worker has {mib(usable)} MiB for it")
    chosen = tiles[first]
    if first > 0:
        fits(tiles[first - 1], start)  # traced already by the bisection, unless it stopped a step short
    best = start
    if batch is None and start >= MIN_BATCH:
        cap = max(start, (batch_cap(chosen) if batch_cap else start) // batch_multiple * batch_multiple)
        sizes = list(range(cap, start, -batch_multiple))  # largest first, those above start
        larger = _first_fitting(len(sizes), lambda i: fits(chosen, sizes[i]))
        best = sizes[larger] if larger is not None else start
        if best < cap:
            fits(chosen, best + batch_multiple)
    return chosen, best, list(traced.values())


