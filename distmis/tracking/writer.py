"""MLflow writes that cannot sink a search: retried, kept in order while the store is away, never raised.

The driver's Tune callback writes every trial's records. A tracking store that is briefly unavailable (a
sqlite file locked by a reader, a tracking server restarting) must not fail the Tune loop and with it every
running trial. :class:`ResilientWriter` runs each write at once when it can; a failed write is retried with
back-off, and while the store stays away the writes wait in a queue, in their order (a run is created before
its metrics are logged), retried at most every ``retry_every`` seconds so the Tune loop is not held up, and
flushed when the store answers again or when the search ends (:meth:`close`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, Sequence

logger = logging.getLogger(__name__)


class ResilientWriter:
    """Ordered, retried writes. ``submit(what, write)``: ``write()`` now, or later if the store is away."""

    def __init__(self, backoff: Sequence[float] = (0.2, 1.0), retry_every: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.backoff, self.retry_every = tuple(backoff), retry_every
        self.clock, self.sleep = clock, sleep
        self.pending: deque[tuple[str, Callable[[], None]]] = deque()
        self.failed_attempts = 0  # flushes that found the store away (their writes stayed queued)
        self._next_try = 0.0

    def submit(self, what: str, write: Callable[[], None]) -> None:
        """Queue ``write`` behind any earlier ones and flush what the store takes now. Never raises."""
        self.pending.append((what, write))
        if len(self.pending) == 1 or self.clock() >= self._next_try:
            self.flush(self.backoff if len(self.pending) == 1 else ())

    def flush(self, backoff: Sequence[float] = ()) -> bool:
        """Run the queued writes in order, each retried after every delay in ``backoff``; True when all are done."""
        while self.pending:
            what, write = self.pending[0]
            for delay in (*backoff, None):
                try:
                    write()
                    break
                except Exception as exc:  # noqa: BLE001 - any store error: keep the write for later
                    if delay is None:
                        self.failed_attempts += 1
                        self._next_try = self.clock() + self.retry_every
                        logger.warning("MLflow is unavailable (%s: %s); %d write(s) wait and will be retried",
                                       type(exc).__name__, exc, len(self.pending))
                        return False
                    self.sleep(delay)
            self.pending.popleft()
        return True

    def close(self, timeout: float = 300.0) -> bool:
        """At the end of a search: keep retrying the queued writes for up to ``timeout`` seconds."""
        deadline = self.clock() + timeout
        while not self.flush(self.backoff):
            if self.clock() >= deadline:
                logger.error("MLflow stayed unavailable for %.0f s: %d write(s) could not be made (%s)", timeout,
                             len(self.pending), ", ".join(what for what, _ in list(self.pending)[:10]))
                return False
            self.sleep(min(self.retry_every, max(0.0, deadline - self.clock())))
        return True
