"""The search plan and the fit check: pure arithmetic over trial layouts, then a real cluster refusing in seconds."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from distmis.cli.main import main
from distmis.search.compare import cell_spec
from distmis.search.plan import fit_problems, plan_search, search_fit_problems, trial_layouts, trials_at_once
from distmis.spec import validate_spec
from distmis.spec.load import SpecError
from tests.conftest import small_spec_tree

TWO_CPUS = [{"CPU": 2.0, "GPU": 0.0}]


def spec_with(tmp_path: Path, **parallelism):
    tree = small_spec_tree(tmp_path / "data")
    tree["parallelism"] = parallelism
    return validate_spec(tree)


def test_plans_read_the_layouts(tmp_path: Path):
    single = plan_search(spec_with(tmp_path, resources_per_trial={"cpu": 2}))
    assert (single.distributed, single.trial_resources, single.max_concurrent_trials) == (False, {"cpu": 2, "gpu": 0}, None)
    data = plan_search(spec_with(tmp_path, mode="data", workers=2))
    assert (data.distributed, data.max_concurrent_trials, data.trial_resources["cpu"]) == (True, 1, 0)
    hybrid = plan_search(spec_with(tmp_path, workers_per_trial=2, max_concurrent_trials=8), cluster_slots=7)
    assert hybrid.max_concurrent_trials == 3 and "hybrid" in hybrid.label  # 7 slots // 2 workers
    auto = plan_search(spec_with(tmp_path, mode="auto", workers=3))
    [start] = auto.layouts  # every trial a worker group, of one replica until its pool grows it
    assert (auto.mode, auto.pool_workers, auto.max_concurrent_trials, auto.trial_resources["cpu"]) == ("auto", 3, 3, 0)
    assert (start.dp, start.distributed, start.effective_lr) == (1, True, pytest.approx(1e-3))
    assert plan_search(spec_with(tmp_path, mode="auto", workers=3, max_concurrent_trials=2)).max_concurrent_trials == 2
    assert trials_at_once(auto, TWO_CPUS) == 3


def test_an_auto_search_s_pool_must_fit_the_cluster_at_once(tmp_path: Path):
    spec = spec_with(tmp_path, mode="auto", workers=3)
    [problem] = search_fit_problems(spec, TWO_CPUS)
    assert "needs 3 worker(s) at once, but the cluster holds 2" in problem
    assert not search_fit_problems(spec_with(tmp_path, mode="auto", workers=2), TWO_CPUS)


def test_the_trials_at_once_are_the_plans_limit_or_what_the_nodes_hold(tmp_path: Path):
    """What the search's time-left estimate divides by (distmis.search.progress)."""
    nodes = [{"CPU": 5.0, "GPU": 0.0}, {"CPU": 3.0, "GPU": 1.0}]
    assert trials_at_once(plan_search(spec_with(tmp_path, resources_per_trial={"cpu": 2})), nodes) == 3  # 2 + 1
    assert trials_at_once(plan_search(spec_with(tmp_path, resources_per_trial={"cpu": 1, "gpu": 1})), nodes) == 1
    limited = plan_search(spec_with(tmp_path, resources_per_trial={"cpu": 1}, max_concurrent_trials=2))
    assert trials_at_once(limited, nodes) == 2
    assert trials_at_once(plan_search(spec_with(tmp_path, mode="data", workers=2)), nodes) == 1
    hybrid = plan_search(spec_with(tmp_path, workers_per_trial=2))  # no limit, no cluster given to the plan
    assert trials_at_once(hybrid, nodes) == 4  # 8 one-CPU workers, 2 per trial
    assert trials_at_once(plan_search(spec_with(tmp_path, resources_per_trial={"cpu": 4})), [{"CPU": 2.0}]) == 1


def test_comparison_cells_are_searches_of_their_own(tmp_path: Path):
    spec = spec_with(tmp_path, mode="compare", workers=[2, 4], resources_per_worker={"cpu": 0.5})
    experiment, data = cell_spec(spec, "experiment", 4), cell_spec(spec, "data", 4)
    [one] = trial_layouts(experiment)
    assert (one.world_size, one.cpu, plan_search(experiment).max_concurrent_trials) == (1, 0.5, 4)
    [four] = trial_layouts(data)
    assert (four.world_size, four.dp, four.effective_lr) == (4, 4, pytest.approx(4e-3))


def test_a_comparison_cell_is_validated_as_a_spec_of_its_own(tmp_path: Path):
    """Its cross-field checks included: here a TensorFlow fp16 trial with no GPU, set on an already validated spec."""
    spec = spec_with(tmp_path, mode="compare", workers=[2])
    unchecked = spec.model_copy(update={"training": spec.training.model_copy(update={"precision": "fp16"})})
    with pytest.raises(SpecError, match=r"(?s)cell data x2.*training.precision"):
        cell_spec(unchecked, "data", 2)


@pytest.mark.parametrize("parallelism, reason", [
    ({"resources_per_trial": {"cpu": 4}}, "needs 4 CPU(s) on one node, but the largest node has 2"),
    ({"mode": "data", "workers": 3}, "needs 3 worker(s) at once, but the cluster holds 2"),
    ({"workers_per_trial": 2, "resources_per_worker": {"cpu": 1, "gpu": 1}}, "needs 1 GPU(s) on one node"),
])
def test_a_trial_that_cannot_fit_is_named(tmp_path: Path, parallelism, reason):
    [problem] = fit_problems(trial_layouts(spec_with(tmp_path, **parallelism)), TWO_CPUS)
    assert reason in problem


def test_workers_must_fit_whole_on_nodes(tmp_path: Path):
    spec = spec_with(tmp_path, mode="data", workers=3)
    assert fit_problems(trial_layouts(spec), [{"CPU": 1.5, "GPU": 0}, {"CPU": 1.5, "GPU": 0}])  # 3 CPUs, 2 slots
    assert not fit_problems(trial_layouts(spec), [{"CPU": 2, "GPU": 0}, {"CPU": 1, "GPU": 0}])


@pytest.mark.parametrize("parallelism", [
    {"resources_per_trial": {"cpu": 4}},
    {"mode": "data", "workers": 3},
    {"mode": "compare", "workers": [4]},
    {"workers_per_trial": 2, "resources_per_worker": {"cpu": 1, "gpu": 1}},
])
def test_an_oversized_search_is_refused_in_seconds_and_converts_nothing(ray_local, tmp_path: Path, capsys,
                                                                        parallelism):
    tree = small_spec_tree(tmp_path / "data")
    tree["parallelism"] = parallelism
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(tree))
    start = time.monotonic()
    code = main(["run", str(tmp_path / "spec.yaml"), "--output", str(tmp_path / "out"), "--quiet"])
    assert code == 2 and time.monotonic() - start < 30
    err = capsys.readouterr().err
    assert "do not fit" in err or "needs" in err
    assert "autoscaling" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "data").exists()  # nothing generated or converted


def test_autoscaling_clusters_skip_the_fit_check(tmp_path: Path):
    from distmis.search.plan import check_fit

    check_fit(spec_with(tmp_path, resources_per_trial={"cpu": 64}, autoscaling=True))  # no cluster asked, no error
