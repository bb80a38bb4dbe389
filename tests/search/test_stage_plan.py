"""``parallelism.pipeline.stages: auto``: the fewest stages whose every rank's predicted peak fits the worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from distmis.perf.sizing import PROCESS_RESERVE
from distmis.search.input_plan import planned_tree
from distmis.search.data_shape import data_shape
from distmis.search.stage_plan import StagePlan, stage_peaks
from distmis.spec import SpecError, validate_spec
from distmis.spec.load import apply_config, with_overrides
from tests.conftest import small_spec_tree

UNET = {"name": "unet3d", "framework": "torch", "params": {"base_filters": 8, "levels": 4, "norm": "group"}}


def staged_tree(data, memory=None) -> dict:
    """A torch U-Net on 48^3 volumes, batch 2 in one micro-batch (GPipe), its stages 'auto'."""
    tree = small_spec_tree(data, model=UNET)
    tree["dataset"]["synthetic"]["shape"] = [48, 48, 48]
    tree["training"].update(tile=[48, 48, 48], batch_size=2)
    tree["parallelism"]["pipeline"] = {"stages": "auto", "microbatches": 1, "schedule": "gpipe"}
    if memory is not None:
        tree["parallelism"]["memory_per_worker"] = memory
    return tree


def peaks_by_stages(tree, counts=(1, 2, 3)) -> dict[int, float]:
    """The busiest rank's predicted peak at each stage count."""
    spec = validate_spec(with_overrides(tree, {"parallelism.pipeline.stages": 1}))
    data = data_shape(spec)
    return {k: max(stage_peaks(apply_config(spec, {"parallelism.pipeline.stages": k}), k, data, "cpu", 1))
            for k in counts}


@pytest.fixture(scope="module")
def peaks(tmp_path_factory):
    return peaks_by_stages(staged_tree(tmp_path_factory.mktemp("data") / "d"))


def test_more_stages_hold_less_on_the_busiest_rank(peaks):
    assert peaks[1] > peaks[2] > peaks[3]


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_the_fewest_stages_that_fit_are_chosen(tmp_path, peaks, stages):
    # a worker just under the peak of one stage fewer: that count does not fit, this one does
    usable = peaks[stages] if stages == 1 else (peaks[stages] + peaks[stages - 1]) / 2
    planned, plan = planned_tree(staged_tree(tmp_path / "d", PROCESS_RESERVE + usable * 1.001))
    assert isinstance(plan, StagePlan) and plan.stages == stages
    assert planned["parallelism"]["pipeline"]["stages"] == stages and validate_spec(planned)
    assert plan.chosen.peak <= plan.usable
    if stages > 1:
        assert plan.fewer.stages == stages - 1 and plan.fewer.peak > plan.usable
        assert f"planned parallelism.pipeline.stages: {stages}" in plan.describe()
        assert f"{stages - 1} stage(s) would need" in plan.describe()


def test_what_stages_auto_cannot_plan_is_named(tmp_path):
    with pytest.raises(SpecError, match="parallelism.memory_per_worker: .*set it"):
        planned_tree(staged_tree(tmp_path / "d"))
    tree = staged_tree(tmp_path / "d", "8GB")
    tree["training"]["tile"] = "auto"
    with pytest.raises(SpecError, match="'auto' plans the stages for the spec's tile and batch"):
        planned_tree(tree)
    tree = staged_tree(tmp_path / "d", "8GB")
    tree["search"]["space"]["model.name"] = {"grid": ["unet3d", "segresnet"]}
    with pytest.raises(SpecError, match="which segresnet does not take"):
        planned_tree(tree)
    with pytest.raises(SpecError, match="'auto' asks distmis to plan parallelism.pipeline.stages"):
        validate_spec(staged_tree(tmp_path / "d", "8GB"))  # a program that skips the planner is told where it is
    with pytest.raises(SpecError, match=r"parallelism.pipeline.stages: 'auto': no stage count fits: 7 stage\(s\) "
                                        r"need \d+ MiB on the busiest rank, and a worker has 0 MiB"):
        planned_tree(staged_tree(tmp_path / "d", PROCESS_RESERVE + 1000))


