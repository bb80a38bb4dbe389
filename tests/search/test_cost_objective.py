"""``search.algorithm: optuna-cost`` (:mod:`distmis.search.cost_objective`) and ``search.cost_limit``
(:mod:`distmis.search.cost_limit`): what Optuna is told of each trial, and which trials may become the model. End
to end: tests/search/test_budget_search.py (a worker-hours budget, searched by optuna-cost, with a cost limit)."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from distmis.search.cost_limit import within_cost_limit
from distmis.search.cost_objective import COST_METRIC, CostAwareOptuna
from distmis.search.search_space import search_algorithm, tune_param_space
from distmis.spec import validate_spec
from distmis.spec.load import SpecError
from tests.conftest import small_spec_tree


def cost_tree(tmp_path: Path) -> dict:
    tree = small_spec_tree(tmp_path / "data")
    tree["search"] = {"algorithm": "optuna-cost", "num_samples": 3,
                      "space": {"training.optimizer.lr": {"loguniform": [1e-4, 1e-2]}}}
    return tree


def test_optuna_is_told_each_trials_best_value_and_its_worker_hours(tmp_path: Path):
    spec = validate_spec(cost_tree(tmp_path))
    searcher = search_algorithm(spec)
    assert isinstance(searcher, CostAwareOptuna) and tune_param_space(spec) == {}  # its own space and objectives
    assert searcher._metric == ["val_dice", COST_METRIC] and searcher._mode == ["max", "min"]
    assert (searcher.metric, searcher.mode) == ("val_dice", "max")  # what Tune checks the trials' results for
    assert searcher._ot_study.directions == [optuna.study.StudyDirection.MAXIMIZE,
                                             optuna.study.StudyDirection.MINIMIZE]
    configs = {trial: searcher.suggest(trial) for trial in ("a", "b")}
    assert all(1e-4 <= config["training.optimizer.lr"] <= 1e-2 for config in configs.values())
    for value, seconds in ((0.4, 30.0), (0.7, 40.0), (0.6, 50.0)):  # its best is not its last
        searcher.on_trial_result("a", {"val_dice": value, "time_this_iter_s": seconds})
    # mode auto's epochs say their workers: 2 workers for 360 s
    searcher.on_trial_result("b", {"val_dice": 0.5, "time_this_iter_s": 360.0, "workers": 2})
    searcher.on_trial_complete("a", {"val_dice": 0.6})
    searcher.on_trial_complete("b", {"val_dice": 0.5, "config": configs["b"]})
    values = [trial.values for trial in searcher._ot_study.trials]
    assert values[0] == pytest.approx([0.7, 120.0 / 3600]) and values[1] == pytest.approx([0.5, 720.0 / 3600])


def test_optuna_cost_is_refused_with_folds_and_with_grid_domains(tmp_path: Path):
    tree = cost_tree(tmp_path)
    tree["dataset"]["split"] = {"folds": 3, "test": 0.25, "seed": 0}
    tree["dataset"]["synthetic"]["cases"] = 8
    with pytest.raises(SpecError, match="'optuna-cost' is not run with cross-validation folds"):
        validate_spec(tree)
    tree = cost_tree(tmp_path)
    tree["search"]["space"] = {"training.optimizer.lr": {"grid": [1e-3, 1e-2]}}
    with pytest.raises(SpecError, match="'optuna-cost' samples; use 'choice'"):
        validate_spec(tree)


def test_a_cost_limit_keeps_the_trials_and_configurations_within_it():
    worker_seconds = {"a": 1800.0, "b": 3600.0, "c": 7200.0}
    assert within_cost_limit({"a", "b", "c"}, worker_seconds, {}, None) == {"a", "b", "c"}
    assert within_cost_limit({"a", "b", "c"}, worker_seconds, {}, 1.0) == {"a", "b"}  # at the limit is within
    assert within_cost_limit({"a", "b", "d"}, worker_seconds, {}, 10.0) == {"a", "b"}  # d: no record, no cost known
    # with folds a configuration costs its folds together: x = a + b (1.5 h), y = c alone (2 h)
    folds = {"a": ("x", 0), "b": ("x", 1), "c": ("y", 0)}
    assert within_cost_limit({"a", "b", "c"}, worker_seconds, folds, 1.5) == {"a", "b"}
    assert within_cost_limit({"a", "b", "c"}, worker_seconds, folds, 1.2) == set()
    assert within_cost_limit({"a", "b", "c"}, worker_seconds, folds, 2.0) == {"a", "b", "c"}


def test_a_cost_limit_is_worker_hours_above_zero(tmp_path: Path):
    tree = small_spec_tree(tmp_path / "data")
    tree["search"]["cost_limit"] = 0
    with pytest.raises(SpecError, match="search.cost_limit"):
        validate_spec(tree)
    tree["search"]["cost_limit"] = 2.5
    assert validate_spec(tree).search.cost_limit == 2.5
