"""The driver's MLflow callback on a real sqlite store records where each trial trained (its first report's
``device`` and ``nodes``: the ``distmis.device`` and ``distmis.nodes`` tags), and a trial refused for a GPU its framework cannot see as FAILED, the
refusal its ``error`` tag."""

from __future__ import annotations

import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from distmis.parallel.devices import FrameworkGpus, GpuUnavailableError, require_gpus
from distmis.spec import validate_spec
from distmis.tracking.mlflow_tracking import DEVICE_TAG, NODES_TAG, SearchRun
from distmis.trial.record import DEVICE_KEY, NODES_KEY
from tests.conftest import small_spec_tree


def trial(trial_id: str, lr: float, error_file: str | None = None) -> Any:
    return SimpleNamespace(trial_id=trial_id, config={"training.optimizer.lr": lr}, last_result={"time_total_s": 1.0},
                           error_file=error_file, get_error=lambda: None)


def result(epoch: int, **extra: Any) -> dict[str, Any]:
    return {"epoch": epoch, "train_loss": 0.5, "val_loss": 0.5, "val_dice": 0.1 * epoch, "epoch_seconds": 0.5,
            "num_parameters": 7, "attempt": "a", **extra}


def test_the_device_of_a_trial_is_tagged_and_a_gpu_refusal_fails_its_run(tmp_path: Path):
    spec = validate_spec(small_spec_tree(tmp_path / "data"))
    run = SearchRun(f"sqlite:///{tmp_path / 'mlflow.db'}", "tiny", run_name="tiny", searched=["training.optimizer.lr"],
                    metric="val_dice", mode="max")
    callback = run.trial_callback(spec)

    trained = trial("t_00000", 1e-3)
    callback.on_trial_start(0, [], trained)
    callback.on_trial_result(0, [], trained, result(1, **{DEVICE_KEY: "cuda:0 (NVIDIA H100 80GB HBM3)",
                                                                NODES_KEY: "n0,n1"}))
    callback.on_trial_result(0, [], trained, result(2))  # the later reports carry no device: the tag stays
    callback.on_trial_complete(0, [], trained)

    try:  # what the trial process raised, as Tune writes it to the trial's error file
        require_gpus(["0"], "0", FrameworkGpus("torch", "2.13.0+cpu", (), None, "torch.cuda.is_available() False"))
    except GpuUnavailableError:
        (tmp_path / "error.txt").write_text(traceback.format_exc())
    refused = trial("t_00001", 5e-3, error_file=str(tmp_path / "error.txt"))
    callback.on_trial_start(0, [], refused)
    callback.on_trial_error(0, [], refused)
    assert callback.close()

    client = run.client
    done = client.get_run(callback.run_ids["t_00000"])
    assert done.info.status == "FINISHED" and done.data.tags[DEVICE_TAG] == "cuda:0 (NVIDIA H100 80GB HBM3)"
    assert done.data.tags[NODES_TAG] == "n0,n1"
    failed = client.get_run(callback.run_ids["t_00001"])
    assert failed.info.status == "FAILED" and DEVICE_TAG not in failed.data.tags and NODES_TAG not in failed.data.tags
    assert failed.data.tags["error"] == (
        "distmis.parallel.devices.GpuUnavailableError: Ray gave this process GPU 0 (CUDA_VISIBLE_DEVICES='0') but "
        "torch 2.13.0+cpu sees no CUDA device (torch.cuda.is_available() False: a build without CUDA). distmis "
        "does not train a GPU trial on the CPU: install torch's CUDA build (gpu-torch extra: docs/install.md, GPU "
        "nodes), or drop gpu from parallelism.resources_per_trial / resources_per_worker.")
