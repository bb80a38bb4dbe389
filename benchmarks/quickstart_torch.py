"""The quickstart's torch variant at two commits, one after the other (issue 52): how much sooner its trials finish.

Runs ``distmis run search_spaces/quickstart.yaml --set model.framework=torch`` (4 trials of the U-Net on whole 64^3
volumes, 10 epochs, two at a time on one CPU each) in a git worktree of each commit, each with its own output and a
fresh step-settings cache, and reports each search's wall time, the sum of its trials' ``worker_seconds``, and its
best configuration.

    .venv/bin/python benchmarks/quickstart_torch.py --before 08efac9 --after HEAD --output /tmp/qs-torch
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_at(commit: str, out: Path) -> dict:
    tree = out / f"tree-{commit}"
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=REPO, check=True,
                       capture_output=True)
    env = {**os.environ, "DISTMIS_CACHE": str(out / f"cache-{commit}")}
    started = time.perf_counter()
    with open(out / f"{commit}.log", "w") as log:  # the worktree's distmis: the driver's and its workers' sys.path
        subprocess.run([sys.executable, "-m", "distmis", "run", "search_spaces/quickstart.yaml",
                        "--set", "model.framework=torch", "--output", str(out / f"run-{commit}")],
                       cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    wall = time.perf_counter() - started
    sys.path.insert(0, str(REPO))
    from mlflow.tracking import MlflowClient

    from distmis.tracking.results import find_search_run, trial_runs

    client = MlflowClient(f"sqlite:///{out / f'run-{commit}' / 'mlflow.db'}")
    rows = []
    for run in trial_runs(client, find_search_run(client, "quickstart")):
        rows.append({"lr": run.data.params["training.optimizer.lr"], "norm": run.data.params["model.params.norm"],
                     "best_val_dice": run.data.metrics.get("best_val_dice", float("nan")),
                     "worker_seconds": run.data.metrics.get("worker_seconds", 0.0),
                     "channels_last": run.data.metrics.get("channels_last")})
    best = max(rows, key=lambda row: row["best_val_dice"])
    return {"commit": commit, "wall_s": wall, "worker_s": sum(row["worker_seconds"] for row in rows), "best": best,
            "trials": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    out = args.output.resolve()
    out.mkdir(parents=True, exist_ok=True)
    commits = [subprocess.run(["git", "rev-parse", "--short", c], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip() for c in (args.before, args.after)]
    results = [run_at(commit, out) for commit in commits]
    print("| commit | wall s | trials' worker-s | best configuration | its val dice | channels-last trials |")
    print("|---|---|---|---|---|---|")
    for result in results:
        best = result["best"]
        cl = sum(1 for row in result["trials"] if row["channels_last"] == 1.0)
        print(f"| {result['commit']} | {result['wall_s']:.0f} | {result['worker_s']:.0f} | lr {best['lr']}, "
              f"{best['norm']} norm | {best['best_val_dice']:.4f} | {cl} of {len(result['trials'])} |")
    before, after = results
    print(f"\nwall: {before['wall_s'] / after['wall_s']:.2f}x sooner; trials' worker-seconds: "
          f"{before['worker_s'] / after['worker_s']:.2f}x fewer")
    (out / "quickstart_torch.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
