"""A search's console: one line per trial epoch, a line when a trial ends, fails or is retried, nothing twice;
after each trial's end, where the search stands (trials finished, running and left, the best, the time left)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distmis.search.console import SearchConsole, clock, progress_line, trial_label
from distmis.search.progress import ProgressFigures, SearchProgress
from distmis.spec import validate_spec
from distmis.trial.record import HISTORY_KEY
from tests.conftest import small_spec_tree


@dataclass
class Trial:
    trial_id: str
    config: dict[str, Any]
    last_result: dict[str, Any] = field(default_factory=dict)
    error_file: str | None = None
    local_path: str | None = None
    status: str = "RUNNING"


def epoch(n: int, dice: float, **extra: Any) -> dict[str, Any]:
    return {"epoch": n, "train_loss": 1.0 - dice / 2, "val_dice": dice, "time_total_s": 30.0 * n, **extra}


class Clock:
    """The driver's clock, set by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def console_of(spec: Any, *, total: int = 2, at_once: int = 2, clock: Clock | None = None,
               records: list | None = None) -> tuple[SearchConsole, SearchProgress]:
    progress = SearchProgress(spec, total=total, at_once=at_once, clock=clock or Clock(),
                              record=None if records is None else lambda metrics, step: records.append((step, metrics)))
    return SearchConsole(spec, progress), progress


class Both:
    """Tune's calls to the progress, then the console (as the MLflow callback's handle forwards them)."""

    def __init__(self, *targets: Any) -> None:
        self.targets = targets

    def __getattr__(self, hook: str) -> Any:
        return lambda *args, **kwargs: [getattr(t, hook)(*args, **kwargs) for t in self.targets]


def test_a_trial_is_named_by_its_searched_values():
    assert trial_label("f_00003", {"training.optimizer.lr": 0.005, "model.params.norm": "group"}) == \
        "lr=0.005 norm=group"
    assert trial_label("f_00003", {}) == "trial 00003"
    assert clock(75.2) == "1:15" and clock(3725) == "1:02:05"


def test_one_line_per_epoch_and_the_best_epoch_at_the_end(tmp_path: Path, capsys):
    spec = validate_spec(small_spec_tree(tmp_path / "data", training={"epochs": 3, "batch_size": 2}))
    console = Both(*reversed(console_of(spec)))
    a = Trial("f_00000", {"training.optimizer.lr": 0.001})
    b = Trial("f_00001", {"training.optimizer.lr": 0.005})
    console.on_trial_start(0, [a, b], a)
    for n, dice in enumerate([0.4, 0.9, 0.7], start=1):
        console.on_trial_result(0, [a, b], a, epoch(n, dice))
    console.on_trial_result(0, [a, b], a, epoch(2, 0.9))  # a restarted trial replays an epoch: not printed again
    a.last_result = epoch(3, 0.7)
    console.on_trial_complete(0, [a, b], a)
    console.on_trial_result(0, [a, b], b, epoch(1, 0.2, attempt="x"))
    console.on_trial_result(0, [a, b], b, epoch(2, 0.3, attempt="y"))  # Ray Train restarted its workers
    console.on_trial_error(0, [a, b], b)

    lines = capsys.readouterr().out.splitlines()
    epochs = [line for line in lines if re.search(r" epoch +\d+/\d+ ", line)]
    assert len(epochs) == 5 and "\x1b" not in "".join(lines)
    assert epochs[0].split() == ["lr=0.001", "epoch", "1/3", "train_loss", "0.8000", "val_dice", "0.4000",
                                 "elapsed", "0:30"]
    assert "lr=0.001  finished: best val_dice 0.9000 at epoch 2, 1:30" in lines[3]
    assert lines[4].startswith("  progress: 1/2 trials finished, 1 running, 0 to start; best val_dice 0.9000 "
                               "(lr=0.001, epoch 2); ")
    assert "retried (attempt 2)" in lines[6]
    assert lines[-2].split()[:5] == ["lr=0.005", "FAILED", "after", "2", "epoch(s):"]
    assert lines[-1] == "  progress: 2/2 trials finished (1 failed), 0 running, 0 to start; best val_dice 0.9000 " \
                        "(lr=0.001, epoch 2)"


