"""The performance model against measurement in MLflow: the driver's callback logs a ViT-seg trial's predicted
FLOPs, memory and bytes (step 0) and its measured step time, peak memory and figure of merit per epoch, on a real
sqlite store."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from distmis.tracking.predicted import PREDICTED_METRICS, predict_trial
from distmis.spec import validate_spec
from distmis.spec.layout import SP_DEGREE_PATH, resolve_trial
from distmis.tracking.mlflow_tracking import EPOCH_METRICS, SearchRun
from tests.conftest import small_spec_tree

VIT = {"name": "vit-seg", "framework": "torch",
       "params": {"layers": 2, "embed_dim": 32, "heads": 4, "patch": 4, "decoder_features": 16}}


def vit_tree(data: Path | str, tile: tuple[int, int, int] | None = (16, 16, 16)) -> dict[str, Any]:
    tree = small_spec_tree(data, model=VIT)
    tree["training"]["tile"] = None if tile is None else list(tile)
    tree["search"]["space"] = {SP_DEGREE_PATH: {"grid": [1, 2]}}
    tree["parallelism"] = {"mode": "data", "workers": 1, "resources_per_worker": {"cpu": 1},
                           "sequence_parallel": {"attention": "ulysses"}}
    return tree


def trial(trial_id: str, config: dict[str, Any]) -> Any:
    return SimpleNamespace(trial_id=trial_id, config=config, last_result={"time_total_s": 3.0}, error_file=None,
                           get_error=lambda: None)


def result(epoch: int, **measured: float) -> dict[str, Any]:
    return {"epoch": epoch, "train_loss": 1.0 / epoch, "val_loss": 1.0 / epoch, "val_dice": epoch / 10,
            "epoch_seconds": 0.5, "learning_rate": 1e-3, "num_parameters": 7, "attempt": "a", **measured}


def search(tmp_path: Path, tree: dict[str, Any]) -> tuple[Any, SearchRun]:
    spec = validate_spec(tree)
    run = SearchRun(f"sqlite:///{tmp_path / 'mlflow.db'}", "tiny", run_name="tiny", searched=[SP_DEGREE_PATH],
                    metric="val_dice", mode="max")
    return spec, run


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_each_vit_trial_logs_its_layouts_predictions_and_its_measurements(tmp_path: Path):
    spec, run = search(tmp_path, vit_tree("/nonexistent/data"))
    callback = run.trial_callback(spec)
    trials = {sp: trial(f"t_0000{sp}", {SP_DEGREE_PATH: sp}) for sp in (1, 2)}
    for sp, t in trials.items():
        callback.on_trial_start(0, [], t)
        for epoch in (1, 2):
            callback.on_trial_result(0, [], t, result(epoch, step_seconds=0.25 * epoch / sp,
                                                      peak_memory_mb=10.0 / sp, fom=1e6 * sp / epoch))
        callback.on_trial_complete(0, [], t)
    assert callback.close()
    client = run.client
    for sp, t in trials.items():
        run_id = callback.run_ids[t.trial_id]
        expected = predict_trial(*resolve_trial(spec, {SP_DEGREE_PATH: sp}))
        assert set(expected) == set(PREDICTED_METRICS)
        for key, value in expected.items():
            assert history(client, run_id, key) == [(0, pytest.approx(value))], key
        assert history(client, run_id, "step_seconds") == [(1, 0.25 / sp), (2, 0.5 / sp)]
        assert history(client, run_id, "peak_memory_mb") == [(1, 10.0 / sp), (2, 10.0 / sp)]
        assert history(client, run_id, "fom") == [(1, 1e6 * sp), (2, 1e6 * sp / 2)]
    one, two = (client.get_run(callback.run_ids[t.trial_id]).data.metrics for t in trials.values())
    assert two["predicted_forward_flops"] < one["predicted_forward_flops"]  # SP=2 shares the encoder
    assert one["predicted_sent_mb"] == 0 < two["predicted_sent_mb"]
    assert {"step_seconds", "peak_memory_mb", "fom"} <= set(EPOCH_METRICS)


def test_the_driver_predicts_nothing_for_a_unet_trial(tmp_path: Path):
    """The performance model describes the ViT-seg alone; a U-Net's trainer reports its traced prediction itself
    (tests/train: the trainers' epoch metrics), which this result leaves out."""
    spec, run = search(tmp_path, small_spec_tree("/nonexistent/data"))
    callback = run.trial_callback(spec)
    t = trial("t_00000", {"training.optimizer.lr": 1e-3})
    callback.on_trial_start(0, [], t)
    callback.on_trial_result(0, [], t, result(1, step_seconds=0.1, peak_memory_mb=5.0))  # a torch U-Net's epoch
    assert callback.close()
    metrics = run.client.get_run(callback.run_ids["t_00000"]).data.metrics
    assert not any(key.startswith("predicted_") for key in metrics) and "fom" not in metrics
    assert metrics["step_seconds"] == 0.1 and metrics["peak_memory_mb"] == 5.0


def test_whole_volumes_are_predicted_from_the_volume_given_and_a_bad_one_only_warns(tmp_path: Path, caplog):
    data = tmp_path / "data"
    data.mkdir()  # the data exist: the spec alone no longer sizes the whole volumes the trials train on
    spec, run = search(tmp_path, vit_tree(data, tile=None))
    config = {SP_DEGREE_PATH: 2}
    sized = run.trial_callback(spec, volume=(16, 16, 16, 4))
    sized.on_trial_start(0, [], trial("t_00000", config))
    unsized = run.trial_callback(spec)
    unsized.on_trial_start(0, [], trial("t_00001", config))
    wrong = run.trial_callback(spec, volume=(18, 18, 18, 4))  # not a multiple of the patch: no prediction
    with caplog.at_level(logging.WARNING, logger="distmis.tracking.mlflow_tracking"):
        wrong.on_trial_start(0, [], trial("t_00002", config))
    assert "no performance-model prediction for trial t_00002" in caplog.text
    for callback in (sized, unsized, wrong):
        assert callback.close()
    predicted = {c: {k: v for k, v in run.client.get_run(c.run_ids[t]).data.metrics.items() if k.startswith("pred")}
                 for c, t in ((sized, "t_00000"), (unsized, "t_00001"), (wrong, "t_00002"))}
    tiled = validate_spec(vit_tree("/nonexistent/data"))  # 16^3 tiles: the same network input
    assert predicted[sized] == pytest.approx(predict_trial(*resolve_trial(tiled, config)))
    assert predicted[unsized] == {} and predicted[wrong] == {}
    assert run.client.get_run(wrong.run_ids["t_00002"]).data.params["trial.workers"] == "2"  # the run is whole
