"""The predicted makespan of a search on W workers, by mode, before anything runs (``distmis plan SPEC --workers W``).

Each trial's cost (:class:`~distmis.perf.makespan.TrialCost`) comes from its traced training step
(:func:`~distmis.search.trial_steps.trial_steps`: the FLOPs of a step of its network, tile and batch) at the
worker's rate (``device_flops``, the rate a worker reaches on these steps: a GPU's or CPU's peak times the share a
convolution reaches of it):

* an epoch's training: ``ceil(train cases / batch)`` steps of the step's FLOPs;
* its validation: every validation case by sliding windows of the tile (overlap ``training.inference.overlap``),
  each window the forward FLOPs of one sample, run whole by every worker of a data-parallel trial;
* the gradients all-reduced each step: 4 bytes a trained parameter;
* the epochs: ``training.epochs``, or under ASHA the epochs it is expected to stop each trial at
  (:func:`~distmis.perf.makespan.asha_epochs`);
* the start-up and a fixed cost per step: given (``startup_seconds``, ``step_overhead``).

The search's trials (:func:`~distmis.search.search_space.num_trials`, folds included) take the distinct steps the
search can take in turn. The schedules are then those of :func:`~distmis.perf.makespan.pack`: experiment-parallel,
data-parallel at every degree up to W, and auto.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from distmis.perf.makespan import Cluster, Schedule, TrialCost, asha_epochs, pack
from distmis.spec.schema import Spec

__all__ = ["Hardware", "MakespanPlan", "split_sizes", "validation_windows", "search_costs", "plan_makespan",
           "format_makespan"]


@dataclass(frozen=True)
class Hardware:
    """A worker's rate on the search's steps (FLOP/s), a trial's start-up (s) and the fixed cost of a step (s)."""

    device_flops: float
    startup_seconds: float = 10.0
    step_overhead: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.device_flops) and self.device_flops > 0):
            raise ValueError(f"device_flops must be a positive rate, got {self.device_flops!r}")
        for name in ("startup_seconds", "step_overhead"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be a non-negative number of seconds, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class MakespanPlan:
    """The search's trials' costs and their schedules: experiment, data at each degree, then auto (last)."""

    cluster: Cluster
    costs: tuple[TrialCost, ...]
    schedules: tuple[Schedule, ...]

    @property
    def auto(self) -> Schedule:
        return self.schedules[-1]


def split_sizes(spec: Spec) -> tuple[int, int]:
    """(training, validation) cases of one trial: the split's, or with folds one fold's validation and the other
    folds' training, from the data set's cases (or, not generated yet, ``dataset.synthetic.cases``)."""
    from distmis.data.layouts import Layout, discover_cases
    from distmis.data.split import make_split

    root = Path(spec.dataset.path)
    if root.exists():
        count = len(discover_cases(root, Layout(spec.dataset.layout)))
    elif spec.dataset.synthetic is not None:
        count = spec.dataset.synthetic.cases
    else:
        raise ValueError(f"dataset.path {str(root)!r} does not exist: its cases cannot be counted")
    ids = [f"case{i:05d}" for i in range(count)]
    s = spec.dataset.split
    if s.folds is not None:
        split = make_split(ids, test=s.test, seed=s.seed, folds=s.folds)
        val = len(split["folds"][0])
        return sum(len(fold) for fold in split["folds"]) - val, val
    split = make_split(ids, train=s.train, val=s.val, test=s.test, seed=s.seed)
    return len(split["train"]), len(split["val"])


def validation_windows(volume: tuple[int, ...], tile: tuple[int, ...], overlap: float) -> int:
    """The sliding windows of ``tile`` over ``volume`` at ``overlap`` (MONAI's: a step of ``tile * (1 - overlap)``
    voxels, at least one)."""
    count = 1
    for v, t in zip(volume, tile):
        if v > t:
            step = max(1, int(t * (1 - overlap)))
            count *= math.ceil((v - t) / step) + 1
    return count


def search_costs(spec: Spec, hardware: Hardware, *, device: Literal["cpu", "cuda"] = "cuda",
                 threads: int = 1) -> list[TrialCost]:
    """Each trial of the search, costed as the module docstring says."""
    from distmis.search.data_shape import data_shape
    from distmis.search.search_space import num_trials
    from distmis.search.trial_steps import trial_steps

    train, val = split_sizes(spec)
    try:
        volume = data_shape(spec).volume
    except (ValueError, OSError):
        volume = None
    steps = [step for step in trial_steps(spec, device=device, threads=threads) if step.memory is not None]
    if not steps:
        raise ValueError(f"no training step of {spec.name} can be traced: the search's trials cannot be costed")
    trials = num_trials(spec)
    search = spec.search
    if search.scheduler == "asha":
        epochs = asha_epochs(trials, spec.training.epochs, search.asha.grace_period, search.asha.reduction_factor)
    else:
        epochs = [float(spec.training.epochs)] * trials
    costs = []
    for index in range(trials):
        step = steps[index % len(steps)]
        trace = step.memory.trace  # type: ignore[union-attr]
        batches = max(1, math.ceil(train / step.batch))
        tile = step.tile or volume
        windows = validation_windows(volume, tile, spec.training.inference.overlap) if volume and tile else 1
        forward = trace.forward_flops / max(1, step.batch)
        costs.append(TrialCost(
            name=f"t{index:03d}", epochs=epochs[index],
            train_seconds=batches * trace.flops / hardware.device_flops, steps=batches,
            step_overhead=hardware.step_overhead, gradient_bytes=4.0 * trace.parameters,
            validate_seconds=val * windows * forward / hardware.device_flops,
            startup_seconds=hardware.startup_seconds, max_degree=None))
    return costs


def plan_makespan(spec: Spec, cluster: Cluster, hardware: Hardware, *, device: Literal["cpu", "cuda"] = "cuda",
                  threads: int = 1) -> MakespanPlan:
    """The search's schedules on ``cluster``: experiment, data at each degree up to its workers, and auto."""
    costs = search_costs(spec, hardware, device=device, threads=threads)
    schedules = [pack(costs, cluster, "experiment")]
    schedules += [pack(costs, cluster, "data", degree=d) for d in range(2, cluster.workers + 1)]
    schedules.append(pack(costs, cluster, "auto"))
    return MakespanPlan(cluster, tuple(costs), tuple(schedules))


def _duration(seconds: float) -> str:
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def format_makespan(plan: MakespanPlan) -> str:
    """The predicted makespans, by mode, and auto's schedule, as the console prints them."""
    cluster = plan.cluster
    nodes = f", {cluster.node_size} per node" if cluster.per_node else ""
    lines = [f"{len(plan.costs)} trial(s) on {cluster.workers} worker(s){nodes}: predicted makespan by mode",
             "| mode | makespan | speedup | idle |", "|---|---|---|---|"]
    serial = sum(cost.seconds(1, cluster) for cost in plan.costs)
    best = min(s.makespan for s in plan.schedules[:-1])
    for schedule in plan.schedules:
        mark = " (best fixed)" if schedule.makespan == best and schedule is not plan.auto else ""
        lines.append(f"| {schedule.mode}{mark} | {_duration(schedule.makespan)} | "
                     f"{serial / schedule.makespan if schedule.makespan else 0:.2f} | {schedule.idle_fraction:.0%} |")
    lines.append("")
    lines.append("auto's schedule (trial: workers, start - end):")
    for p in sorted(plan.auto.placements, key=lambda p: (p.start, p.workers)):
        lines.append(f"  {p.trial}: {p.degree} worker(s) {list(p.workers)}, {_duration(p.start)} - {_duration(p.end)}")
    return "\n".join(lines)
