"""A Ray Train worker that dies while its worker group starts must not leave its placement group holding the CPUs.

Ray Train 2.60 loses the worker group when a worker dies after the group's state is built and before
``WorkerGroup.create`` returns (a worker that exits first thing in its train loop dies while the train function
is being launched): nobody removes the group's placement group, and as it was made by the (non-detached) Train
controller, Ray keeps it until the driver's job ends. Every later trial then waits for CPUs that never come back.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from distmis.trial.trainables import data_parallel_trial

pytestmark = pytest.mark.slow


# Module level and light: every trial process and Ray Train worker imports this module.
def die_at_start(loop_config: dict) -> None:
    os._exit(1)  # as a worker killed at start-up (OOM killer, segfault in an import) does


def report_epochs(loop_config: dict) -> None:
    """A worker that trains nothing and reports every epoch (each rank reports: it is a collective)."""
    import ray.train

    for epoch in range(1, loop_config["spec"].training.epochs + 1):
        ray.train.report({"epoch": epoch, "train_loss": 1.0 / epoch, "val_loss": 1.0 / epoch, "val_dice": epoch / 10,
                          "epoch_seconds": 0.1})


def dying_trial(config: dict, *, spec, tfrecord_dir: str, storage_path: str) -> None:
    data_parallel_trial(config, spec=spec, tfrecord_dir=tfrecord_dir, storage_path=storage_path,
                        worker_loop=die_at_start)


def reporting_trial(config: dict, *, spec, tfrecord_dir: str, storage_path: str) -> None:
    data_parallel_trial(config, spec=spec, tfrecord_dir=tfrecord_dir, storage_path=storage_path,
                        worker_loop=report_epochs)


def created_groups() -> dict[str, list]:
    import ray

    return {pg_id: list(info["bundles"].values())
            for pg_id, info in ray.util.placement_group_table().items() if info["state"] == "CREATED"}


def wait_until_released(before: set[str], timeout: float = 30.0) -> tuple[dict[str, list], float, float]:
    """Placement groups made since ``before`` still CREATED, and free / total CPUs, once all are free or at the
    timeout (removing a group and reporting its CPUs free again take a moment)."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        left = {k: v for k, v in created_groups().items() if k not in before}
        free, total = ray.available_resources().get("CPU", 0.0), ray.cluster_resources().get("CPU", 0.0)
        if (not left and free == total) or time.monotonic() > deadline:
            return left, free, total
        time.sleep(0.5)


def remove_groups(ids) -> None:
    import ray
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    for pg_id in ids:
        remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))


def test_workers_dying_at_start_up_release_their_cpus_and_the_next_trial_runs(ray_local, tmp_path: Path):
    from mlflow.tracking import MlflowClient

    from distmis.search.run import run_search
    from distmis.spec import validate_spec
    from distmis.tracking.results import trial_runs
    from tests.search.test_layout_in_workers import dp_tree

    # a hybrid search's trial: a Ray Train run of 2 workers x 1 CPU, all the CPUs
    spec = validate_spec(dp_tree(tmp_path / "data", "torch", workers_per_trial=2, resources_per_worker={"cpu": 1}))
    before = set(created_groups())
    try:
        failed = run_search(spec, tmp_path / "out", progress=False, trainable=dying_trial)
        assert failed.failed == 1  # the trial failed: its workers died
        leaked, free, total = wait_until_released(before)
        assert not leaked, f"placement groups left CREATED after the trial ended: {leaked}"
        assert free == total, f"only {free} of {total} CPUs free after the trial ended"
    finally:
        remove_groups(set(created_groups()) - before)  # a leak must not hang the rest of the session

    # The CPUs are there for the next trial: a 2-worker trial that needs every CPU starts and finishes (in a new
    # output folder: the first one holds a search that ended with a failed trial, which only --resume reopens).
    outcome = run_search(spec, tmp_path / "next", progress=False, trainable=reporting_trial)
    assert outcome.failed == 0, list(outcome.results.get("error", []))  # whole, not pandas' cut
    client = MlflowClient(outcome.tracking_uri)
    [run] = trial_runs(client, client.get_run(outcome.parent_run_id))
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_dice")) == [1, 2]
    leaked, free, total = wait_until_released(before)
    assert not leaked and free == total, (leaked, free, total)
