"""benchmarks/step_efficiency.py on its CPU path at a small tile (no GPU here): the table a GPU run would give, from a
process that imports torch, MONAI and distmis's torch modules alone (what the GPU machines have)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_efficiency.py"


@pytest.mark.slow  # each setting's steps and two compilations in a fresh process
def test_the_cpu_path_measures_every_setting_and_the_gpu_path_refuses_without_one(tmp_path: Path):
    output = tmp_path / "rows.json"
    args = ["--networks", "unet3d", "--tile", "16", "--repeats", "1", "--threads", "1", "--precisions", "fp32",
            "--output", str(output)]  # fp32 alone: one compilation fewer (bf16 rows: the benchmark's own run)
    code = (f"import runpy, sys; sys.argv = [{str(SCRIPT)!r}, *{args!r}]; runpy.run_path(sys.argv[0], "
            "run_name='__main__'); assert not {'ray', 'mlflow', 'tensorflow'} & set(sys.modules), sys.modules.keys()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    [row] = json.loads(output.read_text())
    assert row["network"] == "unet3d" and row["flops"] > 0 and row["matmul_rates"]["fp32"] > 0
    chosen = row["auto"]["memory_format"]
    assert set(row["settings"]) == {"contiguous fp32", "channels_last fp32", f"compiled {chosen} fp32"}
    for name, setting in row["settings"].items():  # each against the matmul rate of its own dtype
        rate = row["matmul_rates"]["bf16" if name.endswith("bf16") else "fp32"]
        assert setting["seconds"] > 0
        assert setting["fraction"] == pytest.approx(row["flops"] / setting["seconds"] / rate), name
    assert "| unet3d | " in done.stdout and "auto chose (fp32, 25000 steps)" in done.stdout
    refused = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda"], capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode != 0 and "torch sees no GPU here" in refused.stderr
