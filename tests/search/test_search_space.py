from __future__ import annotations

from ray import tune

from distmis.search.affinity import GraphAffineConfigurations
from distmis.search.search_space import num_trials, param_space, scheduler, search_algorithm
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
