"""Run one-trial searches that ask for a GPU on a Ray node that declares one it does not have; print their runs.

Not a test module: ``test_gpu_refusal.py`` runs it in a subprocess, because the node must be started with
``ray.init(num_gpus=1)`` (a logical GPU on this CPU-only machine) and the test session may hold a Ray of its own.
Usage:
    python -m tests.search.gpu_refusal_search WORKDIR CASE [CASE ...]
with CASE ``torch``, ``tensorflow`` (experiment mode, ``resources_per_trial: {gpu: 1}``), ``torch-group`` or
``tensorflow-group`` (a data-mode search's worker group of one worker of one GPU), ``tensorflow-hybrid`` or
``torch-hybrid`` (a Ray Train trial of two workers of half a GPU).
Prints one JSON line: per case, the search's failed count and each trial run's status, tags and metrics.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def case_tree(workdir: Path, case: str) -> dict:
    from tests.conftest import small_spec_tree

    tree = small_spec_tree(workdir / "data")
    tree["name"] = f"gpu-{case}"
    tree["dataset"]["synthetic"] = {"cases": 4, "shape": [32, 32, 32], "seed": 0}
    tree["dataset"]["split"] = {"train": 0.5, "val": 0.25, "test": 0.25, "seed": 0}
    tree["training"]["epochs"] = 1
    tree["search"] = {"algorithm": "grid", "space": {"training.optimizer.lr": {"grid": [1.0e-3]}}}
    tree["model"]["framework"] = "tensorflow" if case.startswith("tensorflow") else "torch"
    if case in ("torch", "tensorflow"):
        tree["parallelism"] = {"resources_per_trial": {"cpu": 1, "gpu": 1}}
    elif case.endswith("-hybrid"):  # two Ray Train workers sharing the one GPU
        tree["parallelism"] = {"workers_per_trial": 2, "resources_per_worker": {"cpu": 1, "gpu": 0.5}}
    else:
        tree["parallelism"] = {"mode": "data", "workers": 1, "resources_per_worker": {"cpu": 1, "gpu": 1}}
    return tree


def main(workdir: Path, cases: list[str]) -> dict:
    import ray
    from mlflow.tracking import MlflowClient

    from distmis.search.ray_session import init_local_ray, local_ray_options
    from distmis.search.run import run_search
    from distmis.service.net import LOOPBACK, free_port
    from distmis.spec import validate_spec
    from distmis.tracking.results import find_search_run, trial_runs

    init_local_ray({**local_ray_options(free_port(LOOPBACK)), "num_cpus": 2, "num_gpus": 1, "logging_level": "WARNING"})
    report: dict = {"cluster_gpus": ray.cluster_resources().get("GPU", 0.0)}
    try:
        for case in cases:
            start = time.monotonic()
            spec = validate_spec(case_tree(workdir, case))
            outcome = run_search(spec, workdir / case, progress=False)
            client = MlflowClient(outcome.tracking_uri)
            runs = trial_runs(client, find_search_run(client, spec.name))
            report[case] = {"failed": outcome.failed, "seconds": round(time.monotonic() - start, 1),
                            "runs": [{"status": r.info.status, "tags": dict(r.data.tags),
                                      "metrics": dict(r.data.metrics)} for r in runs]}
    finally:
        ray.shutdown()
    return report


if __name__ == "__main__":
    print("GPUREFUSAL " + json.dumps(main(Path(sys.argv[1]), sys.argv[2:])), flush=True)