def test_an_auto_search_s_epoch_line_says_the_workers_it_ran_on(tmp_path: Path, capsys):
    spec = validate_spec(small_spec_tree(tmp_path / "data", training={"epochs": 3, "batch_size": 2}))
    console = Both(*reversed(console_of(spec)))
    a = Trial("f_00000", {"training.optimizer.lr": 0.001})
    console.on_trial_start(0, [a], a)
    for n, workers in enumerate([1, 2], start=1):  # grown after its first epoch: the same attempt, no retry
        console.on_trial_result(0, [a], a, {**epoch(n, 0.5, attempt="x"), "workers": workers})
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[-3:] for line in lines] == [["on", "1", "worker(s)"], ["on", "2", "worker(s)"]]


def test_the_header_names_the_spec_the_trials_the_mode_and_the_store(tmp_path: Path, capsys):
    spec = validate_spec(small_spec_tree(tmp_path / "data"))
    console_of(spec)[0].header(spec, trials=2, layout="experiment-parallel, 2 trial(s) at once",
                               store="sqlite:///x/mlflow.db", experiment="tiny")
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "search tiny: 2 trial(s), experiment-parallel, 2 trial(s) at once"
    assert "sqlite:///x/mlflow.db" in out and "'tiny'" in out


def test_trials_that_drew_the_same_values_are_told_apart_by_their_number(tmp_path: Path, capsys):
    spec = validate_spec(small_spec_tree(tmp_path / "data", training={"epochs": 3, "batch_size": 2}))
    console, _ = console_of(spec)
    a, b = Trial("f_00000", {"training.optimizer.lr": 0.001}), Trial("f_00001", {"training.optimizer.lr": 0.001})
    console.on_trial_result(0, [a, b], a, epoch(1, 0.5))
    console.on_trial_result(0, [a, b], b, epoch(1, 0.6))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[0] == "lr=0.001" and lines[1].split()[:2] == ["00001", "lr=0.001"]


def test_the_progress_line_counts_the_trials_and_estimates_the_time_left(tmp_path: Path, capsys):
    """4 trials of 3 epochs, 2 at once. A trial-epoch is timed from one report to the next: a's second and third,
    10 s each (a trial's first epoch, which holds its start-up, is not counted once others are). When a ends, b has
    2 epochs left and two trials of 3 wait: on two slots they end after 5 trial-epochs, 50 s. The same figures go
    to the search run, stepped by the trials ended."""
    spec = validate_spec(small_spec_tree(tmp_path / "data", training={"epochs": 3, "batch_size": 2}))
    clock, records = Clock(), []
    console, progress = console_of(spec, total=4, clock=clock, records=records)
    both = Both(progress, console)
    a, b = Trial("f_00000", {"training.optimizer.lr": 0.001}), Trial("f_00001", {"training.optimizer.lr": 0.005})
    both.on_trial_start(0, [a], a)
    both.on_trial_start(0, [a, b], b)
    for now, trial, n, dice in [(25, a, 1, 0.5), (29, b, 1, 0.6), (35, a, 2, 0.8), (45, a, 3, 0.7)]:
        clock.now = now
        both.on_trial_result(0, [a, b], trial, epoch(n, dice))
    a.last_result = epoch(3, 0.7)
    both.on_trial_complete(0, [a, b], a)

    line = capsys.readouterr().out.splitlines()[-1]
    assert line == ("  progress: 1/4 trials finished, 1 running, 2 to start; best val_dice 0.8000 (lr=0.001, epoch 2); "
                    "about 0:50 left (8 trial-epochs of 10.0 s, 2 at once)")
    assert records == [(1, {"search_trials_finished": 1.0, "search_trials_failed": 0.0, "search_trials_running": 1.0,
                            "search_trials_left": 2.0, "search_best_val_dice": 0.8, "search_epoch_seconds": 10.0,
                            "search_eta_seconds": 50.0})]


def test_a_trial_stopped_early_by_the_scheduler_says_so_and_counts_as_finished(tmp_path: Path, capsys):
    spec = validate_spec(small_spec_tree(tmp_path / "data", training={"epochs": 3, "batch_size": 2}))
    console, progress = console_of(spec, total=2)
    both = Both(progress, console)
    a = Trial("f_00000", {"training.optimizer.lr": 0.001})
    both.on_trial_start(0, [a], a)
    both.on_trial_result(0, [a], a, epoch(1, 0.3))
    a.last_result = epoch(1, 0.3)
    both.on_trial_complete(0, [a], a)  # ASHA stopped it after its first epoch
    lines = capsys.readouterr().out.splitlines()
    assert "lr=0.001  stopped early after epoch 1/3: best val_dice 0.3000 at epoch 1, 0:30" in lines[-2]
    assert lines[-1].startswith("  progress: 1/2 trials finished (1 stopped early), 0 running, 1 to start; ")
    assert lines[-1].endswith("about 0:00 left (3 trial-epochs of 0.0 s, 2 at once)")


