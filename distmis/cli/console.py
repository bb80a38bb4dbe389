"""distmis owns its console: what a person reads, and the libraries' noise only with ``--verbose``.

A command's console is set up once, before the libraries are imported (:func:`console`):

* **Library logs.** MLflow logs at WARNING (no ``INFO mlflow...`` lines, no download bars), Ray at ERROR in
  this process (its start-up notices stay out); Ray Tune's own reporter is off and trial processes' output is not
  forwarded (:func:`distmis.search.ray_session.ray_connection`): it stays in Ray's log files
  (``/tmp/ray/session_latest/logs``). ``--verbose`` leaves all of them as the libraries set them.
* **Native noise.** TensorFlow writes its absl and oneDNN notices (``WARNING: All log messages before
  absl::InitializeLog()``, ``I0000 ... port.cc:153] oneDNN custom operations are on``) straight to file
  descriptor 2 from C++, whatever ``TF_CPP_MIN_LOG_LEVEL`` says, in this process and in the processes it starts.
  :class:`NativeStderrFilter` puts a pipe on descriptor 2 and passes on every line except absl's info and
  warning lines: errors and fatal messages, and Python's own tracebacks, still reach the console.
* **No ANSI codes** where stdout or stderr is not a terminal (a log file, a pipe): colour codes a library writes
  through Python's streams are stripped (:class:`StripAnsi`), and Ray is told not to colour its prefixes.
* **No redrawn lines** off a terminal: distmis's own progress (:mod:`distmis.data.case_progress`) is a bar on a
  terminal and a few plain lines elsewhere, and MLflow's artifact bars are off. On a terminal ``sys.stderr`` still
  says it is one while descriptor 2 goes through the filter's pipe (:class:`FilteredTerminal`).
"""

from __future__ import annotations

import io
import logging
import os
import re
import sys
import threading
from contextlib import contextmanager
from typing import Iterator, TextIO

__all__ = ["ANSI", "NATIVE_NOISE", "FilteredTerminal", "NativeStderrFilter", "StripAnsi", "console",
           "quiet_environment"]

#: An ANSI escape sequence (colours, cursor moves).
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
#: The lines of TensorFlow's C++ logging that say nothing to a person running a search: absl's notice that it
#: logs before being set up, and absl-format info and warning lines (``I0000 00:00:1795617414.390555  5158
#: port.cc:153] ...``). Errors (``E...``) and fatal lines (``F...``) are kept.
NATIVE_NOISE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\) is called"
                          r"|[IW]\d{4} [\d:.]+\s+\d+ [\w./-]+:\d+\])")


def quiet_environment(*, verbose: bool, colour: bool) -> dict[str, str]:
    """Environment variables read by the libraries when they are imported (set with ``setdefault``: a user's own
    setting wins). ``colour``: whether the console is a terminal."""
    env: dict[str, str] = {}
    if not verbose:
        env.update({"MLFLOW_LOGGING_LEVEL": "WARNING", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"})
    if not colour:
        env["RAY_COLOR_PREFIX"] = "0"
    return env


class StripAnsi(io.TextIOBase):
    """A text stream that writes to ``stream`` with every ANSI escape sequence removed."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(ANSI.sub("", text))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", "utf-8")

    def __getattr__(self, name: str) -> object:  # buffer, errors, ...: the wrapped stream's
        return getattr(self.stream, name)


class FilteredTerminal(StripAnsi):
    """``sys.stderr`` while descriptor 2 is :class:`NativeStderrFilter`'s pipe in front of a terminal: written as
    it is, and a terminal to whoever asks (``isatty()``), as the console a person sees is."""

    def write(self, text: str) -> int:
        self.stream.write(text)
        return len(text)

    def isatty(self) -> bool:
        return True


class NativeStderrFilter:
    """File descriptor 2 through a pipe that drops :data:`NATIVE_NOISE` lines (see the module's docstring).

    Everything written to descriptor 2 (Python's ``sys.stderr`` included) goes through a reader thread, in order,
    line by line; a line that is still being drawn (a progress bar's ``\r`` updates) is passed on at once.
    :meth:`stop` puts descriptor 2 back and lets the thread pass on what is still in the pipe.
    """

    def __init__(self) -> None:
        self._console = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self._read = read
        self._strip = not os.isatty(self._console)
        self._thread = threading.Thread(target=self._pump, name="distmis-stderr-filter", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self._read, 65536)
            except OSError:
                break
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            kept = b"".join(line + b"\n" for line in lines if not NATIVE_NOISE.match(line.decode("utf-8", "replace")))
            drawn = pending.rfind(b"\r") + 1  # a progress bar redrawing its line: shown now, not at its end
            if drawn:
                kept, pending = kept + pending[:drawn], pending[drawn:]
            if kept:
                self._emit(kept)
        if pending and not NATIVE_NOISE.match(pending.decode("utf-8", "replace")):
            self._emit(pending)

    def _emit(self, data: bytes) -> None:
        if self._strip:
            data = ANSI.sub("", data.decode("utf-8", "replace")).encode("utf-8")
        try:
            os.write(self._console, data)
        except OSError:
            pass

    def stop(self, timeout: float = 0.5) -> None:
        """Descriptor 2 back on the console; what the pipe still holds is passed on for up to ``timeout`` s (a
        process that inherited the pipe and still runs keeps it open: the thread is a daemon)."""
        sys.stderr.flush()
        os.dup2(self._console, 2)
        self._thread.join(timeout)


@contextmanager
def console(*, verbose: bool, native: bool = True) -> Iterator[None]:
    """A command's console (see the module's docstring), for the duration of the context. ``native``: filter
    descriptor 2 (:class:`NativeStderrFilter`; not for a command whose child processes outlive it)."""
    colour = sys.stdout.isatty() and sys.stderr.isatty()
    terminal = sys.stderr.isatty()  # before the filter's pipe takes descriptor 2
    for key, value in quiet_environment(verbose=verbose, colour=colour).items():
        os.environ.setdefault(key, value)
    pipe = None
    if not verbose:
        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
        # the driver's own TensorFlow (the best model's scoring): its retracing advice is for TensorFlow's users
        logging.getLogger("tensorflow").setLevel(logging.ERROR)
        # not when a caller captures sys.stderr itself (a test's capsys)
        if native and _writes_to_descriptor_2(sys.stderr):
            try:
                pipe = NativeStderrFilter()
            except OSError:  # no descriptor 2 to put a pipe on (a daemon): nothing to filter
                pipe = None
    streams = sys.stdout, sys.stderr
    if not sys.stdout.isatty():
        sys.stdout = StripAnsi(sys.stdout)  # type: ignore[assignment]
    if not terminal:
        sys.stderr = StripAnsi(sys.stderr)  # type: ignore[assignment]
    elif pipe is not None:
        sys.stderr = FilteredTerminal(sys.stderr)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout, sys.stderr = streams
        if pipe is not None:
            pipe.stop()


def _writes_to_descriptor_2(stream: TextIO) -> bool:
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        return False
