from __future__ import annotations

from pathlib import Path

import pytest

from ray import tune
from ray.tune.search import Searcher

from distmis.search.affinity import GraphAffineConfigurations
from distmis.search.folds import Configurations
from distmis.search.search_space import configuration_graph, gives_every_trial, graph_affine, search_algorithm
from distmis.spec import validate_spec
from tests.conftest import small_spec_tree

SPACE = {"training.optimizer.lr": tune.grid_search([1e-3, 5e-3]), "model.params.norm": tune.grid_search(["batch", "group"])}


def norm_of(config: dict) -> str:
    return config["model.params.norm"]


def searcher() -> GraphAffineConfigurations:
    return GraphAffineConfigurations(SPACE, num_samples=1, seed=0, graph=norm_of)


def test_the_trial_after_an_ended_one_has_its_graphs_whichever_ends_first():
    search = searcher()
    first = [search.suggest("t0"), search.suggest("t1")]  # Tune's order while no trial has ended
    assert first == Configurations(SPACE, 1, 0).configs[:2]
    assert [norm_of(c) for c in first] == ["batch", "group"]
    search.on_trial_complete("t1", {"val_dice": 0.5})  # the group norm trial ends first: its actor is freed first
    search.on_trial_complete("t0", {"val_dice": 0.5})
    assert norm_of(search.suggest("t2")) == "group"
    assert norm_of(search.suggest("t3")) == "batch"
    assert search.suggest("t4") == Searcher.FINISHED
    given = [search.configs[search.given[t]] for t in ("t0", "t1", "t2", "t3")]
    assert sorted(map(str, given)) == sorted(map(str, Configurations(SPACE, 1, 0).configs))  # each one once


def test_a_failed_trial_is_not_followed_and_a_graph_none_has_left_takes_the_next_in_order():
    search = searcher()
    search.suggest("t0"), search.suggest("t1")
    search.on_trial_complete("t1", error=True)  # its actor is not reused
    search.on_trial_complete("t0", {"val_dice": 0.5})
    assert search.suggest("t2") == {"training.optimizer.lr": 5e-3, "model.params.norm": "batch"}
    search.on_trial_complete("t2", {"val_dice": 0.5})  # batch again: none left, so the next in Tune's order
    assert search.suggest("t3") == {"training.optimizer.lr": 5e-3, "model.params.norm": "group"}


def test_its_state_is_saved_and_restored_whole(tmp_path: Path):
    search = searcher()
    search.suggest("t0"), search.suggest("t1")
    search.on_trial_complete("t1", {"val_dice": 0.5})
    search.save(str(tmp_path / "state"))
    restored = GraphAffineConfigurations(SPACE, num_samples=1, seed=0, graph=lambda config: "unused")
    restored.restore(str(tmp_path / "state"))
    assert norm_of(restored.suggest("t2")) == "group" and restored.given == {"t0": 0, "t1": 1, "t2": 3}


def test_experiment_mode_tensorflow_grids_use_it_with_the_trial_specs_graph_keys(tmp_path: Path):
    tree = small_spec_tree(tmp_path / "data")
    tree["search"] = {"algorithm": "grid", "metric": "val_dice", "mode": "max",
                      "space": {"training.optimizer.lr": {"grid": [1e-3, 5e-3]},
                                "model.params.norm": {"grid": ["batch", "group"]}}}
    spec = validate_spec(tree)
    assert spec.model.framework == "tensorflow" and spec.parallelism.mode == "experiment"
    assert graph_affine(spec) and gives_every_trial(spec)
    search = search_algorithm(spec)
    assert isinstance(search, GraphAffineConfigurations)
    graph = configuration_graph(spec)
    assert search.graphs == [graph(config) for config in search.configs]
    # the learning rate is not part of a graph; the normalization is
    assert search.graphs[0] == search.graphs[2] != search.graphs[1] == search.graphs[3]
    torch = validate_spec({**tree, "model": {**tree["model"], "framework": "torch"}})
    assert not graph_affine(torch) and search_algorithm(torch) is None


def test_a_configuration_a_trial_would_refuse_has_a_graph_of_its_own(tmp_path: Path):
    tree = small_spec_tree(tmp_path / "data")
    spec = validate_spec(tree)
    graph = configuration_graph(spec)
    assert graph({"training.optimizer.lr": -1.0}) != graph({"training.optimizer.lr": -2.0})


@pytest.mark.slow  # a real search: 4 TensorFlow trials, 2 at a time
def test_in_a_real_search_the_first_freed_actor_gets_a_trial_of_its_graphs(ray_local, tmp_path: Path):
    """A grid over two U-Net depths, two trials at a time. The shallower one, started second, usually ends first,
    and Tune would hand its actor the next trial in grid order: the deeper U-Net's. The trial made when the first
    one ends has that trial's depth, and restarts the trainer its actor kept."""
    from mlflow.tracking import MlflowClient

    from distmis.search.run import run_search
    from distmis.tracking.results import find_search_run, trial_runs

    tree = small_spec_tree(tmp_path / "data")
    tree["training"]["epochs"] = 1
    tree["search"] = {"algorithm": "grid", "evaluate_top": 0,
                      "space": {"training.optimizer.lr": {"grid": [1e-3, 5e-3]}, "model.params.levels": {"grid": [3, 2]}}}
    tree["parallelism"]["max_concurrent_trials"] = 2
    tree["tracking"] = {"register_model": False}
    outcome = run_search(validate_spec(tree), tmp_path / "out", progress=False)
    assert outcome.failed == 0
    client = MlflowClient(outcome.tracking_uri)
    runs = sorted(trial_runs(client, find_search_run(client, "tiny")), key=lambda run: run.info.start_time)
    assert len(runs) == 4

    def levels(run) -> str:
        return run.data.tags["mlflow.runName"].split("levels=")[1]

    seen = [(run.data.tags["mlflow.runName"], run.info.end_time, run.data.metrics["startup_graphs_reused"])
            for run in runs]
    first_ended = min(runs[:2], key=lambda run: run.info.end_time)
    assert sorted(levels(run) for run in runs[:2]) == ["2", "3"], seen  # one of each to start with
    assert levels(runs[2]) == levels(first_ended), seen
    assert runs[2].data.metrics["startup_graphs_reused"] == 1.0, seen
