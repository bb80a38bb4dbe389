"""``python -m distmis.service.guard COMMAND...``: run COMMAND in this process's group, and take the whole group down
when this process is told to stop, which the kernel does when the process that started it dies (distmis starts it
in a session of its own with :func:`~distmis.service.lifetime.dies_with_parent`).

``mlflow server`` needs it: on SIGTERM it stops its uvicorn worker and then exits, but its job runner and that
runner's huey consumers only notice, each by polling its own parent once a second, and only once their imports are
done (tens of seconds on a loaded machine), and nothing of it kills its process group. The guard sends the group
SIGTERM (graceful shutdowns), waits up to :data:`GRACE_S` seconds for COMMAND, then SIGKILLs whatever of the group
is left, itself included. A COMMAND that ends by itself ends the guard with its exit code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

#: How long COMMAND may take to stop after SIGTERM before its process group is SIGKILLed.
GRACE_S = 5.0

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def main(command: list[str]) -> int:
    if not command:
        print("usage: python -m distmis.service.guard COMMAND [ARG...]", file=sys.stderr)
        return 2
    child: subprocess.Popen | None = None

    def stop(signum: int, frame: Any) -> None:
        for sig in STOP_SIGNALS:  # this process takes the group's SIGTERM below, and any later one, as done
            signal.signal(sig, signal.SIG_IGN)
        os.killpg(0, signal.SIGTERM)
        if child is not None:
            try:
                child.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        os.killpg(0, signal.SIGKILL)  # what is left of the group: COMMAND's children, and this process

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)
    child = subprocess.Popen(command)
    return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
