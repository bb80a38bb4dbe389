"""A search's data as MLflow dataset inputs, and a trial's system samples as MLflow system metrics, written by the
driver's callback into a real sqlite store and read back through MLflow's client: what the UI's "Dataset" column
and "System metrics" tab show."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mlflow.data.schema import TensorDatasetSchema
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from distmis.data.split import fold_parts
from distmis.spec import validate_spec
from distmis.spec.load import CONFIGURATION_KEY, FOLD_KEY
from distmis.tracking.datasets import CONTEXT_TAG, PART_TAG, TrackedData
from distmis.tracking.mlflow_tracking import SearchRun
from distmis.trial.record import SYSTEM_KEY, SystemSample, samples_to_json
from tests.conftest import small_spec_tree


def manifest(parts: dict[str, int], split: dict[str, Any]) -> dict[str, Any]:
    """A TFRecord manifest as ``convert_to_tfrecords`` writes it, for parts of the given case counts."""
    splits = {name: {"num_cases": n, "case_ids": [f"{name}_{i}" for i in range(n)],
                     "shards": [{"file": f"{name}-00000-of-00001.tfrecord", "num_cases": n,
                                 "sha256": hashlib.sha256(name.encode()).hexdigest()}]}
              for name, n in parts.items()}
    return {"format_version": 3, "image_shape": [16, 16, 16, 4], "label_shape": [16, 16, 16, 1],
            "image_dtype": "float32", "label_dtype": "uint8", "channels": ["FLAIR", "T1w", "t1gd", "T2w"],
            "targets": {"activation": "sigmoid", "channels": [{"name": "whole tumour"}]},
            "dataset": {"name": "BRATS"}, "splits": splits, "split": split}


def tracked(data: dict[str, Any], source: Path) -> TrackedData:
    split = data["split"]
    folds = range(len(split["folds"])) if "folds" in split else [None]
    return TrackedData.from_manifest(data, source=source, tfrecord_dir=source.parent / "tfrecords" / "0123456789abcdef",
                                     trial_parts={fold: fold_parts(split, fold) for fold in folds})


def trial(trial_id: str, config: dict[str, Any]) -> Any:
    return SimpleNamespace(trial_id=trial_id, config=config, last_result={}, error_file=None, get_error=lambda: None)


def inputs(run: Run) -> dict[str, tuple[str, str, str]]:
    """A run's dataset inputs, ``{part: (context, name, digest)}``."""
    out = {}
    for item in run.inputs.dataset_inputs:
        tags = {tag.key: tag.value for tag in item.tags}
        out[tags[PART_TAG]] = (tags[CONTEXT_TAG], item.dataset.name, item.dataset.digest)
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One sqlite store for the module (each test in its own experiment): creating one takes seconds."""
    return f"sqlite:///{tmp_path_factory.mktemp('datasets') / 'mlflow.db'}"


def test_the_search_and_each_trial_record_the_parts_they_use_as_dataset_inputs(tmp_path: Path, store: str):
    spec = validate_spec(small_spec_tree(tmp_path / "BRATS"))
    data = tracked(manifest({"train": 3, "val": 2, "test": 1}, {"train": [], "val": [], "test": []}),
                   tmp_path / "BRATS")
    run = SearchRun(store, "inputs", run_name="tiny", searched=["training.optimizer.lr"], metric="val_dice",
                    mode="max")
    run.log_inputs(data.search_inputs())
    callback = run.trial_callback(spec, data=data)
    t = trial("t_00000", {"training.optimizer.lr": 1e-3})
    callback.on_trial_start(0, [], t)
    callback.on_trial_complete(0, [], t)
    run.log_inputs(data.test_inputs(), run_id=callback.run_ids["t_00000"])  # scored on the test split
    run.log_inputs(data.test_inputs(), run_id=callback.run_ids["t_00000"])  # again (a resumed search's end): once
    assert callback.close() and run.writer.close()

    client = MlflowClient(store)
    digests = {part: hashlib.sha256(hashlib.sha256(part.encode()).hexdigest().encode()).hexdigest()[:10]
               for part in ("train", "val", "test")}  # of the part's shards' recorded sha256
    searched = client.get_run(run.run_id)
    assert inputs(searched) == {part: (part, "BRATS", digests[part]) for part in ("train", "val", "test")}
    trial_run = client.get_run(callback.run_ids["t_00000"])
    assert inputs(trial_run) == {"train": ("train", "BRATS", digests["train"]), "val": ("val", "BRATS", digests["val"]),
                                 "test": ("test", "BRATS", digests["test"])}

    dataset = next(item.dataset for item in trial_run.inputs.dataset_inputs if item.dataset.digest == digests["val"])
    assert dataset.source_type == "local" and json.loads(dataset.source) == {"uri": str((tmp_path / "BRATS").resolve())}
    schema = TensorDatasetSchema.from_dict(json.loads(dataset.schema))
    [image], [label] = schema.features.inputs, schema.targets.inputs
    assert (image.name, image.shape, str(image.type)) == ("image", (-1, 16, 16, 16, 4), "float32")
    assert (label.name, label.shape, str(label.type)) == ("label", (-1, 16, 16, 16, 1), "uint8")
    profile = json.loads(dataset.profile)
    assert profile["num_cases"] == 2 and profile["fingerprint"] == "0123456789abcdef"
    assert profile["channels"] == ["FLAIR", "T1w", "t1gd", "T2w"] and profile["targets"] == ["whole tumour"]
    # what MLflow's search finds by them
    found = client.search_runs([searched.info.experiment_id], filter_string="dataset.context = 'val'")
    assert {r.info.run_id for r in found} == {run.run_id, trial_run.info.run_id}


def test_a_fold_trial_trains_on_the_other_folds_and_its_configuration_holds_them_all(tmp_path: Path, store: str):
    tree = small_spec_tree(tmp_path / "BRATS")
    tree["dataset"]["split"] = {"folds": 3, "test": 0.25, "seed": 0}
    spec = validate_spec(tree)
    data = tracked(manifest({"fold0": 2, "fold1": 2, "fold2": 1, "test": 1}, {"folds": [[], [], []], "test": []}),
                   tmp_path / "BRATS")
    run = SearchRun(store, "cv", run_name="cv", searched=["training.optimizer.lr"], metric="val_dice", mode="max")
    callback = run.trial_callback(spec, data=data)
    t = trial("t_00001", {"training.optimizer.lr": 1e-3, CONFIGURATION_KEY: "c000", FOLD_KEY: 1})
    callback.on_trial_start(0, [], t)
    assert callback.close()
    client = MlflowClient(store)
    contexts = {part: context for part, (context, _, _) in inputs(client.get_run(callback.run_ids["t_00001"])).items()}
    assert contexts == {"fold0": "train", "fold2": "train", "fold1": "val"}
    configuration = client.get_run(callback.configuration_runs["c000"])
    assert {part: context for part, (context, _, _) in inputs(configuration).items()} == {
        "fold0": "fold0", "fold1": "fold1", "fold2": "fold2"}


def test_a_trials_system_samples_become_mlflows_system_metrics_at_their_own_times(tmp_path: Path, store: str):
    spec = validate_spec(small_spec_tree(tmp_path / "data"))
    run = SearchRun(store, "system", run_name="tiny", searched=["training.optimizer.lr"], metric="val_dice",
                    mode="max")
    callback = run.trial_callback(spec)
    t = trial("t_00000", {"training.optimizer.lr": 1e-3})
    callback.on_trial_start(0, [], t)
    # more figures than one MLflow batch takes (1,000), a NaN among them
    first = [SystemSample(1_000_000 + 5_000 * i, {"cpu_utilization_percentage": 10.0 + i,
                                                   "rank0_memory_usage_megabytes": 100.0,
                                                   "rank1_memory_usage_megabytes": 90.0,
                                                   "gpu_0_utilization_percentage": math.nan if i == 3 else 50.0})
             for i in range(300)]
    later = [SystemSample(9_000_000, {"cpu_utilization_percentage": 99.0})]
    base = {"train_loss": 1.0, "val_loss": 1.0, "val_dice": 0.1, "epoch_seconds": 1.0, "attempt": "a"}
    callback.on_trial_result(0, [], t, {**base, "epoch": 1, SYSTEM_KEY: samples_to_json(first)})
    callback.on_trial_result(0, [], t, {**base, "epoch": 2, SYSTEM_KEY: samples_to_json(later)})
    callback.on_trial_complete(0, [], t)
    assert callback.close()

    client = MlflowClient(store)
    run_id = callback.run_ids["t_00000"]
    cpu = sorted(client.get_metric_history(run_id, "system/cpu_utilization_percentage"), key=lambda m: m.timestamp)
    assert [(m.timestamp, m.value, m.step) for m in cpu] == [
        *((1_000_000 + 5_000 * i, 10.0 + i, 1) for i in range(300)), (9_000_000, 99.0, 2)]
    assert len(client.get_metric_history(run_id, "system/rank1_memory_usage_megabytes")) == 300
    assert len(client.get_metric_history(run_id, "system/gpu_0_utilization_percentage")) == 299  # no NaN
    metrics = client.get_run(run_id).data.metrics
    assert SYSTEM_KEY not in metrics and metrics["system/cpu_utilization_percentage"] == 99.0
