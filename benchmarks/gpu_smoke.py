"""One tiny trial of every training path on this node's GPUs, and a table of what ran on which device.

Run it through `benchmarks/gpu_smoke.sh` on a GPU node (it refuses a node where `nvidia-smi -L` lists no GPU):

    benchmarks/gpu_smoke.sh [OUTPUT] [--paths tf,torch,...]

Each path is a one-trial search (`distmis run`, its own local Ray, which finds the node's GPUs) on 8 synthetic
cases of 32^3 (made once, in `OUTPUT/data`), one epoch, with a whole GPU per trial or per rank:

| path | what | ranks |
|---|---|---|
| `tf` | the Keras U-Net, one process | 1 |
| `torch` | the torch U-Net, one process | 1 |
| `ddp` | the torch U-Net, data-parallel (DDP over NCCL) on a Ray Train worker group | min(GPUs, 2) |
| `sp` | `vit-seg`, sequence-parallel (Ulysses) over NCCL | 2 |
| `pipeline` | the torch U-Net in 2 pipeline stages (1F1B) over NCCL | 2 |
| `bf16` | the torch U-Net, `training.precision: bf16` | 1 |
| `fp16` | the torch U-Net, `training.precision: fp16` | 1 |

NCCL takes one GPU per rank, so on a node of one GPU the 2-rank paths (`sp`, `pipeline`) are not run (their row
says so) and `ddp` is a worker group of one. The table reads each search's MLflow store: the trial's status, the
device its model trained on (the run's `distmis.device` tag: `cuda:0 (NVIDIA ...)`, `GPU:0 (...)`, or `cpu` /
`CPU:0` where a path did not reach a GPU), its validation dice, the seconds `distmis run` took and, for a failed
trial, its `error` tag. A path whose framework sees no GPU fails at its start with `GpuUnavailableError` (a
`gpu-torch` environment has TensorFlow's CPU build: its `tf` row fails so). The table goes to stdout and to
`OUTPUT/gpu_smoke.md`, the rows to `OUTPUT/gpu_smoke.json`; the exit status is 0 only when every path that ran
finished on a GPU.

`python benchmarks/gpu_smoke.py OUTPUT --table` prints the table again from the stores (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO = Path(__file__).resolve().parents[1]

UNET_TF = {"name": "unet3d", "framework": "tensorflow", "params": {"base_filters": 4, "levels": 3}}
UNET_TORCH = {"name": "unet3d", "framework": "torch",
              "params": {"base_filters": 4, "levels": 3, "norm": "group", "norm_groups": 2}}
VIT = {"name": "vit-seg", "framework": "torch",
       "params": {"layers": 2, "embed_dim": 32, "heads": 4, "patch": 4, "decoder_features": 16}}


@dataclass(frozen=True)
class SmokePath:
    """One path of the smoke test: the spec's sections it sets, the ``--set`` overrides, and the ranks it needs."""

    name: str
    what: str
    model: dict[str, Any]
    parallelism: dict[str, Any]
    ranks: int = 1  # GPUs it needs at once (one per rank)
    training: dict[str, Any] = field(default_factory=dict)
    overrides: tuple[str, ...] = ()


def smoke_paths(gpus: int) -> list[SmokePath]:
    """Every path, for a node of ``gpus`` GPUs (``ddp`` spans up to 2 of them)."""
    one = {"resources_per_trial": {"cpu": 1, "gpu": 1}}
    ddp = max(1, min(gpus, 2))
    return [
        SmokePath("tf", "Keras U-Net, one process", UNET_TF, one),
        SmokePath("torch", "torch U-Net, one process", UNET_TORCH, one),
        SmokePath("ddp", f"torch U-Net, DDP over {ddp} worker(s)", UNET_TORCH,
                  {"mode": "data", "workers": ddp, "resources_per_worker": {"cpu": 1, "gpu": 1}}, ranks=ddp),
        SmokePath("sp", "vit-seg, sequence-parallel (Ulysses) over 2 ranks", VIT,
                  {"resources_per_worker": {"cpu": 1, "gpu": 1},
                   "sequence_parallel": {"degree": 2, "attention": "ulysses"}}, ranks=2,
                  training={"tile": [16, 16, 16]}),
        SmokePath("pipeline", "torch U-Net, 2 pipeline stages (1F1B)", UNET_TORCH,
                  {"resources_per_worker": {"cpu": 1, "gpu": 1},
                   "pipeline": {"stages": 2, "microbatches": 2, "schedule": "1f1b"}}, ranks=2),
        SmokePath("bf16", "torch U-Net, bf16", UNET_TORCH, one, overrides=("training.precision=bf16",)),
        SmokePath("fp16", "torch U-Net, fp16", UNET_TORCH, one, overrides=("training.precision=fp16",)),
    ]


