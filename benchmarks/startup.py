"""Where a data-parallel trial's start-up goes, part by part (issue 12's first step: measure, then cut).

Runs one trial of benchmarks/speedup.yaml (one epoch) data-parallel over each worker count, per framework, as
`distmis run` would, and prints the start-up parts its trial logged in MLflow (distmis.train.startup):
Ray Train's controller, placement group, worker processes and backend set-up (`workers`), imports and thread
pinning, MultiWorkerMirroredStrategy (TensorFlow), model and data (`data`), and the first epoch beside them.

    python benchmarks/startup.py --workers 1,2 --frameworks tensorflow,torch --output runs/startup
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

PARTS = ("workers", "imports", "strategy", "data", "total")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2", help="worker counts, e.g. 1,2")
    parser.add_argument("--frameworks", default="tensorflow,torch")
    parser.add_argument("--output", default="runs/startup")
    args = parser.parse_args()

    import pandas as pd
    from mlflow.tracking import MlflowClient

    from distmis.search.ray_session import ray_connection
    from distmis.search.run import run_search
    from distmis.spec import load_spec
    from distmis.tracking.results import to_markdown, trial_runs

    rows = []
    with ray_connection():
        for framework in args.frameworks.split(","):
            for workers in (int(n) for n in args.workers.split(",")):
                name = f"startup-{framework}-{workers}w"
                spec = load_spec(Path(__file__).with_name("speedup.yaml"), {
                    "name": name, "model.framework": framework, "training.epochs": 1,
                    "search.space": {"training.optimizer.lr": {"grid": [1.0e-3]}},
                    "parallelism.mode": "data", "parallelism.workers": workers, "search.evaluate_top": 0,
                    "tracking.register_model": False,
                })
                outcome = run_search(spec, Path(args.output) / name, progress=False)
                client = MlflowClient(outcome.tracking_uri)
                [trial] = trial_runs(client, client.get_run(outcome.parent_run_id))
                metrics = trial.data.metrics
                first_epoch = client.get_metric_history(trial.info.run_id, "epoch_seconds")[0].value
                rows.append({"framework": framework, "ranks": workers,
                             **{f"{part}_s": metrics.get(f"startup_{part}_s") for part in PARTS},
                             "first_epoch_s": first_epoch, "trial_s": metrics.get("elapsed_seconds")})
    print(to_markdown(pd.DataFrame(rows).round(1)))


if __name__ == "__main__":
    main()
