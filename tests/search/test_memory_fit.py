"""parallelism.memory_per_worker: a search with a step predicted not to fit is refused before any work, naming the
trial, its need and the largest tile that fits; `validate` prints every step."""

from __future__ import annotations

import yaml

from distmis.cli.main import main
from distmis.perf.sizing import PROCESS_RESERVE
from distmis.search.memory_fit import check_trials_fit
from distmis.search.trial_steps import predict_step
from distmis.spec import SpecError, validate_spec
from tests.conftest import small_spec_tree


def test_a_step_over_the_memory_is_refused_with_the_largest_tile_that_fits(tmp_path, capsys):
    tree = small_spec_tree(tmp_path / "data")  # 16^3 synthetic brain volumes: 4 channels in, 1 out
    tree["model"]["framework"] = "torch"
    tree["training"]["tile"] = [16, 16, 16]
    spec = validate_spec(tree)
    assert check_trials_fit(spec) is None  # no memory given: nothing to check

    need = {tile: predict_step(spec, tile, 2, "cpu", 1, channels=(4, 1), activation="sigmoid").peak
            for tile in ((16, 16, 16), (12, 16, 16))}
    tree["parallelism"]["memory_per_worker"] = PROCESS_RESERVE + (need[(16, 16, 16)] + need[(12, 16, 16)]) / 2
    try:
        check_trials_fit(validate_spec(tree))
        raise AssertionError("a step over the memory was not refused")
    except SpecError as exc:
        [(field, message)] = exc.problems
    assert field == "training.tile"
    assert "every trial: unet3d on tile [16, 16, 16] at batch 2 (fp32) is predicted to need" in message
    assert message.endswith("the largest tile that fits at batch 2 is [12, 16, 16]")
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(tree))
    assert main(["validate", str(path)]) == 2  # before any work: nothing generated
    assert "training.tile: every trial" in capsys.readouterr().err and not (tmp_path / "data").exists()

    tree["parallelism"]["memory_per_worker"] = "8GB"
    path.write_text(yaml.safe_dump(tree))
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| - | unet3d | 16x16x16 | 2 | fp32 |" in out and out.count("| yes |") == 1


def test_the_driver_imports_no_torch_until_a_step_is_checked():
    """A search's driver (a TensorFlow search's, a `distmis run` without memory_per_worker) loads no torch."""
    import subprocess
    import sys

    code = ("import sys, distmis.cli.main, distmis.cli.planned, distmis.search.run, distmis.search.preflight, "
            "distmis.search.input_plan, distmis.search.memory_fit; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
