"""The workers of a ``parallelism.mode: auto`` search, and who holds them: each trial's share, and when to grow one.

An ``auto`` search holds ``parallelism.workers`` workers (each ``resources_per_worker``). Its trials are worker groups
(:mod:`distmis.trial.auto_trial`) that ask this pool how many workers to run on:

* **at their start** (:meth:`WorkerPool.request`): a trial waits, first come first served, until a worker is free,
  then takes its even share of the free ones among the trials that still wait or are still to come (the search's
  trials less those that began): one worker each while trials outnumber the free workers (experiment-parallel), all
  of them for the last one (data-parallel);
* **after each epoch** (:meth:`WorkerPool.report`): once no trial waits or is to come, workers that fall idle (a
  grid's tail, a trial ASHA stopped, one that failed) go to the running trials, one at a time to the trial predicted
  to end last, while that brings its end earlier by more than a restart costs; a trial given more workers
  checkpoints and restarts on them from that checkpoint. A trial never shrinks.

The prediction is :mod:`distmis.perf.makespan`'s model of an epoch, on what the search measures: an epoch at
``k`` workers is its training (the trial's one-worker training time over ``k``, times the data-parallel efficiency)
plus its validation (which every worker of a data-parallel trial runs whole). The one-worker training time and the
validation are the trial's own measured epochs (``epoch_seconds`` less ``validation_seconds``); the efficiency
(1 until measured: the all-reduce and the fixed costs of a step that more workers do not divide) is learned from the
trials the pool grew, their epochs before and after; the restart is the median of the trials' measured starts (from
the grant of their workers to their second epoch's end, less two whole epochs: the first holds the warm-up, a traced
graph or the first batches). A trial grows only once it has run a whole epoch on its workers. Each report's
prediction for the next epoch is logged with it (``predicted_epoch_seconds``), beside what it measured.

:class:`WorkerPool` is the rule, pure and clocked by the caller's clock (the tests drive it, and :func:`simulate` runs
it on a simulated one for ``distmis plan``); the driver runs it in a Ray actor named :func:`pool_name` in
:data:`POOL_NAMESPACE` (:mod:`distmis.search.worker_pool`), which the trials find by that name
(:mod:`distmis.trial.auto_trial`).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from distmis.perf.makespan import Cluster, Placement, Schedule, TrialCost
__all__ = ["Grant", "TrialProgress", "WorkerPool", "simulate", "pool_name", "POOL_NAMESPACE"]

POOL_NAME_PREFIX = "distmis-pool-"
POOL_NAMESPACE = "distmis"  # a Tune trial's process does not share the driver's anonymous namespace


@dataclass(frozen=True)
class Grant:
    """The pool's answer to a trial: the workers it is to run on from now on (0: wait) and the predicted seconds
    of its next epoch on them (None: nothing measured yet)."""

    workers: int
    predicted_epoch_seconds: float | None = None


@dataclass
class TrialProgress:
    """What the pool knows of one trial: its epochs in all and done, the workers it holds, its measured training
    seconds of an epoch by the workers they ran on, its validation seconds, and when its workers were granted."""

    epochs: int
    max_workers: int
    workers: int = 0
    done: int = 0
    train_seconds: dict[int, float] = field(default_factory=dict)
    validation_seconds: float = 0.0
    granted_at: float | None = None
    reported_at: float | None = None
    grown_from: int | None = None  # the workers it held before its last growth, until its first epoch after it
    started: bool = False  # its first epoch since the grant has ended
    measured: bool = False  # a whole epoch on the workers it holds (not the first since their grant) ended: it may grow


class WorkerPool:
    """``workers`` workers shared by a search's ``trials`` trials (``begun``: the ids of those that began in an
    earlier run of a resumed search, which ask again only if they are restarted)."""

    def __init__(self, workers: int, trials: int, *, begun: Iterable[str] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        if workers < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {workers}")
        self.workers = workers
        self.trials = trials
        self.begun = set(begun)
        self.clock = clock
        self.progress: dict[str, TrialProgress] = {}
        self.waiting: list[str] = []  # trials asking for their first workers, in the order they asked
        self.restarts: list[float] = []  # measured seconds from a grant to the first epoch's start
        self.efficiencies: list[float] = []  # measured (k x training at k) / training at 1, for k > 1

    # ------------------------------------------------------------------ state
    @property
    def held(self) -> int:
        return sum(p.workers for p in self.progress.values())

    @property
    def free(self) -> int:
        return self.workers - self.held

    @property
    def to_come(self) -> int:
        """Trials of the search that have not asked for workers yet."""
        return max(0, self.trials - len(self.begun | set(self.progress)))

    @property
    def efficiency(self) -> float:
        """The median measured data-parallel efficiency (1 until a grown trial measured one)."""
        return statistics.median(self.efficiencies) if self.efficiencies else 1.0

    @property
    def restart_seconds(self) -> float:
        return statistics.median(self.restarts) if self.restarts else 0.0

    # ------------------------------------------------------------------ the calls of a trial
    def request(self, trial: str, epochs: int, max_workers: int | None = None) -> Grant:
        """A trial (new, or restarted by Tune or a resumed search) asks for its workers: its share, or 0 (ask
        again) while no worker is free or trials that asked earlier wait. ``max_workers``: the most it can use (a
        replica needs a training case of its own)."""
        progress = self.progress.get(trial)
        if progress is None:
            cap = max(1, min(self.workers, max_workers or self.workers))
            progress = self.progress[trial] = TrialProgress(epochs, cap)
        elif trial not in self.waiting:  # restarted (a retry, a resumed search): its earlier run's workers are free
            progress.workers, progress.granted_at, progress.grown_from, progress.started = 0, None, None, False
        if trial not in self.waiting:
            self.waiting.append(trial)
        if self.waiting[0] != trial or self.free < 1:
            return Grant(0)
        demand = len(self.waiting) + self.to_come
        share = max(1, min(progress.max_workers, self.free // demand))
        self.waiting.pop(0)
        progress.workers, progress.granted_at, progress.grown_from = share, self.clock(), None
        progress.started = progress.measured = False
        return Grant(share, self.predicted_epoch(progress, share))

    def report(self, trial: str, epoch: int, epoch_seconds: float, validation_seconds: float | None = None, *,
               workers: int | None = None) -> Grant:
        """A trial ended ``epoch`` (measured: ``epoch_seconds``, of which ``validation_seconds`` validating) on
        the workers it holds (``workers``: what it runs on, which the pool takes as the truth: a release of its
        earlier run that came late is undone): the workers it is to go on with (more when it grows) and the next
        epoch's prediction."""
        progress = self.progress.get(trial)
        if progress is not None and workers and progress.workers != workers:
            progress.workers = workers
            if trial in self.waiting:
                self.waiting.remove(trial)
        if progress is None or progress.workers == 0:
            raise ValueError(f"trial {trial} reported an epoch without holding workers of the pool")
        now = self.clock()
        validation = min(max(0.0, validation_seconds or 0.0), epoch_seconds)
        train = max(0.0, epoch_seconds - validation)
        if progress.granted_at is not None and not progress.started:
            # the first epoch since its workers were granted holds their warm-up (a traced graph, the first
            # batches): a measure only until a whole epoch comes
            progress.started = True
            progress.train_seconds.setdefault(progress.workers, train)
        else:  # a whole epoch on its workers
            if progress.granted_at is not None:  # the second since the grant: the restart is what the two left
                self.restarts.append(max(0.0, now - progress.granted_at - 2 * epoch_seconds))
                progress.granted_at = None
            if progress.grown_from is not None and progress.grown_from in progress.train_seconds and train > 0:
                one = progress.train_seconds[progress.grown_from] * progress.grown_from
                self.efficiencies.append(train * progress.workers / one)
                progress.grown_from = None
            progress.train_seconds[progress.workers] = train
            progress.measured = True
        progress.validation_seconds = validation
        progress.done, progress.reported_at = epoch, now
        target = self._grow(trial, now)
        if target > progress.workers:  # it must run a whole epoch on its new workers before it grows again
            progress.grown_from = progress.workers
            progress.workers, progress.granted_at, progress.started, progress.measured = target, now, False, False
        return Grant(progress.workers, self.predicted_epoch(progress, progress.workers))

    def release(self, trial: str) -> None:
        """A trial ended (finished, stopped, failed or killed): its workers are free. Idempotent. A trial that ended
        before it asked for workers (refused as it started) is no longer to come."""
        self.begun.add(trial)
        progress = self.progress.get(trial)
        if progress is not None:
            progress.workers, progress.granted_at = 0, None
        if trial in self.waiting:
            self.waiting.remove(trial)

    # ------------------------------------------------------------------ the model
    def predicted_epoch(self, progress: TrialProgress, workers: int) -> float | None:
        """An epoch of the trial on ``workers`` workers (s); None before it measured one."""
        if not progress.train_seconds:
            return None
        if workers in progress.train_seconds:
            return progress.train_seconds[workers] + progress.validation_seconds
        measured, train = min(progress.train_seconds.items())  # the fewest workers it ran on
        one = train * measured / (self.efficiency if measured > 1 else 1.0)
        return one / workers * (self.efficiency if workers > 1 else 1.0) + progress.validation_seconds

    def _remaining(self, progress: TrialProgress, workers: int, now: float) -> float:
        """The trial's predicted seconds to its end on ``workers`` (a restart added when that is more than it
        holds), from ``now``: its epochs left, less the time into the epoch it is in."""
        epoch = self.predicted_epoch(progress, workers)
        if epoch is None:
            return math.inf
        into = now - progress.reported_at if progress.reported_at is not None else 0.0
        left = max(0.0, (progress.epochs - progress.done) * epoch - (into if workers == progress.workers else 0.0))
        return left + (self.restart_seconds if workers > progress.workers else 0.0)

    def _grow(self, trial: str, now: float) -> int:
        """The workers ``trial`` goes on with: more than it holds when no trial waits or is to come, some workers are
        free, and giving them out one at a time to the running trial predicted to end last gives it some."""
        progress = self.progress[trial]
        if self.waiting or self.to_come or self.free < 1 or progress.done >= progress.epochs:
            return progress.workers
        running = {name: p for name, p in self.progress.items()
                   if p.workers and p.done < p.epochs and p.measured and p.started}
        targets = {name: p.workers for name, p in running.items()}
        free = self.free
        while free > 0 and running:
            name = max(running, key=lambda n: (self._remaining(running[n], targets[n], now), n == trial))
            p = running[name]
            more = targets[name] + 1
            if more <= p.max_workers and self._remaining(p, more, now) < self._remaining(p, targets[name], now) - 1e-9:
                targets[name], free = more, free - 1
            else:
                del running[name]
        return targets.get(trial, progress.workers)


