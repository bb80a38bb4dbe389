"""A search's console: one line per trial epoch, a line when a trial ends, fails or is retried, nothing twice."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distmis.search.console import SearchConsole, clock, trial_label
from distmis.spec import validate_spec
from tests.conftest import small_spec_tree


@dataclass
class Trial:
    trial_id: str
    config: dict[str, Any]
    last_result: dict[str, Any] = field(default_factory=dict)
    error_file: str | None = None
    local_path: str | None = None


def epoch(n: int, dice: float, **extra: Any) -> dict[str, Any]:
    return {"epoch": n, "train_loss": 1.0 - dice / 2, "val_dice": dice, "time_total_s": 30.0 * n, **extra}


def test_a_trial_is_named_by_its_searched_values():
    assert trial_label("f_00003", {"training.optimizer.lr": 0.005, "model.params.norm": "group"}) == \
        "lr=0.005 norm=group"
    assert trial_label("f_00003", {}) == "trial 00003"
    assert clock(75.2) == "1:15" and clock(3725) == "1:02:05"


def test_one_line_per_epoch_and_the_best_epoch_at_the_end(tmp_path: Path, capsys):
    spec = validate_spec(small_spec_tree(tmp_path / "data", training={"epochs": 3, "batch_size": 2}))
    console = SearchConsole(spec)
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
    assert "retried (attempt 2)" in lines[5]
    assert lines[-1].split()[:5] == ["lr=0.005", "FAILED", "after", "2", "epoch(s):"]


def test_the_header_names_the_spec_the_trials_the_mode_and_the_store(tmp_path: Path, capsys):
    spec = validate_spec(small_spec_tree(tmp_path / "data"))
    SearchConsole(spec).header(spec, trials=2, layout="experiment-parallel, 2 trial(s) at once",
                               store="sqlite:///x/mlflow.db", experiment="tiny")
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "search tiny: 2 trial(s), experiment-parallel, 2 trial(s) at once"
    assert "sqlite:///x/mlflow.db" in out and "'tiny'" in out


def test_trials_that_drew_the_same_values_are_told_apart_by_their_number(tmp_path: Path, capsys):
    spec = validate_spec(small_spec_tree(tmp_path / "data", training={"epochs": 3, "batch_size": 2}))
    console = SearchConsole(spec)
    a, b = Trial("f_00000", {"training.optimizer.lr": 0.001}), Trial("f_00001", {"training.optimizer.lr": 0.001})
    console.on_trial_result(0, [a, b], a, epoch(1, 0.5))
    console.on_trial_result(0, [a, b], b, epoch(1, 0.6))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[0] == "lr=0.001" and lines[1].split()[:2] == ["00001", "lr=0.001"]
