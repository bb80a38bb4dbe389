"""The worker pool of an ``auto`` search: each trial's share at its start, and growth onto idle workers."""

from __future__ import annotations

import dataclasses

import pytest

from distmis.perf.makespan import Cluster, TrialCost, pack
from distmis.perf.pool import WorkerPool, simulate


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_trials_share_the_free_workers_and_wait_in_order():
    clock = Clock()
    pool = WorkerPool(2, trials=3, clock=clock)
    assert pool.request("a", 4).workers == 1  # 3 trials for 2 workers: one each
    assert pool.request("b", 4).workers == 1
    assert pool.request("c", 4).workers == 0 and pool.waiting == ["c"]  # none free: c waits
    assert pool.request("c", 4).workers == 0  # asking again keeps its place
    pool.release("a")
    grant = pool.request("c", 4)
    assert grant.workers == 1 and pool.waiting == [] and pool.free == 0
    pool.release("a")  # idempotent
    assert pool.held == 2


def test_a_lone_trial_takes_every_free_worker_up_to_its_training_cases():
    assert WorkerPool(4, trials=1).request("a", 3).workers == 4  # the last trial: data-parallel
    assert WorkerPool(4, trials=1).request("a", 3, max_workers=3).workers == 3  # a replica needs a case of its own
    assert WorkerPool(4, trials=2).request("a", 3).workers == 2  # two trials for four workers: two each


def test_the_first_come_is_served_first():
    pool = WorkerPool(1, trials=3)
    assert pool.request("a", 2).workers == 1
    assert pool.request("b", 2).workers == 0 and pool.request("c", 2).workers == 0
    pool.release("a")
    assert pool.request("c", 2).workers == 0  # b asked first
    assert pool.request("b", 2).workers == 1


def test_an_idle_worker_grows_the_trial_predicted_to_end_last_when_that_pays_for_its_restart():
    clock = Clock()
    pool = WorkerPool(2, trials=2, clock=clock)
    pool.request("short", 3)
    pool.request("long", 20)
    clock.now = 14.0  # each started in 2 s, its first epoch 12 s (2 s of warm-up), the next ones 10 s (8 training)
    assert pool.report("short", 1, 12.0, 2.0).workers == 1  # another trial runs: nothing idle
    assert pool.report("long", 1, 12.0, 2.0).workers == 1
    clock.now = 24.0
    pool.report("short", 2, 10.0, 2.0)
    pool.report("long", 2, 10.0, 2.0)
    assert pool.restart_seconds == pytest.approx(4.0)  # 24 s to the second epoch's end, less two of 10 s
    clock.now = 34.0
    pool.report("short", 3, 10.0, 2.0)
    pool.release("short")  # it ended: one worker idle
    grant = pool.report("long", 3, 10.0, 2.0)
    # 17 epochs left: 170 s on 1 worker, 17 x (8 / 2 + 2) + 4 = 106 s on 2
    assert grant.workers == 2 and grant.predicted_epoch_seconds == pytest.approx(6.0)
    assert pool.free == 0
    clock.now = 44.0
    assert pool.report("long", 4, 10.0, 2.0).workers == 2  # the restart's first epoch, with its warm-up
    clock.now = 51.0
    grant = pool.report("long", 5, 7.0, 2.0)  # a whole epoch on 2: training 5 s, against 4 predicted
    assert pool.efficiency == pytest.approx(5 * 2 / 8)
    assert pool.restarts[-1] == pytest.approx(51.0 - 34.0 - 2 * 7.0)
    assert grant.workers == 2 and grant.predicted_epoch_seconds == pytest.approx(7.0)


def test_a_trial_grows_only_after_a_whole_epoch_on_its_workers():
    clock = Clock()
    pool = WorkerPool(2, trials=2, clock=clock)
    pool.request("a", 1)
    pool.request("b", 50)
    clock.now = 30.0
    pool.report("a", 1, 25.0, 1.0)
    pool.release("a")
    assert pool.report("b", 1, 25.0, 1.0).workers == 1  # its first epoch (a traced graph?): not a measure to act on
    clock.now = 35.0
    assert pool.report("b", 2, 5.0, 1.0).workers == 2


