"""A search's output folder and its MLflow search run: the data prepared into the folder (removed again if this
call made it and preparing fails: nothing half-written), the tracking store and artifact location, the search run
opened with the spec, split and manifest (or reopened on ``--resume``), and the name of its Ray Tune experiment
folder."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import yaml
from mlflow.tracking import MlflowClient

from distmis.data.split import fold_parts
from distmis.search.interrupts import let_go
from distmis.search.plan import SearchPlan
from distmis.search.prepare import PreparedData, prepare_data
from distmis.spec.load import spec_to_dict
from distmis.spec.schema import Spec
from distmis.tracking.datasets import TrackedData
from distmis.tracking.mlflow_tracking import SearchRun, default_tracking_uri, flatten, mark_interrupted
from distmis.tracking.uri import redact_uri

__all__ = ["prepare_output", "tracking_location", "artifact_location", "open_search_run", "tracked_data",
           "ended_unless_recorded", "reopen_search_run", "experiment_name"]


def prepare_output(spec: Spec, output_dir: Path, *, progress: bool, created: bool | None = None) -> PreparedData:
    """Prepare the data; on failure remove an output folder this call created (nothing half-written). ``created``:
    whether the search made the folder (its lock did: :mod:`distmis.search.output_lock`); None: if it is missing."""
    created = not output_dir.exists() if created is None else created
    try:
        return prepare_data(spec, output_dir, progress=progress)
    except BaseException:
        if created and output_dir.exists():
            shutil.rmtree(output_dir)
        raise


def tracking_location(spec: Spec, output_dir: Path) -> tuple[str, str | None]:
    """The tracking URI (``tracking.uri``, else ``$MLFLOW_TRACKING_URI``, else a sqlite store in the output folder)
    and the artifact location of the experiment, should the search create it (:func:`artifact_location`)."""
    uri = spec.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(output_dir)
    return uri, artifact_location(uri, spec.tracking.artifact_location)


def artifact_location(uri: str, given: str | None = None) -> str | None:
    """Where a new experiment of the store ``uri`` keeps its artifacts: ``given`` (a folder, made absolute, or a
    URI); for a local sqlite store, ``mlartifacts/`` beside its database file, whatever the working directory
    (MLflow's own default, ``./mlruns``, is relative to it); otherwise None: a tracking server's own artifact
    store (or a database's default)."""
    if given:
        return given if "://" in given or given.startswith("file:") else Path(given).resolve().as_uri()
    if uri.startswith("sqlite:///") and uri.removeprefix("sqlite:///") not in ("", ":memory:"):
        database = Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
        return (database.resolve().parent / "mlartifacts").as_uri()
    return None


def open_search_run(spec: Spec, output_dir: Path, data: PreparedData, *, run_name: str | None = None,
                    role: str = "search", parent_run_id: str | None = None,
                    tags: dict[str, str] | None = None) -> SearchRun:
    """Create the MLflow run of a search (or comparison) with the spec, split and manifest attached."""
    uri, artifacts = tracking_location(spec, output_dir)
    run = SearchRun(uri, spec.experiment_name, run_name=run_name or spec.name, searched=list(spec.search.space),
                    metric=spec.search.selected_metric, mode=spec.search.mode, artifact_location=artifacts,
                    role=role, parent_run_id=parent_run_id, tags=tags)
    with ended_unless_recorded(run):
        resolved = spec_to_dict(spec)
        # The spec's fields as params, except the search space (a tag) and the tracking URI (may hold credentials).
        run.log_params({k: v for k, v in flatten(resolved).items()
                        if not k.startswith(("search.space", "tracking.uri"))})
        if resolved["tracking"]["uri"]:
            resolved["tracking"]["uri"] = redact_uri(resolved["tracking"]["uri"])
        run.log_text(yaml.safe_dump(resolved, sort_keys=False), "spec.yaml")
        run.log_dict(data.split, "split.json")
        run.log_dict(data.manifest.to_dict(), "tfrecord_manifest.json")
        run.log_dict(data.fingerprint.to_dict(), "dataset_fingerprint.json")
        run.log_inputs(tracked_data(spec, data).search_inputs())
    return run


def tracked_data(spec: Spec, data: PreparedData) -> TrackedData:
    """The search's data as MLflow's dataset inputs record it (:mod:`distmis.tracking.datasets`): its TFRecord
    folder's parts, and the parts each trial reads by its fold (:func:`~distmis.data.split.fold_parts`, as the
    trainers read them)."""
    folds = range(len(data.split["folds"])) if data.split.get("folds") is not None else [None]
    return TrackedData.from_manifest(data.manifest.to_dict(), source=spec.dataset.path, tfrecord_dir=data.tfrecord_dir,
                                     trial_parts={fold: fold_parts(data.split, fold) for fold in folds})


@contextmanager
def ended_unless_recorded(run: SearchRun) -> Iterator[SearchRun]:
    """While a new search's run is set up, before ``search_state.json`` names it: a Ctrl-C or a failure ends the run
    (KILLED or FAILED) rather than leaving it RUNNING with no state that could resume it."""
    try:
        yield run
    except KeyboardInterrupt as interrupt:
        let_go(interrupt)
        run.finish("KILLED", timeout=10)
        raise
    except BaseException:
        run.finish("FAILED", timeout=10)
        raise


def reopen_search_run(spec: Spec, output_dir: Path, run_id: str) -> SearchRun:
    """The MLflow run of an interrupted search, RUNNING again; what its killed driver left RUNNING is KILLED."""
    uri, _ = tracking_location(spec, output_dir)
    mark_interrupted(MlflowClient(tracking_uri=uri), run_id)
    return SearchRun.reopen(uri, run_id)


def experiment_name(spec: Spec, plan: SearchPlan, run_id: str) -> str:
    """The Ray Tune experiment folder of a search, under ``OUTPUT/ray_results``: one per MLflow search run."""
    return f"{spec.name}-{plan.mode}-{plan.largest.world_size}w-{run_id[:8]}"
