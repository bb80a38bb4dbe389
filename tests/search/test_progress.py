"""The search as a whole (distmis.search.progress): the trials ended, running and left, the best so far, and the
arithmetic of the time left."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from distmis.search.progress import SearchProgress, seconds_left
from distmis.spec import validate_spec
from tests.conftest import small_spec_tree


@dataclass
class Trial:
    trial_id: str
    config: dict[str, Any]
    status: str = "RUNNING"
    last_result: dict[str, Any] = field(default_factory=dict)


def test_the_time_left_lays_the_waiting_trials_on_the_first_slot_that_frees():
    # slots end after 2 and 5 epochs; the first waiting trial takes the first (2 + 10), the second the other (5 + 10)
    assert seconds_left([2, 5], [10, 10], 3.0, at_once=2) == 45.0
    assert seconds_left([2, 5], [10, 10], 3.0, at_once=1) == 45.0  # more running than the plan's slots: as many
    assert seconds_left([2], [10, 10], 3.0, at_once=1) == 3.0 * 22  # one at a time
    assert seconds_left([], [4, 4, 4], 1.0, at_once=2) == 8.0
    assert seconds_left([], [4, 4, 4], 1.0, at_once=8) == 4.0  # more slots than trials
    assert seconds_left([], [], 7.0, at_once=2) == 0.0


def test_a_resumed_search_counts_what_ended_before_and_what_its_waiting_trials_have_left(tmp_path: Path):
    """6 trials of 4 epochs, 2 at once. Before the interruption: one finished, one failed (Tune ERROR; it is not
    retried here), one had trained 3 epochs and waits to go on. Now: one runs (epoch 2 of 4, timed at 6 s an epoch)
    and the one with 3 epochs ends. Left: the waiting one's 1 epoch, then one trial not made yet (4)."""
    spec = validate_spec(small_spec_tree(tmp_path / "data", training={"epochs": 4, "batch_size": 2}))
    now = [0.0]
    progress = SearchProgress(spec, total=6, at_once=2, clock=lambda: now[0])
    progress.adopt({"f_0": (0.5, 4), "f_1": (0.99, 1), "f_2": (0.6, 3)}, {"f_0": 4, "f_1": 1, "f_2": 3})
    done, failed = Trial("f_0", {}, "TERMINATED", {"epoch": 4}), Trial("f_1", {}, "ERROR", {"epoch": 1})
    waits, runs = Trial("f_2", {}, "PENDING"), Trial("f_3", {})
    ends = Trial("f_4", {})
    trials = [done, failed, waits, runs, ends]
    progress.on_trial_start(0, trials, runs)
    progress.on_trial_start(0, trials, ends)
    for t, trial, epoch in [(6.0, runs, 1), (12.0, runs, 2), (6.0, ends, 4)]:
        now[0] = t
        progress.on_trial_result(0, trials, trial, {"epoch": epoch, "val_dice": 0.1 * epoch})
    progress.on_trial_complete(0, trials, ends)  # f_4 trained all 4 epochs, but is still RUNNING in Tune's list

    figures = progress.figures()
    assert (figures.total, figures.ended, figures.failed, figures.stopped_early, figures.running, figures.left) == \
        (6, 3, 1, 0, 1, 2)
    assert figures.best == (0.6, "trial 2", 3)  # the failed trial's 0.99 is not a result
    assert figures.seconds_per_epoch == pytest.approx(6.0)  # 18 s over 3 epochs
    # slots: f_3 has 2 epochs left, the other is free; f_2 (1 left) takes the free one, the new trial (4) follows it
    assert figures.epochs_left == 7.0 and figures.seconds_left == pytest.approx(5 * 6.0)
    metrics = figures.metrics("val_dice")
    assert metrics["search_trials_finished"] == 3 and metrics["search_best_val_dice"] == 0.6
    assert metrics["search_eta_seconds"] == pytest.approx(30.0)


def test_a_searched_number_of_epochs_is_each_trials_own(tmp_path: Path):
    spec = validate_spec(small_spec_tree(tmp_path / "data", training={"epochs": 4, "batch_size": 2}))
    progress = SearchProgress(spec, total=2, at_once=1, clock=lambda: 0.0)
    short = Trial("f_0", {"training.epochs": 2})
    progress.on_trial_start(0, [short], short)
    progress.on_trial_result(0, [short], short, {"epoch": 2, "val_dice": 0.3})
    progress.on_trial_complete(0, [short], short)
    assert progress.figures().stopped_early == 0  # it trained its 2 epochs