def spec_tree(path: SmokePath, data: Path) -> dict[str, Any]:
    """The one-trial search of ``path`` (its ``overrides`` are given to ``distmis run`` as ``--set``)."""
    return {
        "name": f"gpu-smoke-{path.name}",
        "dataset": {"path": str(data), "layout": "msd", "synthetic": {"cases": 8, "shape": [32, 32, 32], "seed": 0},
                    "split": {"train": 0.5, "val": 0.25, "test": 0.25, "seed": 0}},
        "model": path.model,
        "training": {"epochs": 1, "batch_size": 2, "optimizer": {"lr": 1.0e-3}, **path.training},
        "search": {"algorithm": "grid", "space": {"training.optimizer.lr": {"grid": [1.0e-3]}}},
        "parallelism": path.parallelism,
    }


# --------------------------------------------------------------------------- what the node has
def visible_gpus() -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists (those in ``CUDA_VISIBLE_DEVICES`` when it is set); none without it."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    gpus = [line.strip() for line in listed.splitlines() if line.startswith("GPU ")]
    chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if chosen is not None:
        keep = {c.strip() for c in chosen.split(",") if c.strip()}
        gpus = [g for i, g in enumerate(gpus) if str(i) in keep or any(k in g for k in keep if k.startswith("GPU-"))]
    return gpus


def frameworks_seen() -> dict[str, str]:
    """What each framework of this environment sees, in words (each asked in a process of its own)."""
    probes = {
        "torch": "import torch; print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, "
                 "{torch.cuda.device_count()} device(s)')",
        "tensorflow": "import tensorflow as tf; print(f'tensorflow {tf.__version__}, built with CUDA: "
                      "{tf.test.is_built_with_cuda()}, GPUs: {len(tf.config.list_physical_devices(\"GPU\"))}')",
    }
    seen = {}
    for name, code in probes.items():
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        seen[name] = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else \
            f"not importable: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
    return seen


# --------------------------------------------------------------------------- the table
@dataclass
class SmokeRow:
    path: str
    what: str
    status: str  # FINISHED, FAILED (the trial's run), NOT RUN, NO RUN (distmis run made none: see note)
    device: str = ""
    val_dice: float | None = None
    seconds: float | None = None
    note: str = ""

    @property
    def on_gpu(self) -> bool:
        return self.device.lower().startswith(("cuda", "gpu"))


def store_row(path: SmokePath, output: Path, seconds: float | None = None, exit_code: int | None = None) -> SmokeRow:
    """``path``'s row, from its search's MLflow store in ``output`` (``OUTPUT/<path>/mlflow.db``)."""
    from mlflow.tracking import MlflowClient

    from distmis.tracking.results import ResultsNotFound, find_search_run, trial_runs

    row = SmokeRow(path.name, path.what, "NO RUN", seconds=seconds)
    database = output / "mlflow.db"
    if not database.is_file():
        row.note = f"no MLflow store at {database}" + (f" (distmis run exit {exit_code})" if exit_code else "")
        return row
    client = MlflowClient(f"sqlite:///{database}")
    try:
        runs = trial_runs(client, find_search_run(client, f"gpu-smoke-{path.name}"))
    except ResultsNotFound as exc:
        row.note = str(exc)
        return row
    if not runs:
        row.note = "the search logged no trial" + (f" (distmis run exit {exit_code})" if exit_code else "")
        return row
    run = runs[0]
    row.status = run.info.status
    row.device = run.data.tags.get("distmis.device", "")
    row.val_dice = run.data.metrics.get("best_val_dice")
    row.note = run.data.tags.get("error", "")
    return row


