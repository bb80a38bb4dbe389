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
  checkpoints and restarts on them from that checkpoint. A trial never shrinks;
* **between trials** (:meth:`WorkerPool.keep`, :meth:`WorkerPool.ended`): a trial that ended leaves its group to its
  process, which Tune gives the next trial; that trial goes on with the group (warm) when its share is the group's
  size. A kept group's workers are taken back (the group removed) when another trial needs them, and once no trial
  waits or is to come.

The prediction is :mod:`distmis.perf.makespan`'s model of an epoch, on what the search measures: an epoch at
``k`` workers is its training (the trial's one-worker training time over ``k``, times the data-parallel efficiency)
plus its validation (which every worker of a data-parallel trial runs whole). The one-worker training time and the
validation are the trial's own measured epochs (``epoch_seconds`` less ``validation_seconds``); the efficiency
(1 until measured: the all-reduce and the fixed costs of a step that more workers do not divide) is learned from the
trials the pool grew, their epochs before and after; the restart is the median of the trials' measured starts on new processes (from
the grant of their workers to their second epoch's end, less two whole epochs: the first holds the warm-up, a traced
graph or the first batches; a one-worker trial in its warm Tune process starts none, and a growth always does). A trial grows only once it has run a whole epoch on its workers. Each report's
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
    """The pool's answer to a trial: the workers it is to run on from now on (0: wait), the predicted seconds of its
    next epoch on them (None: nothing measured yet), and the worker group that runs it: ``group``, the name of a new
    one for the trial to start (at its start, and when it grows), or of the group its process kept from its last
    trial, which it goes on with when ``reuse`` (warm: no new processes, imports or traced graphs)."""

    workers: int
    predicted_epoch_seconds: float | None = None
    group: str = ""
    reuse: bool = False


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
    cold: bool = True  # its workers are a new group (a warm, kept one measures no restart)
    groups: list[str] = field(default_factory=list)  # the groups named for it that it has not handed back, newest last


