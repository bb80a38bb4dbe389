"""A trial's system use, sampled where it trains: MLflow's system metrics, without MLflow in the trial process.

No trial process opens the tracking store (docs/architecture.md), so MLflow's own monitor (a thread that logs to a
run) cannot run here. :class:`SystemSampler` samples instead, every ``tracking.system_metrics_interval`` seconds in a
background thread and once more at each epoch's end, and the epoch loop (:mod:`distmis.train.loop`) hands the
samples taken since the last report to the driver with the next report (:data:`~distmis.trial.record.SYSTEM_KEY`),
which logs them under MLflow's names, prefixed ``system/`` (:mod:`distmis.tracking.mlflow_tracking`), so the UI's
"System metrics" tab draws them. It reads ``/proc`` through psutil (and NVML through ``pynvml`` for GPUs): well under
a millisecond a sample, in a thread that sleeps in between. MLflow itself is not imported (2 s in every trial
process).

Every rank of a trial samples:

- its own process: ``rank<r>_cpu_utilization_percentage``, its CPU time over the period (its threads', and its
  finished child processes') as a percentage of the CPUs the trial's layout gives the rank (100: every one busy
  all the time), and ``rank<r>_memory_usage_megabytes``, its resident set (MB = 10^6 bytes, as MLflow's). Live
  child processes are not counted: distmis's trainers read their data in threads, and listing a process's children
  reads every process's ``/proc`` entry (tens of milliseconds on a busy node);
- its GPUs, those the process sees (``CUDA_VISIBLE_DEVICES``), when its layout gives it some and NVML is there
  (``pip install nvidia-ml-py``), under MLflow's names ``gpu_<i>_utilization_percentage``,
  ``gpu_<i>_memory_usage_megabytes``, ``gpu_<i>_memory_usage_percentage``, ``gpu_<i>_power_usage_watts``,
  ``gpu_<i>_power_usage_percentage``, ``i`` numbering the trial's GPUs rank by rank (rank r's first is
  ``r x`` its GPU count);
- rank 0 only, its node, as MLflow's own monitor does: ``cpu_utilization_percentage`` (every CPU of the machine),
  ``system_memory_usage_megabytes`` and ``system_memory_usage_percentage``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable

import psutil

from distmis.trial.record import SystemSample

__all__ = ["SystemSampler", "NODE_METRICS", "GPU_METRICS"]

logger = logging.getLogger(__name__)

#: The node's figures, by MLflow's names (mlflow.system_metrics.metrics.cpu_monitor.CPUMonitor).
NODE_METRICS = ("cpu_utilization_percentage", "system_memory_usage_megabytes", "system_memory_usage_percentage")
#: Each GPU's figures, ``gpu_<i>_<name>``, by MLflow's names (mlflow.system_metrics.metrics.gpu_monitor.GPUMonitor).
GPU_METRICS = ("utilization_percentage", "memory_usage_megabytes", "memory_usage_percentage", "power_usage_watts",
               "power_usage_percentage")
MB = 1e6  # MLflow's megabyte


class SystemSampler:
    """Samples of one rank's system use (see the module docstring), taken every ``interval`` seconds by a daemon
    thread (:meth:`start`) and by :meth:`drain`, which hands over those taken since the last drain.

    Each sample's utilizations are averages since the previous sample (CPU time over wall time), its memory
    figures what is held at that moment. ``cpus``: the CPUs the rank was given (its layout's); ``gpus``: whether
    it was given GPUs (their figures are sampled then, if NVML can be loaded). Rank 0 samples the machine's figures
    too.
    """

    def __init__(self, interval: float, *, rank: int = 0, cpus: float = 1.0, gpus: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        if interval <= 0:
            raise ValueError(f"the sampling interval must be positive seconds, got {interval!r}")
        self.interval, self.rank = float(interval), int(rank)
        self.cpus = float(cpus) if cpus and cpus > 0 else float(psutil.cpu_count() or 1)
        self.clock = clock
        self._process = psutil.Process()
        self._lock = threading.Lock()
        self._samples: list[SystemSample] = []
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._gpus = _visible_gpus() if gpus else []
        self._gpu_offset = self.rank * len(self._gpus)
        self._gpu_failures: set[str] = set()
        self._last = (self.clock(), _process_cpu_seconds(self._process), _machine_cpu_times())

    # -- the thread
    def start(self) -> SystemSampler:
        self._thread = threading.Thread(target=self._run, name="distmis-system-metrics", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a figure that cannot be read never stops training
                logger.debug("a system-metrics sample failed", exc_info=True)

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._gpus:  # NVML counts its users: this one is done
            import pynvml

            self._gpus = []
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass

    def __enter__(self) -> SystemSampler:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- samples
    def drain(self) -> list[SystemSample]:
        """A sample now, and every sample since the last drain, oldest first."""
        self.sample()
        with self._lock:
            samples, self._samples = self._samples, []
        return samples

    def sample(self) -> SystemSample:
        """Take one sample (kept for the next :meth:`drain`)."""
        with self._lock:
            now, tree, machine = self.clock(), _process_cpu_seconds(self._process), _machine_cpu_times()
            before_wall, before_tree, before_machine = self._last
            self._last = (now, tree, machine)
            wall = max(now - before_wall, 1e-6)
            prefix = f"rank{self.rank}_"
            values = {f"{prefix}cpu_utilization_percentage": 100.0 * max(0.0, tree - before_tree) / (wall * self.cpus),
                      f"{prefix}memory_usage_megabytes": self._process.memory_info().rss / MB}
            if self.rank == 0:
                busy, total = machine[0] - before_machine[0], machine[1] - before_machine[1]
                memory = psutil.virtual_memory()
                values.update({"cpu_utilization_percentage": 100.0 * busy / total if total > 0 else 0.0,
                               "system_memory_usage_megabytes": memory.used / MB,
                               "system_memory_usage_percentage": 100.0 * memory.used / memory.total})
            values.update(self._gpu_values())
            sample = SystemSample(int(now * 1000), {key: round(value, 3) for key, value in values.items()})
            self._samples.append(sample)
            return sample

    def _gpu_values(self) -> dict[str, float]:
        if not self._gpus:
            return {}
        import pynvml  # loaded by _visible_gpus, which found these GPUs

        values: dict[str, float] = {}
        for index, handle in enumerate(self._gpus):
            prefix = f"gpu_{self._gpu_offset + index}_"
            for what, read in (("memory", _gpu_memory), ("utilization", _gpu_utilization), ("power", _gpu_power)):
                try:
                    values.update({prefix + key: value for key, value in read(pynvml, handle).items()})
                except pynvml.NVMLError as exc:  # not every GPU has every counter (MIG: no utilization)
                    if what not in self._gpu_failures:
                        self._gpu_failures.add(what)
                        logger.warning("no GPU %s figures in this trial's system metrics: %s", what, exc)
        return values


# --------------------------------------------------------------------------- the CPU and memory
def _process_cpu_seconds(process: psutil.Process) -> float:
    """CPU seconds the process has used, those of its finished children included."""
    times = process.cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def _machine_cpu_times() -> tuple[float, float]:
    """The machine's busy and total CPU seconds since boot (as psutil's ``cpu_percent`` counts them: idle and I/O
    wait are not busy; guest time is counted once, in user time)."""
    times = psutil.cpu_times()
    total = sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
    return total - times.idle - getattr(times, "iowait", 0.0), total


# --------------------------------------------------------------------------- the GPUs
def _visible_gpus() -> list[Any]:
    """NVML handles of the GPUs this process sees (``CUDA_VISIBLE_DEVICES``: indices or UUIDs, the first invalid
    one ending the list, as in CUDA); ``[]`` without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except ImportError:
        logger.warning("no GPU figures in this trial's system metrics: NVML's Python binding is not installed "
                       "(pip install nvidia-ml-py)")
        return []
    except Exception as exc:  # noqa: BLE001 - pynvml.NVMLError: no driver
        logger.warning("no GPU figures in this trial's system metrics: NVML did not start (%s)", exc)
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [str(i) for i in range(pynvml.nvmlDeviceGetCount())] if visible is None else visible.split(",")
    handles = []
    for name in (name.strip() for name in names):
        try:
            handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(name)) if name.isdigit()
                           else pynvml.nvmlDeviceGetHandleByUUID(name.encode()))
        except (pynvml.NVMLError, ValueError):
            break
    return handles


def _gpu_memory(pynvml: Any, handle: Any) -> dict[str, float]:
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return {"memory_usage_megabytes": memory.used / MB, "memory_usage_percentage": 100.0 * memory.used / memory.total}


def _gpu_utilization(pynvml: Any, handle: Any) -> dict[str, float]:
    return {"utilization_percentage": float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)}


def _gpu_power(pynvml: Any, handle: Any) -> dict[str, float]:
    milliwatts = pynvml.nvmlDeviceGetPowerUsage(handle)
    limit = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle)
    return {"power_usage_watts": milliwatts / 1000, "power_usage_percentage": 100.0 * milliwatts / limit}
