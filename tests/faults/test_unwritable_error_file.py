"""A trial that fails where Tune cannot write its error file (issue 32, case 2) still counts as failed: the search
exits 1, the summary and the table count it, and it is neither scored on the test split nor published.

The disk fault is real: the failing trial makes its folder in the driver's staging area immutable (``chattr +i``,
which stops root too) before it raises, so Tune's ``error.txt`` cannot be written there and its ``ResultGrid``
knows no error for the trial.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from distmis.cli.main import print_search
from distmis.search.run import run_search
from distmis.trial.trainables import single_process_trial
from distmis.spec import validate_spec
from distmis.tracking.results import trial_runs
from tests.conftest import small_spec_tree

pytestmark = pytest.mark.slow  # a real search on the shared local Ray

FAILING_LR = 5.0e-3


def ray_sessions() -> list[Path]:
    """Every Ray session's folder on this machine, not Ray's ``session_latest`` link: that names whichever Ray
    started last, which may be another process's started since (another pytest worker's)."""
    return [session for session in Path("/tmp/ray").glob("session_*") if not session.is_symlink()]


def immutable(folder: Path) -> bool:
    """Whether ``folder`` has the immutable attribute (False for one that has gone since it was listed)."""
    listed = subprocess.run(["lsattr", "-d", str(folder)], capture_output=True, text=True).stdout.split()
    return bool(listed) and "i" in listed[0]


def staging_folders(trial_dir: Path) -> list[Path]:
    """The trial's folder in the driver's staging area (Tune writes its error file there). ``trial_dir``: what the
    trial's context names (``<experiment>/driver_artifacts/<trial>`` in Ray 2.60, else its storage folder)."""
    in_session = trial_dir.parent.name in ("driver_artifacts", "working_dirs")
    experiment = trial_dir.parent.parent if in_session else trial_dir.parent
    pattern = f"artifacts/*/{experiment.name}/driver_artifacts/{trial_dir.name}"
    return [p for session in ray_sessions() for p in session.glob(pattern) if p.is_dir()]


def trial_failing_where_its_error_cannot_be_written(config: dict[str, Any], **kwargs: Any) -> None:
    """The real trial; the FAILING_LR one then locks its staging folder and fails, after training every epoch."""
    single_process_trial(config, **kwargs)
    if config["training.optimizer.lr"] == FAILING_LR:
        from ray import tune

        import time

        trial_dir = Path(tune.get_context().get_trial_dir())
        deadline = time.monotonic() + 60
        # The driver writes the trial's results there as it takes them: lock the folder once it took the last one.
        while not (folders := [f for f in staging_folders(trial_dir) if (f / "result.json").is_file()
                               and (f / "result.json").stat().st_size > 0]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert folders, f"the staging folder of {trial_dir} was not found: no fault made"
        for folder in folders:
            subprocess.run(["chattr", "+i", str(folder)], check=True)
        raise RuntimeError("the trial failed after its last epoch")


def test_a_trial_whose_error_file_cannot_be_written_counts_as_failed_and_is_not_published(ray_local, tmp_path: Path,
                                                                                           capsys):
    tree = small_spec_tree(tmp_path / "data")
    tree["training"]["epochs"] = 1
    tree["search"]["space"] = {"training.optimizer.lr": {"grid": [1.0e-3, FAILING_LR]}}
    tree["search"]["evaluate_top"] = 2  # both would be scored if the failed one counted as finished
    # One trial at a time (each takes both CPUs), the finishing one first: the failing trial's error stops Tune, and a
    # trial still running beside it would be stopped with it, a race the test is not about.
    tree["parallelism"]["resources_per_trial"] = {"cpu": 2}
    spec = validate_spec(tree)
    try:
        outcome = run_search(spec, tmp_path / "out", progress=False,
                             trainable=trial_failing_where_its_error_cannot_be_written)
    finally:
        locked = [p for session in ray_sessions() for p in session.glob("artifacts/*/*/driver_artifacts/*")
                  if immutable(p)]
        for folder in locked:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
    assert locked, "no staging folder was made immutable: the test did not test anything"
    assert not (Path(locked[0]) / "error.txt").exists()  # Tune could not write the trial's error

    assert outcome.failed == 1 and len(outcome.failed_trials) == 1
    assert print_search(spec, outcome, tmp_path / "out") == 1
    printed = capsys.readouterr()
    assert "2 trial(s), 1 failed" in printed.out and outcome.failed_trials[0] in printed.err
    by_status = {row["status"]: row for row in outcome.results.to_dict("records")}
    assert set(by_status) == {"FINISHED", "FAILED"}

    client = MlflowClient(outcome.tracking_uri)
    parent = client.get_run(outcome.parent_run_id)
    runs = {run.data.tags["distmis.trial_id"]: run for run in trial_runs(client, parent)}
    failed, finished = runs[outcome.failed_trials[0]], next(r for t, r in runs.items() if t != outcome.failed_trials[0])
    assert float(failed.data.params["training.optimizer.lr"]) == FAILING_LR and failed.info.status == "FAILED"
    assert not any(key.startswith("test_") for key in failed.data.metrics), outcome.problems  # not scored
    assert any(key.startswith("test_dice") for key in finished.data.metrics), outcome.problems
    assert parent.data.metrics["failed_trials"] == 1
    assert parent.data.tags["distmis.model_trial"] == finished.data.tags["distmis.trial_id"]  # not published
    assert client.get_model_version_by_alias("tiny", "best").run_id == finished.info.run_id
