"""Ray Tune's asynchronous HyperBand (``AsyncHyperBandScheduler``) with its draws seeded: which bracket each new
trial joins is drawn from numpy's global generator in Tune, so two runs of one search would put their trials in
different brackets. Here the draw comes from a generator of the scheduler's own, seeded with ``training.seed``,
which is saved and restored with the scheduler (a resumed search goes on drawing where it stopped)."""

from __future__ import annotations

from typing import Any

import numpy as np
from ray.tune.schedulers import AsyncHyperBandScheduler

__all__ = ["SeededAsyncHyperBand"]


class SeededAsyncHyperBand(AsyncHyperBandScheduler):
    """``AsyncHyperBandScheduler`` whose bracket draws come from ``np.random.RandomState(seed)``."""

    def __init__(self, *args: Any, seed: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._draws = np.random.RandomState(seed)

    def on_trial_add(self, tune_controller: Any, trial: Any) -> None:
        # Tune draws with np.random: its global state is swapped for this scheduler's around the draw, and back
        outside = np.random.get_state()
        np.random.set_state(self._draws.get_state())
        try:
            super().on_trial_add(tune_controller, trial)
        finally:
            self._draws.set_state(np.random.get_state())
            np.random.set_state(outside)
