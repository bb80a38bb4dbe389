"""Experiment-parallel search: many trials at once, each on its own share of the cluster.

:func:`run_search` is the whole job behind ``distmis run``: prepare the data, connect to Ray,
open the MLflow parent run, run the Ray Tune ``Tuner``, and read the results back from MLflow.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import yaml

from distmis.orchestration.prepare import PreparedData, prepare_data
from distmis.orchestration.search_space import num_trials, param_space, scheduler, search_algorithm
from distmis.orchestration.trainable import unet_trial
from distmis.spec.load import spec_to_dict
from distmis.spec.schema import Spec
from distmis.tracking.mlflow_tracking import SearchRun, default_tracking_uri, flatten
from distmis.tracking.figures import learning_curves_figure
from distmis.tracking.results import format_results, results_frame
from distmis.tracking.uri import redact_uri

logger = logging.getLogger(__name__)

# Environment every trial process starts with (quiet TensorFlow, Keras on TF).
TRIAL_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow", "PYTHONUNBUFFERED": "1"}


@dataclass(frozen=True)
class SearchOutcome:
    results: pd.DataFrame
    failed: int
    elapsed_seconds: float
    tracking_uri: str
    experiment: str
    parent_run_id: str
    data: PreparedData

    @property
    def best(self) -> dict[str, Any] | None:
        ok = self.results[self.results["status"] == "FINISHED"] if not self.results.empty else self.results
        return None if ok.empty else ok.iloc[0].to_dict()


def connect_ray(address: str | None = None) -> bool:
    """Start a local Ray (or join ``address``) unless one is already up. True if this call started it."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(
        address=address,
        include_dashboard=False,
        runtime_env={"env_vars": TRIAL_ENV},
        logging_level=logging.WARNING,
    )
    return True


def run_search(
    spec: Spec,
    output_dir: str | Path,
    *,
    address: str | None = None,
    progress: bool = True,
    trainable: Callable[..., None] = unet_trial,
) -> SearchOutcome:
    """Run the spec's search experiment-parallel and return the results table (best first).

    ``trainable`` is the Tune function run for each trial; it is called as
    ``trainable(config, base_spec=..., tfrecord_dir=...)``.
    """
    from ray import tune

    output_dir = Path(output_dir).resolve()
    created = not output_dir.exists()
    try:
        data = prepare_data(spec, output_dir, progress=progress)
    except BaseException:
        if created and output_dir.exists():  # leave nothing half-written behind
            shutil.rmtree(output_dir)
        raise

    tracking_uri = spec.tracking.uri or default_tracking_uri(output_dir)
    artifact_location = None if spec.tracking.uri else (output_dir / "mlartifacts").as_uri()
    search_run = SearchRun(
        tracking_uri,
        spec.experiment_name,
        run_name=spec.name,
        searched=list(spec.search.space),
        metric=spec.search.metric,
        mode=spec.search.mode,
        artifact_location=artifact_location,
    )
    base_spec = spec_to_dict(spec)
    # The spec's fields as params, except the search space (a tag) and the tracking URI (may hold credentials).
    search_run.log_params({k: v for k, v in flatten(base_spec).items() if not k.startswith(("search.space", "tracking.uri"))})
    logged_spec = spec_to_dict(spec)
    if logged_spec["tracking"]["uri"]:
        logged_spec["tracking"]["uri"] = redact_uri(logged_spec["tracking"]["uri"])
    search_run.log_text(yaml.safe_dump(logged_spec, sort_keys=False), "spec.yaml")
    search_run.log_dict(data.split, "split.json")
    search_run.log_dict(data.manifest, "tfrecord_manifest.json")

    # One checkpoint per improved epoch with num_to_keep=1 makes Tune warn about snapshot frequency; expected here.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    started_ray = connect_ray(address)
    status = "FAILED"
    try:
        resources = spec.parallelism.resources_per_trial
        trial_fn = tune.with_resources(
            tune.with_parameters(trainable, base_spec=base_spec, tfrecord_dir=str(data.tfrecord_dir)),
            {"cpu": resources.cpu, "gpu": resources.gpu},
        )
        tuner = tune.Tuner(
            trial_fn,
            param_space=param_space(spec.search),
            tune_config=tune.TuneConfig(
                metric=spec.search.metric,
                mode=spec.search.mode,
                num_samples=spec.search.num_samples,
                search_alg=search_algorithm(spec),
                scheduler=scheduler(spec),
                max_concurrent_trials=spec.parallelism.max_concurrent_trials,
            ),
            run_config=tune.RunConfig(
                name=f"{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}",
                storage_path=str(output_dir / "ray_results"),
                callbacks=[search_run.trial_callback(base_spec)],
                checkpoint_config=tune.CheckpointConfig(
                    num_to_keep=1,
                    checkpoint_score_attribute=spec.search.metric,
                    checkpoint_score_order=spec.search.mode,
                ),
                failure_config=tune.FailureConfig(max_failures=0),
                verbose=1 if progress else 0,
            ),
        )
        logger.info("running %d trial(s) of %s", num_trials(spec.search), spec.name)
        grid = tuner.fit()
        failed = len(grid.errors)
        status = "FINISHED"
    finally:
        if started_ray:
            import ray

            ray.shutdown()
        if status != "FINISHED":
            search_run.finish("FAILED")

    client = search_run.client
    parent = client.get_run(search_run.run_id)
    results = results_frame(client, parent)
    search_run.log_text(format_results(results, "csv"), "results.csv")
    search_run.log_text(format_results(results, "markdown"), "results.md")
    search_run.log_figure(learning_curves_figure(client, parent, "val_dice"), "val_dice_curves.png")
    if failed < len(results):
        _log_best_overlay(search_run, grid, base_spec, data)
    search_run.log_metrics({"trials": len(results), "failed_trials": failed})
    best_column = results.get(f"best_{spec.search.metric}")
    if best_column is not None and best_column.notna().any():
        search_run.log_metrics({f"best_{spec.search.metric}": float(best_column.iloc[0])})
    elapsed = search_run.finish("FINISHED")
    return SearchOutcome(results, failed, elapsed, tracking_uri, spec.experiment_name, search_run.run_id, data)


def _log_best_overlay(search_run: SearchRun, grid: Any, base_spec: dict[str, Any], data: PreparedData) -> None:
    """Predict the first validation case with the best trial's best checkpoint; log the overlay PNG.

    A picture for the MLflow UI, not part of the results: a failure here is logged, not raised.
    """
    try:
        from distmis.orchestration.trainable import trial_spec
        from distmis.tracking.figures import segmentation_overlay_figure
        from distmis.train.metrics import dice_score
        from distmis.train.tf_unet import UNetTrainer

        best = grid.get_best_result(scope="all")
        checkpoint = best.get_best_checkpoint(search_run.metric, search_run.mode) or best.checkpoint
        if checkpoint is None:
            return
        trainer = UNetTrainer(trial_spec(base_spec, best.config), data.tfrecord_dir)
        with checkpoint.as_directory() as directory:
            trainer.model.load_weights(Path(directory) / "model.weights.h5")
        case_id, image, label = trainer.val_cases[0]
        prob = trainer.predict_volume(image)
        title = f"best trial, validation case {case_id}: dice {dice_score(prob, label):.3f}"
        search_run.log_figure(segmentation_overlay_figure(image, label, prob, title=title), "best_trial_overlay.png")
    except Exception:  # noqa: BLE001
        logger.warning("could not draw the segmentation overlay of the best trial", exc_info=True)


def default_output_dir(spec: Spec) -> Path:
    return Path(os.environ.get("DISTMIS_OUTPUT", "runs")) / spec.name
