"""Progress through a loop over cases (synthesis, statistics, conversion, inspection, prediction), on stderr.

On a terminal it is a tqdm bar, redrawn in place. Anywhere else (a log file, a pipe, a job's captured output) a
redrawn bar would be one long line of carriage returns, so it is a few plain lines instead: one when the loop
starts, one each further tenth of the cases done at most every :data:`PLAIN_INTERVAL_S` seconds, and one at the
end with the time it took::

    tfrecords: 12 cases
    tfrecords: 12/12 cases in 0:41

Whether stderr is a terminal is its own ``isatty()`` (the CLI's console keeps that true on a terminal while it
filters descriptor 2: :mod:`distmis.cli.console`).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Iterable, Iterator, TextIO, TypeVar

__all__ = ["PLAIN_INTERVAL_S", "CaseProgress", "case_progress", "is_terminal"]

T = TypeVar("T")

#: The shortest time between two plain progress lines before the end (a loop of seconds prints two lines).
PLAIN_INTERVAL_S = 10.0


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (False for anything that cannot say)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(max(seconds, 0.0))), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class CaseProgress:
    """``total`` cases of a loop named ``desc``: :meth:`update` after each, :meth:`close` at the end (or use it as a
    context manager). ``enabled`` False: nothing is shown. ``stream``: default ``sys.stderr`` (read when made);
    ``clock``: seconds, for the plain lines' pacing and the time taken."""

    def __init__(self, total: int, desc: str, *, enabled: bool = True, unit: str = "case",
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.desc, self.unit = int(total), desc, unit
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self._bar: Any = None
        self._plain = False
        self._closed = not enabled
        if not enabled:
            return
        if is_terminal(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=desc, unit=unit, file=self.stream)
        else:
            self._plain = True
            self._started = self._last_line = clock()
            self._next_tenth = 1
            self._write(f"{desc}: {self.total} {self._units(self.total)}")

    def _units(self, count: int) -> str:
        return self.unit if count == 1 else f"{self.unit}s"

    def _write(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def update(self, count: int = 1) -> None:
        if self._closed:
            return
        self.done += count
        if self._bar is not None:
            self._bar.update(count)
            return
        tenths = self.done * 10 // max(self.total, 1)
        if tenths < self._next_tenth or self.done >= self.total:
            return
        self._next_tenth = tenths + 1
        now = self.clock()
        if now - self._last_line >= PLAIN_INTERVAL_S:
            self._last_line = now
            self._write(f"{self.desc}: {self.done}/{self.total} {self._units(self.total)}, "
                        f"{_clock(now - self._started)}")

    def close(self) -> None:
        """The end: the bar closed, or the last plain line (only when every case was done; an error that stopped
        the loop says what happened itself)."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self._plain and self.done >= self.total:
            self._write(f"{self.desc}: {self.done}/{self.total} {self._units(self.total)} in "
                        f"{_clock(self.clock() - self._started)}")

    def __enter__(self) -> CaseProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def case_progress(items: Iterable[T], desc: str, *, enabled: bool = True, total: int | None = None,
                  unit: str = "case") -> Iterator[T]:
    """``items``, one at a time, with their progress shown (see :class:`CaseProgress`); ``total``: default
    ``len(items)``."""
    items = list(items) if total is None and not hasattr(items, "__len__") else items
    count = total if total is not None else len(items)  # type: ignore[arg-type]
    with CaseProgress(count, desc, enabled=enabled, unit=unit) as progress:
        for item in items:
            yield item
            progress.update()
