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

import gc
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from distmis.trial.record import STARTUP_PREFIX

__all__ = ["StartupClock", "STARTUP_PREFIX", "loading_libraries"]


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


_loading = threading.Lock()
_loaders = 0
_collecting_before = True


@contextmanager
def loading_libraries() -> Iterator[None]:
    """While a process imports its large libraries (TensorFlow, Keras, torch, Ray, MLflow): no cyclic garbage
    collection, and after it their objects are frozen (``gc.freeze``), so that no later collection scans them.

    They live as long as the process (several hundred thousand objects with TensorFlow and Ray), and Python's
    full collections scan every live object: each took about a second of a 2-core machine, the imports alone set
    off several, and the interpreter's own at exit took 6 to 14 s. Blocks may overlap (threads): collection is
    back, as it was before the first, when the last ends."""
    global _loaders, _collecting_before
    with _loading:
        if _loaders == 0:
            _collecting_before = gc.isenabled()
            gc.disable()
        _loaders += 1
    try:
        yield
    finally:
        with _loading:
            _loaders -= 1
            if _loaders == 0:
                gc.freeze()
                if _collecting_before:
                    gc.enable()
