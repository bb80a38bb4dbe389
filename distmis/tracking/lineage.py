"""Population-based training's lineage on the trials' MLflow runs (``search.scheduler: pbt``, :mod:`distmis.search.pbt`).

A trial that PBT restarts from another trial's checkpoint (an :class:`Exploit`) goes on from the donor's weights,
optimizer state and history. Its run records:

- tag ``distmis.pbt.exploits``: JSON, each exploit in order: ``{"from": donor trial id, "from_run": its run id,
  "epoch": the receiver's epoch when it happened, "donor_epoch": the donor's when PBT chose it, "went_on_after": the
  epoch of the checkpoint the trial went on from, "values": the searched values explore gave it}``;
- metrics ``pbt/<path>`` at every epoch: the value of each path PBT changes (``pbt/training.optimizer.lr``);
- its epochs after the exploit at their own numbers from ``went_on_after + 1`` (the donor's epochs before are on
  the donor's run), and its best epoch from then on the donor's line's: the one its kept checkpoint holds.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

__all__ = ["EXPLOITS_TAG", "PBT_PREFIX", "Exploit", "exploit_entry", "best_epoch"]

EXPLOITS_TAG = "distmis.pbt.exploits"
PBT_PREFIX = "pbt/"


@dataclass(frozen=True)
class Exploit:
    """Trial ``trial`` goes on from ``donor``'s checkpoint (``donor_epoch``: the donor's epoch when PBT chose it)
    after its own epoch ``epoch``, with ``values``: the searched values explore gave it."""

    trial: str
    donor: str
    epoch: int
    donor_epoch: int
    values: dict[str, Any]


def exploit_entry(exploit: Exploit, run_ids: Mapping[str, str]) -> dict[str, Any]:
    """One exploit as the ``distmis.pbt.exploits`` tag lists it (``went_on_after`` is added once the trial says)."""
    return {"from": exploit.donor, "from_run": run_ids.get(exploit.donor, ""), "epoch": exploit.epoch,
            "donor_epoch": exploit.donor_epoch, "values": exploit.values}


def best_epoch(history: Sequence[Mapping[str, Any]], metric: str, mode: str) -> tuple[float, int] | None:
    """``(value, epoch)`` of the best finite ``metric`` in ``history`` (the first of equals), None without one."""
    best: tuple[float, int] | None = None
    for entry in history:
        value = entry.get(metric)
        if value is None or not math.isfinite(float(value)):
            continue
        if best is None or (float(value) > best[0] if mode == "max" else float(value) < best[0]):
            best = (float(value), int(entry["epoch"]))
    return best
