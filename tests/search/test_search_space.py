from __future__ import annotations

import pytest
from ray import tune
from ray.tune.search import Searcher

from distmis.search.affinity import GraphAffineConfigurations
from distmis.search.search_space import (
    TUNE_ALGORITHMS, TUNE_SCHEDULERS, num_trials, param_space, scheduler, search_algorithm, tune_param_space,
    tune_search,
)
from distmis.spec.searchers import ALGORITHMS, SCHEDULERS, SchedulerEntry
from distmis.train.loop import is_better
from distmis.spec import validate_spec


def test_param_space_maps_each_domain(spec_tree):
    spec_tree["search"] = {
        "algorithm": "random",
        "num_samples": 3,
        "space": {
            "training.optimizer.lr": {"loguniform": [1.0e-4, 1.0e-2]},
            "training.optimizer.beta2": {"uniform": [0.9, 0.999]},
            "model.params.norm": {"choice": ["batch", "group"]},
            "training.batch_size": {"randint": [1, 2]},
            "training.optimizer.amsgrad": {"grid": [True, False]},
        },
    }
    spec = validate_spec(spec_tree)
    space = param_space(spec.search)
    assert isinstance(space["training.optimizer.lr"], tune.search.sample.Float)
    assert isinstance(space["model.params.norm"], tune.search.sample.Categorical)
    assert space["training.optimizer.amsgrad"] == {"grid_search": [True, False]}
    # randint is inclusive in the spec, exclusive in Tune.
    assert space["training.batch_size"].upper == 3
    assert num_trials(spec) == 6
    assert scheduler(spec) is None
    # Tune's own variant generator for torch trials; experiment-mode TensorFlow ones are handed out by graph
    assert search_algorithm(validate_spec({**spec_tree, "model": {**spec_tree["model"], "framework": "torch"}})) is None
    assert isinstance(search_algorithm(spec), GraphAffineConfigurations) and len(search_algorithm(spec).configs) == 6


def test_optuna_and_asha(spec_tree):
    spec_tree["search"] = {"algorithm": "optuna", "scheduler": "asha", "space": {}}
    spec = validate_spec(spec_tree)
    assert type(search_algorithm(spec)).__name__ == "OptunaSearch"
    assert type(scheduler(spec)).__name__ == "AsyncHyperBandScheduler"


def test_is_better():
    assert is_better(0.5, None, "max") and is_better(0.6, 0.5, "max") and not is_better(0.4, 0.5, "max")
    assert is_better(0.4, 0.5, "min") and not is_better(float("nan"), None, "max")


def test_every_registered_algorithm_and_scheduler_has_its_tune_binding():
    assert set(TUNE_ALGORITHMS) == set(ALGORITHMS) and set(TUNE_SCHEDULERS) == set(SCHEDULERS)
    for name, entry in ALGORITHMS.items():  # Tune's variant generator is the algorithms that enumerate or draw
        assert (TUNE_ALGORITHMS[name] is None) == entry.variant_generator, name


def test_a_new_scheduler_is_one_entry_and_one_binding(spec_tree, monkeypatch):
    """A toy scheduler, registered as a new one would be: a spec naming it validates, the search gets its object,
    with folds one per fold; before it is registered, the spec is refused naming the registered ones."""
    from ray.tune.schedulers import FIFOScheduler

    from distmis.search.folds import FoldScheduler
    from distmis.spec.load import SpecError

    spec_tree["search"] = {"algorithm": "grid", "scheduler": "toy",
                           "space": {"training.optimizer.lr": {"grid": [1e-3, 2e-3]}}}
    with pytest.raises(SpecError, match="no trial scheduler 'toy'; registered: none, asha"):
        validate_spec(spec_tree)

    made: list[FIFOScheduler] = []

    def toy(spec, key):
        made.append(FIFOScheduler())
        return made[-1]

    monkeypatch.setitem(SCHEDULERS, "toy", SchedulerEntry("toy", stops_trials=False, summary="a toy"))
    monkeypatch.setitem(TUNE_SCHEDULERS, "toy", toy)
    spec = validate_spec(spec_tree)
    assert scheduler(spec) is made[0]
    spec_tree["dataset"]["split"] = {"folds": 3, "test": 0.25, "seed": 0}
    spec_tree["dataset"]["synthetic"]["cases"] = 8
    per_fold = scheduler(validate_spec(spec_tree))
    assert isinstance(per_fold, FoldScheduler) and list(per_fold.by_fold.values()) == made[1:] and len(made) == 4


