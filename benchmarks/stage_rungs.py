"""Multi-fidelity over the input size (issue 51): ``search.scheduler: stage-halving`` (and ``stage-asha``) against
the grid they prune.

One search space of 8 configurations (``training.optimizer.lr`` x ``model.params.norm``) of distmis's torch U-Net on
synthetic 64^3 volumes, every trial trained with LAMP's curriculum (small tiles first, the whole volume last), two
trials at a time on one CPU each, run through ``distmis run``, one after the other on an otherwise idle machine:

1. **the grid**: every configuration trains every stage (``scheduler: none``);
2. each of ``--schedulers`` (reduction factor 2), with the grid's values in the order the spec lists them (the
   learning rate rising) and in ``--orders`` other orders (the values shuffled, seeds 1, 2, ...):
   - ``stage-halving``: synchronous successive halving at the ends of the curriculum's first stages; every trial
     waits, paused, at a stage's end until all have reached it, and the better half go on;
   - ``stage-asha``: ASHA at the same rungs, each trial judged against those that reached the rung before it.

For each: the best configuration by validation dice (each trial's best epoch, whole validation volumes), its dice,
and the search's worker-seconds (the sum of its trials' ``worker_seconds``: workers x wall time) and wall time. The
acceptance: the scheduler finds the grid's best configuration, or one within 0.01 validation dice of it, for at
most half the grid's worker-seconds.

    .venv/bin/python benchmarks/stage_rungs.py --output runs/stage-rungs [--schedulers stage-halving stage-asha]
                                               [--orders 2] [--reuse]

The table goes to ``OUTPUT/stage_rungs.md`` (and ``.json``); each search's console to ``OUTPUT/<name>.log``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

DISTMIS = [sys.executable, "-m", "distmis"]


def spec_tree(data: Path, args: argparse.Namespace, scheduler: str, order: int = 0) -> dict[str, Any]:
    """The search's spec; ``order`` > 0: the grid's values shuffled with that seed (Tune runs a grid's
    configurations in the order of its values, the learning rate's outer)."""
    lrs, norms = [1e-4, 3e-4, 1e-3, 3e-3], ["batch", "group"]
    if order:
        draw = random.Random(order)
        draw.shuffle(lrs)
        draw.shuffle(norms)
    size = args.shape
    small, middle = size // 2, (3 * size) // 4
    return {
        "name": f"stage-rungs-{scheduler}" + (f"-order{order}" if order else ""),
        "dataset": {"path": str(data), "layout": "msd",
                    "synthetic": {"cases": args.cases, "shape": [size] * 3, "seed": 0},
                    "split": {"train": 0.5, "val": 0.25, "test": 0.25, "seed": 0}},
        "model": {"name": "unet3d", "framework": "torch", "params": {"base_filters": 8, "levels": 4}},
        "training": {
            "batch_size": 2, "steps_per_epoch": args.steps, "optimizer": {"lr": 1e-3}, "seed": 0,
            "curriculum": [{"tile": [small] * 3, "epochs": args.stage_epochs},
                           {"tile": [middle] * 3, "epochs": args.stage_epochs},
                           {"tile": None, "epochs": args.stage_epochs}],
        },
        "search": {"algorithm": "grid", "scheduler": scheduler, "stage_asha": {"reduction_factor": 2},
                   "stage_halving": {"reduction_factor": 2},
                   "evaluate_top": 0,
                   "space": {"training.optimizer.lr": {"grid": lrs}, "model.params.norm": {"grid": norms}}},
        "parallelism": {"mode": "experiment", "resources_per_trial": {"cpu": 1}},
    }


def run(tree: dict[str, Any], out: Path) -> float:
    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.yaml"
    spec.write_text(yaml.safe_dump(tree, sort_keys=False))
    start = time.perf_counter()
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run([*DISTMIS, "run", str(spec), "--output", str(out)], stdout=log, stderr=subprocess.STDOUT,
                       check=True)
    return time.perf_counter() - start


def trials(out: Path, experiment: str) -> list[dict[str, Any]]:
    from mlflow.tracking import MlflowClient

    from distmis.tracking.results import find_search_run, trial_runs

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    parent = find_search_run(client, experiment)
    rows = []
    for run in trial_runs(client, parent):
        metrics, params = run.data.metrics, run.data.params
        rows.append({"lr": float(params["training.optimizer.lr"]), "norm": params["model.params.norm"],
                     "start": run.info.start_time,
                     "best_val_dice": metrics.get("best_val_dice", float("nan")),
                     "epochs": int(metrics.get("epochs_completed", 0)),
                     "worker_seconds": metrics.get("worker_seconds", 0.0)})
    return sorted(rows, key=lambda row: -row["best_val_dice"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--cases", type=int, default=12)
    parser.add_argument("--shape", type=int, default=64)
    parser.add_argument("--stage-epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="training steps per epoch")
    parser.add_argument("--schedulers", nargs="+", default=["stage-halving"], choices=["stage-halving", "stage-asha"])
    parser.add_argument("--orders", type=int, default=2, help="runs of each with the grid's values shuffled")
    parser.add_argument("--reuse", action="store_true", help="read the searches an earlier run left in OUTPUT")
    args = parser.parse_args()
    out = args.output.resolve()
    data = out / "data"
    results: dict[str, Any] = {"machine": f"{platform.node()}, {platform.processor() or platform.machine()}",
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                        text=True, cwd=Path(__file__).parent).stdout.strip()}
    runs = [("none", 0), *((name, order) for name in args.schedulers for order in range(args.orders + 1))]
    for scheduler, order in runs:
        tree = spec_tree(data, args, scheduler, order)
        folder = out / tree["name"]
        if args.reuse and (folder / "result.json").is_file():  # an earlier run of this benchmark's
            results[tree["name"]] = json.loads((folder / "result.json").read_text())
            continue
        wall = run(tree, folder)
        rows = trials(folder, tree["name"])
        result = {"order": [f"lr {row['lr']:g} {row['norm']}" for row in sorted(rows, key=lambda r: r["start"])],
                  "wall_s": wall, "worker_s": sum(row["worker_seconds"] for row in rows), "best": rows[0],
                  "trials": rows}
        (folder / "result.json").write_text(json.dumps(result, indent=2))
        results[tree["name"]] = result
        print(f"{tree['name']}: best lr={rows[0]['lr']:g} norm={rows[0]['norm']} val_dice "
              f"{rows[0]['best_val_dice']:.4f}, {result['worker_s']:.0f} worker-s, {wall:.0f} s", flush=True)
    grid = results["stage-rungs-none"]
    lines = ["| search | trials in the order they started | best configuration | its val dice | worker-s "
             "(/ grid) | wall s | epochs per trial |", "|---|---|---|---|---|---|---|"]
    verdicts = []
    for name, result in results.items():
        if not isinstance(result, dict) or "best" not in result:
            continue
        best = result["best"]
        ratio = result["worker_s"] / grid["worker_s"]
        gap = grid["best"]["best_val_dice"] - best["best_val_dice"]
        same = (best["lr"], best["norm"]) == (grid["best"]["lr"], grid["best"]["norm"])
        epochs = sorted((row["epochs"] for row in result["trials"]), reverse=True)
        lines.append(f"| {name.removeprefix('stage-rungs-')} | {'; '.join(result['order'])} | lr {best['lr']:g}, "
                     f"{best['norm']} norm | {best['best_val_dice']:.4f} | {result['worker_s']:.0f} ({ratio:.2f}) | "
                     f"{result['wall_s']:.0f} | {', '.join(map(str, epochs))} |")
        if name != "stage-rungs-none":
            verdicts.append(f"{name.removeprefix('stage-rungs-')}: {ratio:.2f} of the grid's worker-seconds, "
                            f"{'the same best' if same else f'best {gap:+.4f} below the grid'}: "
                            f"{'met' if (same or gap <= 0.01) and ratio <= 0.5 else 'not met'}")
    table = "\n".join([*lines, "", *verdicts])
    print(table)
    (out / "stage_rungs.md").write_text(table + "\n")
    (out / "stage_rungs.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {out / 'stage_rungs.md'}")


if __name__ == "__main__":
    main()
