"""What a search cost the cluster, from its trials' runs: each trial's span and workers, the search's span, its
worker-hours and idle share, and the schedule that ran (a Gantt chart on the search's run).

A trial's span is its run's start and end (MLflow's times: a resumed trial's span holds the time the search was
down); its workers are its layout's world size (the ``trial.workers`` param). The search's span runs from the first
trial's start to the last one's end; ``idle_fraction`` is the share of ``capacity`` workers' time over that span that
no trial held (a resumed search counts the time it was down as idle). Each trial's own ``worker_seconds`` (its
workers times Tune's ``time_total_s``, the time it ran) is logged by the trial callback when it ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from mlflow.tracking import MlflowClient

from distmis.perf.makespan import Placement, Schedule

__all__ = ["TrialSpan", "trial_spans", "measured_schedule", "search_accounting"]


@dataclass(frozen=True)
class TrialSpan:
    """One trial run's name, workers, and start and end (s, Unix time)."""

    name: str
    workers: int
    start: float
    end: float
    grown_seconds: float = 0.0  # worker-seconds beyond ``workers`` for its span: the epochs an auto search grew it for
    grown: tuple[tuple[float, int], ...] = ()  # mode auto: (when, the workers it went on with) at each growth

    def stretches(self) -> list[tuple[float, float, int]]:
        """``(start, end, workers)`` of each stretch of the span on one set of workers: one, unless it grew."""
        starts = [(self.start, self.workers), *[(min(max(t, self.start), self.end), k) for t, k in self.grown]]
        ends = [t for t, _ in starts[1:]] + [max(self.end, self.start)]
        return [(start, end, workers) for (start, workers), end in zip(starts, ends)]

    @property
    def held(self) -> float:
        """The workers' seconds the trial held: its workers over its span, and what it held more once grown."""
        return self.workers * max(0.0, self.end - self.start) + self.grown_seconds


def trial_spans(client: MlflowClient, parent_run_id: str) -> list[TrialSpan]:
    """The ended trial runs of the search ``parent_run_id`` (a cross-validated search's fold runs included)."""
    from distmis.tracking.mlflow_tracking import ROLE_TAG, SEARCH_RUN_TAG, run_workers

    parent = client.get_run(parent_run_id)
    runs = client.search_runs([parent.info.experiment_id], max_results=10_000,
                              filter_string=f"tags.`{SEARCH_RUN_TAG}` = '{parent_run_id}'")
    spans = []
    for run in runs:
        if run.data.tags.get(ROLE_TAG) != "trial" or not run.info.end_time or not run.info.start_time:
            continue
        workers, metrics = run_workers(run), run.data.metrics
        grown = max(0.0, metrics.get("worker_seconds", 0.0) - workers * metrics.get("elapsed_seconds", math.inf))
        growths = _growths(client, run.info.run_id) if "workers" in metrics else ()  # mode auto's trials
        spans.append(TrialSpan(run.info.run_name or run.info.run_id, workers, run.info.start_time / 1000,
                               run.info.end_time / 1000, grown, growths))
    return sorted(spans, key=lambda span: (span.start, span.name))


def _growths(client: MlflowClient, run_id: str) -> tuple[tuple[float, int], ...]:
    """When a trial of an auto search went on with more workers (s, Unix time: the report of the last epoch before,
    after which it restarted), and with how many: from its ``workers`` metric, one point an epoch."""
    points = sorted(client.get_metric_history(run_id, "workers"), key=lambda m: m.step)
    return tuple((before.timestamp / 1000, int(after.value)) for before, after in zip(points, points[1:])
                 if after.value != before.value)


def measured_schedule(spans: Sequence[TrialSpan], capacity: int) -> Schedule:
    """The spans as a :class:`~distmis.perf.makespan.Schedule` from the first start: each trial (each stretch of a
    trial an auto search grew) on the lowest ``workers`` worker rows free at its start (rows beyond ``capacity``
    where the spans overlap more than it holds, as two trials' runs overlap by the moments their records take)."""
    if not spans:
        return Schedule("measured", max(1, capacity))
    origin = min(span.start for span in spans)
    free: list[float] = [0.0] * max(1, capacity)
    placements = []
    stretches = sorted(((start, end, workers, span.name) for span in spans for start, end, workers in span.stretches()),
                       key=lambda s: (s[0], s[3]))
    for start, end, workers, name in stretches:
        start, end = start - origin, end - origin
        rows = [w for w in range(len(free)) if free[w] <= start + 1e-6][:workers]
        while len(rows) < workers:
            free.append(0.0)
            rows.append(len(free) - 1)
        for w in rows:
            free[w] = end
        placements.append(Placement(name, workers, start, end, tuple(rows)))
    return Schedule("measured", len(free), tuple(placements))


def search_accounting(spans: Sequence[TrialSpan], capacity: int) -> dict[str, float]:
    """``span_seconds`` (first start to last end), ``worker_hours`` (the trials' workers times their spans) and
    ``idle_fraction`` (of ``capacity`` workers over the span); ``{}`` without a trial that ended."""
    if not spans:
        return {}
    span = max(s.end for s in spans) - min(s.start for s in spans)
    held = sum(s.held for s in spans)
    idle = 1.0 - held / (capacity * span) if span > 0 and capacity > 0 else 0.0
    return {"span_seconds": span, "worker_hours": held / 3600, "idle_fraction": max(0.0, idle)}