def format_table(rows: list[SmokeRow]) -> str:
    """The rows as a markdown table."""
    lines = ["| path | what | status | device | val dice | seconds | note |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        dice = "" if r.val_dice is None else f"{r.val_dice:.3f}"
        seconds = "" if r.seconds is None else f"{r.seconds:.0f}"
        note = r.note.replace("|", "/").replace("\n", " ")
        lines.append(f"| {r.path} | {r.what} | {r.status} | {r.device or '-'} | {dice} | {seconds} | {note} |")
    return "\n".join(lines)


def all_on_gpu(rows: list[SmokeRow]) -> bool:
    """Every path that ran finished with its model on a GPU."""
    return all(r.status == "NOT RUN" or (r.status == "FINISHED" and r.on_gpu) for r in rows)


# --------------------------------------------------------------------------- running it
def run_path(path: SmokePath, output: Path, data: Path) -> SmokeRow:
    import yaml

    folder = output / path.name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    spec_file = folder.with_suffix(".yaml")
    spec_file.write_text(yaml.safe_dump(spec_tree(path, data), sort_keys=False))
    command = [sys.executable, "-m", "distmis", "run", str(spec_file), "--output", str(folder), "--quiet"]
    for override in path.overrides:
        command += ["--set", override]
    start = time.monotonic()
    with (output / f"{path.name}.log").open("w") as log:
        done = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    return store_row(path, folder, seconds=time.monotonic() - start, exit_code=done.returncode)


def run_smoke(output: Path, names: list[str] | None = None) -> list[SmokeRow]:
    gpus = visible_gpus()
    if not gpus:
        raise SystemExit("gpu_smoke: no GPU visible (nvidia-smi -L lists none): run it on a GPU node")
    print(f"GPUs: {len(gpus)}", *(f"  {g}" for g in gpus), sep="\n", flush=True)
    for name, seen in frameworks_seen().items():
        print(f"{name}: {seen}", flush=True)
    output.mkdir(parents=True, exist_ok=True)
    paths = [p for p in smoke_paths(len(gpus)) if names is None or p.name in names]
    rows = []
    for path in paths:
        if path.ranks > len(gpus):
            rows.append(SmokeRow(path.name, path.what, "NOT RUN",
                                 note=f"needs {path.ranks} GPUs (NCCL: one rank per GPU), {len(gpus)} visible"))
            continue
        print(f"{path.name}: {path.what} ...", flush=True)
        rows.append(run_path(path, output, output / "data"))
        print(f"{path.name}: {rows[-1].status} on {rows[-1].device or '-'} ({rows[-1].seconds:.0f} s)", flush=True)
    return rows


def write_table(rows: list[SmokeRow], output: Path) -> str:
    table = format_table(rows)
    (output / "gpu_smoke.md").write_text(table + "\n")
    (output / "gpu_smoke.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return table


def read_rows(output: Path) -> list[SmokeRow]:
    """The rows again: from ``gpu_smoke.json`` (its seconds and skipped paths) with each status re-read."""
    saved = {r["path"]: SmokeRow(**r) for r in json.loads((output / "gpu_smoke.json").read_text())} \
        if (output / "gpu_smoke.json").is_file() else {}
    rows = []
    for path in smoke_paths(2):
        old = saved.get(path.name)
        if (output / path.name).is_dir() and (old is None or old.status != "NOT RUN"):
            rows.append(store_row(path, output / path.name, seconds=old.seconds if old else None))
        elif old is not None:  # not run, or run without leaving a folder
            rows.append(old)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", nargs="?", default="runs/gpu-smoke", type=Path)
    parser.add_argument("--paths", help="comma-separated paths to run (default: all): "
                                        + ",".join(p.name for p in smoke_paths(2)))
    parser.add_argument("--table", action="store_true", help="print the table of an earlier run of OUTPUT")
    args = parser.parse_args(argv)
    output = args.output.resolve()
    if args.table:
        rows = read_rows(output)
    else:
        rows = run_smoke(output, args.paths.split(",") if args.paths else None)
    print(write_table(rows, output))
    return 0 if rows and all_on_gpu(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
