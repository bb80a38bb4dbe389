"""Where a trial's start-up goes: wall-clock marks, reported once with its first epoch and logged in MLflow.

A data-parallel trial pays, before its first step: the Ray Train controller, the placement group and the worker
processes with their backend set-up (``TF_CONFIG``, or torch's process group) up to the worker loop's first line
(``startup_workers_s``, measured from the driver's ``fit()`` call); importing the frameworks and pinning threads
(``startup_imports_s``); TensorFlow's ``MultiWorkerMirroredStrategy`` (``startup_strategy_s``); building the
model and opening the data (``startup_data_s``). ``startup_total_s`` is their sum. A single-process trial starts
its clock at the trainable's first line (Tune's actor is already up). Marks are wall-clock times, comparable
between the processes of one node (between nodes, up to their clocks' skew).
"""

from __future__ import annotations

import time

from distmis.trial_record import STARTUP_PREFIX

__all__ = ["StartupClock", "STARTUP_PREFIX"]


class StartupClock:
    """Wall-clock marks of one process's start-up. ``since``: when it began (another process's ``time.time()``),
    by default now."""

    def __init__(self, since: float | None = None) -> None:
        self.marks: list[tuple[str, float]] = [("start", time.time() if since is None else float(since))]

    def mark(self, part: str) -> None:
        """The part of the start-up that ends now."""
        self.marks.append((part, time.time()))

    def seconds(self) -> dict[str, float]:
        """``startup_<part>_s`` for every part marked, and ``startup_total_s``."""
        out = {f"{STARTUP_PREFIX}{part}_s": round(max(0.0, t - previous), 3)
               for (_, previous), (part, t) in zip(self.marks, self.marks[1:])}
        out[f"{STARTUP_PREFIX}total_s"] = round(max(0.0, self.marks[-1][1] - self.marks[0][1]), 3)
        return out