def test_an_algorithm_refuses_the_domains_it_cannot_take_by_its_entry(spec_tree):
    from distmis.spec.load import SpecError

    spec_tree["search"] = {"algorithm": "optuna", "space": {"training.optimizer.lr": {"grid": [1e-3, 2e-3]}}}
    with pytest.raises(SpecError, match="algorithm 'optuna' samples; use 'choice' instead of 'grid'"):
        validate_spec(spec_tree)
    spec_tree["search"] = {"algorithm": "grid", "space": {"training.optimizer.lr": {"uniform": [1e-3, 2e-3]}}}
    with pytest.raises(SpecError, match="algorithm 'grid' takes only 'grid' domains, got 'uniform'"):
        validate_spec(spec_tree)


def test_hyperband_and_median_stopping_are_tunes_schedulers_of_the_spec(spec_tree):
    import types

    import numpy as np
    from ray.tune.schedulers import AsyncHyperBandScheduler, MedianStoppingRule

    spec_tree["training"]["epochs"] = 9
    spec_tree["search"] = {"scheduler": "hyperband", "space": {},
                           "hyperband": {"grace_period": 1, "reduction_factor": 3, "brackets": 2}}
    made = scheduler(validate_spec(spec_tree))
    assert isinstance(made, AsyncHyperBandScheduler) and len(made._brackets) == 2
    assert [[rung for rung, _ in bracket._rungs] for bracket in made._brackets] == [[9, 3, 1], [9, 3]]  # s = 0, 1

    # its brackets drawn from its own generator, seeded with training.seed: the same search draws the same
    # brackets, and numpy's global draws are left as they were
    def brackets(seed: int) -> list[int]:
        spec_tree["training"]["seed"] = seed
        hyperband = scheduler(validate_spec(spec_tree))
        hyperband.set_search_properties("val_dice", "max")
        for index in range(8):
            hyperband.on_trial_add(None, types.SimpleNamespace(trial_id=str(index)))
        return [hyperband._brackets.index(hyperband._trial_info[str(index)]) for index in range(8)]

    np.random.seed(5)
    expected = np.random.random()
    np.random.seed(5)
    assert brackets(0) == brackets(0) != brackets(1) and np.random.random() == expected

    spec_tree["search"] = {"scheduler": "median", "space": {}, "median": {"grace_period": 2, "min_samples": 2}}
    median = scheduler(validate_spec(spec_tree))
    assert isinstance(median, MedianStoppingRule)
    assert (median._time_attr, median._grace_period, median._min_samples_required, median._hard_stop) == (
        "epoch", 2, 2, True)


def test_under_a_stopping_scheduler_a_grid_is_handed_out_in_a_seeded_random_order(spec_tree):
    """A grid written in order (learning rates rising) would bring each trial to ASHA's rungs better than all before
    it, and the asynchronous rule stops none: its configurations go out shuffled, the same order for the same seed."""
    from distmis.search.folds import Configurations

    lrs = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2]
    spec_tree["search"] = {"algorithm": "grid", "scheduler": "asha",
                           "space": {"training.optimizer.lr": {"grid": lrs}}}
    spec_tree["model"]["framework"] = "torch"  # (TensorFlow's experiment-mode trials: by graph, shuffled likewise)
    spec = validate_spec(spec_tree)
    searcher = search_algorithm(spec)
    assert type(searcher) is Configurations and tune_param_space(spec) == {}
    made = tune_search(spec, 2)
    assert type(made["search_alg"]) is Configurations and (made["num_samples"], made["max_concurrent_trials"]) == (6, 2)
    order = [searcher.suggest(str(i))["training.optimizer.lr"] for i in range(6)]
    assert sorted(order) == lrs and order != lrs and searcher.suggest("7") == Searcher.FINISHED
    again = search_algorithm(spec)
    assert [again.suggest(str(i))["training.optimizer.lr"] for i in range(6)] == order
    spec_tree["search"]["scheduler"] = "none"  # nothing stopped: Tune's own generator, in the grid's order
    assert search_algorithm(validate_spec(spec_tree)) is None
