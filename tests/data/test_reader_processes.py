"""The conversion's reader processes and Ctrl-C (distmis.data.tfrecord): a Ctrl-C that arrives while the readers
start is acted on once they have started, never lost; the readers themselves never take it."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from distmis.data.tfrecord import _ctrl_c_held_while_readers_start, _ordered_map


def sigint_blocked_here() -> bool:
    return signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])


@pytest.fixture(autouse=True)
def pythons_own_sigint_handler():
    """SIGINT raises KeyboardInterrupt here, as in a ``distmis`` process, whatever ran in this pytest process before
    (Ray Tune's ``Tuner.fit``, run directly by other tests, installs a handler of its own and leaves it)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("taken_by", ["this thread", "another thread"])
def test_a_ctrl_c_while_the_readers_start_is_raised_once_they_have_started(taken_by: str):
    """SIGINT to the thread that starts the readers waits (blocked); SIGINT taken by another thread of the
    process runs the handler in the main thread at once, which only records it. Either way the window runs to
    its end and KeyboardInterrupt is raised as it closes, with the handler and the mask as they were."""
    bystander_may_end = threading.Event()
    bystander = threading.Thread(target=bystander_may_end.wait, daemon=True)
    bystander.start()
    handler, blocked_before = signal.getsignal(signal.SIGINT), sigint_blocked_here()
    target = threading.main_thread().ident if taken_by == "this thread" else bystander.ident
    window_ran_to_its_end = False
    try:
        with pytest.raises(KeyboardInterrupt):
            with _ctrl_c_held_while_readers_start():
                assert sigint_blocked_here()
                signal.pthread_kill(target, signal.SIGINT)
                time.sleep(0.2)  # a handler that would raise has had its chance
                window_ran_to_its_end = True
    finally:
        bystander_may_end.set()
    assert window_ran_to_its_end
    assert signal.getsignal(signal.SIGINT) is handler and sigint_blocked_here() == blocked_before


def test_without_a_ctrl_c_the_window_raises_nothing_and_restores_the_handler():
    handler = signal.getsignal(signal.SIGINT)
    with _ctrl_c_held_while_readers_start():
        pass
    assert signal.getsignal(signal.SIGINT) is handler and not sigint_blocked_here()


def ctrl_c_to_myself_then_report(item: int, _config: object) -> tuple[int, int, bool]:
    """Reader task: a SIGINT sent to this reader, then its pid and whether it blocks SIGINT (it still lives)."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    return item, os.getpid(), sigint_blocked_here()


def test_readers_finish_their_cases_through_a_ctrl_c_and_the_converting_process_still_takes_one():
    results = list(_ordered_map(ctrl_c_to_myself_then_report, range(6), None, workers=2))
    assert [item for item, _, _ in results] == list(range(6))
    readers = {pid for _, pid, _ in results}
    assert os.getpid() not in readers and 1 <= len(readers) <= 2
    assert all(blocked for _, _, blocked in results)
    assert not sigint_blocked_here() and signal.getsignal(signal.SIGINT) is signal.default_int_handler
