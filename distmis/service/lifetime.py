"""A child process that dies with the process that started it, even one killed by SIGKILL (which runs no handler
that could stop the child): Linux's parent-death signal."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable

#: Linux's ``prctl`` option that has the kernel signal a process when its parent dies (``<linux/prctl.h>``).
PR_SET_PDEATHSIG = 1


def dies_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen` after which the child gets ``sig`` when this process dies,
    however it dies (SIGKILL included); None where the system has no such signal (anything but Linux).

    The kernel sends it when the *thread* that started the child ends: start the child from a thread that lives as
    long as the process (the main thread, as ``distmis ui`` does). The setting survives the child's ``exec`` but not
    its own forks, so the child must take its own children down (``mlflow server`` does, on SIGTERM). libc's
    ``prctl`` is looked up here, in the parent: the function runs in the child between fork and exec, where loading
    a library could wait forever on a lock another thread held at the fork. A parent that died before the child's
    ``prctl`` ran is caught too: the child has another parent by then, and signals itself.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # this interpreter's libc
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec
