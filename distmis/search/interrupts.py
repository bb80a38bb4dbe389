"""How a signal stops a search: Ctrl-C (SIGINT) and SIGTERM (``distmis stop``, a batch scheduler) while Tune runs
the trials (:func:`signals_stop_tune`: Tune stops gracefully) and while the driver sets up or ends the search
(:func:`sigterm_interrupts`: SIGTERM raises as Ctrl-C does); either way the caller raises :class:`SearchInterrupted`
once the unfinished runs are marked KILLED, the interrupted code's frames let go first (:func:`let_go`)."""

from __future__ import annotations

import gc
import os
import signal
import threading
import traceback
from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["SearchInterrupted", "let_go", "signals_stop_tune", "sigterm_interrupts"]


class SearchInterrupted(KeyboardInterrupt):
    """The search was stopped by a signal (Ctrl-C, SIGTERM from ``distmis stop`` or a scheduler); its MLflow runs
    that had not finished are marked KILLED. ``exit_code`` is the shell's: 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        super().__init__(f"search interrupted by {signal.Signals(self.signum).name}; unfinished runs marked KILLED "
                         "(the same command with --resume continues it)")


def let_go(interrupt: BaseException) -> None:
    """Clear the locals of the frames ``interrupt`` (a Ctrl-C's KeyboardInterrupt, being handled) was raised through,
    and of those its context (an error raised while they unwound) was, and collect them, before the handler writes
    to the tracking store. What they held open goes with them: an MLflow read of a sqlite store cut between its
    statement and its last row holds the file's shared lock while its cursor lives, and every write (the runs marked
    KILLED) would wait out sqlite's busy timeout (MLflow sets 20 s) and fail. The frames themselves may live on (a
    context manager's ``__exit__`` holds the traceback), so their locals are cleared (``traceback.clear_frames``:
    not those of the frames still running, the handler's and its callers')."""
    seen: set[int] = set()
    error: BaseException | None = interrupt
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__context__
    gc.collect()  # the frames of a cut-short library call are often in reference cycles


@contextmanager
def signals_stop_tune() -> Iterator[dict[str, int]]:
    """While Tune runs, Ctrl-C (SIGINT) and SIGTERM stop it gracefully: Tune ends its loop, stops the running
    trials and saves its state, instead of the driver dying with every run left RUNNING. A second signal stops at
    once (KeyboardInterrupt). Yields what was received (``{"signal": 15}``): Tune ends the trials it stopped as
    TERMINATED, like finished ones, and returns normally, so this is how the caller knows it was interrupted.

    Tune's own SIGINT handler is turned off (``TUNE_DISABLE_SIGINT_HANDLER``) for this one, which records the
    signal and asks Tune to stop through SIGUSR1, which Tune always handles alike.
    """
    received: dict[str, int] = {}
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
        yield received
        return

    def stop(signum: int, frame: Any) -> None:
        if received:  # the second: stop now
            raise KeyboardInterrupt
        received["signal"] = signum
        os.kill(os.getpid(), signal.SIGUSR1)  # Tune's handler ends its loop gracefully

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    tune_handler = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"  # read by Tuner.fit when it starts
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if tune_handler is None:
            os.environ.pop("TUNE_DISABLE_SIGINT_HANDLER", None)
        else:
            os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = tune_handler


@contextmanager
def sigterm_interrupts() -> Iterator[dict[str, int]]:
    """SIGTERM raises KeyboardInterrupt as Ctrl-C does (in the search's end: scoring and publishing the best
    model), so that the caller can mark the search's run KILLED rather than the driver dying with it RUNNING.
    Yields what was received (``{"signal": 15}``; empty for Ctrl-C, whose KeyboardInterrupt Python raises)."""
    received: dict[str, int] = {}
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def interrupt(signum: int, frame: Any) -> None:
        received["signal"] = signum
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)
