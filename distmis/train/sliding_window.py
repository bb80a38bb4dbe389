"""Whole-volume prediction with overlapping windows (torch, channels-first), optionally Gaussian-weighted.

A model trained on tiles (the ViT segmenter takes tiles of exactly one size) predicts a larger volume
window by window; where windows overlap their predictions are averaged, each voxel weighted by 1 or by a
Gaussian centred on its window (which down-weights the borders of a window, where context is missing).

Every window position is deterministic, so under sequence parallelism every rank of a group can call this
with the parallel model as ``model_fn``: the ranks run the same windows in the same order.
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from distmis.models.vit_seg import as_triple


def window_starts(size: int, tile: int, overlap: float) -> list[int]:
    """Start offsets of windows of length ``tile`` over ``size`` with ``overlap``; the last is flush with the end."""
    if size <= tile:
        return [0]
    step = max(1, int(tile * (1.0 - overlap)))
    starts = list(range(0, size - tile + 1, step))
    if starts[-1] != size - tile:
        starts.append(size - tile)
    return starts


def gaussian_weights(
    tile: Sequence[int], sigma_scale: float = 0.125, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """A ``tile``-shaped Gaussian importance map (peak 1, sigma ``sigma_scale * tile`` per axis, floor 1e-3)."""
    axes = []
    for t in tile:
        coords = torch.arange(t, dtype=torch.float32, device=device) - (t - 1) / 2.0
        axes.append(torch.exp(-0.5 * (coords / (sigma_scale * t)) ** 2))
    weights = axes[0][:, None, None] * axes[1][None, :, None] * axes[2][None, None, :]
    return (weights / weights.max()).clamp_min(1e-3)


def sliding_window_inference(
    model_fn: Callable[[torch.Tensor], torch.Tensor],
    volume: torch.Tensor,
    tile: int | Sequence[int],
    overlap: float = 0.5,
    gaussian: bool = False,
    *,
    sigma_scale: float = 0.125,
    batch_size: int = 1,
) -> torch.Tensor:
    """Predictions ``(B, K, *spatial)`` for a ``(B, C, *spatial)`` volume from ``tile``-sized windows.

    ``model_fn`` maps windows ``(n, C, *tile)`` to ``(n, K, *tile)`` (logits or probabilities, averaged as
    given). ``batch_size`` windows (of every volume in the batch) go through ``model_fn`` at once. A volume
    smaller than the tile along an axis is zero-padded at the end for prediction and cropped back.
    """
    if volume.dim() != 5:
        raise ValueError(f"volume must be (B, C, W, D, H), got shape {tuple(volume.shape)}")
    tile = as_triple(tile, "tile")
    if not 0.0 <= overlap < 1.0:
        raise ValueError(f"overlap must lie in [0, 1), got {overlap!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if not sigma_scale > 0:
        raise ValueError(f"sigma_scale must be positive, got {sigma_scale!r}")

    spatial = tuple(volume.shape[2:])
    padding = [max(0, t - s) for s, t in zip(spatial, tile)]
    if any(padding):
        # F.pad lists the last axis first: (H_before, H_after, D_before, D_after, W_before, W_after)
        volume = F.pad(volume, [p for axis in reversed(padding) for p in (0, axis)])
    padded = tuple(volume.shape[2:])
    starts = list(itertools.product(*(window_starts(s, t, overlap) for s, t in zip(padded, tile))))
    weights = gaussian_weights(tile, sigma_scale, device=volume.device) if gaussian else None

    batch = volume.shape[0]
    out: torch.Tensor | None = None
    total = torch.zeros((1, 1) + padded, dtype=torch.float32, device=volume.device)
    for i in range(0, len(starts), batch_size):
        group = [tuple(slice(a, a + t) for a, t in zip(start, tile)) for start in starts[i : i + batch_size]]
        windows = torch.cat([volume[(slice(None), slice(None)) + s] for s in group])
        predictions = model_fn(windows)
        if predictions.dim() != 5 or predictions.shape[0] != windows.shape[0] or tuple(predictions.shape[2:]) != tile:
            raise ValueError(
                f"model_fn must map windows {tuple(windows.shape)} to (n, K, {', '.join(map(str, tile))}), "
                f"got {tuple(predictions.shape)}"
            )
        if out is None:
            out = torch.zeros((batch, predictions.shape[1]) + padded, dtype=torch.float32, device=volume.device)
        for j, s in enumerate(group):
            prediction = predictions[j * batch : (j + 1) * batch].float()
            index = (slice(None), slice(None)) + s
            if weights is None:
                out[index] += prediction
                total[index] += 1.0
            else:
                out[index] += prediction * weights
                total[index] += weights
    assert out is not None
    out = out / total
    return out[(slice(None), slice(None)) + tuple(slice(0, s) for s in spatial)]
