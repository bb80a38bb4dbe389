"""benchmarks/gpu_memory.py, the GPU check of the memory model, on its CPU path (no GPU here)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_memory.py"


@pytest.mark.slow  # a real training step in a fresh process (about 15 s)
def test_the_cpu_path_measures_and_predicts_a_step_and_the_gpu_path_refuses_without_one(tmp_path: Path):
    output = tmp_path / "rows.json"
    args = ["--device", "cpu", "--networks", "unet3d", "--tiles", "16", "--precisions", "fp32", "--output", str(output)]
    # torch only: what a GPU machine without Ray, MLflow or TensorFlow can run
    code = (f"import runpy, sys; sys.argv = [{str(SCRIPT)!r}, *{args!r}]; runpy.run_path(sys.argv[0], "
            "run_name='__main__'); assert not {'ray', 'mlflow', 'tensorflow'} & set(sys.modules), sys.modules.keys()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    [row] = json.loads(output.read_text())
    assert row["network"] == "unet3d" and row["tile"] == [16, 16, 16]
    assert row["measured_mib"] > 0 and row["predicted_total_mib"] > row["predicted_mib"] > 0
    assert "| unet3d | 16x16x16 | fp32 |" in done.stdout
    refused = subprocess.run([sys.executable, str(SCRIPT), "--networks", "unet3d"], capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode != 0 and "torch sees no GPU here" in refused.stderr