def test_a_grown_trial_grows_again_only_after_a_whole_epoch_on_its_new_workers():
    clock = Clock()
    pool = WorkerPool(3, trials=3, clock=clock)
    for name in ("a", "b", "long"):
        pool.request(name, 1 if name != "long" else 100)
    for epoch, now in ((1, 10.0), (2, 20.0)):
        clock.now = now
        pool.report("long", epoch, 10.0)
    pool.release("a")
    assert pool.report("long", 3, 10.0).workers == 2  # a's worker: the restart measured 0 s
    pool.release("b")
    clock.now = 40.0
    assert pool.report("long", 4, 30.0).workers == 2  # its first epoch on two (a slow warm-up): no decision on it
    clock.now = 45.0
    assert pool.report("long", 5, 5.0).workers == 3


def test_a_start_in_a_warm_process_measures_no_restart():
    clock = Clock()
    pool = WorkerPool(2, trials=2, clock=clock)
    pool.request("new", 3)
    pool.request("warm", 3)
    clock.now = 14.0
    pool.report("new", 1, 12.0, 2.0, new_processes=True)  # its group's processes started with it
    pool.report("warm", 1, 12.0, 2.0, new_processes=False)  # a one-worker group in its warm trial process
    clock.now = 24.0
    pool.report("new", 2, 10.0, 2.0)
    pool.report("warm", 2, 10.0, 2.0)
    assert pool.restarts == [pytest.approx(4.0)]  # a growth's restart starts new processes: only "new" says its cost


def test_no_growth_that_a_restart_would_not_pay_for():
    clock = Clock()
    pool = WorkerPool(2, trials=2, clock=clock)
    pool.request("a", 2)
    pool.request("b", 3)
    clock.now = 40.0  # a start of 20 s
    pool.report("a", 1, 10.0, 2.0)
    pool.report("b", 1, 10.0, 2.0)
    clock.now = 50.0
    pool.report("a", 2, 10.0, 2.0)
    pool.release("a")
    # 1 epoch left: 10 s on 1 worker, 6 s + a 30 s restart on 2
    assert pool.report("b", 2, 10.0, 2.0).workers == 1


def test_no_growth_while_trials_wait_or_are_still_to_come():
    clock = Clock()
    pool = WorkerPool(3, trials=4, clock=clock)
    for name in "abc":
        assert pool.request(name, 10).workers == 1
    clock.now = 10.0
    pool.report("b", 1, 5.0)
    pool.release("a")
    assert pool.report("b", 2, 5.0).workers == 1  # trial d has not asked yet: the idle worker is its
    assert pool.request("d", 10).workers == 1
    pool.release("d")
    clock.now = 20.0
    assert pool.report("b", 3, 5.0).workers == 2  # every trial began: b, last to end, grows


def test_a_restarted_trial_gives_back_what_it_held_and_asks_again():
    pool = WorkerPool(2, trials=1)
    assert pool.request("a", 5).workers == 2
    assert pool.request("a", 5).workers == 2  # Tune's retry of it: the same trial, its workers free again first
    assert pool.held == 2
    resumed = WorkerPool(2, trials=3, begun={"x", "y"})  # a resumed search: x and y began in the earlier run
    assert resumed.to_come == 1 and resumed.request("z", 5).workers == 2


def test_a_trial_that_failed_before_it_asked_is_no_longer_to_come():
    pool = WorkerPool(2, trials=2)
    assert pool.request("a", 5).workers == 1  # b is still to come
    pool.release("b")  # refused as it started (its values invalid): it will never ask
    assert pool.to_come == 0
    pool.report("a", 1, 1.0)
    assert pool.report("a", 2, 1.0).workers == 2  # the idle worker is a's


def test_a_report_without_workers_is_refused():
    with pytest.raises(ValueError, match="without holding workers"):
        WorkerPool(1, trials=1).report("a", 1, 1.0)
    with pytest.raises(ValueError, match="at least one worker"):
        WorkerPool(0, trials=1)


def test_a_late_release_of_a_restarted_trial_is_undone_by_its_next_report():
    pool = WorkerPool(2, trials=1)
    assert pool.request("a", 5).workers == 2
    pool.release("a")  # the driver's release of its killed run, arriving after the restarted run got its workers
    assert pool.free == 2
    assert pool.report("a", 1, 1.0, workers=2).workers == 2 and pool.held == 2


