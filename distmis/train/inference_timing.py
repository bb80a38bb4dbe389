"""Whole-volume against sliding-window inference of a trial's best model, timed and scored (LAMP's question).

LAMP (Zhu et al., its Tables 3 and 5) finds that a network trained on large inputs not only segments better but
also predicts a whole volume faster in one pass than by sliding windows of a small tile, which need many
overlapping passes. With ``training.inference.compare: true`` every U-Net trial answers that for itself: after
its last epoch, its best epoch's weights predict every validation case

- ``whole_volume``: in one pass (the volume, padded up to what the network's pooling divides, if need be), and
- ``sliding_window``: by overlapping windows (``training.inference``) of the smallest tile the trial trained on
  (``training.tile``, or the first stage's of ``training.curriculum``; none when it trained on whole volumes),

and reports, per way, the mean dice and the mean seconds per case (``<way>_dice``, ``<way>_seconds``). Each
way's first case is predicted once untimed first, so that neither pays for warming up (TensorFlow's tracing,
oneDNN's kernel choice). The timings are those of the trial's process as it runs, beside whatever else runs.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from distmis.spec.curriculum import training_stages

__all__ = ["inference_windows", "compare_inference"]


def inference_windows(spec: Any, volume: tuple[int, ...]) -> dict[str, tuple[int, int, int] | None]:
    """``{"whole_volume": window or None, "sliding_window": tile}`` for a trial of ``spec`` on volumes of
    ``volume``: the whole volume is one pass (None) when the network takes its shape, else one window of it
    rounded up to the pooling factor; the sliding window is the smallest training tile, left out without one."""
    multiple = spec.model.input_multiple
    whole = tuple(int(math.ceil(v / multiple) * multiple) for v in volume[:3])
    windows: dict[str, tuple[int, int, int] | None] = {
        "whole_volume": None if whole == tuple(volume[:3]) else whole}  # type: ignore[dict-item]
    tiles = [stage.tile for stage in training_stages(spec.training) if stage.tile is not None]
    if tiles:
        windows["sliding_window"] = min(tiles, key=lambda t: math.prod(t))
    return windows


def compare_inference(trainer: Any, weights: str | Path) -> dict[str, float]:
    """Predict every validation case of ``trainer`` with the weights in ``weights`` (:meth:`save`'s folder), each
    way of :func:`inference_windows`; the mean dice and seconds per case of each. The trainer's own weights are
    back in place afterwards."""
    cases = trainer.val_cases
    if not len(cases):
        return {}
    results: dict[str, float] = {}
    with trainer.weights_from(weights):
        for way, window in inference_windows(trainer.spec, trainer.volume_shape).items():
            _, first_image, _ = cases[0]
            trainer.predict_with_window(first_image, window)  # warm-up, not timed
            seconds, dices = [], []
            for _case_id, image, label in cases:
                start = time.perf_counter()
                prob = trainer.predict_with_window(image, window)
                seconds.append(time.perf_counter() - start)
                dices.append(float(trainer.case_dice(prob, label).mean()))  # over the foreground channels
            results[f"{way}_dice"] = float(np.mean(dices))
            results[f"{way}_seconds"] = float(np.mean(seconds))
    return results
