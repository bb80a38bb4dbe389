"""Which epoch of a trial is its best (``search.selection``): the one value every trial reports for it.

- ``epoch``: the epoch's own value of ``search.metric`` (the best epoch is the one with the highest, or lowest).
- ``moving-average``: ``ema_<metric>``, the exponential moving average of the metric over the epochs so far, as
  nnU-Net v2 keeps its checkpoint by (``ema_fg_dice``): the first finite value, then
  ``ema = smoothing * ema + (1 - smoothing) * value`` at each epoch (smoothing 0.9: nnU-Net's). One noisy epoch moves
  it by a tenth of its jump, so it cannot win alone. An epoch whose value is not finite leaves it as it was.

The trial computes it from its history (:func:`selection_metrics`), so a resumed trial reports the same values;
the epoch loop keeps the best epoch's weights by it, and the driver ranks trials, fills the results table and
picks the model to register by the same reported value (``SearchSpec.selected_metric``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from distmis.spec.schema import SearchSpec

__all__ = ["moving_average", "selection_metrics"]


def moving_average(values: Iterable[float], smoothing: float) -> float:
    """The exponential moving average after ``values`` (oldest first); NaN while none is finite."""
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must be within [0, 1), got {smoothing}")
    average = math.nan
    for value in values:
        value = float(value)
        if not math.isfinite(value):
            continue
        average = value if math.isnan(average) else smoothing * average + (1.0 - smoothing) * value
    return average


def selection_metrics(history: Sequence[Mapping[str, object]], search: SearchSpec) -> dict[str, float]:
    """What an epoch reports besides its own metrics for ``search.selection``: ``{ema_<metric>: value}`` after the
    epochs of ``history`` (oldest first, the current one last) with ``moving-average``; nothing with ``epoch``."""
    if search.selection == "epoch":
        return {}
    values = (float(epoch[search.metric]) for epoch in history  # type: ignore[arg-type]
              if isinstance(epoch.get(search.metric), (int, float)))
    return {search.selected_metric: moving_average(values, search.smoothing)}
