"""``search.selection`` (distmis.train.selection): the moving average against a hand computation, and the epoch loop
keeping the best epoch's weights by it, with a real torch trainer whose validation dice is scripted."""

from __future__ import annotations

import dataclasses
import io
import math
from pathlib import Path

import pytest
import torch

from distmis.search.prepare import prepare_data
from distmis.spec import validate_spec
from distmis.train.loop import epoch_reports
from distmis.train.selection import moving_average, selection_metrics
from distmis.trial.record import RESUME_DIR, STATE_FILE, TrainingState
from tests.conftest import small_spec_tree
from tests.train.torch_trainers import local_trainer

#: A validation dice whose best single epoch (5) is not the best by nnU-Net's moving average (epoch 1).
SCRIPTED = [0.9, 0.9, 0.9, 0.1, 0.95]


def test_the_moving_average_is_nnunets_and_skips_epochs_without_a_value():
    assert math.isnan(moving_average([], 0.9)) and math.isnan(moving_average([math.nan], 0.9))
    by_hand = 0.5
    for value in (0.7, 0.2):
        by_hand = 0.9 * by_hand + 0.1 * value
    assert moving_average([0.5, 0.7, math.nan, 0.2], 0.9) == pytest.approx(by_hand)
    assert moving_average([0.5, 0.7], 0.0) == 0.7  # no smoothing: the last value
    with pytest.raises(ValueError, match="smoothing"):
        moving_average([0.5], 1.0)


def test_the_selected_metric_names_the_value_reported_beside_the_metric(tmp_path: Path):
    tree = small_spec_tree(tmp_path)
    assert validate_spec(tree).search.selected_metric == "val_dice"
    tree["search"].update({"selection": "moving-average", "smoothing": 0.5})
    search = validate_spec(tree).search
    assert search.selected_metric == "ema_val_dice"
    assert selection_metrics([{"val_dice": 0.2}, {"val_dice": 0.6}], search) == {"ema_val_dice": pytest.approx(0.4)}
    tree["search"]["selection"] = "best"
    with pytest.raises(ValueError, match="selection"):
        validate_spec(tree)
    tree["search"]["selection"] = "epoch"  # (smoothing 0.5 stays)
    with pytest.raises(ValueError, match="smoothing .*moving-average"):
        validate_spec(tree)


@pytest.mark.parametrize("selection, best_epoch", [("epoch", 5), ("moving-average", 1)])
def test_the_loop_keeps_the_weights_of_the_epoch_the_rule_selects(tmp_path: Path, selection: str, best_epoch: int):
    tree = small_spec_tree(tmp_path / "data")
    tree["model"]["framework"] = "torch"
    tree["training"].update({"epochs": len(SCRIPTED), "tile": [8, 8, 8]})
    tree["search"]["selection"] = selection
    spec = validate_spec(tree)
    trainer = local_trainer(spec, prepare_data(spec, tmp_path / "out", progress=False).tfrecord_dir)
    trained = trainer.run_epoch

    def scripted(epoch: int):  # the epoch really trains; only its validation dice is the script's
        return dataclasses.replace(trained(epoch), val_dice=SCRIPTED[epoch - 1])

    trainer.run_epoch = scripted  # type: ignore[method-assign]
    weights: dict[int, bytes] = {}
    reports = []
    for metrics, checkpoint in epoch_reports(trainer, spec, scratch=tmp_path / "trial"):
        reports.append(metrics)
        assert checkpoint is not None
        weights[int(metrics["epoch"])] = (checkpoint / "model.pt").read_bytes()  # the best epoch's so far
        state = TrainingState.from_json((checkpoint / RESUME_DIR / STATE_FILE).read_text())
    assert state.best_epoch == best_epoch
    assert weights[len(SCRIPTED)] == weights[best_epoch]  # the kept weights are the selected epoch's ...
    kept = torch.load(io.BytesIO(weights[len(SCRIPTED)]), weights_only=True)
    last = trainer.model.state_dict()
    same = all(torch.equal(kept[name], last[name]) for name in last)
    assert same == (best_epoch == len(SCRIPTED))  # ... not the last epoch's, unless it was selected
    if selection == "moving-average":
        expected = [moving_average(SCRIPTED[:k], 0.9) for k in range(1, len(SCRIPTED) + 1)]
        assert [m["ema_val_dice"] for m in reports] == pytest.approx(expected)
        assert state.best_value == pytest.approx(expected[0])
        assert all(h["ema_val_dice"] == pytest.approx(e) for h, e in zip(state.history, expected))  # a resume's
    else:
        assert "ema_val_dice" not in reports[0] and state.best_value == pytest.approx(0.95)
