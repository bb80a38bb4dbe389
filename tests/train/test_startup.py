"""The start-up clock: parts between marks, their total from the first mark (another process's time); the
garbage collector while a process loads its libraries."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator

import pytest

from distmis.train.startup import StartupClock, loading_libraries


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


@pytest.fixture
def collector() -> Iterator[None]:
    """The test process's collector as it was: enabled, nothing frozen by the test left frozen."""
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    if enabled:
        gc.enable()


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_while_libraries_load_nothing_is_collected_and_what_they_made_is_frozen_after(collector):
    gc.enable()
    frozen = gc.get_freeze_count()
    with loading_libraries():
        assert not gc.isenabled()
        kept = [Cycle() for _ in range(1000)]  # a library's module-level objects
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + 1000
    gc.collect()
    assert gc.get_freeze_count() >= frozen + 1000  # a full collection leaves the frozen objects alone
    assert len(kept) == 1000


def test_overlapping_loads_bring_collection_back_when_the_last_ends(collector):
    gc.enable()
    inside, leave = threading.Event(), threading.Event()

    def other_load() -> None:
        with loading_libraries():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=other_load)
    thread.start()
    assert inside.wait(10)
    with loading_libraries():
        leave.set()
        thread.join(10)
        assert not gc.isenabled()  # the other load ended, this one goes on
    assert gc.isenabled()


def test_a_process_that_had_turned_collection_off_keeps_it_off(collector):
    gc.disable()
    with loading_libraries():
        pass
    assert not gc.isenabled()