class WorkerPool:
    """``workers`` workers shared by a search's ``trials`` trials (``begun``: the ids of those that began in an
    earlier run of a resumed search, which ask again only if they are restarted).

    The pool names every worker group (``group_prefix`` and the trial that starts it) and knows which trial runs on
    which, and which groups trial processes keep between their trials (:meth:`keep`). A group it takes back (a kept
    one whose workers another trial needs, or one whose trial ended without handing it back: killed, failed) is
    given to ``remove_groups``, which removes it (the driver's actor: its placement group; the caller's clock and
    nothing else here)."""

    def __init__(self, workers: int, trials: int, *, begun: Iterable[str] = (),
                 clock: Callable[[], float] = time.monotonic, group_prefix: str = "",
                 remove_groups: Callable[[Sequence[str]], None] = lambda names: None) -> None:
        if workers < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {workers}")
        self.workers = workers
        self.trials = trials
        self.begun = set(begun)
        self.clock = clock
        self.group_prefix = group_prefix
        self.remove_groups = remove_groups
        self.progress: dict[str, TrialProgress] = {}
        self.waiting: list[str] = []  # trials asking for their first workers, in the order they asked
        self.kept: dict[str, int] = {}  # groups kept by trial processes between two trials: their workers, oldest first
        self.restarts: list[float] = []  # measured seconds from a cold grant to the first epoch's start
        self.efficiencies: list[float] = []  # measured (k x training at k) / training at 1, for k > 1
        self._named = 0

    # ------------------------------------------------------------------ state
    @property
    def held(self) -> int:
        return sum(p.workers for p in self.progress.values())

    @property
    def free(self) -> int:
        """Workers neither a trial's nor kept in a group."""
        return self.workers - self.held - sum(self.kept.values())

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
    def request(self, trial: str, epochs: int, max_workers: int | None = None, *, kept: str = "") -> Grant:
        """A trial (new, or restarted by Tune or a resumed search) asks for its workers: its share, or 0 (ask
        again) while no worker is free or trials that asked earlier wait. ``max_workers``: the most it can use (a
        replica needs a training case of its own). ``kept``: the group its process kept from its last trial, which
        it goes on with when that group is still kept and of the trial's share (``Grant.reuse``); otherwise the
        grant names a new group, and the workers of kept groups are taken back as the share needs them."""
        progress = self.progress.get(trial)
        if progress is None:
            cap = max(1, min(self.workers, max_workers or self.workers))
            progress = self.progress[trial] = TrialProgress(epochs, cap)
        elif trial not in self.waiting:  # restarted (a retry, a resumed search): its earlier run's workers are free
            self._take_back(progress)
            progress.workers, progress.granted_at, progress.grown_from, progress.started = 0, None, None, False
        if trial not in self.waiting:
            self.waiting.append(trial)
        own = self.kept.get(kept, 0)
        if self.waiting[0] != trial or self.free + sum(self.kept.values()) < 1:
            return Grant(0)
        demand = len(self.waiting) + self.to_come
        share = max(1, min(progress.max_workers, (self.free + sum(self.kept.values())) // demand))
        self.waiting.pop(0)
        if own == share:  # its process's warm group, of the right size
            del self.kept[kept]
            group, reuse = kept, True
        else:
            if own:
                self._remove([kept])
            self._reclaim(share - self.free)
            group, reuse = self._name(trial), False
        progress.workers, progress.granted_at, progress.grown_from = share, self.clock(), None
        progress.started = progress.measured = False
        progress.cold, progress.groups = not reuse, [*progress.groups, group]
        self._reclaim_unneeded()
        return Grant(share, self.predicted_epoch(progress, share), group, reuse)

    def report(self, trial: str, epoch: int, epoch_seconds: float, validation_seconds: float | None = None, *,
               workers: int | None = None, new_processes: bool | None = None) -> Grant:
        """A trial ended ``epoch`` (measured: ``epoch_seconds``, of which ``validation_seconds`` validating) on
        the workers it holds (``workers``: what it runs on, which the pool takes as the truth: a release of its
        earlier run that came late is undone): the workers it is to go on with (more when it grows, on the new
        group the grant names) and the next epoch's prediction. ``new_processes``, with the first epoch since a
        grant: whether its group started in new processes (False: a new one-worker group in the trial's warm
        process, whose start says nothing of a growth's, which always starts new processes)."""
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
            progress.cold = progress.cold and new_processes is not False
            progress.train_seconds.setdefault(progress.workers, train)
        else:  # a whole epoch on its workers
            if progress.granted_at is not None:  # the second since the grant: the restart is what the two left
                if progress.cold:  # a growth restarts on a new group: a warm start says nothing of its cost
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
        group = progress.groups[-1] if progress.groups else ""
        if target > progress.workers:  # it must run a whole epoch on its new workers before it grows again
            self._reclaim(target - progress.workers - self.free)
            group = self._name(trial)
            progress.groups.append(group)
            progress.grown_from = progress.workers
            progress.workers, progress.granted_at, progress.started, progress.measured = target, now, False, False
            progress.cold = True
        return Grant(progress.workers, self.predicted_epoch(progress, progress.workers), group)

    def keep(self, trial: str, group: str) -> bool:
        """A trial ended and its process holds its group ``group`` idle for its next trial: whether the pool keeps it
        (while trials wait or are to come, and the group is still the trial's, or kept already by :meth:`ended`);
        when not, the process shuts the group down. Either way the trial's workers leave it, as :meth:`release`."""
        progress = self.progress.get(trial)
        if progress is not None and progress.workers and progress.groups[-1:] == [group]:
            self.kept[group] = progress.workers
            progress.groups = []  # the groups before its growths it shut down itself
        self.release(trial)
        return group in self.kept

    def ended(self, trial: str) -> None:
        """Tune ended the trial (finished, or stopped by its scheduler) and its process lives on, for the next trial
        Tune gives it: the trial's group is kept for that trial (the process says so too: :meth:`keep`), and its
        workers leave it, as :meth:`release`."""
        progress = self.progress.get(trial)
        if progress is not None and progress.workers and progress.groups:
            self.kept[progress.groups[-1]] = progress.workers
            progress.groups = []
        self.release(trial)

    def release(self, trial: str) -> None:
        """A trial ended (failed, killed, or ended by its own process): its workers are free, and the groups it did
        not hand back (:meth:`keep`, :meth:`ended`) are removed. Idempotent. A trial that ended before it asked for
        workers (refused as it started) is no longer to come."""
        self.begun.add(trial)
        progress = self.progress.get(trial)
        if progress is not None:
            self._take_back(progress)
            progress.workers, progress.granted_at = 0, None
        if trial in self.waiting:
            self.waiting.remove(trial)
        self._reclaim_unneeded()

    # ------------------------------------------------------------------ the groups
    def _name(self, trial: str) -> str:
        self._named += 1
        return f"{self.group_prefix}{trial}-{self._named}"

    def _remove(self, names: Sequence[str]) -> None:
        for name in names:
            self.kept.pop(name, None)
        if names:
            self.remove_groups(list(names))

    def _take_back(self, progress: TrialProgress) -> None:
        """The groups of a trial that ended, or restarted, without handing them back: removed."""
        groups, progress.groups = progress.groups, []
        self._remove(groups)

    def _reclaim(self, needed: int) -> None:
        """Take back the oldest kept groups until ``needed`` more workers are free."""
        names = []
        for name, size in self.kept.items():
            if needed <= 0:
                break
            names.append(name)
            needed -= size
        self._remove(names)

    def _reclaim_unneeded(self) -> None:
        """Kept groups serve a trial yet to start: once none waits or is to come, their workers go back, free for
        the running trials to grow onto."""
        if self.kept and not self.waiting and not self.to_come:
            self._remove(list(self.kept))
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
    ``startup_seconds``, plus its ``cold_start_seconds`` on a new worker group (new processes: their imports, a traced
    graph). A trial that ended offers its group to the next trial to start, as its reused Tune process does: a grant
    that reuses it is warm, on the same worker rows. A trial's ``epochs`` are rounded up. Each stretch a trial runs on
    one set of workers is a placement of its own (a grown trial has two or more), on the lowest worker rows free (and
    not kept) when it begins."""
    import heapq

    now = 0.0
    pool = WorkerPool(cluster.workers, len(costs), clock=lambda: now)
    waiting = list(range(len(costs)))
    events: list[tuple[float, int, int]] = []  # (time, trial, epoch ending then)
    workers = [0] * len(costs)
    began = [0.0] * len(costs)
    free_at = [0.0] * cluster.workers
    rows: list[tuple[int, ...]] = [()] * len(costs)
    groups = [""] * len(costs)
    placements: list[Placement] = []
    idle: list[str] = []  # the groups of ended trials' processes, kept for the next trials, in the order they ended
    kept_rows: dict[str, tuple[int, ...]] = {}

    def start(index: int, grant: Grant, epoch: int) -> None:
        """Trial ``index`` (re)starts on the grant's workers now, its next epoch ``epoch + 1``."""
        kept = {w for name, taken in kept_rows.items() if name in pool.kept for w in taken}
        if grant.reuse:
            taken = kept_rows.pop(grant.group)
        else:
            taken = tuple(sorted(range(cluster.workers),
                                 key=lambda w: (free_at[w] > now + 1e-9, w in kept, w))[:grant.workers])
        cold = 0.0 if grant.reuse else costs[index].cold_start_seconds
        for w in taken:
            free_at[w] = math.inf
        workers[index], began[index], rows[index], groups[index] = grant.workers, now, taken, grant.group
        end = now + costs[index].startup_seconds + cold + costs[index].epoch_seconds(grant.workers, cluster)
        heapq.heappush(events, (end, index, epoch + 1))

    def stop(index: int) -> None:
        placements.append(Placement(costs[index].name, workers[index], began[index], now, rows[index]))
        for w in rows[index]:
            free_at[w] = now

    def admit() -> None:
        while waiting:
            index = waiting[0]
            cost = costs[index]
            kept = idle.pop(0) if idle else ""
            grant = pool.request(cost.name, max(1, math.ceil(cost.epochs)), cost.max_degree, kept=kept)
            if not grant.workers:
                if kept:
                    idle.insert(0, kept)
                return
            waiting.pop(0)
            start(index, grant, 0)

    admit()
    while events:
        now, index, epoch = heapq.heappop(events)
        cost = costs[index]
        seconds = cost.epoch_seconds(workers[index], cluster)
        if epoch >= max(1, math.ceil(cost.epochs)):
            stop(index)
            if pool.keep(cost.name, groups[index]):
                idle.append(groups[index])
                kept_rows[groups[index]] = rows[index]
            admit()
            continue
        grant = pool.report(cost.name, epoch, seconds, cost.validate_seconds, workers=workers[index])
        if grant.workers > workers[index]:
            stop(index)
            start(index, grant, epoch)
        else:
            heapq.heappush(events, (now + seconds, index, epoch + 1))
    return Schedule("auto (the pool)", cluster.workers, tuple(placements))


def pool_name(experiment: str) -> str:
    """The Ray actor name of the search ``experiment``'s pool (unique per search: its Tune experiment's name)."""
    return f"{POOL_NAME_PREFIX}{experiment}"
