"""A repeated comparison's speedup table read back from MLflow, and its figure's error bars."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.container import ErrorbarContainer
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from distmis.tracking.figures import speedup_figure
from distmis.tracking.mlflow_tracking import METRIC_TAG, PARENT_TAG, RESUMES_TAG, ROLE_TAG
from distmis.tracking.results import REPEAT_TAG, comparison_frame, speedup_table

# (mode, workers, repeat or None: a run from before repeats, seconds, status, resumed)
CELL_RUNS = [
    ("experiment", 1, None, 100.0, "FINISHED", False),
    ("data", 1, None, 90.0, "FINISHED", False),
    ("data", 2, None, 60.0, "FINISHED", False),
    ("experiment", 2, None, 50.0, "FINISHED", False),
    ("experiment", 1, 2, 120.0, "FINISHED", False),
    ("data", 1, 2, 80.0, "FINISHED", False),
    ("data", 2, 2, 5.0, "FINISHED", True),  # resumed: its seconds are only the part after the resume
    ("experiment", 2, 2, 40.0, "FINISHED", False),
    ("experiment", 1, 3, 110.0, "FINISHED", False),
    ("data", 1, 3, 70.0, "FAILED", False),
    ("data", 2, 3, 35.0, "FINISHED", False),
    ("experiment", 2, 3, 55.0, "FINISHED", False),
]


def test_the_comparison_table_is_rebuilt_from_the_repeats_runs(tmp_path: Path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("compare", artifact_location=(tmp_path / "artifacts").as_uri())
    parent = client.create_run(experiment, run_name="tiny compare", tags={ROLE_TAG: "compare", METRIC_TAG: "val_dice"})
    cells = []
    for mode, workers, repeat, seconds, status, resumed in CELL_RUNS:
        tags = {PARENT_TAG: parent.info.run_id, "distmis.compare.mode": mode, "distmis.compare.workers": str(workers)}
        if repeat is not None:
            tags[REPEAT_TAG] = str(repeat)
        if resumed:
            tags[RESUMES_TAG] = "1"
        run = client.create_run(experiment, run_name=f"{mode} x{workers} #{repeat or 1}", tags=tags)
        if status == "FINISHED":
            metrics = {"search_seconds": seconds, "trials": 2, "failed_trials": 0, "best_val_dice": 0.5 + seconds / 1000}
            client.log_batch(run.info.run_id, metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()])
        client.set_terminated(run.info.run_id, status)
        cell_status = "RESUMED" if resumed else status
        cells.append({"mode": mode, "workers": workers, "repeat": repeat or 1,
                      "elapsed_s": math.nan if resumed or status != "FINISHED" else seconds,
                      "best_val_dice": 0.5 + seconds / 1000 if status == "FINISHED" else math.nan,
                      "trials": 2 if status == "FINISHED" else 0, "failed_trials": 0, "status": cell_status})
    table = comparison_frame(client, client.get_run(parent.info.run_id))
    pd.testing.assert_frame_equal(table, speedup_table(cells))  # as run_compare computed it from its cells

    rows = table.set_index(["mode", "workers"])
    assert rows["repeats"].to_dict() == {("experiment", 1): 3, ("experiment", 2): 3, ("data", 1): 2, ("data", 2): 2}
    # data x2: repeat 2 resumed (no time), repeat 3's baseline failed: only repeat 1 gives a speedup.
    assert rows.loc[("data", 2), "elapsed_s"] == pytest.approx(47.5)
    assert rows.loc[("data", 2), "speedup"] == pytest.approx(1.5) and math.isnan(rows.loc[("data", 2), "speedup_std"])
    assert rows.loc[("data", 2), "status"] == "FINISHED, #2 RESUMED"
    assert rows.loc[("data", 1), "status"] == "FINISHED, #3 FAILED"
    paired = pd.Series([100 / 50, 120 / 40, 110 / 55])
    assert rows.loc[("experiment", 2), "speedup"] == pytest.approx(paired.mean())
    assert rows.loc[("experiment", 2), "speedup_std"] == pytest.approx(paired.std(ddof=1))


def repeated_table() -> pd.DataFrame:
    def cell(mode: str, workers: int, repeat: int, seconds: float) -> dict:
        return {"mode": mode, "workers": workers, "repeat": repeat, "elapsed_s": seconds, "best_val_dice": 0.8,
                "trials": 2, "failed_trials": 0, "status": "FINISHED"}

    return speedup_table([
        cell("experiment", 1, 1, 100.0), cell("data", 1, 1, 90.0), cell("data", 2, 1, 60.0),
        cell("experiment", 2, 1, 50.0), cell("experiment", 1, 2, 120.0), cell("data", 1, 2, 80.0),
        cell("data", 2, 2, 50.0), cell("experiment", 2, 2, 40.0),
    ])


def bars(ax) -> list[tuple[float, float, float]]:
    """``(x, low, high)`` of every error bar drawn on ``ax``."""
    out = []
    for container in ax.containers:
        if isinstance(container, ErrorbarContainer):
            for collection in container.lines[2]:
                out += [(float(s[0][0]), float(s[0][1]), float(s[1][1])) for s in collection.get_segments()]
    return sorted(out)


def test_the_speedup_figure_draws_plus_minus_one_std_where_repeats_finished():
    table = repeated_table()
    figure = speedup_figure(table, title="repeated")
    ax_time, ax_speed = figure.axes
    expected_time = []
    expected_speed = []
    for _, row in table.iterrows():
        expected_time.append((row["workers"], row["elapsed_s"] - row["elapsed_s_std"],
                              row["elapsed_s"] + row["elapsed_s_std"]))
        expected_speed.append((row["workers"], row["speedup"] - row["speedup_std"], row["speedup"] + row["speedup_std"]))
    assert np.allclose(bars(ax_time), sorted(expected_time))
    assert np.allclose(bars(ax_speed), sorted(expected_speed))
    assert bars(ax_speed)[-1][2] > bars(ax_speed)[-1][1]  # experiment x2: 2.0 and 3.0, a visible spread
    assert "mean ± std" in ax_time.get_title()


def test_the_speedup_figure_has_no_error_bars_without_a_spread():
    one_repeat = speedup_table([
        {"mode": mode, "workers": n, "elapsed_s": 100.0 / n, "best_val_dice": 0.8, "trials": 2,
         "failed_trials": 0, "status": "FINISHED"} for mode in ("experiment", "data") for n in (1, 2)])
    figure = speedup_figure(one_repeat)
    assert all(not bars(ax) for ax in figure.axes)
    assert [list(line.get_ydata()) for line in figure.axes[1].get_lines()][:2] == [[1.0, 2.0], [1.0, 2.0]]
    # A repeated table where one repeat of a cell finished: that point has no bar, the others have theirs.
    table = repeated_table()
    table.loc[(table["mode"] == "data") & (table["workers"] == 2), ["speedup_std", "elapsed_s_std"]] = math.nan
    xs = [x for x, _, _ in bars(speedup_figure(table).axes[1])]
    assert sorted(xs) == [1.0, 1.0, 2.0]