# --------------------------------------------------------------------------- the rule on a simulated clock
def cost(name: str, epochs: float, train: float = 0.35, validate: float = 0.05, startup: float = 4.0) -> TrialCost:
    return TrialCost(name, epochs=epochs, train_seconds=train, steps=2, validate_seconds=validate,
                     startup_seconds=startup)


def test_the_simulated_pool_grows_the_long_trial_a_short_one_leaves_alone():
    costs = [cost("short", 1), cost("long", 60)]
    cluster = Cluster(workers=2)
    schedule = simulate(costs, cluster)
    long = sorted((p for p in schedule.placements if p.trial == "long"), key=lambda p: p.start)
    assert [p.degree for p in long] == [1, 2] and long[0].end == long[1].start  # grown, after a whole epoch
    assert long[1].workers == (0, 1)
    experiment = pack(costs, cluster, "experiment")
    assert schedule.makespan < experiment.makespan
    # its makespan by hand: the short trial ends at 4.4 s; the long one's 2nd epoch ends at 4.8 s, then it restarts
    # (4 s) and trains its 58 epochs left on two workers: 0.35 / 2 + 0.05 each
    assert schedule.makespan == pytest.approx(4.8 + 4.0 + 58 * (0.35 / 2 + 0.05))


def test_the_simulated_pool_runs_a_lone_trial_on_every_worker_and_equal_trials_side_by_side():
    cluster = Cluster(workers=2)
    [alone] = simulate([cost("a", 10)], cluster).placements
    assert alone.degree == 2 and alone.end == pytest.approx(pack([cost("a", 10)], cluster, "data", degree=2).makespan)
    four = [cost(f"t{i}", 10) for i in range(4)]
    schedule = simulate(four, cluster)
    assert {p.degree for p in schedule.placements} == {1}  # never an idle worker to grow onto
    assert schedule.makespan == pytest.approx(pack(four, cluster, "experiment").makespan)


def test_the_simulated_pool_starts_cold_on_a_new_group_and_warm_on_a_kept_one():
    """A trial that ends leaves its group to the next trial of its process, warm (as experiment mode's reused Tune
    actors are); a growth starts a new group, cold."""
    costs = [TrialCost(f"t{i}", epochs=2, train_seconds=1.0, steps=1, startup_seconds=1.0, cold_start_seconds=5.0)
             for i in range(2)]
    schedule = simulate(costs, Cluster(workers=1))
    assert schedule.makespan == pytest.approx(5.0 + 2 * (1.0 + 2 * 1.0))  # one cold start, the second trial warm
    assert schedule.makespan == pytest.approx(pack(costs, Cluster(workers=1), "experiment").makespan)
    grown = [cost("short", 1, startup=1.0), cost("long", 60, startup=1.0)]
    grown = [dataclasses.replace(c, cold_start_seconds=3.0) for c in grown]
    long = sorted((p for p in simulate(grown, Cluster(workers=2)).placements if p.trial == "long"),
                  key=lambda p: p.start)
    assert [p.degree for p in long] == [1, 2]
    # its start and its growth both cold: 1 + 3 s each, the two epochs before the growth, 58 after it
    assert long[1].end == pytest.approx(2 * (1.0 + 3.0) + 2 * 0.4 + 58 * (0.35 / 2 + 0.05))


# --------------------------------------------------------------------------- groups kept between a process's trials
def test_a_process_keeps_its_group_for_its_next_trial_while_trials_are_to_come():
    removed: list[str] = []
    pool = WorkerPool(2, trials=4, group_prefix="s-", remove_groups=removed.extend)
    a, b = pool.request("a", 2), pool.request("b", 2)
    assert (a.workers, a.reuse, b.workers) == (1, False, 1) and a.group != b.group and a.group.startswith("s-a-")
    assert pool.keep("a", a.group) and pool.kept == {a.group: 1}
    assert (pool.free, pool.held) == (0, 1)  # a's worker is in its kept group, not free for a new one
    c = pool.request("c", 2, kept=a.group)
    assert (c.workers, c.group, c.reuse) == (1, a.group, True) and pool.kept == {}  # warm: the same group
    assert pool.keep("b", b.group)
    d = pool.request("d", 2, kept=b.group)
    assert (d.group, d.reuse) == (b.group, True)
    assert not pool.keep("c", a.group)  # none waits or is to come: its process shuts the group down
    assert pool.free == 1 and pool.kept == {} and removed == [a.group]


