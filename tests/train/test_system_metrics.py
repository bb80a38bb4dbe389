"""A trial's system sampler (MLflow's system metrics, sampled in the trial's own process): the figures and their
MLflow names, the arithmetic of a utilization over a period, the background thread and the drain, and the samples
every rank's report carries to the driver."""

from __future__ import annotations

import sys
import threading

import psutil
import pytest
from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor

from distmis.train.system_metrics import NODE_METRICS, SystemSampler
from distmis.trial.record import (NODES_KEY, SYSTEM_KEY, SystemSample, samples_from_json, samples_to_json,
                                  with_every_rank_records)


class Clock:
    """Wall time the test sets: a utilization is CPU time over this."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def burn(cpu_seconds: float) -> None:
    """Use this much CPU time in this thread (measured by the kernel's count, not by a clock)."""
    process = psutil.Process()
    start = sum(process.cpu_times()[:2])
    x = 0
    while sum(process.cpu_times()[:2]) - start < cpu_seconds:
        for i in range(10_000):
            x += i


def test_the_node_figures_are_mlflows_own_names():
    monitor = CPUMonitor()  # MLflow's monitor of a run's system metrics
    monitor.collect_metrics()
    assert set(monitor.metrics) == set(NODE_METRICS)
    values = SystemSampler(10, rank=0, cpus=1).sample().values
    assert set(NODE_METRICS) <= set(values)


def test_a_utilization_is_the_processes_cpu_time_over_the_period_and_its_cpus():
    clock = Clock()
    sampler = SystemSampler(10, rank=0, cpus=2, clock=clock)
    process = psutil.Process()
    before = process.cpu_times()
    burn(0.3)
    after = process.cpu_times()
    clock.now += 1.0
    values = sampler.sample().values
    used = sum(after) - sum(before)  # user, system and the children's: what the sampler counts
    # its own CPU seconds over 1 s of wall time on 2 CPUs (it read the count a moment after `after`)
    assert values["rank0_cpu_utilization_percentage"] == pytest.approx(100 * used / 2, abs=100 * 0.05 / 2)
    assert values["rank0_cpu_utilization_percentage"] >= 100 * 0.3 / 2 - 0.01
    assert values["rank0_memory_usage_megabytes"] == pytest.approx(process.memory_info().rss / 1e6, rel=0.2)
    memory = psutil.virtual_memory()
    assert 0 < values["system_memory_usage_percentage"] <= 100
    assert values["system_memory_usage_megabytes"] == pytest.approx(memory.used / 1e6, rel=0.2)
    assert 0 <= values["cpu_utilization_percentage"] <= 100
    assert not any(key.startswith("gpu_") for key in values)  # no GPU asked for


def test_other_ranks_sample_their_own_process_not_the_node():
    values = SystemSampler(10, rank=3, cpus=1).sample().values
    assert set(values) == {"rank3_cpu_utilization_percentage", "rank3_memory_usage_megabytes"}


def test_the_thread_samples_every_interval_and_a_drain_hands_over_each_sample_once():
    sampler = SystemSampler(0.05, rank=0, cpus=1)
    taken, count = threading.Event(), 0
    original = sampler.sample

    def counted() -> SystemSample:
        nonlocal count
        sample = original()
        count += 1
        if count >= 3:
            taken.set()
        return sample

    sampler.sample = counted  # type: ignore[method-assign]
    with sampler:
        assert taken.wait(60)
        first = sampler.drain()
        second = sampler.drain()
    assert len(first) >= 4  # the thread's, and the drain's own at the end
    times = [sample.timestamp_ms for sample in first + second]
    assert times == sorted(times) and len(set(times)) >= 2
    assert second and second[0].timestamp_ms >= first[-1].timestamp_ms  # nothing handed over twice
    assert "distmis-system-metrics" not in {thread.name for thread in threading.enumerate()}  # stopped with the block


def test_the_interval_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        SystemSampler(0)


def test_samples_travel_as_json_and_every_ranks_reach_the_driver():
    rank0 = [SystemSample(2_000, {"rank0_memory_usage_megabytes": 5.0, "cpu_utilization_percentage": 50.0})]
    rank1 = [SystemSample(1_000, {"rank1_memory_usage_megabytes": 6.0}),
             SystemSample(3_000, {"rank1_memory_usage_megabytes": 7.0})]
    assert samples_from_json(samples_to_json(rank1)) == rank1
    assert samples_from_json("not json") == [] and samples_from_json('[{"t": 1}]') == []
    reports = [{"epoch": 3, "val_dice": 0.5, SYSTEM_KEY: samples_to_json(rank0)},
               {"epoch": 3, "val_dice": 0.4, SYSTEM_KEY: samples_to_json(rank1)}]
    merged = with_every_rank_records(reports)
    assert merged["val_dice"] == 0.5 and merged["epoch"] == 3  # rank 0's report...
    assert samples_from_json(merged[SYSTEM_KEY]) == [rank1[0], rank0[0], rank1[1]]  # ...with everyone's samples
    assert reports[0][SYSTEM_KEY] == samples_to_json(rank0)  # the reports themselves untouched
    assert SYSTEM_KEY not in with_every_rank_records([{"epoch": 1}, {"epoch": 1}])


def test_a_first_report_names_every_ranks_node_in_rank_order():
    merged = with_every_rank_records([{"epoch": 1, NODES_KEY: "a"}, {"epoch": 1, NODES_KEY: "b"}])
    assert merged[NODES_KEY] == "a,b"
    assert NODES_KEY not in with_every_rank_records([{"epoch": 2}, {"epoch": 2}])  # later reports: none


def test_a_rank_given_gpus_without_nvml_samples_the_rest_and_says_why(caplog, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed (as on this machine)
    with caplog.at_level("WARNING", logger="distmis.train.system_metrics"):
        sampler = SystemSampler(10, rank=0, cpus=1, gpus=True)
        values = sampler.sample().values
        sampler.stop()
    assert "rank0_cpu_utilization_percentage" in values and not any(key.startswith("gpu_") for key in values)
    assert "pip install nvidia-ml-py" in caplog.text