def test_a_spec_whose_stages_do_not_fit_is_refused_naming_the_fewest_that_do(tmp_path, peaks):
    from distmis.search.memory_fit import check_trials_fit

    usable = (peaks[2] + peaks[3]) / 2  # three stages fit, two do not
    tree = staged_tree(tmp_path / "d", PROCESS_RESERVE + usable)
    tree["parallelism"]["pipeline"]["stages"] = 3
    assert check_trials_fit(validate_spec(tree)) is None  # fits: nothing to refuse
    tree["parallelism"]["pipeline"]["stages"] = 2
    with pytest.raises(SpecError, match=r"parallelism.pipeline.stages: every trial: unet3d in 2 stage\(s\) on tile "
                                        r"\[48, 48, 48\] at batch 2: its busiest rank is predicted to need \d+ MiB, "
                                        r"and a worker has \d+ MiB \(cpu rules\); 3 stages fit"):
        check_trials_fit(validate_spec(tree))
    tree["search"]["space"]["parallelism.pipeline.stages"] = {"grid": [2, 3]}
    with pytest.raises(SpecError, match=r"search.space.parallelism.pipeline.stages: "
                                        r"parallelism.pipeline.stages=2: unet3d in 2 stage"):
        check_trials_fit(validate_spec(tree))


@pytest.mark.slow  # two measured steps in fresh processes (one of two gloo ranks) and a pipelined trial (~70 s)
def test_a_search_with_stages_auto_trains_the_planned_pipeline(ray_local, tmp_path, peaks, capsys):
    """The U-Net's step on one rank and cut into two stages, each predicted and measured as a trial measures it
    (the pipeline's busiest rank): with a worker's memory in the room both agree on, between two stages and one,
    ``distmis run`` plans 2 stages, and the trial trains as a pipeline of two ranks."""
    import json
    import subprocess
    import sys

    import yaml
    from mlflow.tracking import MlflowClient

    from distmis.cli.main import main

    root = Path(__file__).resolve().parents[2]

    def measured(stages: int) -> float:
        config = {"network": "unet3d", "params": UNET["params"], "in": 4, "out": 1, "tile": [48, 48, 48],
                  "activation": "sigmoid", "loss": "dice", "batch": 2, "stages": stages}
        run = subprocess.run([sys.executable, "-m", "tests.search.measured_step", json.dumps(config)], cwd=root,
                             capture_output=True, text=True, check=True)
        return float(run.stdout.split()[-1])

    real = {stages: measured(stages) for stages in (1, 2)}
    low, high = max(peaks[2], real[2]), min(peaks[1], real[1])
    assert low < high, f"no memory separates the stage counts: predicted {peaks}, measured {real} (bytes)"
    usable = (low + high) / 2
    tree = staged_tree(tmp_path / "data", PROCESS_RESERVE + usable)
    tree["name"] = "staged"
    tree["training"].update(epochs=1, loss={"name": "dice"})
    tree["search"]["space"] = {}  # one trial
    tree["parallelism"]["resources_per_worker"] = {"cpu": 1}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(tree))
    assert main(["run", str(tmp_path / "spec.yaml"), "--output", str(tmp_path / "out"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "planned parallelism.pipeline.stages: 2" in out and "1 stage(s) would need" in out
    assert "1 trial(s), 0 failed" in out, out
    client = MlflowClient(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("staged").experiment_id])
    trial = next(r for r in runs if r.data.tags.get("distmis.role") != "search")
    assert trial.info.status == "FINISHED" and trial.data.metrics["val_dice"] >= 0
    assert (trial.data.params["parallelism.pipeline.stages"], trial.data.params["trial.workers"]) == ("2", "2")
