"""What a training step costs on one rank: its wall time and how far its peak memory rises (:class:`StepMeter`),
read from ``/proc`` on the CPU and from the CUDA allocator on a GPU."""

from __future__ import annotations

import resource
import sys
import time
from typing import Callable

import torch

__all__ = ["StepMeter"]


def _proc_status_bytes(field: str) -> int | None:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``, given in KiB) in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere), so that the
    resident set holds what is in use, as in a process that has just started, not what earlier work freed."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):  # not glibc
        pass


def _reset_resident_peak() -> bool:
    """Set the process's resident-set high-water mark (``VmHWM``) to its current resident set (Linux:
    ``5`` to ``/proc/self/clear_refs``, which touches nothing else); False where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return _proc_status_bytes("VmHWM") is not None


def _lifetime_resident_peak() -> int:
    """``getrusage``'s ``ru_maxrss`` in bytes (KiB on Linux, bytes on macOS): the peak since the process began."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class StepMeter:
    """One rank's training steps of an epoch: their mean wall time, and how far their peak memory rises above
    the parameters (what :attr:`~distmis.perf.model.MemoryEstimate.step` predicts).

    A step is timed from the moment its batch is in hand (the wait for the reading thread is not counted) to
    its loss read back after the optimizer's step: the batch's copy to the device, forward, loss, backward,
    gradient synchronization (DDP's all-reduce, or the SP and DP collectives) and the optimizer; on CUDA after a
    ``synchronize``, so every kernel of the step is in it.

    Memory is the epoch's peak less a baseline taken just before its first step (its batch in hand):

    - CUDA: ``torch.cuda.max_memory_allocated`` (its peak reset at :meth:`start_epoch`) less ``memory_allocated``;
    - CPU: the resident set's high-water mark ``VmHWM`` (reset at :meth:`start_epoch` through
      ``/proc/self/clear_refs``; in a process that has not peaked before it is the ``getrusage`` ``ru_maxrss``
      that ``benchmarks/sp_scaling.py`` reads) less the resident set ``VmRSS``. The C heap's free pages are given
      back first (glibc's ``malloc_trim``): else the steps reuse what earlier epochs and validation freed, and
      the resident set does not show them. Where the peak cannot be reset (no ``/proc``) the process's lifetime
      peak (``ru_maxrss``) is used.

    ``held`` gives the bytes of training state earlier steps left in place (gradients, the optimizer's moments:
    none before a trainer's first step); they are taken off the baseline, so every epoch counts them as the first
    does. On CPU the first epoch also counts what first use pages in (library code, kernel caches), and every
    epoch the allocator's own overhead and the batches the reading thread prepares.
    """

    def __init__(self, device: torch.device, held: Callable[[], float] | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.held = held or (lambda: 0.0)
        self.baseline: float | None = None  # bytes in use before this epoch's first step, less `held`
        self.seconds = 0.0
        self.steps = 0
        self._resettable = False
        self._started: float | None = None

    def _in_use(self) -> float:
        if self.cuda:
            return float(torch.cuda.memory_allocated(self.device))
        rss = _proc_status_bytes("VmRSS")
        if rss is None:
            import psutil

            rss = psutil.Process().memory_info().rss
        return float(rss)

    def _peak(self) -> float:
        if self.cuda:
            return float(torch.cuda.max_memory_allocated(self.device))
        hwm = _proc_status_bytes("VmHWM") if self._resettable else None
        return float(hwm if hwm is not None else _lifetime_resident_peak())

    def start_epoch(self) -> None:
        """Forget the previous epoch's steps and reset the memory peak."""
        self.seconds, self.steps, self._started, self.baseline = 0.0, 0, None, None
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _trim_heap()
            self._resettable = _reset_resident_peak()

    def start_step(self) -> None:
        """A step begins (its batch is in hand)."""
        if self.baseline is None:
            self.baseline = self._in_use() - self.held()
        self._started = time.perf_counter()

    def end_step(self) -> None:
        """The step has ended (its loss has been read back)."""
        if self._started is None:
            raise RuntimeError("end_step without start_step")
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - self._started
        self.steps += 1
        self._started = None

    @property
    def step_seconds(self) -> float:
        """Mean seconds of this epoch's steps."""
        if not self.steps:
            raise ValueError("no step measured this epoch")
        return self.seconds / self.steps

    @property
    def peak_bytes(self) -> float:
        """This epoch's peak above the baseline (0 if the memory in use fell below it)."""
        if self.baseline is None:
            raise ValueError("no step measured this epoch")
        return max(0.0, self._peak() - self.baseline)
