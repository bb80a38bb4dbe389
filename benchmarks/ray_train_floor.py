"""The floor under a distributed torch trial's start-up: a Ray Train run that trains nothing, against a worker group
kept between trials.

Every distributed torch trial of a hybrid search is one Ray Train run: a controller actor, a detached
placement-group cleaner, a dataset manager, a synchronization actor, a preemption watcher and the workers, each a
new process, before and after the trial's own work. This times ``TorchTrainer.fit`` of a function that only joins
the process group (a barrier), on a local Ray started as distmis starts one, and the import of ``ray.train.torch``
in a fresh interpreter, which every one of those processes pays in part. Whatever a hybrid trial's
``startup_workers_s`` (``benchmarks/startup.py``) is above this floor is distmis's; the floor itself is Ray Train's.
A data-mode search keeps its workers from one trial to the next instead (``distmis/trial/worker_group.py``): the
same number of ranks, joined into one gloo process group once, then one barrier per "trial" on them; both are
timed here in the same run.

    python benchmarks/ray_train_floor.py --runs 3 --workers 2
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from typing import Any


def barrier(config: dict | None = None) -> None:
    import torch.distributed as dist

    dist.barrier()


def group_barrier(worker: Any) -> None:
    barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="Ray Train runs (and trials on the kept group)")
    parser.add_argument("--workers", type=int, default=2, help="workers per run, one CPU each")
    args = parser.parse_args()

    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import ray.train.torch"], check=True)
    print(f"import ray.train.torch in a fresh interpreter: {time.perf_counter() - started:.1f} s")

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from distmis.search.ray_session import ray_connection
    from distmis.spec.layout import TrialLayout
    from distmis.trial.worker_group import WorkerGroup

    started = time.perf_counter()
    with ray_connection(), tempfile.TemporaryDirectory() as storage:
        print(f"local Ray started: {time.perf_counter() - started:.1f} s")
        fits = []
        for run in range(args.runs):
            started = time.perf_counter()
            TorchTrainer(barrier, scaling_config=ScalingConfig(num_workers=args.workers,
                                                               resources_per_worker={"CPU": 1}),
                         run_config=RunConfig(storage_path=storage, name=f"floor-{run}")).fit()
            fits.append(time.perf_counter() - started)
            print(f"run {run + 1}: TorchTrainer.fit of a barrier on {args.workers} workers: {fits[-1]:.1f} s")

        started = time.perf_counter()
        group = WorkerGroup(TrialLayout.for_ranks(args.workers, cpu=1.0), "distmis-workers-floor-1", "torch")
        try:
            start = time.perf_counter() - started
            print(f"a kept worker group of {args.workers} torch workers started and joined: {start:.1f} s")
            trials = []
            for run in range(args.runs):
                started = time.perf_counter()
                ray.get([worker.__ray_call__.remote(group_barrier) for worker in group.workers])
                trials.append(time.perf_counter() - started)
                print(f"trial {run + 1} on it: a barrier: {trials[-1]:.2f} s")
        finally:
            group.shutdown()
        print(f"{args.runs} trials' floor: Ray Train {sum(fits):.1f} s, a kept group {start + sum(trials):.1f} s "
              f"(ratio {sum(fits) / (start + sum(trials)):.1f})")


if __name__ == "__main__":
    main()
