"""A Ctrl-C is never lost (:func:`interrupts_kept`).

Python runs a signal's handler in the main thread at whatever line it is at. When that line belongs to a
finalizer (a weak reference's callback, a ``__del__``, run as the garbage collector frees an object), the
KeyboardInterrupt the handler raises cannot reach the code around it: Python prints "Exception ignored in ..."
and goes on, and the Ctrl-C is lost (a search's end interrupted so went on to publish its model and exit 0).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["interrupts_kept"]

logger = logging.getLogger(__name__)

AGAIN_AFTER_S = 0.05  # a dropped Ctrl-C is sent again this long after (a person does not notice it)


@contextmanager
def interrupts_kept() -> Iterator[None]:
    """While inside, a KeyboardInterrupt Python had to drop (raised in a finalizer: ``sys.unraisablehook``) is
    sent again as a SIGINT to the main thread, so the handler in place raises it once more, in the code the finalizer
    interrupted. Every other dropped exception is reported as before.

    The SIGINT is sent to the main thread a moment later (:data:`AGAIN_AFTER_S`), from a thread of its own: sent
    at once, Python would run the handler at the hook's next line, where the KeyboardInterrupt would be dropped
    again. Should it land in a finalizer again, the hook sends it again."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            logger.debug("a KeyboardInterrupt raised in %r is sent again", unraisable.object)
            again = threading.Timer(AGAIN_AFTER_S, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
            again.daemon = True
            again.start()
            return
        previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous
