"""training.tile / batch_size 'auto': the largest tile, then batch, whose predicted step fits a worker's memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from distmis.cli.main import main
from distmis.perf.sizing import PROCESS_RESERVE
from distmis.search.input_plan import load_planned_spec, planned_tree
from distmis.search.tile_search import tile_candidates
from distmis.spec import SpecError, validate_spec
from tests.conftest import small_spec_tree

ROOT = Path(__file__).resolve().parents[2]


def test_auto_is_refused_without_memory_beside_a_search_over_the_tile_and_outside_the_planner(tmp_path):
    tree = small_spec_tree(tmp_path / "data")
    tree["model"]["framework"] = "torch"  # traced in a fraction of a second
    tree["training"]["tile"] = "auto"
    with pytest.raises(SpecError, match="parallelism.memory_per_worker: .*set it"):
        planned_tree(tree)
    tree["parallelism"]["memory_per_worker"] = "4GB"
    tree["search"]["space"]["training.tile"] = {"grid": [[8, 8, 8], [16, 16, 16]]}
    with pytest.raises(SpecError, match=r"search.space.training.tile: searches what training.tile 'auto' plans"):
        planned_tree(tree)
    with pytest.raises(SpecError, match="'auto' asks distmis to plan training.tile"):
        validate_spec(tree)  # a program that skips the planner is told where it is
    del tree["search"]["space"]["training.tile"]
    tree["parallelism"]["memory_per_worker"] = "600MB"  # 88 MiB above the process's own 512 MiB: enough
    planned, plan = planned_tree(tree)
    assert plan is not None and planned["training"]["tile"] == list(plan.tile) and validate_spec(planned)
    tree["parallelism"]["memory_per_worker"] = PROCESS_RESERVE + 1000  # less than the smallest network's weights
    with pytest.raises(SpecError, match=r"parallelism.memory_per_worker: 'auto': no training step fits: the "
                                        r"smallest, tile \[\d, \d, \d\] at batch 1, is predicted to need \d MiB, and "
                                        r"a worker has 0 MiB"):
        planned_tree({**tree, "training": {**tree["training"], "batch_size": "auto"}})


def test_a_planned_batch_keeps_the_specs_tile_or_whole_volumes_and_nnunets_cap(tmp_path):
    tree = small_spec_tree(tmp_path / "data")  # 6 synthetic cases of 16^3
    tree["model"]["framework"] = "torch"
    tree["dataset"]["synthetic"]["cases"] = 40
    tree["training"].update(tile=[8, 8, 8], batch_size="auto")
    tree["parallelism"]["memory_per_worker"] = "8GB"
    planned, plan = planned_tree(tree)
    # 5% of 40 x 16^3 voxels is 16 tiles of 8^3: the cap, in a roomy worker
    assert planned["training"]["tile"] == [8, 8, 8] and planned["training"]["batch_size"] == plan.batch == 16
    assert plan.fields == ("training.batch_size",) and plan.next_larger is None
    tree["training"]["tile"] = None  # whole volumes: the batch is planned for them
    planned, plan = planned_tree(tree)
    assert planned["training"]["tile"] is None and plan.tile == (16, 16, 16) and plan.batch == 2


@pytest.mark.slow  # traces a U-Net's step at a few tiles, and measures two real steps in fresh processes (~20 s)
def test_the_planned_tile_fits_a_worker_and_the_next_larger_does_not_predicted_and_measured(tmp_path, capsys):
    """Two consecutive tiles of the planner's sequence, each predicted and measured as a trial measures its step:
    the model must order them as the measurements do, with room between (else no cap separates them both ways).
    Under a cap in that room, the plan picks the smaller tile, which fits as measured, and refuses the larger,
    which does not fit, predicted or measured. The cap is placed from both, since a CPU's measured peak varies by
    machine (the resident set: the allocator's thresholds, the kernels' workspaces)."""
    params = {"base_filters": 8, "levels": 5}  # every side divides by 16: tiles 48^3, then 32x48x48
    tree = small_spec_tree(tmp_path / "data", model={"name": "unet3d", "framework": "torch", "params": params})
    tree["dataset"]["synthetic"]["shape"] = [48, 48, 48]
    tree["training"]["tile"] = "auto"
    larger, smaller = tile_candidates((48, 48, 48), 16)[:2]
    probe = validate_spec({**tree, "training": {**tree["training"], "tile": list(smaller)}})
    from distmis.search.trial_steps import predict_step

    def measured(tile):
        config = {"network": "unet3d", "params": params, "in": 4, "out": 1, "tile": list(tile),
                  "activation": "sigmoid", "loss": probe.training.loss.name, "batch": 2}
        run = subprocess.run([sys.executable, "-m", "tests.search.measured_step", json.dumps(config)], cwd=ROOT,
                             capture_output=True, text=True, check=True)
        return float(run.stdout.split()[-1])

    predicted = {t: predict_step(probe, t, 2, "cpu", 1, channels=(4, 1), activation="sigmoid").peak
                 for t in (larger, smaller)}
    real = {t: measured(t) for t in (larger, smaller)}
    low, high = max(predicted[smaller], real[smaller]), min(predicted[larger], real[larger])
    assert low < high, f"no cap separates the tiles: predicted {predicted}, measured {real} (bytes)"
    cap = (low + high) / 2
    tree["parallelism"]["memory_per_worker"] = PROCESS_RESERVE + cap
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(tree))

    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"planned training.tile: tile {list(smaller)}, batch 2" in out and f"tile {list(larger)} at batch 2" in out
    spec, plan = load_planned_spec(path)
    assert spec.training.tile == smaller and plan.next_larger.tile == larger and not plan.next_larger.fits
    assert real[smaller] <= cap < real[larger]
