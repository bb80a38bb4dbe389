"""parallelism.max_failures: a trial whose process (or one of its Ray Train workers) is killed mid-trial restarts
from its last epoch and finishes, in its one MLflow run. Real processes killed with SIGKILL."""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from mlflow.tracking import MlflowClient

from distmis.search.run import run_search
from distmis.trial.trainables import (
    data_parallel_trial, data_parallel_worker, single_process_trial, worker_working_folder,
)
from distmis.trial.checkpoints import trial_working_folder
from distmis.spec import validate_spec
from distmis.tracking.mlflow_tracking import ATTEMPTS_TAG
from distmis.tracking.results import trial_runs
from distmis.train.loop import BEST_DIR, SCRATCH_PREFIX
from tests.conftest import small_spec_tree

EPOCHS = 4
KILL_AFTER = 2  # epochs: the process is SIGKILLed once the second epoch's checkpoint is saved


def die_after_reports(report: Any, log: Path, armed: bool, working_folder: Callable[[], str | None],
                      rank: int = 0) -> Any:
    """``report``, logging each epoch as "pid epoch"; when ``armed``, SIGKILL this process after KILL_AFTER, once
    it has written down what its trial's working folder held (``scratch.json``)."""

    def wrapped(metrics: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        report(metrics, *args, **kwargs)
        with log.open("a") as handle:
            handle.write(f"{os.getpid()} {metrics['epoch']}\n")
        if armed and metrics["epoch"] >= KILL_AFTER:
            time.sleep(3)  # let the driver (and Ray Train's controller) take in the reports made so far
            folder = working_folder()
            scratch = Path(folder or "/nonexistent", f"{SCRATCH_PREFIX}{rank}")
            held = sorted(str(p.relative_to(scratch)) for p in scratch.rglob("*")) if scratch.is_dir() else []
            Path(log.parent, "scratch.json").write_text(json.dumps({"scratch": str(scratch), "held": held}))
            os.kill(os.getpid(), signal.SIGKILL)

    return wrapped


def first_time(marker: Path) -> bool:
    try:
        marker.touch(exist_ok=False)
        return True
    except FileExistsError:
        return False


def dying_single_trial(workdir: str, config: dict[str, Any], **kwargs: Any) -> None:
    """The real single-process trial, whose first process is killed after its second epoch."""
    from ray import tune

    tune.report = die_after_reports(tune.report, Path(workdir, "reports.log"), first_time(Path(workdir, "killed")),
                                    trial_working_folder)
    single_process_trial(config, **kwargs)


def dying_worker(workdir: str, loop_config: dict[str, Any]) -> None:
    """A real data-parallel worker; rank 1 of the first worker group is killed after its second epoch."""
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    armed = rank == 1 and first_time(Path(workdir, "killed"))
    log = Path(workdir, f"reports.rank{rank}.log")
    ray.train.report = die_after_reports(ray.train.report, log, armed, worker_working_folder, rank)
    data_parallel_worker(loop_config)


def dying_data_trial(workdir: str, config: dict[str, Any], **kwargs: Any) -> None:
    data_parallel_trial(config, worker_loop=functools.partial(dying_worker, workdir), **kwargs)


def epochs_by_process(log: Path) -> list[list[int]]:
    processes: dict[str, list[int]] = {}
    for line in log.read_text().splitlines():
        pid, epoch = line.split()
        processes.setdefault(pid, []).append(int(epoch))
    return list(processes.values())


@pytest.mark.parametrize("mode", ["experiment", "hybrid"])
def test_a_killed_trial_restarts_from_its_last_epoch(ray_local, tmp_path: Path, mode: str):
    tree = small_spec_tree(tmp_path / "data")
    # A TensorFlow trial restarted in its own process, torch workers in a Ray Train group (a hybrid search's trial;
    # Ray Train's FailureConfig restarts it): the two frameworks' restores in a search (the killed-driver resume of
    # tests/faults/test_kill_and_resume.py runs torch; a data-mode search's worker group resumes a trial from its
    # checkpoint in tests/trial/test_torch_worker_group.py).
    tree["model"]["framework"] = "tensorflow" if mode == "experiment" else "torch"
    tree["dataset"]["synthetic"]["shape"] = [32, 32, 32]  # epochs of about a second: each report reaches the driver
    tree["training"]["epochs"] = EPOCHS
    tree["search"]["space"] = {"training.optimizer.lr": {"grid": [1.0e-3]}}
    if mode == "experiment":
        tree["parallelism"] = {"resources_per_trial": {"cpu": 1}, "max_failures": 1}
        trainable = functools.partial(dying_single_trial, str(tmp_path))
    else:
        tree["parallelism"] = {"workers_per_trial": 2, "max_failures": 1}
        trainable = functools.partial(dying_data_trial, str(tmp_path))
    outcome = run_search(validate_spec(tree), tmp_path / "out", progress=False, trainable=trainable)

    assert (tmp_path / "killed").exists(), "no process was killed: the test tested nothing"
    assert outcome.failed == 0, list(outcome.results.get("error", []))  # whole, not pandas' cut
    client = MlflowClient(outcome.tracking_uri)
    [run] = trial_runs(client, client.get_run(outcome.parent_run_id))
    assert run.info.status == "FINISHED"
    for key in ("train_loss", "val_dice", "epoch_seconds"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == list(range(1, EPOCHS + 1))
    assert run.data.tags[ATTEMPTS_TAG] == "2"  # one run, and it says the trial was restarted once
    log = tmp_path / ("reports.log" if mode == "experiment" else "reports.rank0.log")
    first, second = epochs_by_process(log) if mode == "experiment" else epochs_by_process(log)[:1] + [
        epochs_by_process(log)[-1]]
    assert first[:KILL_AFTER] == list(range(1, KILL_AFTER + 1))
    assert second == list(range(KILL_AFTER + 1, EPOCHS + 1)), second  # went on from its last epoch, not the start

    # The killed process kept its scratch (the best weights so far, on rank 0) in its trial's own working folder,
    # not the system's temporary folder (issue 46, finding 14); the restarted run reused it and removed it at its end.
    killed = json.loads((tmp_path / "scratch.json").read_text())
    assert BEST_DIR in killed["held"], killed
    if mode == "experiment":
        assert f"{BEST_DIR}/model.weights.h5" in killed["held"], killed
    assert not Path(killed["scratch"]).exists()
