"""Searches on a multi-node Ray cluster simulated on this machine (``ray.cluster_utils.Cluster``):
a head with no CPUs and two worker nodes of one CPU each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a simulated 3-node Ray cluster

REPO = Path(__file__).resolve().parents[2]


def test_trials_spread_over_nodes_and_a_data_parallel_trial_spans_them(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tests.search.multinode_search", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=540)
    lines = [line for line in result.stdout.splitlines() if line.startswith("MULTINODE ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(lines[-1].removeprefix("MULTINODE "))
    workers = set(report["worker_nodes"])
    assert len(workers) == 2

    experiment = report["experiment"]
    assert experiment["trials"] == 2 and experiment["failed"] == 0
    # One trial per worker node: each node holds one CPU, a trial needs it.
    assert sorted(experiment["trial_nodes"]) == sorted(workers), experiment

    data = report["data"]
    assert data["trials"] == 1 and data["failed"] == 0
    assert len(data["train_worker_nodes"]) == 2 and set(data["train_worker_nodes"]) == workers, data
