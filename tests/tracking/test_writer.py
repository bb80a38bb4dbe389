"""ResilientWriter: writes made in order, retried, held while the store is away, flushed after, never raised."""

from __future__ import annotations

import logging

import pytest

from distmis.tracking.writer import ResilientWriter


class Store:
    """A store that refuses every write while ``away`` is set (as a locked sqlite file or a restarting server)."""

    def __init__(self) -> None:
        self.away = False
        self.rows: list[str] = []
        self.attempts = 0

    def write(self, row: str):
        def do() -> None:
            self.attempts += 1
            if self.away:
                raise OSError("database is locked")
            self.rows.append(row)
        return do


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_writes_are_made_at_once_when_the_store_answers():
    store, clock = Store(), Clock()
    writer = ResilientWriter(clock=clock, sleep=clock.sleep)
    for row in ("create", "epoch 1", "epoch 2"):
        writer.submit(row, store.write(row))
    assert store.rows == ["create", "epoch 1", "epoch 2"] and not writer.pending and clock.slept == []


def test_a_store_away_delays_the_writes_in_order_and_never_raises(caplog):
    store, clock = Store(), Clock()
    writer = ResilientWriter(backoff=(0.2, 1.0), retry_every=10.0, clock=clock, sleep=clock.sleep)
    writer.submit("create", store.write("create"))
    store.away = True
    with caplog.at_level(logging.WARNING, logger="distmis.tracking.writer"):
        writer.submit("epoch 1", store.write("epoch 1"))  # tried 3 times (after 0.2 s and 1 s), then held
    assert clock.slept == [0.2, 1.0] and store.attempts == 1 + 3
    assert "MLflow is unavailable" in caplog.text and [w for w, _ in writer.pending] == ["epoch 1"]
    writer.submit("epoch 2", store.write("epoch 2"))  # queued behind, not tried: the Tune loop is not held up
    assert store.attempts == 4 and len(writer.pending) == 2
    clock.now += 10.0
    writer.submit("epoch 3", store.write("epoch 3"))  # retry_every has passed: one try, no back-off
    assert store.attempts == 5 and len(writer.pending) == 3 and clock.slept == [0.2, 1.0]
    store.away = False
    clock.now += 10.0
    writer.submit("status", store.write("status"))
    assert store.rows == ["create", "epoch 1", "epoch 2", "epoch 3", "status"] and not writer.pending


def test_close_waits_for_the_store_and_says_what_it_could_not_write(caplog):
    store, clock = Store(), Clock()
    writer = ResilientWriter(backoff=(), retry_every=5.0, clock=clock, sleep=clock.sleep)
    store.away = True
    writer.submit("epoch 1", store.write("epoch 1"))

    def back_after(seconds: float):
        def sleep(s: float) -> None:
            clock.sleep(s)
            store.away = clock.now < seconds
        return sleep

    writer.sleep = back_after(12.0)
    assert writer.close(timeout=60.0) and store.rows == ["epoch 1"]
    store.away = True
    writer.sleep = clock.sleep
    writer.submit("epoch 2", store.write("epoch 2"))
    with caplog.at_level(logging.ERROR, logger="distmis.tracking.writer"):
        assert not writer.close(timeout=20.0)
    assert "could not be made (epoch 2)" in caplog.text


def test_a_write_that_fails_for_a_programming_error_is_kept_too():
    writer = ResilientWriter(backoff=(), clock=Clock(), sleep=lambda s: None)

    def broken() -> None:
        raise KeyError("run id")

    writer.submit("broken", broken)  # never raised into the caller (Tune's loop)
    assert [w for w, _ in writer.pending] == ["broken"]
    with pytest.raises(AssertionError):
        assert writer.flush()
