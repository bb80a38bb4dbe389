"""How long a search's trials take on W workers, each at the data-parallel degree it is given, and how they are
packed onto the workers so that the last one ends soonest (DistMIS's question, experiment- against data-parallel,
answered for one search rather than measured by running it twice).

A trial's time at degree ``k`` (:meth:`TrialCost.seconds`): its start-up, then its epochs, each the training
compute over ``k`` workers, plus, per step of a worker's share of the epoch, the fixed per-step cost and the ring
all-reduce of its gradients (``2 (k - 1) / k`` of their bytes over the link between its workers, and ``2 (k - 1)``
latencies: inside a node, or between nodes once ``k`` exceeds the workers of one), plus the validation, which every
worker of a data-parallel trial runs whole.

The packing (:func:`pack`) treats the trials as moldable jobs: each is given a degree, then placed, in order, on the
``k`` workers that are free first (one node's, where ``k`` fits in one, as Ray's packed placement groups place
them), starting when the last of them is free; it holds them until it ends. Three ways to choose the degrees:

* ``experiment``: every trial on one worker, many at once (Ray Tune's experiment parallelism);
* ``data`` at degree ``d``: every trial on ``d`` workers, ``W // d`` at once (Ray Train's data parallelism);
* ``auto``: the best schedule the rule below finds, and never one worse than the fixed modes': starting from each
  fixed mode's degrees, the trial that ends last is given one more worker while that brings the last end earlier
  (a longest-processing-time list schedule each time: the longest trials placed first). :func:`brute_force` is the
  best list schedule over every choice of degrees and every order, the yardstick of the tests on small searches.

What the model leaves out: a trial's degree is fixed for its life (``auto`` does not yet grow a trial when workers
fall idle), the trials' ends under ASHA are the expected ones (:func:`asha_epochs`), and a link is shared by no
other trial.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Literal, Sequence

__all__ = ["Cluster", "TrialCost", "Placement", "Schedule", "Mode", "asha_epochs", "asha_epochs_at_rungs", "list_schedule", "pack",
           "brute_force", "MODES"]

Mode = Literal["experiment", "data", "auto"]
MODES: tuple[Mode, ...] = ("experiment", "data", "auto")


@dataclass(frozen=True)
class Cluster:
    """The workers a search runs on: ``workers`` in all, ``per_node`` of them on each node (None: one node), the
    bytes per second a worker sends inside a node and between nodes, and a message's latency (s)."""

    workers: int
    per_node: int | None = None
    bandwidth: float = 100e9
    inter_node_bandwidth: float = 12.5e9
    latency: float = 5e-6

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"a cluster has at least one worker, got workers={self.workers}")
        if self.per_node is not None and not 1 <= self.per_node <= self.workers:
            raise ValueError(f"per_node must be between 1 and workers ({self.workers}), got {self.per_node}")
        for name in ("bandwidth", "inter_node_bandwidth"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a positive number of bytes/s, got {getattr(self, name)!r}")
        if not (math.isfinite(self.latency) and self.latency >= 0):
            raise ValueError(f"latency must be a non-negative number of seconds, got {self.latency!r}")

    @property
    def node_size(self) -> int:
        return self.per_node or self.workers

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        """The workers' indices, node by node."""
        size = self.node_size
        return tuple(tuple(range(start, min(start + size, self.workers))) for start in range(0, self.workers, size))

    def allreduce_seconds(self, nbytes: float, degree: int) -> float:
        """A ring all-reduce of ``nbytes`` over ``degree`` workers: inside a node while they fit in one."""
        if degree <= 1 or nbytes <= 0:
            return 0.0
        bandwidth = self.bandwidth if degree <= self.node_size else self.inter_node_bandwidth
        return 2 * (degree - 1) / degree * nbytes / bandwidth + 2 * (degree - 1) * self.latency


@dataclass(frozen=True)
class TrialCost:
    """What one trial costs, by parts: ``epochs`` (ASHA: the expected ones), an epoch's training compute on one
    worker (s), its ``steps`` on one worker, the fixed cost of a step (s), the gradient bytes all-reduced each step,
    the validation each epoch (s, on every worker), the start-up (s), and the most workers it can use (1: a trial
    that cannot be data-parallel). ``cold_start_seconds``: what a trial costs more when it is the first on one of
    its workers (distmis keeps a worker's process, imports and traced graphs for the next trial it runs)."""

    name: str
    epochs: float
    train_seconds: float
    steps: int
    step_overhead: float = 0.0
    gradient_bytes: float = 0.0
    validate_seconds: float = 0.0
    startup_seconds: float = 0.0
    max_degree: int | None = None
    cold_start_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"trial {self.name}: steps must be at least 1, got {self.steps}")
        for name in ("epochs", "train_seconds", "step_overhead", "gradient_bytes", "validate_seconds",
                     "startup_seconds", "cold_start_seconds"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"trial {self.name}: {name} must be a non-negative number, got {value!r}")
        if self.max_degree is not None and self.max_degree < 1:
            raise ValueError(f"trial {self.name}: max_degree must be at least 1, got {self.max_degree}")

    def degree(self, wanted: int) -> int:
        """``wanted`` workers, or as many as the trial can use."""
        return max(1, min(wanted, self.max_degree or wanted))

    def epoch_seconds(self, degree: int, cluster: Cluster) -> float:
        """One epoch on ``degree`` workers: each trains ``ceil(steps / degree)`` steps of the epoch's compute over
        ``degree``, all-reducing the gradients after each, then validates."""
        steps = math.ceil(self.steps / degree)
        per_step = self.step_overhead + cluster.allreduce_seconds(self.gradient_bytes, degree)
        return self.train_seconds / degree + steps * per_step + self.validate_seconds

    def seconds(self, degree: int, cluster: Cluster) -> float:
        """The whole trial on ``degree`` workers, start-up included."""
        return self.startup_seconds + self.epochs * self.epoch_seconds(degree, cluster)