# --------------------------------------------------------------------------- the rule's makespan, before a search
def simulate(costs: Sequence[TrialCost], cluster: Cluster) -> Schedule:
    """The schedule ``mode: auto`` gives ``costs`` on ``cluster``'s workers: the pool's own rule (:class:`WorkerPool`)
    on a simulated clock, every trial asking in turn (as Tune starts them), each epoch of a trial at ``k`` workers
    :meth:`~distmis.perf.makespan.TrialCost.epoch_seconds` long, its start (and each restart after a growth) its
    ``startup_seconds`` plus its ``cold_start_seconds`` every time: each start is a worker group of new processes
    (their imports, a traced graph), as mode auto starts them. A trial's ``epochs`` are rounded up. Each stretch a
    trial runs on one set of workers is a placement of its own (a grown trial has two or more), on the lowest worker
    rows free when it begins."""
    import heapq

    now = 0.0
    pool = WorkerPool(cluster.workers, len(costs), clock=lambda: now)
    waiting = list(range(len(costs)))
    events: list[tuple[float, int, int]] = []  # (time, trial, epoch ending then)
    workers = [0] * len(costs)
    began = [0.0] * len(costs)
    free_at = [0.0] * cluster.workers
    rows: list[tuple[int, ...]] = [()] * len(costs)
    placements: list[Placement] = []

    def start(index: int, degree: int, epoch: int) -> None:
        """Trial ``index`` (re)starts on ``degree`` workers now, its next epoch ``epoch + 1``."""
        taken = tuple(sorted(range(cluster.workers), key=lambda w: (free_at[w] > now + 1e-9, w))[:degree])
        cold = costs[index].cold_start_seconds  # a new group each time, however warm its workers' nodes are
        for w in taken:
            free_at[w] = math.inf
        workers[index], began[index], rows[index] = degree, now, taken
        end = now + costs[index].startup_seconds + cold + costs[index].epoch_seconds(degree, cluster)
        heapq.heappush(events, (end, index, epoch + 1))

    def stop(index: int) -> None:
        placements.append(Placement(costs[index].name, workers[index], began[index], now, rows[index]))
        for w in rows[index]:
            free_at[w] = now

    def admit() -> None:
        while waiting:
            index = waiting[0]
            cost = costs[index]
            grant = pool.request(cost.name, max(1, math.ceil(cost.epochs)), cost.max_degree)
            if not grant.workers:
                return
            waiting.pop(0)
            start(index, grant.workers, 0)

    admit()
    while events:
        now, index, epoch = heapq.heappop(events)
        cost = costs[index]
        seconds = cost.epoch_seconds(workers[index], cluster)
        if epoch >= max(1, math.ceil(cost.epochs)):
            stop(index)
            pool.release(cost.name)
            admit()
            continue
        grant = pool.report(cost.name, epoch, seconds, cost.validate_seconds, workers=workers[index])
        if grant.workers > workers[index]:
            stop(index)
            start(index, grant.workers, epoch)
        else:
            heapq.heappush(events, (now + seconds, index, epoch + 1))
    return Schedule("auto (the pool)", cluster.workers, tuple(placements))


def pool_name(experiment: str) -> str:
    """The Ray actor name of the search ``experiment``'s pool (unique per search: its Tune experiment's name)."""
    return f"{POOL_NAME_PREFIX}{experiment}"
