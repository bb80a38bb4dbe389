"""A torch U-Net search whose trials are pipelined, end to end through ``distmis run``: Ray Tune drives Ray Train
worker groups of 2 gloo ranks that each hold one stage of the U-Net; MLflow records the pipeline."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import small_spec_tree
from tests.search.test_sequence_parallel_search import curve, run_spec, trial_runs

pytestmark = pytest.mark.slow


def test_one_and_two_stage_trials_follow_the_same_loss_curve(ray_local, tmp_path: Path, capsys):
    tree = small_spec_tree(tmp_path / "data", model={
        "name": "unet3d", "framework": "torch",
        "params": {"base_filters": 4, "levels": 3, "norm": "group", "norm_groups": 2}})
    tree["name"] = "tiny-pipeline"
    tree["dataset"]["synthetic"]["cases"] = 8  # 4 training cases: full batches of 2, as a pipeline takes
    tree["training"].update(epochs=2, batch_size=2)
    tree["search"] = {"algorithm": "grid", "space": {"parallelism.pipeline.stages": {"grid": [1, 2]}}}
    tree["parallelism"] = {"resources_per_worker": {"cpu": 1}, "pipeline": {"microbatches": 2, "schedule": "1f1b"}}
    client, runs = run_spec(tree, tmp_path, capsys)
    by_stages = {int(r.data.params["parallelism.pipeline.stages"]): r for r in trial_runs(runs)}
    assert sorted(by_stages) == [1, 2]
    for stages, run in by_stages.items():
        assert run.info.status == "FINISHED"
        assert run.data.params["trial.workers"] == str(stages)
        assert run.data.params["parallelism.pipeline.schedule"] == "1f1b"
        assert run.data.metrics["step_seconds"] > 0 and run.data.metrics["peak_memory_mb"] > 0
    # Same seed and data order, group norm and full batches: the pipeline's micro-batches give the batch's own
    # gradients, so both trials train the same weights.
    for metric in ("train_loss", "val_loss", "val_dice"):
        one, two = curve(client, by_stages[1], metric), curve(client, by_stages[2], metric)
        assert len(one) == len(two) == 2
        np.testing.assert_allclose(two, one, rtol=1e-4, atol=1e-5, err_msg=metric)
    assert curve(client, by_stages[1], "train_loss")[1] < curve(client, by_stages[1], "train_loss")[0]
    # the search ends in a registered model with test metrics, whichever trial won
    parent = next(r for r in runs if r.data.tags.get("distmis.role") == "search")
    assert any(key.startswith("test_") for key in parent.data.metrics)