ASHA_SAMPLES = 1001  # orders of merit :func:`asha_epochs` draws (odd: its median is one of them)


def asha_epochs(trials: int, max_epochs: int, grace_period: int, reduction_factor: float) -> list[float]:
    """The epochs each of ``trials`` trains under ASHA, longest first, as Ray Tune's asynchronous successive halving
    is expected to stop them. Its rungs are at ``grace_period * reduction_factor ** k`` epochs below ``max_epochs``; a
    trial reaching one goes on when its result is at least the ``1 - 1 / reduction_factor`` quantile of the results
    the rung recorded before it (Tune's rule: the first to arrive always goes on, and a trial that arrives after
    weaker ones goes on where synchronous halving would stop it). Which trials are better is not known in advance:
    the trials arrive one after another (as on one worker) with merits in a random order, drawn
    :data:`ASHA_SAMPLES` times with a fixed seed; each place, longest first, takes the median of its epochs over the
    draws."""
    if reduction_factor <= 1:
        raise ValueError(f"reduction_factor must be above 1, got {reduction_factor}")
    return list(_expected_asha_epochs(trials, max_epochs, grace_period, float(reduction_factor)))


@functools.lru_cache(maxsize=64)
def _expected_asha_epochs(trials: int, max_epochs: int, grace_period: int, reduction_factor: float,
                          ) -> tuple[float, ...]:
    rungs, rung = [], float(max(1, grace_period))
    while rung < max_epochs:
        rungs.append(rung)
        rung *= reduction_factor
    return _expected_epochs_at_rungs(trials, tuple(rungs), max_epochs, reduction_factor)


def asha_epochs_at_rungs(trials: int, rungs: Sequence[int], max_epochs: int, reduction_factor: float) -> list[float]:
    """:func:`asha_epochs` with rungs at the given epochs (the ends of a curriculum's stages: ``stage-asha``)."""
    if reduction_factor <= 1:
        raise ValueError(f"reduction_factor must be above 1, got {reduction_factor}")
    return list(_expected_epochs_at_rungs(trials, tuple(sorted(float(r) for r in rungs if r < max_epochs)),
                                          max_epochs, float(reduction_factor)))