def test_a_kept_group_is_taken_back_when_another_trial_needs_its_workers():
    removed: list[str] = []
    pool = WorkerPool(2, trials=4, remove_groups=removed.extend)
    a, b = pool.request("a", 2), pool.request("b", 2)
    assert pool.keep("a", a.group) and pool.keep("b", b.group)
    c = pool.request("c", 2)  # in a new process: a new group, on the oldest kept group's worker
    assert (c.workers, c.reuse) == (1, False) and c.group not in (a.group, b.group)
    assert removed == [a.group] and pool.kept == {b.group: 1}
    d = pool.request("d", 2, kept=a.group)  # a's process, its group gone: a new one, and b's taken back (none to come)
    assert (d.workers, d.reuse) == (1, False) and removed == [a.group, b.group] and pool.kept == {}


def test_kept_groups_go_back_once_no_trial_is_to_come_so_that_the_running_ones_grow():
    removed: list[str] = []
    clock = Clock()
    pool = WorkerPool(3, trials=3, clock=clock, remove_groups=removed.extend)
    a, b, c = pool.request("a", 1), pool.request("b", 1), pool.request("c", 50)
    assert (a.workers, b.workers, c.workers) == (1, 1, 1)
    assert not pool.keep("a", a.group)  # all three trials began: nobody to keep it for
    assert pool.free == 1
    clock.now = 1.0
    pool.report("c", 1, 1.0)
    clock.now = 2.0
    grant = pool.report("c", 2, 1.0)
    assert grant.workers == 2 and grant.group not in (c.group, a.group)  # a growth: a new group, cold
    assert pool.progress["c"].cold and pool.progress["c"].groups == [c.group, grant.group]


def test_a_trial_that_ends_without_handing_its_group_back_has_it_removed():
    removed: list[str] = []
    pool = WorkerPool(2, trials=3, remove_groups=removed.extend)
    a, b = pool.request("a", 2), pool.request("b", 2)
    pool.release("a")  # its process killed (the driver's release): its group goes
    assert removed == [a.group]
    assert pool.keep("b", b.group)
    pool.release("b")  # the driver's release after the trial kept its group: the kept group stays
    assert removed == [a.group] and pool.kept == {b.group: 1}
    again = pool.request("a", 2)  # a retried: asks again, a new group on the free worker (b's kept for c, to come)
    assert again.group not in (a.group, b.group) and removed == [a.group] and pool.kept == {b.group: 1}
    pool.release("a")
    assert removed[-1] == again.group
    assert not pool.keep("a", again.group)  # the driver released it first: the group is not its any more


def test_a_trial_tune_stopped_leaves_its_group_kept_for_its_process():
    removed: list[str] = []
    pool = WorkerPool(2, trials=3, remove_groups=removed.extend)
    a, b = pool.request("a", 9), pool.request("b", 9)
    pool.ended("a")  # ASHA stopped it: the driver hears first, the process after
    assert pool.kept == {a.group: 1} and pool.held == 1 and removed == []
    assert pool.keep("a", a.group)  # its process, stopped, holds the group idle: still kept
    c = pool.request("c", 9, kept=a.group)
    assert c.reuse and pool.kept == {}
    pool.ended("b")  # none waits or is to come: its group goes back, for c to grow onto
    assert removed == [b.group] and pool.free == 1
    assert not pool.keep("b", b.group)


def test_a_restarted_trial_has_its_earlier_runs_groups_removed_and_a_warm_start_measures_no_restart():
    removed: list[str] = []
    clock = Clock()
    pool = WorkerPool(1, trials=3, clock=clock, remove_groups=removed.extend)
    first = pool.request("a", 3)
    again = pool.request("a", 3)  # Tune restarted it before the driver's release reached the pool
    assert removed == [first.group] and again.group != first.group
    assert pool.keep("a", again.group)
    b = pool.request("b", 2, kept=again.group)
    assert b.reuse
    clock.now = 5.0
    pool.report("b", 1, 1.0)
    clock.now = 6.0
    pool.report("b", 2, 1.0)
    assert pool.restarts == []  # a warm group: what its start took is no restart's cost
