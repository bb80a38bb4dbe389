import os
import signal
import sys


def _interrupted_while_importing(signum: int, frame: object) -> None:
    """Ctrl-C while the command is still being imported: one line and 130, whatever the library being imported
    makes of a KeyboardInterrupt (numpy's C core turns one into an ImportError with a traceback)."""
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)


signal.signal(signal.SIGINT, _interrupted_while_importing)
try:
    from distmis.cli.main import run
except KeyboardInterrupt:  # a SIGINT raised before the handler above was in place
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)
signal.signal(signal.SIGINT, signal.default_int_handler)  # the command handles its own from here

run()
