"""The makespan model (distmis.perf.makespan): a trial's time at each data-parallel degree, ASHA's expected stops,
and the packing of a search's trials on W workers against the exhaustive optimum on small searches."""

from __future__ import annotations

import random

import pytest

from distmis.perf.makespan import (
    Cluster, TrialCost, asha_epochs, brute_force, list_schedule, pack,
)


def trial(name: str, seconds: float = 100.0, *, steps: int = 100, gradient_bytes: float = 0.0,
          overhead: float = 0.0, validate: float = 0.0, startup: float = 0.0, epochs: float = 1.0,
          max_degree: int | None = None) -> TrialCost:
    return TrialCost(name, epochs, seconds, steps, overhead, gradient_bytes, validate, startup, max_degree)


def assert_valid(schedule, costs, cluster) -> None:
    """Every trial placed once, on distinct workers, for its time at its degree; no worker holds two at once."""
    assert sorted(p.trial for p in schedule.placements) == sorted(c.name for c in costs)
    by_name = {c.name: c for c in costs}
    for p in schedule.placements:
        assert len(set(p.workers)) == p.degree and all(0 <= w < cluster.workers for w in p.workers)
        seconds = by_name[p.trial].seconds(p.degree, cluster)
        assert p.end - p.start == pytest.approx(seconds) or \
            p.end - p.start == pytest.approx(seconds + by_name[p.trial].cold_start_seconds)
    for a in schedule.placements:
        for b in schedule.placements:
            if a is not b and set(a.workers) & set(b.workers):
                assert a.end <= b.start + 1e-9 or b.end <= a.start + 1e-9, (a, b)


def test_a_trial_speeds_up_by_its_degree_less_its_all_reduce_and_its_validation():
    cluster = Cluster(workers=8, per_node=4, bandwidth=10e9, inter_node_bandwidth=1e9, latency=0.0)
    cost = trial("t", 100.0, steps=100, gradient_bytes=1e8, validate=5.0, startup=20.0, epochs=2)
    assert cost.seconds(1, cluster) == pytest.approx(20 + 2 * (100 + 5))
    # 2 workers: half the compute, 50 steps each all-reducing 2 * 1/2 * 1e8 bytes at 10 GB/s
    assert cost.epoch_seconds(2, cluster) == pytest.approx(50 + 50 * 0.01 + 5)
    # 8 workers span two nodes: the slower link, 2 * 7/8 * 1e8 bytes at 1 GB/s a step
    assert cost.epoch_seconds(8, cluster) == pytest.approx(12.5 + 13 * 0.175 + 5)
    assert cluster.allreduce_seconds(1e8, 4) < cluster.allreduce_seconds(1e8, 5)  # the node's edge


def test_a_trial_first_on_a_worker_pays_its_cold_start_and_the_next_does_not():
    cluster = Cluster(workers=2)
    costs = [TrialCost(f"t{i}", 1, 10.0, 10, cold_start_seconds=5.0) for i in range(4)]
    schedule = pack(costs, cluster, "experiment")
    lengths = sorted(round(p.end - p.start, 6) for p in schedule.placements)
    assert lengths == [10.0, 10.0, 15.0, 15.0] and schedule.makespan == pytest.approx(25.0)
    data = pack(costs, cluster, "data", degree=2)  # the first trial starts both workers
    assert sorted(round(p.end - p.start, 6) for p in data.placements) == [5.0, 5.0, 5.0, 10.0]


def test_asha_stops_the_trials_at_its_rungs():
    # Tune's asynchronous rule: more go on than synchronous halving's half (8, 4, 2, 2, 1, 1, 1, 1)
    assert asha_epochs(8, max_epochs=8, grace_period=1, reduction_factor=2) == [8, 8, 8, 4, 2, 1, 1, 1]
    assert asha_epochs(4, max_epochs=6, grace_period=2, reduction_factor=2) == [6, 6, 4, 2]
    assert asha_epochs(3, max_epochs=10, grace_period=20, reduction_factor=3) == [10, 10, 10]  # grace over max
    assert sum(asha_epochs(32, 100, 10, 3)) < 32 * 100
    with pytest.raises(ValueError, match="reduction_factor"):
        asha_epochs(4, 6, 1, 1)


@pytest.mark.parametrize("trials,max_epochs,grace,factor", [(8, 6, 1, 2), (12, 27, 1, 3), (6, 20, 2, 2)])
def test_the_expected_stops_follow_ray_tunes_own_asha_rule(trials, max_epochs, grace, factor):
    """The model's rule against Ray Tune's ASHA bracket itself, fed the same trials one after another (as one worker
    runs them), epoch by epoch, with the same merits: the same epochs for every trial."""
    import random

    from ray.tune.schedulers import TrialScheduler
    from ray.tune.schedulers.async_hyperband import _Bracket

    from distmis.perf.makespan import _asha_run

    rungs, rung = [], float(grace)
    while rung < max_epochs:
        rungs.append(rung)
        rung *= factor
    draws = random.Random(1)
    for _ in range(20):
        merits = [draws.random() for _ in range(trials)]
        bracket = _Bracket(min_t=grace, max_t=max_epochs, reduction_factor=factor, s=0)
        tune_epochs = []
        for index, merit in enumerate(merits):
            trial = type("Trial", (), {"trial_id": f"t{index}"})()
            epoch = 1
            while epoch < max_epochs and bracket.on_result(trial, epoch, merit) == TrialScheduler.CONTINUE:
                epoch += 1
            tune_epochs.append(float(epoch))
        assert _asha_run(merits, rungs, float(max_epochs), 1 - 1 / factor) == sorted(tune_epochs, reverse=True)


