"""The model a search ends in: saved as an MLflow model, logged on its trial's run, registered under the search.

An MLflow model folder holds the network in its framework's flavour (``mlflow.pytorch``: the module, pickled;
``mlflow.tensorflow``: the Keras model as ``model.keras``), a tensor signature (the window the network takes and
the channels it returns) and, in ``extra_files/``, the recipe that says how to use it
(:class:`~distmis.predict.recipe.ModelRecipe`: modalities, normalisation, crop, resize, label mode, window and
inference settings). ``distmis predict`` needs nothing else.

Registered model versions carry the test metrics as tags. The alias ``best`` (``models:/<name>@best``) names the
version with the best score so far: the test dice (the mean over regions) when the test split was evaluated,
else the search metric's best value; a version whose score is of another kind than the holder's takes the alias.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from distmis.predict.recipe import RECIPE_FILE, ModelRecipe

logger = logging.getLogger(__name__)

__all__ = ["BEST_ALIAS", "MODEL_NAME", "PublishedModel", "log_model", "register_model", "save_model",
           "model_signature", "fluent_tracking_uri"]

#: The name of the logged model on its trial's run.
MODEL_NAME = "model"
#: The registry alias of the best version of a search's model.
BEST_ALIAS = "best"
SCORE_TAG, SCORE_KIND_TAG = "distmis.score", "distmis.score_metric"


@dataclass(frozen=True)
class PublishedModel:
    """Where a search's model went: ``folder`` (a local copy), ``model_uri`` (the logged model), and its registry
    ``name`` and ``version`` (None when not registered); ``best``: whether the version holds the alias ``best``;
    ``error``: why it was not logged or registered, when it was not."""

    folder: Path | None
    model_uri: str | None
    name: str | None = None
    version: str | None = None
    best: bool = False
    error: str = ""

    @property
    def registry_uri(self) -> str | None:
        return None if self.version is None else f"models:/{self.name}/{self.version}"


def model_signature(recipe: ModelRecipe) -> Any:
    """The network's tensor signature: a batch of windows in, a batch of per-channel maps out (float32)."""
    from mlflow.models.signature import ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    channels, window = len(recipe.modalities), tuple(recipe.window)
    if recipe.channels_last:
        inputs, outputs = (-1, *window, channels), (-1, *window, recipe.num_classes)
    else:
        inputs, outputs = (-1, channels, *window), (-1, recipe.num_classes, *window)
    return ModelSignature(inputs=Schema([TensorSpec(np.dtype(np.float32), inputs, "image")]),
                          outputs=Schema([TensorSpec(np.dtype(np.float32), outputs, recipe.output)]))


def _requirements(recipe: ModelRecipe) -> list[str]:
    """The packages the model needs, pinned to this process's versions (given, so MLflow does not infer them)."""
    from importlib.metadata import PackageNotFoundError, version

    names = ["torch", "monai"] if recipe.framework == "torch" else ["tensorflow-cpu", "tensorflow", "keras"]
    names += ["numpy", "nibabel", "scipy"]
    pins = []
    for name in names:
        try:
            pins.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            continue
    return pins


def _flavour_arguments(network: Any, recipe: ModelRecipe, recipe_file: Path) -> tuple[Any, dict[str, Any]]:
    common = {"signature": model_signature(recipe), "pip_requirements": _requirements(recipe),
              "extra_files": [str(recipe_file)]}
    if recipe.framework == "torch":
        import mlflow.pytorch

        logging.getLogger("mlflow.pytorch").setLevel(logging.ERROR)  # its warning about pickles, every time
        # pickle: the module object itself (distmis must be importable where it is loaded, as distmis predict is)
        return mlflow.pytorch, {"serialization_format": "pickle", **common}
    import mlflow.tensorflow

    return mlflow.tensorflow, common


@contextmanager
def _recipe_file(recipe: ModelRecipe) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="distmis-recipe-") as tmp:
        yield recipe.write(Path(tmp) / RECIPE_FILE)


def save_model(network: Any, recipe: ModelRecipe, folder: str | Path) -> Path:
    """Write the MLflow model folder ``folder`` whole: built beside it, then moved into place (an earlier model
    folder there, one distmis wrote, is replaced; any other existing path is refused)."""
    folder = Path(folder)
    if folder.exists() and not (folder / "MLmodel").is_file():
        raise FileExistsError(f"{str(folder)!r} exists and is not a model folder distmis wrote: not replacing it")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        with _recipe_file(recipe) as recipe_file:
            flavour, arguments = _flavour_arguments(network, recipe, recipe_file)
            flavour.save_model(network, str(staging / "model"), **arguments)
        old = None
        if folder.exists():
            old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
            os.replace(folder, old)
        os.replace(staging / "model", folder)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


@contextmanager
def fluent_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's fluent API (which the flavours' log_model uses) pointed at ``uri`` for a moment."""
    import mlflow

    previous = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous)  # None: unset again


def log_model(network: Any, recipe: ModelRecipe, tracking_uri: str, run_id: str) -> str:
    """Log the model on the (finished) run ``run_id`` as an MLflow model named :data:`MODEL_NAME`, in the run's
    experiment; the recipe also as a run artifact, to read in the UI. Returns the model's URI (``models:/m-...``)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(run_id)
    logged = client.create_logged_model(experiment_id=run.info.experiment_id, name=MODEL_NAME, source_run_id=run_id,
                                        tags={"distmis.recipe": RECIPE_FILE})
    with fluent_tracking_uri(tracking_uri), _recipe_file(recipe) as recipe_file:
        flavour, arguments = _flavour_arguments(network, recipe, recipe_file)
        info = flavour.log_model(network, name=MODEL_NAME, run_id=run_id, model_id=logged.model_id, **arguments)
        client.log_artifact(run_id, str(recipe_file))
    return info.model_uri


def _better(score: float, than: float, mode: str) -> bool:
    return score > than if mode == "max" else score < than


def register_model(tracking_uri: str, model_uri: str, name: str, *, run_id: str, tags: Mapping[str, Any],
                   score: tuple[str, float, str] | None, description: str = "") -> tuple[str, bool]:
    """Register ``model_uri`` as a new version of ``name`` with ``tags``; give it the alias ``best`` when its
    ``score`` (``(metric, value, "max" | "min")``) beats the holder's. Returns the version and whether it is best."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    all_tags = {key: str(value) for key, value in tags.items()}
    if score is not None:
        all_tags.update({SCORE_KIND_TAG: score[0], SCORE_TAG: repr(float(score[1]))})
    with fluent_tracking_uri(tracking_uri):
        version = mlflow.register_model(model_uri, name, tags=all_tags, await_registration_for=60).version
    if description:
        client.update_model_version(name, version, description=description)
    try:
        holder = client.get_model_version_by_alias(name, BEST_ALIAS)
    except MlflowException:
        holder = None
    best = holder is None or score is None or holder.tags.get(SCORE_KIND_TAG) != score[0]
    if not best and holder is not None and score is not None:
        best = _better(float(score[1]), float(holder.tags.get(SCORE_TAG, "nan")), score[2])
    if best:
        client.set_registered_model_alias(name, BEST_ALIAS, version)
    return str(version), best
