"""What a search cost, from its trials' spans (distmis.tracking.accounting): the schedule that ran, its span,
worker-hours and idle share."""

from __future__ import annotations

import pytest

from distmis.tracking.accounting import TrialSpan, measured_schedule, search_accounting


def test_the_spans_become_the_schedule_that_ran_and_its_cost():
    spans = [TrialSpan("a", 1, 100.0, 160.0), TrialSpan("b", 1, 101.0, 131.0), TrialSpan("c", 2, 161.0, 181.0),
             TrialSpan("d", 1, 131.0, 150.0)]
    schedule = measured_schedule(spans, capacity=2)
    rows = {p.trial: p.workers for p in schedule.placements}
    assert rows == {"a": (0,), "b": (1,), "d": (1,), "c": (0, 1)}  # d takes the row b left; c both once free
    assert schedule.workers == 2 and schedule.makespan == pytest.approx(81.0)
    figures = search_accounting(spans, capacity=2)
    held = 60 + 30 + 2 * 20 + 19
    assert figures["span_seconds"] == pytest.approx(81.0)
    assert figures["worker_hours"] == pytest.approx(held / 3600)
    assert figures["idle_fraction"] == pytest.approx(1 - held / (2 * 81.0))


def test_spans_that_overlap_more_than_the_capacity_get_rows_of_their_own():
    spans = [TrialSpan("a", 1, 0.0, 10.0), TrialSpan("b", 1, 9.5, 20.0)]  # b's run began as a's was being ended
    schedule = measured_schedule(spans, capacity=1)
    assert schedule.workers == 2 and {p.trial: p.workers for p in schedule.placements} == {"a": (0,), "b": (1,)}
    assert search_accounting(spans, capacity=1)["idle_fraction"] == 0.0  # never below nothing
    assert search_accounting([], capacity=4) == {}


def test_a_trial_an_auto_search_grew_is_drawn_stretch_by_stretch_and_costs_what_it_held():
    # b ended at 30 s; a went on with both workers from 40 s (its epoch after b's end) to its end
    spans = [TrialSpan("a", 1, 0.0, 100.0, grown_seconds=60.0, grown=((40.0, 2),)), TrialSpan("b", 1, 0.0, 30.0)]
    schedule = measured_schedule(spans, capacity=2)
    stretches = sorted((p.trial, p.degree, p.start, p.end, p.workers) for p in schedule.placements)
    assert stretches == [("a", 1, 0.0, 40.0, (0,)), ("a", 2, 40.0, 100.0, (0, 1)), ("b", 1, 0.0, 30.0, (1,))]
    assert schedule.workers == 2
    figures = search_accounting(spans, capacity=2)
    assert figures["worker_hours"] == pytest.approx((100 + 60 + 30) / 3600)
    assert figures["idle_fraction"] == pytest.approx(1 - 190 / 200)
