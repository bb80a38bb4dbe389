"""A Ctrl-C that lands in a finalizer is raised again where the program was (distmis.cli.signals)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A real SIGINT handled while a weak reference's callback runs (as the garbage collector frees an object in the
# middle of a search's end), then two seconds of work the Ctrl-C should have stopped.
PROGRAM = textwrap.dedent("""
    import signal, sys, time, weakref
    from contextlib import nullcontext
    from distmis.cli.signals import interrupts_kept

    class Thing:
        pass

    def finalizer(reference):
        signal.raise_signal(signal.SIGINT)  # Python runs the handler at the callback's next line or so
        for _ in range(100_000):
            pass

    kept = interrupts_kept() if sys.argv[1] == "kept" else nullcontext()
    try:
        with kept:
            thing = Thing()
            reference = weakref.ref(thing, finalizer)
            del thing  # the callback runs here
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                pass
        print("went on")
        sys.exit(0)
    except KeyboardInterrupt:
        print("interrupted")
        sys.exit(130)
""")


def run(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PROGRAM, mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_a_ctrl_c_in_a_finalizer_interrupts_the_program():
    lost = run("plain")  # without it Python drops the KeyboardInterrupt: what the test guards against
    assert (lost.returncode, lost.stdout.strip()) == (0, "went on"), lost.stderr
    assert "Exception ignored" in lost.stderr and "KeyboardInterrupt" in lost.stderr
    kept = run("kept")
    assert (kept.returncode, kept.stdout.strip()) == (130, "interrupted"), kept.stderr
    assert "Exception ignored" not in kept.stderr, kept.stderr


def test_other_exceptions_in_finalizers_are_still_reported_and_the_hook_is_put_back():
    import weakref

    from distmis.cli.signals import interrupts_kept

    class Thing:
        pass

    def finalizer(reference: object) -> None:
        raise ValueError("a finalizer's own failure")

    before = sys.unraisablehook
    seen: list[type[BaseException] | None] = []
    sys.unraisablehook = reporter = lambda unraisable: seen.append(unraisable.exc_type)
    try:
        with interrupts_kept():
            thing = Thing()
            reference = weakref.ref(thing, finalizer)
            del thing
            assert reference() is None
        assert sys.unraisablehook is reporter
    finally:
        sys.unraisablehook = before
    assert seen == [ValueError]
