"""``search.scheduler: pbt`` (:mod:`distmis.search.pbt`): what the spec may ask of it, what Tune's scheduler is given,
and the explore that keeps values in their domains. The exploit in the trial's process:
tests/trial/test_pbt_exploit.py; end to end: tests/search/test_pbt_search.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from ray.tune.schedulers import TrialScheduler
from ray.tune.search.sample import Float

from distmis.search.pbt import DistmisPBT, explore_within, mutations, pbt_scheduler
from distmis.search.search_space import graph_affine, scheduler
from distmis.spec import validate_spec
from distmis.spec.load import SpecError
from tests.conftest import small_spec_tree


def pbt_tree(tmp_path: Path, **pbt) -> dict:
    tree = small_spec_tree(tmp_path / "data")
    tree["training"]["epochs"] = 6
    tree["search"] = {"algorithm": "random", "num_samples": 4, "scheduler": "pbt", "pbt": pbt, "space": {
        "training.optimizer.lr": {"loguniform": [1e-4, 1e-2]},
        "training.optimizer.weight_decay": {"choice": [0.0, 1e-5, 1e-4]},
        "model.params.base_filters": {"choice": [4, 8]},  # searched, but fixed for a trial's life
    }}
    return tree


def test_pbt_perturbs_the_searched_values_it_may_change_within_their_domains(tmp_path: Path):
    spec = validate_spec(pbt_tree(tmp_path, interval=2, quantile=0.5, factors=[0.5, 2.0]))
    assert list(mutations(spec)) == ["training.optimizer.lr", "training.optimizer.weight_decay"]
    made = scheduler(spec, "run-1")
    assert isinstance(made, DistmisPBT) and made.key == "run-1"
    assert made._perturbation_interval == 2 and made._quantile_fraction == 0.5
    assert made._perturbation_factors == (0.5, 2.0) and made._time_attr == "epoch"
    lr, decay = made._hyperparam_mutations["training.optimizer.lr"], made._hyperparam_mutations[
        "training.optimizer.weight_decay"]
    assert isinstance(lr, Float) and (lr.lower, lr.upper) == (1e-4, 1e-2)
    assert decay == [0.0, 1e-5, 1e-4]  # a list's value moves to a neighbour
    assert not graph_affine(validate_spec({**pbt_tree(tmp_path), "model": {"name": "unet3d", "framework": "tensorflow"}}))

    named = validate_spec(pbt_tree(tmp_path, mutations=["training.optimizer.lr"]))
    assert list(pbt_scheduler(named, "k")._hyperparam_mutations) == ["training.optimizer.lr"]

    clamp = explore_within(mutations(spec))
    assert clamp({"training.optimizer.lr": 0.05, "training.optimizer.weight_decay": 1e-5}) == {
        "training.optimizer.lr": 1e-2, "training.optimizer.weight_decay": 1e-5}
    assert clamp({"training.optimizer.lr": 1e-5})["training.optimizer.lr"] == 1e-4
    assert clamp({"training.optimizer.lr": 3e-3})["training.optimizer.lr"] == 3e-3


def test_a_trials_last_epoch_is_never_perturbed(tmp_path: Path):
    made = pbt_scheduler(validate_spec(pbt_tree(tmp_path, interval=1)), "k")
    # no controller is needed: the last epoch returns before Tune's rule looks at the population
    assert made.on_trial_result(None, object(), {"epoch": 6, "val_dice": 0.5}) == TrialScheduler.CONTINUE


@pytest.mark.parametrize("change, field, message", [
    ({"pbt": {"mutations": ["model.params.base_filters"]}}, "search.pbt.mutations",
     "'model.params.base_filters' cannot change mid-training"),
    ({"pbt": {"mutations": ["training.optimizer.momentum"]}}, "search.pbt.mutations",
     "'training.optimizer.momentum' is not searched"),
    ({"space": {"model.params.base_filters": {"choice": [4, 8]}}}, "search.space", "none is searched"),
    ({"algorithm": "optuna"}, "search.algorithm", "use 'grid' or 'random' with 'pbt'"),
    ({"pbt": {"interval": 6}}, "search.pbt.interval", "smaller than training.epochs"),
    ({"pbt": {"factors": [0.8, -1]}}, "search.pbt.factors", "positive"),
])
def test_what_pbt_cannot_do_is_refused_by_name(tmp_path: Path, change: dict, field: str, message: str):
    tree = pbt_tree(tmp_path)
    tree["search"].update(change)
    with pytest.raises(SpecError) as raised:
        validate_spec(tree)
    assert field in str(raised.value) and message in str(raised.value)


def test_pbt_is_refused_with_folds_and_outside_experiment_mode(tmp_path: Path):
    tree = pbt_tree(tmp_path)
    tree["dataset"]["split"] = {"folds": 3, "test": 0.25, "seed": 0}
    tree["dataset"]["synthetic"]["cases"] = 8
    with pytest.raises(SpecError, match="validation cases it trained on"):
        validate_spec(tree)
    tree = pbt_tree(tmp_path)
    tree["parallelism"] = {"mode": "data", "workers": 2, "resources_per_worker": {"cpu": 1}}
    with pytest.raises(SpecError, match="for mode 'experiment' trials; got mode 'data'"):
        validate_spec(tree)
