"""A cross-validated search restored from a searcher state newer than Tune's experiment state (issue 46, 13): a tiny
real Tune run on the session's local Ray, with a trivial function trainable, whose saved states are then made to
disagree as a driver killed between their writes leaves them.

Tune's generator state, saved with the searchers', already counts the trial Tune's own state lost, says the searcher
is finished, and its concurrency limiter still counts the lost trial as running. The restored search must hand the
lost fold out again and end with every (configuration, fold) trained once, as :func:`tune_search` sets Tune up.
"""

from __future__ import annotations

import glob
import json
import os
import pickle
from pathlib import Path

import pytest
from ray import cloudpickle, tune
from ray.tune.experiment.trial import Trial

from distmis.search.folds import CONFIGURATION_KEY, FOLD_KEY, FoldSearchGenerator
from distmis.search.search_space import tune_param_space, tune_search
from distmis.spec import validate_spec
from tests.conftest import small_spec_tree


def fold_trial(config: dict) -> None:
    tune.report({"val_dice": 0.5 + 0.1 * config[FOLD_KEY]})


def _newest(folder: Path, pattern: str) -> Path:
    return Path(max(glob.glob(str(folder / pattern))))


def lose_the_last_trial(experiment: Path) -> str:
    """Tune's experiment state without the trial of the last fold (configuration c000, fold 1); the searchers' state
    as it was while that trial ran: the fold searcher has not heard of its end, the limiter counts it running.
    Returns the lost trial's id."""
    state_file = _newest(experiment, "experiment_state-*.json")
    state = json.loads(state_file.read_text())
    trials = [Trial.from_json_state(json_state, stub=True) for json_state, _ in state["trial_data"]]
    [lost] = [t.trial_id for t in trials if (t.config[CONFIGURATION_KEY], t.config[FOLD_KEY]) == ("c000", 1)]
    state["trial_data"] = [entry for entry, trial in zip(state["trial_data"], trials) if trial.trial_id != lost]
    state_file.write_text(json.dumps(state))

    searcher_file = _newest(experiment, "searcher-state-*.pkl")
    searcher = pickle.loads(searcher_file.read_bytes())
    del searcher["ended"]["c000"][1]
    searcher["best"].pop(lost, None)
    searcher_file.write_bytes(pickle.dumps(searcher))

    generator_file = _newest(experiment, "search_gen_state-*.json")
    generator = cloudpickle.loads(generator_file.read_bytes())
    assert generator["finished"] and generator["counter"] == 2  # what stopped the restored search before
    generator["name:ConcurrencyLimiter"]["live_trials"].add(lost)
    generator_file.write_bytes(cloudpickle.dumps(generator))
    return lost


def test_a_fold_whose_trial_tune_lost_is_trained_on_resume(ray_local, tmp_path: Path) -> None:
    tree = small_spec_tree(tmp_path / "data")
    tree["dataset"]["split"] = {"folds": 2, "test": 0.25, "seed": 0}
    tree["search"]["space"] = {"training.optimizer.lr": {"grid": [1.0e-3]}}  # one configuration, two folds
    spec = validate_spec(tree)
    options = tune_search(spec, max_concurrent=1)
    assert isinstance(options["search_alg"], FoldSearchGenerator) and options["num_samples"] == -1
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    tuner = tune.Tuner(
        fold_trial, param_space=tune_param_space(spec),
        tune_config=tune.TuneConfig(metric=spec.search.metric, mode=spec.search.mode, reuse_actors=True,
                                    time_budget_s=120, **options),  # a search that would wait for ever ends
        run_config=tune.RunConfig(name="folds", storage_path=str(tmp_path / "ray_results"), verbose=0))
    first = tuner.fit()
    assert sorted((r.config[CONFIGURATION_KEY], r.config[FOLD_KEY]) for r in first) == [("c000", 0), ("c000", 1)]

    experiment = tmp_path / "ray_results" / "folds"
    lost = lose_the_last_trial(experiment)
    restored = tune.Tuner.restore(str(experiment), trainable=fold_trial, resume_unfinished=True, resume_errored=True)
    results = restored.fit()

    trained = sorted((r.config[CONFIGURATION_KEY], r.config[FOLD_KEY]) for r in results if r.error is None)
    assert trained == [("c000", 0), ("c000", 1)], trained  # the lost fold trained again, no fold twice
    assert lost not in {r.metrics.get("trial_id") for r in results}
    assert not results.errors


@pytest.mark.parametrize("max_concurrent", [None, 2])
def test_without_folds_tune_counts_the_trials_as_before(tmp_path: Path, max_concurrent) -> None:
    tree = small_spec_tree(tmp_path / "data")
    tree["model"]["framework"] = "torch"  # Tune's own grid: no distmis searcher
    options = tune_search(validate_spec(tree), max_concurrent)
    assert options == {"search_alg": None, "num_samples": 1, "max_concurrent_trials": max_concurrent}