def test_the_fixed_modes_place_every_trial_on_its_degree_without_overlap():
    cluster = Cluster(workers=4, per_node=2)
    costs = [trial(f"t{i}", 50.0 + 10 * i, gradient_bytes=1e6) for i in range(5)]
    experiment = pack(costs, cluster, "experiment")
    data = pack(costs, cluster, "data", degree=2)
    assert set(experiment.degrees().values()) == {1} and set(data.degrees().values()) == {2}
    for schedule in (experiment, data):
        assert_valid(schedule, costs, cluster)
    # a 2-worker trial takes one node's two workers
    assert {tuple(sorted(p.workers)) for p in data.placements} <= {(0, 1), (2, 3)}
    assert 0 <= experiment.idle_fraction < 1


def test_a_trial_that_cannot_be_data_parallel_keeps_one_worker():
    cluster = Cluster(workers=4)
    costs = [trial("vit", 100.0, max_degree=1), trial("unet", 100.0)]
    assert pack(costs, cluster, "data", degree=4).degrees() == {"vit": 1, "unet": 4}
    assert pack(costs, cluster, "auto").degrees()["vit"] == 1


def test_auto_grows_the_tail_of_a_search_and_the_fixed_modes_lose_where_expected():
    """Three equal trials on 2 workers: experiment-parallel leaves one worker idle for the third trial, data-
    parallel pays the all-reduce on all three; auto runs two at once and the third on both workers."""
    cluster = Cluster(workers=2, bandwidth=1e9, latency=0.0)
    costs = [trial(f"t{i}", 100.0, steps=100, gradient_bytes=2e6) for i in range(3)]
    experiment, data, auto = (pack(costs, cluster, "experiment"), pack(costs, cluster, "data", degree=2),
                              pack(costs, cluster, "auto"))
    assert experiment.makespan == pytest.approx(200)
    assert data.makespan == pytest.approx(3 * (50 + 50 * 0.002))
    assert auto.makespan == pytest.approx(100 + 50 + 50 * 0.002)
    assert auto.makespan < min(experiment.makespan, data.makespan)
    assert sorted(auto.degrees().values()) == [1, 1, 2]
    assert_valid(auto, costs, cluster)


def random_search(rng: random.Random, n: int) -> list[TrialCost]:
    return [trial(f"t{i}", rng.uniform(20, 200), steps=rng.choice([8, 40, 100]),
                  gradient_bytes=rng.choice([0.0, 1e6, 5e7]), overhead=rng.choice([0.0, 0.05]),
                  validate=rng.uniform(0, 10), startup=rng.uniform(0, 30), epochs=rng.choice([1, 2, 4]),
                  max_degree=rng.choice([None, None, 1])) for i in range(n)]


@pytest.mark.parametrize("workers,per_node", [(2, None), (3, None), (4, 2)])
def test_auto_is_never_worse_than_a_fixed_mode_and_close_to_the_optimum(workers, per_node):
    """On random small searches (2 to 4 trials): auto's makespan is at most each fixed mode's, and within 10% of
    the best list schedule over every choice of degrees and order (the exhaustive optimum), equal to it on most."""
    rng = random.Random(workers * 100 + (per_node or 0))
    cluster = Cluster(workers=workers, per_node=per_node, bandwidth=1e9, inter_node_bandwidth=2e8, latency=1e-5)
    ratios = []
    for _ in range(25):
        costs = random_search(rng, rng.randint(2, 4))
        auto = pack(costs, cluster, "auto")
        assert_valid(auto, costs, cluster)
        fixed = [pack(costs, cluster, "experiment")] + [pack(costs, cluster, "data", degree=d)
                                                        for d in range(2, workers + 1)]
        assert auto.makespan <= min(s.makespan for s in fixed) + 1e-9
        optimum = brute_force(costs, cluster)
        assert_valid(optimum, costs, cluster)
        assert optimum.makespan <= auto.makespan + 1e-9
        ratios.append(auto.makespan / optimum.makespan)
    assert max(ratios) <= 1.10, max(ratios)
    assert sum(r < 1 + 1e-9 for r in ratios) >= len(ratios) * 0.6


def test_bad_schedules_are_refused():
    cluster = Cluster(workers=2)
    with pytest.raises(ValueError, match="degree 3 is not between 1 and the 2 workers"):
        list_schedule([trial("a")], [3], cluster)
    with pytest.raises(ValueError, match="names must differ"):
        pack([trial("a"), trial("a")], cluster)
    with pytest.raises(ValueError, match="per_node"):
        Cluster(workers=2, per_node=3)
    with pytest.raises(ValueError, match="steps must be at least 1"):
        trial("a", steps=0)
