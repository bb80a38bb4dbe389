"""How the trials of one search are laid out on the cluster.

Three shapes, one dataclass:

- experiment-parallel: every trial is one process (a Ray Tune actor); many trials at once.
- data-parallel: every trial is a Ray Train run over N workers; one trial at a time.
- hybrid: experiment-parallel trials that are each data-parallel over k workers; as many at once as
  the cluster has room for k-worker trials.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from distmis.spec.schema import ResourcesSpec, Spec

# A data-parallel trial's own process only drives its Ray Train run; it must not hold a CPU that a
# training worker needs. Ray refuses an empty request, so it asks for a token amount of memory.
DRIVER_RESOURCES = {"cpu": 0, "memory": 2**20}


def resources_dict(spec: ResourcesSpec) -> dict[str, float]:
    """A spec's ``{cpu, gpu}`` as the dict Ray takes."""
    return {"cpu": spec.cpu, "gpu": spec.gpu}


@dataclass(frozen=True)
class TrialPlan:
    mode: Literal["experiment", "data"]
    workers_per_trial: int
    distributed: bool  # True: each trial is a Ray Train run (even with one worker)
    max_concurrent_trials: int | None
    trial_resources: dict[str, float]  # what Tune reserves for the trial's own process
    worker_resources: dict[str, float]  # what each Ray Train worker reserves (distributed trials)

    @property
    def label(self) -> str:
        if self.mode == "data":
            return f"data-parallel, {self.workers_per_trial} worker(s) per trial"
        if self.distributed:
            return f"hybrid: {self.max_concurrent_trials or 'as many as fit'} trial(s) x {self.workers_per_trial} workers"
        return f"experiment-parallel, {self.max_concurrent_trials or 'as many as fit'} trial(s) at once"


def experiment_plan(spec: Spec, *, cluster_workers: int | None = None) -> TrialPlan:
    """The spec's experiment mode: one process per trial, or hybrid with ``workers_per_trial > 1``.

    ``cluster_workers``: worker slots in the cluster; a hybrid search runs ``cluster_workers // k`` trials at once.
    """
    par = spec.parallelism
    k = par.workers_per_trial
    ranks_per_trial = k * max(sequence_parallel_degrees(spec))  # a vit-seg trial of SP degree s holds k * s workers
    if ranks_per_trial == 1:
        return TrialPlan("experiment", 1, False, par.max_concurrent_trials, resources_dict(par.resources_per_trial), {})
    limits = [n for n in (par.max_concurrent_trials, cluster_workers and max(1, cluster_workers // ranks_per_trial))
              if n]
    return TrialPlan("experiment", k, True, min(limits) if limits else None,
                     DRIVER_RESOURCES, resources_dict(par.resources_per_worker))


def sequence_parallel_degrees(spec: Spec) -> list[int]:
    """The sequence-parallel degrees the search's trials may use: the spec's, or every searched value."""
    domain = spec.search.space.get("parallelism.sequence_parallel.degree")
    if domain is None:
        return [spec.parallelism.sequence_parallel.degree]
    return sorted({int(v) for v in domain.values})


def data_plan(spec: Spec, workers: int) -> TrialPlan:
    """Trials one after another, each data-parallel over ``workers`` workers."""
    return TrialPlan("data", workers, True, 1, DRIVER_RESOURCES, resources_dict(spec.parallelism.resources_per_worker))


def compare_plans(spec: Spec, workers: int) -> dict[str, TrialPlan]:
    """The two sides of one column of the speedup table, on the same ``workers`` worker slots:
    ``workers`` one-worker trials at once, or one trial at a time over ``workers`` workers."""
    worker = resources_dict(spec.parallelism.resources_per_worker)
    return {
        "experiment": TrialPlan("experiment", 1, False, workers, worker, {}),
        "data": data_plan(spec, workers),
    }


def cluster_worker_slots(worker_resources: dict[str, float]) -> int:
    """How many workers of this size the connected Ray cluster holds (CPU- or GPU-bound)."""
    import ray

    total = ray.cluster_resources()
    slots = []
    if worker_resources.get("cpu"):
        slots.append(int(total.get("CPU", 0) // worker_resources["cpu"]))
    if worker_resources.get("gpu"):
        slots.append(int(total.get("GPU", 0) // worker_resources["gpu"]))
    return max(1, min(slots)) if slots else 1