def halving_epochs_at_rungs(trials: int, rungs: Sequence[int], max_epochs: int, reduction_factor: float,
                            ) -> list[float]:
    """The epochs each of ``trials`` trains under synchronous successive halving at ``rungs``, longest first: at
    each rung, of the ``n`` trials that reached it, ``ceil(n / reduction_factor)`` go on (``stage-halving``). Exact,
    whichever trials are the better ones."""
    if reduction_factor <= 1:
        raise ValueError(f"reduction_factor must be above 1, got {reduction_factor}")
    epochs, live = [], trials
    for rung in sorted(r for r in set(rungs) if r < max_epochs):
        kept = max(1, math.ceil(live / reduction_factor)) if live else 0
        epochs += [float(rung)] * (live - kept)
        live = kept
    return [float(max_epochs)] * live + sorted(epochs, reverse=True)


@functools.lru_cache(maxsize=64)
def _expected_epochs_at_rungs(trials: int, rungs: tuple[float, ...], max_epochs: int, reduction_factor: float,
                              ) -> tuple[float, ...]:
    if trials < 1:
        return ()
    draws = random.Random(0)
    runs = [_asha_run([draws.random() for _ in range(trials)], rungs, float(max_epochs), 1 - 1 / reduction_factor)
            for _ in range(ASHA_SAMPLES)]
    return tuple(sorted(run[index] for run in runs)[ASHA_SAMPLES // 2] for index in range(trials))


def _asha_run(merits: Sequence[float], rungs: Sequence[float], max_epochs: float, quantile: float) -> list[float]:
    """The epochs of trials of ``merits`` (higher is better) arriving in that order, under Tune's ASHA rule at
    ``rungs``, longest first."""
    recorded: list[list[float]] = [[] for _ in rungs]  # each rung's results so far, sorted
    epochs = []
    for merit in merits:
        reached = max_epochs
        for milestone, results in zip(rungs, recorded):
            stop = bool(results) and merit < _quantile(results, quantile)
            bisect.insort(results, merit)
            if stop:
                reached = milestone
                break
        epochs.append(reached)
    return sorted(epochs, reverse=True)


def _quantile(ordered: Sequence[float], q: float) -> float:
    """numpy's default (linear) percentile ``100 q`` of the sorted ``ordered``."""
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Placement:
    """Where and when one trial runs: its degree, start and end (s) and the workers it holds."""

    trial: str
    degree: int
    start: float
    end: float
    workers: tuple[int, ...]


@dataclass(frozen=True)
class Schedule:
    """A search's trials placed on ``workers`` workers (:func:`list_schedule`)."""

    mode: str
    workers: int
    placements: tuple[Placement, ...] = field(default_factory=tuple)

    @property
    def makespan(self) -> float:
        """When the last trial ends (s)."""
        return max((p.end for p in self.placements), default=0.0)

    @property
    def worker_seconds(self) -> float:
        """The workers' time the trials held."""
        return sum(p.degree * (p.end - p.start) for p in self.placements)

    @property
    def idle_fraction(self) -> float:
        """The share of the workers' time until the makespan that no trial held."""
        total = self.workers * self.makespan
        return 0.0 if total <= 0 else 1.0 - self.worker_seconds / total

    def degrees(self) -> dict[str, int]:
        return {p.trial: p.degree for p in self.placements}


def _take(free: list[float], degree: int, cluster: Cluster) -> tuple[int, ...]:
    """The ``degree`` workers a trial placed now takes: one node's that are free first, where it fits in one (the
    node whose ``degree``-th worker is free soonest; the lower node on a tie), else the first free anywhere."""
    if degree <= cluster.node_size:
        best: tuple[float, tuple[int, ...]] | None = None
        for node in cluster.nodes:
            if len(node) < degree:
                continue
            chosen = tuple(sorted(node, key=lambda w: (free[w], w))[:degree])
            ready = max(free[w] for w in chosen)
            if best is None or ready < best[0]:
                best = (ready, chosen)
        if best is not None:
            return best[1]
    return tuple(sorted(range(len(free)), key=lambda w: (free[w], w))[:degree])


def list_schedule(costs: Sequence[TrialCost], degrees: Sequence[int], cluster: Cluster, *,
                  order: Sequence[int] | None = None, mode: str = "") -> Schedule:
    """Place the trials, in ``order`` (default: the longest at its degree first), each on its ``degrees[i]``
    workers (:func:`_take`), starting when the last of them is free; a trial that is the first on one of its workers
    takes its ``cold_start_seconds`` longer."""
    if len(degrees) != len(costs):
        raise ValueError(f"{len(costs)} trial(s) but {len(degrees)} degree(s)")
    for cost, degree in zip(costs, degrees):
        if not 1 <= degree <= cluster.workers:
            raise ValueError(f"trial {cost.name}: degree {degree} is not between 1 and the {cluster.workers} workers")
    seconds = [cost.seconds(degree, cluster) for cost, degree in zip(costs, degrees)]
    if order is None:
        order = sorted(range(len(costs)), key=lambda i: (-seconds[i], i))
    free = [0.0] * cluster.workers
    used: set[int] = set()
    placements = []
    for index in order:
        workers = _take(free, degrees[index], cluster)
        start = max(free[w] for w in workers)
        cold = costs[index].cold_start_seconds if any(w not in used for w in workers) else 0.0
        end = start + seconds[index] + cold
        used.update(workers)
        for w in workers:
            free[w] = end
        placements.append(Placement(costs[index].name, degrees[index], start, end, workers))
    return Schedule(mode, cluster.workers, tuple(placements))


def _fixed(costs: Sequence[TrialCost], degree: int, cluster: Cluster) -> list[int]:
    return [cost.degree(min(degree, cluster.workers)) for cost in costs]


def _improve(costs: Sequence[TrialCost], degrees: list[int], cluster: Cluster) -> Schedule:
    """Give the trial that ends last one more worker while that brings the last end earlier."""
    best = list_schedule(costs, degrees, cluster, mode="auto")
    while True:
        last = max(best.placements, key=lambda p: p.end)
        index = next(i for i, cost in enumerate(costs) if cost.name == last.trial)
        if degrees[index] >= min(cluster.workers, costs[index].max_degree or cluster.workers):
            return best
        trial = list(degrees)
        trial[index] += 1
        candidate = list_schedule(costs, trial, cluster, mode="auto")
        if candidate.makespan >= best.makespan - 1e-9:
            return best
        degrees, best = trial, candidate


def pack(costs: Sequence[TrialCost], cluster: Cluster, mode: Mode = "auto", *, degree: int = 1) -> Schedule:
    """The schedule of ``mode`` (see the module docstring; ``data`` at ``degree`` workers a trial)."""
    if len({cost.name for cost in costs}) != len(costs):
        raise ValueError("the trials' names must differ")
    if mode == "experiment":
        return list_schedule(costs, _fixed(costs, 1, cluster), cluster, mode="experiment")
    if mode == "data":
        if not 1 <= degree <= cluster.workers:
            raise ValueError(f"data-parallel degree {degree} is not between 1 and the {cluster.workers} workers")
        return list_schedule(costs, _fixed(costs, degree, cluster), cluster, mode=f"data x{degree}")
    if mode != "auto":
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not costs:
        return Schedule("auto", cluster.workers)
    found = [_improve(costs, _fixed(costs, d, cluster), cluster) for d in range(1, cluster.workers + 1)]
    return min(found, key=lambda schedule: schedule.makespan)


def brute_force(costs: Sequence[TrialCost], cluster: Cluster) -> Schedule:
    """The best list schedule over every choice of degrees and every order (small searches only: the tests'
    yardstick for :func:`pack`)."""
    if len(costs) > 6:
        raise ValueError(f"brute force over {len(costs)} trials is too many; at most 6")
    choices = [range(1, cost.degree(cluster.workers) + 1) for cost in costs]
    best: Schedule | None = None
    for degrees in itertools.product(*choices):
        for order in itertools.permutations(range(len(costs))):
            schedule = list_schedule(costs, degrees, cluster, order=order, mode="optimum")
            if best is None or schedule.makespan < best.makespan - 1e-12:
                best = schedule
    return best if best is not None else Schedule("optimum", cluster.workers)
