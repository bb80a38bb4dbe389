"""A trial that Ray gives a GPU which its framework cannot see fails at its start, with the reason in its MLflow
run: never trained on the CPU in the GPU's place (issue 37). The Ray node declares a GPU it does not have
(``ray.init(num_gpus=1)`` on this CPU-only machine, whose torch is a CPU build); the trial asks for it
(``resources_per_trial: {gpu: 1}``). The other paths (TensorFlow, Ray Train workers, the TensorFlow worker group)
refuse through the same check: ``tests/parallel/test_devices.py`` with the real frameworks, and
``python -m tests.search.gpu_refusal_search WORKDIR tensorflow torch-group tensorflow-group tensorflow-hybrid
torch-hybrid`` by hand (each about 10 to 30 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a Ray node of its own, in a subprocess

REPO = Path(__file__).resolve().parents[2]


def test_a_torch_trial_given_a_gpu_torch_cannot_see_fails_with_the_reason(tmp_path):
    import torch

    assert not torch.cuda.is_available(), "this test needs a machine (or a torch build) without CUDA"
    result = subprocess.run([sys.executable, "-m", "tests.search.gpu_refusal_search", str(tmp_path), "torch"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith("GPUREFUSAL ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(lines[-1].removeprefix("GPUREFUSAL "))
    assert report["cluster_gpus"] == 1.0  # the node declared its one (logical) GPU

    search = report["torch"]
    assert search["failed"] == 1 and len(search["runs"]) == 1
    run = search["runs"][0]
    assert run["status"] == "FAILED"
    error = run["tags"]["error"]
    assert error.startswith("distmis.parallel.devices.GpuUnavailableError: Ray gave this process GPU 0 "
                            "(CUDA_VISIBLE_DEVICES='0') but torch "), error
    for said in ("torch.cuda.is_available() False", "a build without CUDA", "install torch's CUDA build",
                 "docs/install.md", "drop gpu from parallelism.resources_per_trial"):
        assert said in error, said
    # refused before any training: no epoch was reported, so no device and no curve
    assert run["metrics"].get("epochs_completed") == 0.0
    assert "train_loss" not in run["metrics"] and "distmis.device" not in run["tags"]