def test_a_trial_paused_by_its_scheduler_says_so_and_is_resumed_not_retried(tmp_path: Path, capsys):
    """stage-halving (or PBT) pauses a trial at a rung (Tune's PAUSED, seen at the end of a step of its loop), and a
    new process goes on with it later."""
    spec = validate_spec(small_spec_tree(tmp_path / "data", training={"epochs": 3, "batch_size": 2}))
    both = Both(*reversed(console_of(spec)))
    a = Trial("f_00000", {"training.optimizer.lr": 0.001})
    both.on_trial_start(0, [a], a)
    both.on_trial_result(0, [a], a, epoch(1, 0.3, attempt="x"))
    both.on_step_end(0, [a])  # saved for a checkpoint, not paused: nothing said (Tune saves on both)
    a.status = "PAUSED"
    both.on_step_end(0, [a])
    both.on_step_end(1, [a])  # said once
    a.status = "RUNNING"
    both.on_trial_result(0, [a], a, epoch(2, 0.5, attempt="y"))
    both.on_trial_result(0, [a], a, epoch(3, 0.6, attempt="z"))  # no pause before it: a retry
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "  lr=0.001  paused after epoch 1"
    assert lines[2] == "  lr=0.001  resumed after epoch 1, from its checkpoint"
    assert "retried (attempt 3), from its last checkpoint" in lines[4]


def test_a_resumed_trial_that_had_trained_every_epoch_ends_with_its_best_over_all_of_them(tmp_path: Path, capsys):
    """Issue 46, finding 10: a trial that had trained its last epoch when the driver was killed is started again on
    ``--resume``; its only report replays its epochs (the best was epoch 2). The console's "finished" line gives
    that best, not the last epoch's value; the replay is not timed as an epoch. A trial that ended before the kill
    (Tune restored it TERMINATED) counts as finished, with its best as its MLflow run holds it."""
    spec = validate_spec(small_spec_tree(tmp_path / "data", training={"epochs": 3, "batch_size": 2}))
    clock = Clock()
    console, progress = console_of(spec, total=3, clock=clock)
    done = Trial("f_00000", {"training.optimizer.lr": 0.001}, status="TERMINATED", last_result=epoch(3, 0.6))
    a = Trial("f_00001", {"training.optimizer.lr": 0.005})
    progress.adopt({"f_00000": (0.65, 2), "f_00001": (0.7, 1)}, {"f_00000": 3, "f_00001": 1})
    both = Both(progress, console)
    both.on_trial_start(0, [done, a], a)
    clock.now = 5.0
    history = [{"epoch": 1, "val_dice": 0.7}, {"epoch": 2, "val_dice": 0.95}, {"epoch": 3, "val_dice": 0.8}]
    both.on_trial_result(0, [done, a], a, epoch(3, 0.8, **{HISTORY_KEY: json.dumps(history)}))
    a.last_result = epoch(3, 0.8)
    both.on_trial_complete(0, [done, a], a)

    lines = capsys.readouterr().out.splitlines()
    assert "lr=0.005  finished: best val_dice 0.9500 at epoch 2, 1:30" in lines[-2]
    assert lines[-1] == ("  progress: 2/3 trials finished, 0 running, 1 to start; best val_dice 0.9500 "
                         "(lr=0.005, epoch 2); time left unknown (no epoch timed yet)")
    assert progress.best_of("f_00000") == (0.65, 2)


def test_one_trial_epoch_left_is_said_in_the_singular():
    figures = ProgressFigures(total=2, ended=1, failed=0, stopped_early=0, running=1, left=0, best=(0.9, "lr=0.1", 3),
                              seconds_per_epoch=6.8, epochs_left=1.0, at_once=2, seconds_left=6.8)
    assert progress_line(figures, "val_dice").endswith("about 0:07 left (1 trial-epoch of 6.8 s, 2 at once)")
    assert progress_line(ProgressFigures(**{**figures.__dict__, "epochs_left": 2.0, "seconds_left": 13.6}),
                         "val_dice").endswith("about 0:14 left (2 trial-epochs of 6.8 s, 2 at once)")
