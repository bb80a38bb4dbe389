"""The start-up clock: parts between marks, their total from the first mark (another process's time)."""

from __future__ import annotations

import time

import pytest

from distmis.train.startup import StartupClock


def test_parts_add_up_to_the_total_from_when_it_began(monkeypatch):
    now = iter([100.0, 101.5, 104.0, 104.25])
    monkeypatch.setattr(time, "time", lambda: next(now))
    clock = StartupClock(since=98.0)  # the driver's fit() call, two seconds before the worker's first line
    for part in ("workers", "imports", "strategy", "data"):
        clock.mark(part)
    assert clock.seconds() == {"startup_workers_s": 2.0, "startup_imports_s": 1.5, "startup_strategy_s": 2.5,
                               "startup_data_s": 0.25, "startup_total_s": 6.25}


def test_a_clock_without_a_beginning_starts_now():
    clock = StartupClock()
    clock.mark("imports")
    seconds = clock.seconds()
    assert set(seconds) == {"startup_imports_s", "startup_total_s"}
    assert seconds["startup_total_s"] == pytest.approx(seconds["startup_imports_s"]) and seconds["startup_total_s"] >= 0
