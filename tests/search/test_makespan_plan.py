"""A search's predicted makespan by mode, from its traced steps (distmis.search.makespan_plan), and
`distmis plan SPEC --workers W`."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from distmis.cli.main import main
from distmis.perf.makespan import Cluster, asha_epochs
from distmis.search.makespan_plan import Hardware, plan_makespan, search_costs, split_sizes, validation_windows
from distmis.search.trial_steps import trial_steps
from distmis.spec import validate_spec
from tests.conftest import small_spec_tree

TORCH_UNET = {"name": "unet3d", "framework": "torch", "params": {"base_filters": 4, "levels": 3}}


def tree(tmp_path: Path) -> dict:
    spec = small_spec_tree(tmp_path / "data", model=TORCH_UNET)
    spec["dataset"]["synthetic"].update({"cases": 12, "shape": [32, 32, 32]})
    spec["training"].update({"tile": [16, 16, 16], "epochs": 4})
    spec["search"]["space"] = {"training.optimizer.lr": {"grid": [1e-3, 2e-3, 3e-3]},
                               "model.params.base_filters": {"grid": [4, 8]}}
    return spec


def test_the_cases_and_windows_a_trial_trains_and_validates(tmp_path: Path):
    spec = validate_spec(tree(tmp_path))
    train, val = split_sizes(spec)
    assert train + val + round(12 * spec.dataset.split.test) == 12 and train > val > 0
    folded = tree(tmp_path)
    folded["dataset"]["split"] = {"folds": 3, "test": 0.25, "seed": 0}
    assert split_sizes(validate_spec(folded)) == (6, 3)  # 9 development cases: a fold validates, two train
    assert validation_windows((32, 32, 32), (16, 16, 16), 0.5) == 27  # 3 a side: 0, 8, 16
    assert validation_windows((32, 32, 32), (32, 32, 32), 0.5) == 1
    assert validation_windows((40, 16, 16), (16, 16, 16), 0.0) == 3


def test_each_trial_costs_its_traced_step_at_the_workers_rate(tmp_path: Path):
    spec = validate_spec(tree(tmp_path))
    hardware = Hardware(device_flops=1e9, startup_seconds=7.0, step_overhead=0.01)
    costs = search_costs(spec, hardware, device="cpu")
    assert len(costs) == 6  # 3 learning rates x 2 widths
    steps = {s.config["model.params.base_filters"]: s.memory.trace for s in trial_steps(spec, device="cpu")}
    train, val = split_sizes(spec)
    batches = math.ceil(train / spec.training.batch_size)
    widths = sorted(steps)
    for index, cost in enumerate(costs):
        trace = steps[widths[index % 2]]  # the distinct steps in turn
        assert cost.steps == batches and cost.train_seconds == pytest.approx(batches * trace.flops / 1e9)
        assert cost.gradient_bytes == 4 * trace.parameters and cost.epochs == 4
        assert cost.validate_seconds == pytest.approx(val * 27 * trace.forward_flops / spec.training.batch_size / 1e9)
        assert (cost.startup_seconds, cost.step_overhead) == (7.0, 0.01)
    asha = tree(tmp_path)
    asha["search"].update({"scheduler": "asha", "asha": {"grace_period": 1, "reduction_factor": 2}})
    epochs = [cost.epochs for cost in search_costs(validate_spec(asha), hardware, device="cpu")]
    assert epochs == asha_epochs(6, 4, 1, 2) == [4, 4, 4, 1, 1, 1]


def test_distmis_plan_workers_prints_each_mode_and_draws_the_schedules(tmp_path: Path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(tree(tmp_path)))
    gantt = tmp_path / "gantt.png"
    assert main(["plan", str(path), "--workers", "4", "--per-node", "2", "--device", "cpu", "--device-flops", "1e9",
                 "--gantt", str(gantt)]) == 0
    out = capsys.readouterr().out
    rows = [line.split(" | ")[0].lstrip("| ") for line in out.splitlines() if line.startswith("| ")
            and not line.startswith("| mode") and "---" not in line]
    assert [r.replace(" (best fixed)", "") for r in rows] == ["experiment", "data x2", "data x3", "data x4",
                                                              "moldable plan", "auto"]
    assert sum("(best fixed)" in r for r in rows) == 1
    assert "6 trial(s) on 4 worker(s), 2 per node" in out and "auto's schedule" in out
    assert gantt.read_bytes().startswith(b"\x89PNG")
    plan = plan_makespan(validate_spec(tree(tmp_path)), Cluster(workers=4, per_node=2), Hardware(device_flops=1e9),
                         device="cpu")
    assert plan.moldable.makespan <= min(s.makespan for s in plan.fixed) + 1e-9
    assert plan.auto.mode == "auto" and {p.trial for p in plan.auto.placements} == {c.name for c in plan.costs}
    assert main(["plan", str(path), "--workers", "2", "--per-node", "3", "--device", "cpu"]) == 2
    assert "per_node must be between 1 and workers (2), got 3" in capsys.readouterr().err


def test_a_spec_whose_cases_cannot_be_counted_is_refused_naming_the_path(tmp_path: Path, capsys):
    spec = tree(tmp_path)
    spec["dataset"].pop("synthetic")
    spec["dataset"]["path"] = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="nowhere.*does not exist"):
        split_sizes(validate_spec(spec))


def test_calibrating_on_a_folder_that_holds_no_search_is_refused_naming_it(tmp_path: Path):
    from distmis.search.makespan_plan import calibrate

    with pytest.raises(ValueError, match=r"--calibrate .*nothing.*not the output folder of a distmis search"):
        calibrate(tmp_path / "nothing")
