"""Every training step a search can take, predicted before it runs, and `distmis plan` for any network."""

from pathlib import Path

from distmis.cli.main import main
from distmis.estimate.memory import predict_step_memory
from distmis.models.registry import NetworkInput, model_entry
from distmis.search.trial_steps import trial_steps
from distmis.spec import validate_spec
from distmis.train.torch_losses import make_loss
from tests.conftest import small_spec_tree

TORCH_UNET = {"name": "unet3d", "framework": "torch", "params": {"base_filters": 4, "levels": 3}}


def tree(tmp_path: Path, **training):
    spec = small_spec_tree(tmp_path / "data", model=TORCH_UNET)
    spec["training"].update({"tile": [16, 16, 16], **training})
    spec["search"]["space"] = {"training.optimizer.lr": {"grid": [1e-3, 2e-3]},
                               "training.batch_size": {"grid": [1, 2]},
                               "model.params.base_filters": {"grid": [4, 8]}}
    return spec


def test_each_distinct_step_is_traced_once_and_what_does_not_change_it_is_left_out(tmp_path: Path):
    steps = trial_steps(validate_spec(tree(tmp_path)), device="cpu")
    # the learning rate changes nothing of the step: 2 batches x 2 widths
    assert [(s.config["training.batch_size"], s.config["model.params.base_filters"]) for s in steps] == [
        (1, 4), (1, 8), (2, 4), (2, 8)]
    assert all("training.optimizer.lr" not in s.config and s.tile == (16, 16, 16) for s in steps)
    by = {(s.batch, s.config["model.params.base_filters"]): s.memory for s in steps}
    assert by[(2, 4)].trace.saved_bytes > by[(1, 4)].trace.saved_bytes
    assert by[(1, 8)].trace.parameters > by[(1, 4)].trace.parameters
    entry = model_entry("unet3d")  # the same as the model predicts for that trial alone
    alone = predict_step_memory(entry, entry.params(base_filters=8, levels=3), NetworkInput(4, 1, (16, 16, 16)),
                                make_loss("dice"), batch=2)
    assert by[(2, 8)].step == alone.step and by[(2, 8)].trace.flops == alone.trace.flops


def test_a_curriculum_gives_a_step_per_stage(tmp_path: Path):
    spec = tree(tmp_path, tile=None, curriculum=[{"tile": [16, 16, 16], "epochs": 1},
                                                 {"tile": [32, 32, 32], "epochs": 1, "batch_size": 1}])
    spec["search"]["space"] = {"training.optimizer.lr": {"grid": [1e-3]}}
    spec["dataset"]["synthetic"]["shape"] = [32, 32, 32]
    steps = trial_steps(validate_spec(spec), device="cuda")
    assert [(s.tile, s.batch) for s in steps] == [((16, 16, 16), 2), ((32, 32, 32), 1)]
    assert steps[1].memory.trace.saved_bytes > steps[0].memory.trace.saved_bytes
    assert all(s.memory.overhead == 0 for s in steps)  # a GPU's rules: no CPU heap


def test_distmis_plan_predicts_every_trial_of_any_network_and_refuses_a_memory_nothing_fits(tmp_path: Path, capsys):
    import yaml

    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(tree(tmp_path)))
    assert main(["plan", str(path), "--memory-per-rank", "8GB", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "4 channel(s) in and 1 out, from the data set" in out  # the synthetic brain set: 4 MRI channels, WT
    rows = [line for line in out.splitlines() if line.startswith("| ") and "training.batch_size=" in line]
    assert len(rows) == 4 and all(row.endswith("| yes |") for row in rows)
    assert main(["plan", str(path), "--memory-per-rank", "513MiB", "--device", "cpu"]) == 2
    out = capsys.readouterr().out
    assert "nothing fits: the smallest predicted peak is" in out and "--memory-per-rank less --reserved" in out
