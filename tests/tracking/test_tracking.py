from __future__ import annotations

import math

import pandas as pd

from distmis.tracking.mlflow_tracking import error_summary, flatten, trial_run_name
from distmis.tracking.results import format_results, short_name


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}}) == {"a.b": 1, "a.c.d": [1, 2], "e": {}}


def test_error_summary_picks_the_cause():
    trace = (
        "Failure # 1\nray.exceptions.RayTaskError(NonFiniteLossError): ray::f()\n"
        "  File \"x.py\", line 3\n    raise NonFiniteLossError('loss nan')\n"
        "distmis.train.tf_unet.NonFiniteLossError: training loss became nan at epoch 2\n"
    )
    assert error_summary(trace) == "distmis.train.tf_unet.NonFiniteLossError: training loss became nan at epoch 2"
    assert error_summary(None) == "unknown error"
    spec_error = ("Traceback ...\n  raise SpecError(source, problems)\n"
                  "distmis.spec.load.SpecError: invalid search spec trial config:\n"
                  "  - model.params: norm_groups (4) must divide base_filters (6)\n")
    assert error_summary(spec_error) == ("distmis.spec.load.SpecError: invalid search spec trial config: "
                                         "- model.params: norm_groups (4) must divide base_filters (6)")


def test_short_name():
    assert short_name("training.optimizer.lr") == "lr"
    assert short_name("training.lr_schedule.name") == "lr_schedule.name"
    assert short_name("training.augment.enabled") == "augment.enabled"


def test_formats():
    frame = pd.DataFrame([
        {"trial": "a", "status": "FINISHED", "best_val_dice": 0.81234, "error": "", "run_id": "1"},
        {"trial": "b", "status": "FAILED", "best_val_dice": math.nan, "error": "Boom: x", "run_id": "2"},
    ])
    table = format_results(frame, "table")
    assert "0.8123" in table and "Boom" in table and "run_id" not in table
    assert "NaN" not in table and "nan" not in table  # a trial without a value shows a blank
    md = format_results(frame, "markdown")
    assert md.splitlines()[0] == "| trial | status | best_val_dice | error | run_id |"
    assert "| a | FINISHED | 0.8123 |  | 1 |" in md
    assert format_results(frame, "csv").splitlines()[0] == "trial,status,best_val_dice,error,run_id"


def test_redact_uri():
    from distmis.tracking.uri import redact_uri

    assert redact_uri("postgresql://alice:s3cret@db:5432/mlflow") == "postgresql://alice:***@db:5432/mlflow"
    assert redact_uri("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"
    assert redact_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"


def test_trial_run_name_says_which_trial():
    config = {"training.optimizer.lr": 0.005, "model.params.norm": "group", "training.batch_size": 2}
    assert trial_run_name("85d81_00003", config) == "00003 lr=0.005 norm=group batch_size=2"
    assert trial_run_name("85d81_00000", {}) == "00000"


def test_the_inference_table_holds_the_trials_that_compared():
    from distmis.tracking.results import inference_frame

    nan = math.nan
    results = pd.DataFrame([
        {"trial": "a", "status": "FINISHED", "base_filters": 8, "tile": "null", "best_val_dice": 0.95, "best_epoch": 4,
         "whole_volume_dice": 0.95, "whole_volume_seconds": 0.5, "sliding_window_dice": nan,
         "sliding_window_seconds": nan, "epochs": 8, "num_params": "403089"},
        {"trial": "b", "status": "FINISHED", "base_filters": 8, "tile": "[32, 32, 32]", "best_val_dice": 0.84,
         "best_epoch": 6, "whole_volume_dice": 0.84, "whole_volume_seconds": 0.45, "sliding_window_dice": 0.83,
         "sliding_window_seconds": 0.83, "epochs": 8, "num_params": "403089"},
        {"trial": "c", "status": "ERROR", "base_filters": 16, "tile": "null", "best_val_dice": nan, "best_epoch": None,
         "whole_volume_dice": nan, "whole_volume_seconds": nan, "sliding_window_dice": nan,
         "sliding_window_seconds": nan, "epochs": 0, "num_params": None},
    ])
    table = inference_frame(results)
    assert list(table["trial"]) == ["a", "b"]  # the failed trial timed nothing
    assert list(table.columns) == ["trial", "base_filters", "tile", "best_val_dice", "num_params", "whole_volume_dice",
                                   "whole_volume_seconds", "sliding_window_dice", "sliding_window_seconds"]
    assert inference_frame(results.drop(columns=[c for c in results if "volume" in c or "window" in c])).empty
