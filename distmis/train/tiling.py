"""Whole-volume prediction from tiles: cover a volume with tiles, predict them, stitch the result."""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np


def tile_starts(size: int, tile: int) -> list[int]:
    """Start offsets of tiles of length ``tile`` covering ``size``; the last one is flush with the end."""
    if tile > size:
        raise ValueError(f"tile {tile} is larger than the volume dimension {size}")
    starts = list(range(0, size - tile + 1, tile))
    if starts[-1] + tile < size:
        starts.append(size - tile)
    return starts


def iter_tiles(shape: tuple[int, int, int], tile: tuple[int, int, int]) -> Iterator[tuple[slice, slice, slice]]:
    """Slices of the tiles that cover a volume of ``shape``."""
    for a in tile_starts(shape[0], tile[0]):
        for b in tile_starts(shape[1], tile[1]):
            for c in tile_starts(shape[2], tile[2]):
                yield slice(a, a + tile[0]), slice(b, b + tile[1]), slice(c, c + tile[2])


def predict_tiled(
    predict: Callable[[np.ndarray], np.ndarray],
    image: np.ndarray,
    tile: tuple[int, int, int],
    *,
    num_classes: int,
    batch_size: int = 1,
) -> np.ndarray:
    """Probabilities (H, W, D, C) for an (H, W, D, channels) ``image``, averaged where tiles overlap.

    ``predict`` maps a batch of channels-last tiles (B, h, w, d, channels) to (B, h, w, d, C) probabilities.
    """
    out = np.zeros(image.shape[:3] + (num_classes,), np.float32)
    count = np.zeros(image.shape[:3] + (1,), np.float32)
    slices = list(iter_tiles(image.shape[:3], tile))
    for i in range(0, len(slices), max(1, batch_size)):
        group = slices[i : i + max(1, batch_size)]
        for s, p in zip(group, predict(np.stack([image[s] for s in group]))):
            out[s] += p
            count[s] += 1.0
    return out / count
