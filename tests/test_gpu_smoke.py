"""``benchmarks/gpu_smoke.sh``, the part that runs without a GPU: it refuses a node without one, its paths are valid
one-trial searches of the ranks and GPUs they say, and its table is read from real MLflow stores as distmis
writes them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from distmis.spec import validate_spec
from distmis.spec.layout import resolve_layout
from distmis.tracking.mlflow_tracking import SearchRun
from distmis.trial.record import DEVICE_KEY
from tests.conftest import small_spec_tree

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_smoke.sh"


@pytest.fixture(scope="module")
def smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", REPO / "benchmarks" / "gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_smoke"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_smoke", None)


def test_the_script_is_valid_bash_and_refuses_a_node_without_a_gpu(tmp_path: Path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    # a PATH with bash but no nvidia-smi: this machine's own, or any machine's seen without its driver
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname"):
        found = subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        (bin_dir / tool).symlink_to(found)
    done = subprocess.run([str(bin_dir / "bash"), str(SCRIPT), str(tmp_path / "out")], capture_output=True,
                          text=True, env={**os.environ, "PATH": str(bin_dir)}, timeout=60)
    assert done.returncode == 2 and "gpu_smoke: nvidia-smi not found" in done.stderr
    assert not (tmp_path / "out").exists()


def test_without_a_gpu_the_python_part_refuses_too(smoke, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PATH", "")  # no nvidia-smi to list a GPU
    with pytest.raises(SystemExit, match="no GPU visible"):
        smoke.run_smoke(tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_each_path_is_a_valid_one_trial_search_with_a_whole_gpu_per_rank(smoke, tmp_path: Path, gpus: int):
    paths = smoke.smoke_paths(gpus)
    assert [p.name for p in paths] == ["tf", "torch", "ddp", "sp", "pipeline", "bf16", "fp16"]
    precisions = {}
    for path in paths:
        tree = smoke.spec_tree(path, tmp_path / "data")
        for override in path.overrides:  # what `distmis run --set` does to the tree
            key, value = override.split("=", 1)
            *parents, leaf = key.split(".")
            section = tree
            for name in parents:
                section = section.setdefault(name, {})
            section[leaf] = value
        spec = validate_spec(tree)
        precisions[path.name] = spec.training.precision
        assert spec.name == f"gpu-smoke-{path.name}" and spec.training.epochs == 1
        assert [len(d.values) for d in spec.search.space.values()] == [1]  # one trial
        layout = resolve_layout(spec)
        assert layout.world_size == path.ranks and layout.gpu == 1, path.name
        assert spec.model.framework == ("tensorflow" if path.name == "tf" else "torch")
    by_name = {p.name: p for p in paths}
    assert by_name["ddp"].ranks == min(gpus, 2)
    assert resolve_layout(validate_spec(smoke.spec_tree(by_name["sp"], tmp_path))).sp == 2
    assert resolve_layout(validate_spec(smoke.spec_tree(by_name["pipeline"], tmp_path))).pp == 2
    assert by_name["bf16"].overrides == ("training.precision=bf16",)
    assert by_name["fp16"].overrides == ("training.precision=fp16",)
    assert precisions == {"tf": "fp32", "torch": "fp32", "ddp": "fp32", "sp": "fp32", "pipeline": "fp32",
                          "bf16": "bf16", "fp16": "fp16"}


def write_store(folder: Path, path_name: str, *, device: str | None, error: str | None, spec_dir: Path) -> None:
    """The store a one-trial ``distmis run`` of ``path_name`` leaves in ``folder``, written by distmis's own
    search run and trial callback (the trial a stand-in for Tune's)."""
    spec = validate_spec({**small_spec_tree(spec_dir), "name": f"gpu-smoke-{path_name}"})
    folder.mkdir(parents=True)
    run = SearchRun(f"sqlite:///{folder / 'mlflow.db'}", spec.name, run_name=spec.name,
                    searched=["training.optimizer.lr"], metric="val_dice", mode="max")
    callback = run.trial_callback(spec)
    error_file = None
    if error is not None:
        error_file = folder / "error.txt"
        error_file.write_text(f"Traceback (most recent call last):\n  File \"x\", line 1\n{error}\n")
    trial = SimpleNamespace(trial_id="t_00000", config={"training.optimizer.lr": 1e-3},
                            last_result={"time_total_s": 1.0}, error_file=str(error_file) if error_file else None,
                            get_error=lambda: None)
    callback.on_trial_start(0, [], trial)
    if device is not None:
        callback.on_trial_result(0, [], trial, {"epoch": 1, "train_loss": 0.5, "val_loss": 0.5, "val_dice": 0.25,
                                                "epoch_seconds": 1.0, "attempt": "a", DEVICE_KEY: device})
    if error is None:
        callback.on_trial_complete(0, [], trial)
    else:
        callback.on_trial_error(0, [], trial)
    assert callback.close()
    run.finish("FINISHED")


def test_the_table_says_what_ran_on_which_device(smoke, tmp_path: Path, capsys):
    out = tmp_path / "smoke"
    refusal = ("distmis.parallel.devices.GpuUnavailableError: Ray gave this process GPU 0 "
               "(CUDA_VISIBLE_DEVICES='0') but TensorFlow 2.21.0 sees no CUDA device")
    write_store(out / "tf", "tf", device=None, error=refusal, spec_dir=tmp_path / "data")
    write_store(out / "torch", "torch", device="cuda:0 (NVIDIA H100 80GB HBM3)", error=None,
                spec_dir=tmp_path / "data")
    paths = {p.name: p for p in smoke.smoke_paths(1)}
    rows = [smoke.store_row(paths["tf"], out / "tf", seconds=21.0, exit_code=1),
            smoke.store_row(paths["torch"], out / "torch", seconds=30.4, exit_code=0),
            smoke.store_row(paths["ddp"], out / "ddp", exit_code=1),  # distmis run left no store
            smoke.SmokeRow("sp", paths["sp"].what, "NOT RUN", note="needs 2 GPUs (NCCL: one rank per GPU), 1 visible")]
    tf, torch_row, ddp, sp = rows
    assert (tf.status, tf.device, tf.note) == ("FAILED", "", refusal) and not tf.on_gpu
    assert (torch_row.status, torch_row.device, torch_row.val_dice) == (
        "FINISHED", "cuda:0 (NVIDIA H100 80GB HBM3)", 0.25) and torch_row.on_gpu
    assert ddp.status == "NO RUN" and ddp.note == f"no MLflow store at {out / 'ddp' / 'mlflow.db'} (distmis run exit 1)"

    table = smoke.format_table(rows).splitlines()
    assert table[0] == "| path | what | status | device | val dice | seconds | note |"
    assert table[2] == f"| tf | Keras U-Net, one process | FAILED | - |  | 21 | {refusal} |"
    assert table[3] == ("| torch | torch U-Net, one process | FINISHED | cuda:0 (NVIDIA H100 80GB HBM3) | 0.250 | 30 "
                        "|  |")
    assert table[5].startswith("| sp | vit-seg, sequence-parallel (Ulysses) over 2 ranks | NOT RUN | - |")
    assert not smoke.all_on_gpu(rows)
    assert smoke.all_on_gpu([torch_row, sp])  # every path that ran finished on a GPU; the one not run says why
    assert not smoke.all_on_gpu([torch_row, smoke.SmokeRow("bf16", "", "FINISHED", device="cpu")])

    # saved, then read again from the stores (`gpu_smoke.py OUTPUT --table`)
    smoke.write_table(rows, out)
    assert json.loads((out / "gpu_smoke.json").read_text())[1]["device"] == "cuda:0 (NVIDIA H100 80GB HBM3)"
    assert smoke.main([str(out), "--table"]) == 1  # the tf row failed
    printed = capsys.readouterr().out
    assert (out / "gpu_smoke.md").read_text().strip() == printed.strip()
    assert "| torch | torch U-Net, one process | FINISHED | cuda:0 (NVIDIA H100 80GB HBM3) | 0.250 | 30 |" in printed
    assert "| sp | vit-seg, sequence-parallel (Ulysses) over 2 ranks | NOT RUN |" in printed
    assert "| ddp | torch U-Net, DDP over 1 worker(s) | NO RUN |" in printed
