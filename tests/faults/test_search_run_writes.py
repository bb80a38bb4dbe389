"""The search's own run writes through the resilient writer (issue 32, item 8): a store that refuses writes for a
while (here a real sqlite file made immutable with ``chattr +i``) delays the parent run's params, tags, artifacts and
metrics, in order; none raises, and all land once the store takes writes again."""

from __future__ import annotations

import subprocess
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from distmis.tracking.mlflow_tracking import SearchRun  # noqa: E402


def chattr(flag: str, path: Path) -> bool:
    return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0


def test_a_read_only_store_delays_the_search_runs_writes_and_loses_none(tmp_path: Path):
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    run = SearchRun(uri, "tiny", run_name="tiny", searched=[], metric="val_dice", mode="max",
                    artifact_location=(tmp_path / "artifacts").as_uri())
    run.writer.backoff, run.writer.retry_every = (0.05,), 0.0  # retry at once: the test waits on nothing
    assert chattr("+i", db), "chattr +i needs CAP_LINUX_IMMUTABLE (root on ext4 here): the store cannot be made read-only"
    try:
        run.log_params({"training.epochs": 2})
        run.set_tag("distmis.layout", "experiment-parallel")
        run.log_metrics({"trials": 2})
        figure = plt.figure()
        run.log_figure(figure, "curves.png")
        run.log_text("a,b\n", "results.csv")
        assert len(run.writer.pending) == 5 and run.writer.failed_attempts > 0  # held, in order, none raised
        assert not plt.fignum_exists(figure.number)  # the figure was drawn and closed at once
    finally:
        assert chattr("-i", db)
    run.finish("FINISHED", timeout=30)
    assert not run.writer.pending
    got = MlflowClient(uri).get_run(run.run_id)
    assert got.info.status == "FINISHED"
    assert got.data.params["training.epochs"] == "2" and got.data.tags["distmis.layout"] == "experiment-parallel"
    assert got.data.metrics["trials"] == 2 and "elapsed_seconds" in got.data.metrics
    names = {a.path for a in MlflowClient(uri).list_artifacts(run.run_id)}
    assert {"curves.png", "results.csv"} <= names
