"""Figures logged to MLflow, drawn from a real sqlite store."""

from __future__ import annotations

from pathlib import Path

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from distmis.tracking.figures import learning_curves_figure
from distmis.tracking.mlflow_tracking import PARENT_TAG, SEARCHED_TAG


def test_learning_curves_are_labelled_once_by_the_trial_run_name(tmp_path: Path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("figures", artifact_location=(tmp_path / "artifacts").as_uri())
    parent = client.create_run(experiment, run_name="search", tags={SEARCHED_TAG: '["training.optimizer.lr"]'})
    for name, status, values in (("00000 lr=0.001", "FINISHED", [0.2, 0.5]), ("00001 lr=0.005", "FAILED", [0.3])):
        run = client.create_run(experiment, run_name=name, tags={PARENT_TAG: parent.info.run_id})
        client.log_batch(run.info.run_id, params=[], metrics=[Metric("val_dice", v, 0, step)
                                                             for step, v in enumerate(values, start=1)])
        client.log_param(run.info.run_id, "training.optimizer.lr", name.rsplit("=", 1)[-1])
        client.set_terminated(run.info.run_id, status)
    figure = learning_curves_figure(client, client.get_run(parent.info.run_id), "val_dice")
    axes = figure.axes[0]
    labels = sorted(text.get_text() for text in axes.get_legend().get_texts())
    assert labels == ["00000 lr=0.001 (finished)", "00001 lr=0.005 (failed)"]
    curves = {line.get_label(): list(line.get_ydata()) for line in axes.get_lines()}
    assert curves["00000 lr=0.001 (finished)"] == [0.2, 0.5]
