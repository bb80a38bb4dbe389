"""SIGTERM stops a real `distmis run` honestly: exit 143, and no MLflow run left RUNNING.

Ctrl-C (SIGINT, exit 130) is tests/faults/test_ctrl_c.py's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from distmis.tracking.results import find_search_run, trial_runs
from tests.conftest import has_epoch_metric, small_spec_tree

pytestmark = pytest.mark.slow  # a real search in its own process, with its own local Ray

ROOT = Path(__file__).resolve().parents[2]


def wait_for_a_metric(db: Path, process: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        if has_epoch_metric(db):
            return
        time.sleep(0.5)
    raise AssertionError("no trial reported an epoch in time")


# SIGTERM here; Ctrl-C (SIGINT, 130) in the same phase is tests/faults/test_ctrl_c.py's trials phase, which asserts
# the same (the signal named, the search's and the trial's runs KILLED) and more.
@pytest.mark.parametrize("signum, exit_code", [(signal.SIGTERM, 143)])
def test_a_signal_marks_the_search_and_its_unfinished_trials_killed(tmp_path: Path, signum: int, exit_code: int):
    tree = small_spec_tree(tmp_path / "data")
    tree["model"]["framework"] = "torch"  # the driver's matter: a driver and trial without TensorFlow start sooner
    tree["training"]["epochs"] = 500  # far longer than the test waits
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(tree))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    process = subprocess.Popen([sys.executable, "-m", "distmis", "run", str(tmp_path / "spec.yaml"), "--output",
                                str(tmp_path / "out"), "--quiet"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        wait_for_a_metric(tmp_path / "out" / "mlflow.db", process)
        process.send_signal(signum)
        _, err = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == exit_code, err[-3000:]
    assert "interrupted" in err and signal.Signals(signum).name in err
    client = MlflowClient(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    parent = find_search_run(client, "tiny")
    assert parent.info.status == "KILLED"
    trials = trial_runs(client, parent)
    assert trials and all(run.info.status == "KILLED" for run in trials), [r.info.status for r in trials]
