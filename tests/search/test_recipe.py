"""A search over the training recipe (augmentation on/off x two learning-rate schedules), end to end on a local
Ray with a test split: issue 13's search, as search_spaces/recipe.yaml runs it at full size."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from distmis.search.run import run_search
from distmis.spec import load_spec
from distmis.tracking.results import find_search_run, trial_runs

RECIPE = Path(__file__).parents[2] / "search_spaces" / "recipe.yaml"


def test_a_search_over_augmentation_and_schedules_scores_every_trial_on_the_test_split(ray_local, tmp_path: Path):
    """The torch U-Net's (the Keras trainer's augmentation and schedules: tests/train/test_tf_unet.py,
    tests/train/test_schedules.py and tests/data/test_tfrecord.py, the TensorFlow input pipeline's augmentation)."""
    spec = load_spec(RECIPE, {  # the shipped spec, made small
        "dataset.path": str(tmp_path / "data"), "dataset.synthetic.cases": 8, "dataset.synthetic.shape": [16, 16, 16],
        "model.framework": "torch", "model.params.base_filters": 4, "model.params.levels": 3,
        "training.epochs": 2, "training.tile": [8, 8, 8], "training.lr_schedule.warmup_epochs": 0,
    })
    outcome = run_search(spec, tmp_path / "out", progress=False)

    assert outcome.failed == 0
    table = outcome.results
    assert sorted(zip(table["augment.enabled"], table["lr_schedule.name"])) == [
        ("False", "cosine"), ("False", "cyclic"), ("True", "cosine"), ("True", "cyclic")]
    assert table["test_dice_WT"].notna().all() and table["test_dice_WT"].between(0, 1).all()  # evaluate_top: 4
    client = MlflowClient(outcome.tracking_uri)
    runs = trial_runs(client, find_search_run(client, spec.name))
    rates = {run.data.params["training.lr_schedule.name"]: [m.value for m in sorted(
        client.get_metric_history(run.info.run_id, "learning_rate"), key=lambda m: m.step)] for run in runs}
    peak = spec.training.optimizer.lr
    assert rates["cosine"] == pytest.approx([peak, peak * 0.5])  # half-way down the cosine at epoch 2 of 2
    assert rates["cyclic"] == pytest.approx([peak * 0.25, peak * 0.625])  # up the first 4-epoch cycle from 0.25
