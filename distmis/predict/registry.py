"""The model a search ends in: saved as an MLflow model, logged on its trial's run, registered under the search.

The model is an MLflow ``python_function`` model from code: its code is :mod:`distmis.pyfunc_model` (one
self-contained file that imports no distmis, copied into the model folder; nothing is pickled) and its artifacts are
the recipe (``artifacts/preprocessing.json``, :class:`~distmis.predict.recipe.ModelRecipe`: modalities,
normalisation, crop, resize, label mode, window and inference settings) and the network in a form that needs only its
framework (torch: a ``torch.export`` program, ``artifacts/network.pt2``; TensorFlow: the Keras model file,
``artifacts/model.keras``). A fold ensemble (the recipe's ``folds``: one network per cross-validation fold) holds one
network per fold instead (artifact ``network_fold<i>``, :func:`distmis.pyfunc_model.network_artifact`; files
``network_fold<i>.pt2`` or ``model_fold<i>.keras``) and predicts the mean of their probabilities; a configuration
ensemble (the recipe's ``configurations``) holds each configuration's networks (``network_c<j>``,
``network_c<j>_fold<i>``) and predicts the mean of its configurations' probabilities.
``mlflow.pyfunc.load_model(uri).predict(image)`` takes ONE case's raw image ``(H, W, D, C)`` and returns its label
map, without distmis installed; ``distmis predict`` runs that same ``predict``. The folder also holds a signature
(float32 ``(-1, -1, -1, C)`` in, uint8 ``(-1, -1, -1)`` out; params ``spacing``, ``orientation``, ``layout`` and
``folds``), a small input example and its pip requirements, public versions only (:func:`model_requirements`).

Registered model versions carry the test metrics as tags. The alias ``best`` (``models:/<name>@best``) names the
version with the best score so far: the test dice (the mean over regions) when the test split was evaluated,
else the search metric's best value; a version whose score is of another kind than the holder's takes the alias.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from distmis.predict.recipe import RECIPE_FILE, ModelRecipe

logger = logging.getLogger(__name__)

__all__ = ["BEST_ALIAS", "MODEL_NAME", "PublishedModel", "ModelFiles", "log_model", "model_files", "register_model",
           "save_model", "model_signature", "network_file", "check_networks", "model_requirements", "input_example",
           "fluent_tracking_uri", "logged_models", "registered_version"]

#: The name of the logged model on its trial's run.
MODEL_NAME = "model"
#: The tag distmis gives the models it logs (its value: the recipe's file name).
LOGGED_TAG = "distmis.recipe"
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
    """The model's signature: ONE case's raw image ``(H, W, D, C)`` (float32) in, its label map ``(H, W, D)``
    (uint8) out; parameters ``spacing`` (the case's voxel spacing in mm; needed when the model resamples),
    ``orientation`` (the case's axis codes, e.g. ``LPS``; needed when the model reorients), ``layout`` (for the
    brain-tumour label modes: whose label values; default the training data's), ``folds`` (a fold ensemble: the
    fold numbers whose probabilities are averaged, a list of integers; default ``[]``, all) and ``mirror`` (the
    spatial axes 0, 1, 2 each sliding window is test-time mirrored on, a list of integers; default the recipe's
    ``inference.mirror``, ``[]``: none).

    ``folds`` is declared for a single network too: MLflow drops a parameter its signature does not declare (with a
    warning), so a single network's model would otherwise ignore ``folds``; declared, it refuses them (not a fold
    ensemble)."""
    from mlflow.models.signature import ModelSignature
    from mlflow.types.schema import ParamSchema, ParamSpec, Schema, TensorSpec

    channels = len(recipe.modalities)
    return ModelSignature(inputs=Schema([TensorSpec(np.dtype(np.float32), (-1, -1, -1, channels))]),
                          outputs=Schema([TensorSpec(np.dtype(np.uint8), (-1, -1, -1))]),
                          params=ParamSchema([ParamSpec("spacing", "double", [], (-1,)),
                                              ParamSpec("orientation", "string", ""),
                                              ParamSpec("layout", "string", recipe.layout),
                                              ParamSpec("folds", "long", [], (-1,)),
                                              ParamSpec("mirror", "long", list(recipe.inference.mirror), (-1,))]))


def input_example(recipe: ModelRecipe) -> np.ndarray | tuple[np.ndarray, dict[str, Any]]:
    """A small raw image ``(8, 8, 8, C)`` (stored as JSON beside the model, and predicted once when it is logged):
    a head of intensity about 100 in every channel with a brighter cube in its middle; with the parameters a model
    that resamples or reorients needs (the recipe's own spacing and orientation)."""
    example = np.zeros((8, 8, 8, len(recipe.modalities)), dtype=np.float32)
    example[1:7, 1:7, 1:7] = 100.0 + np.random.default_rng(0).normal(0, 5, (6, 6, 6, example.shape[-1]))
    example[3:5, 3:5, 3:5] += 150.0
    params: dict[str, Any] = {}
    if recipe.spacing is not None:
        params["spacing"] = [float(v) for v in recipe.spacing]
    if recipe.orientation is not None:
        params["orientation"] = recipe.orientation
    return (example, params) if params else example


def _public_version(names: tuple[str, ...]) -> str | None:
    """The public version (no local label: ``2.13.0``, not ``2.13.0+cpu``) of the first of ``names`` installed."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    for name in names:
        try:
            return Version(version(name)).public
        except PackageNotFoundError:
            continue
    return None


def model_requirements(recipe: ModelRecipe) -> list[str]:
    """What the model needs, pinned to this process's versions by their public names and versions
    (``tensorflow==2.21.0`` where ``tensorflow-cpu`` is installed, ``torch==2.13.0`` for ``2.13.0+cpu``): mlflow,
    numpy, scipy (the resize), torch and monai (the sliding windows, for both frameworks), and tensorflow and keras
    for a Keras model. Given, so that MLflow does not infer them."""
    wanted: list[tuple[str, tuple[str, ...]]] = [("mlflow", ("mlflow", "mlflow-skinny")), ("numpy", ("numpy",)),
                                                 ("scipy", ("scipy",)), ("torch", ("torch",)), ("monai", ("monai",))]
    if any(member.framework == "tensorflow" for member in recipe.members):
        wanted += [("tensorflow", ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel")),
                   ("keras", ("keras",))]
    pins = []
    for name, distributions in wanted:
        found = _public_version(distributions)
        pins.append(f"{name}=={found}" if found else name)
    return pins


#: The network's file in the model's artifacts, per framework (a fold ensemble's: ``network_fold<i>.pt2``,
#: ``model_fold<i>.keras``; a configuration ensemble's ``network_c<j>_fold<i>.pt2``, :func:`network_file`).
NETWORK_FILES = {"torch": "network.pt2", "tensorflow": "model.keras"}


def network_file(framework: str, artifact: str = "network") -> str:
    """The file name of the network of artifact ``artifact`` (:func:`distmis.pyfunc_model.network_artifacts`):
    :data:`NETWORK_FILES`'s, with the artifact's suffixes (``network_fold2`` -> ``network_fold2.pt2`` or
    ``model_fold2.keras``; ``network_c1_fold2`` -> ``model_c1_fold2.keras``)."""
    from distmis.pyfunc_model import NETWORK_ARTIFACT

    if not artifact.startswith(NETWORK_ARTIFACT):
        raise ValueError(f"not a network artifact: {artifact!r}")
    stem, suffix = NETWORK_FILES[framework].split(".", 1)
    return f"{stem}{artifact[len(NETWORK_ARTIFACT):]}.{suffix}"


def check_networks(networks: Sequence[Any], recipe: ModelRecipe) -> list[Any]:
    """``networks`` as a list, one per fold of ``recipe.folds`` (exactly one when the recipe has no folds) of each
    configuration of ``recipe`` (configuration by configuration); ValueError otherwise."""
    if not isinstance(networks, (list, tuple)):
        raise ValueError(f"networks must be a list of networks (one per fold of recipe.folds, or exactly one), got "
                         f"{type(networks).__name__}: wrap a single network in a list")
    wanted = recipe.network_count
    if len(networks) != wanted:
        what = (f"a fold ensemble of folds {list(recipe.folds)} takes {len(recipe.folds)} network(s), one per fold, "
                "in that order" if recipe.folds else "a recipe without folds takes exactly one network")
        if recipe.configurations:
            what = (f"a configuration ensemble of {len(recipe.members)} configurations takes {wanted} network(s): "
                    f"configuration by configuration, {what}")
        raise ValueError(f"{len(networks)} network(s) given: {what}")
    return list(networks)


def _write_network(network: Any, configuration: Mapping[str, Any], channels: int, path: Path) -> Path:
    """The network as a file (``path``) that needs only its framework: a ``torch.export`` program of the network in
    eval mode on the CPU, for a batch of any number of windows of ``channels`` channels (``.pt2``), or the Keras
    model file; ``configuration``: the recipe (a dict) of the configuration it is a network of (its framework
    and window)."""
    if configuration["framework"] == "tensorflow":
        from distmis.models.tf_layers import keras_portable

        keras_portable(network).save(str(path))  # Keras's own layer classes: loads without distmis
        return path
    import copy

    import torch

    module = copy.deepcopy(network).to("cpu").eval()  # the caller's network stays where and as it is
    # In PyTorch's default layout: a network trained channels-last (training.performance) has weights whose strides
    # torch.export's archive takes for parts of a larger tensor (it warns, once per weight), and whoever loads the
    # program chooses its own layout (pyfunc_model.inference_memory_format)
    module.to(memory_format=torch.contiguous_format)
    windows = torch.randn(2, channels, *configuration["window"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        program = torch.export.export(module, (windows,), dynamic_shapes=({0: torch.export.Dim("windows", min=1)},))
    torch.export.save(program, str(path))
    return path


@dataclass(frozen=True)
class ModelFiles:
    """A model's artifacts, written once (:func:`model_files`) for :func:`save_model` and :func:`log_model`."""

    recipe: ModelRecipe
    recipe_file: Path
    network_files: tuple[Path, ...]  # one; an ensemble's, in the order of network_artifacts(recipe)

    def artifacts(self) -> dict[str, str]:
        """The MLflow model's artifacts: the recipe, and the network (``network``), or each fold's
        (``network_fold<i>``) of each configuration's (``network_c<j>...``)."""
        from distmis import pyfunc_model

        names = [name for name, _ in pyfunc_model.network_artifacts(self.recipe.to_dict())]
        return {pyfunc_model.RECIPE_ARTIFACT: str(self.recipe_file),
                **{name: str(path) for name, path in zip(names, self.network_files)}}

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments of ``mlflow.pyfunc.save_model`` / ``log_model`` for this model."""
        from distmis import pyfunc_model

        return {"python_model": str(Path(pyfunc_model.__file__)),  # models from code: this file, nothing pickled
                "artifacts": self.artifacts(),
                "signature": model_signature(self.recipe), "input_example": input_example(self.recipe),
                "pip_requirements": model_requirements(self.recipe)}


@contextmanager
def model_files(networks: Sequence[Any], recipe: ModelRecipe) -> Iterator[ModelFiles]:
    """The recipe and the networks (one per fold of ``recipe.folds``, in that order; exactly one when it has none:
    :func:`check_networks`) written to a temporary folder (removed afterwards)."""
    networks = check_networks(networks, recipe)
    from distmis.pyfunc_model import network_artifacts

    with tempfile.TemporaryDirectory(prefix="distmis-model-") as tmp:
        written = tuple(_write_network(network, member, len(recipe.modalities),
                                       Path(tmp) / network_file(member["framework"], name))
                        for network, (name, member) in zip(networks, network_artifacts(recipe.to_dict())))
        yield ModelFiles(recipe, recipe.write(Path(tmp) / RECIPE_FILE), written)


@contextmanager
def _files(networks: Sequence[Any], recipe: ModelRecipe, files: ModelFiles | None) -> Iterator[ModelFiles]:
    if files is not None:
        if files.recipe != recipe:
            raise ValueError("files were written for another recipe")
        yield files
        return
    with model_files(networks, recipe) as written:
        yield written


def save_model(networks: Sequence[Any], recipe: ModelRecipe, folder: str | Path, *,
               files: ModelFiles | None = None) -> Path:
    """Write the MLflow model folder ``folder`` of ``networks`` (one per fold of ``recipe.folds``, in that order;
    exactly one when it has none) whole: built beside it, then moved into place (an earlier model folder there, one
    distmis wrote, is replaced; any other existing path is refused). ``files``: the artifacts, when
    :func:`model_files` wrote them already."""
    import mlflow.pyfunc

    if files is None:
        check_networks(networks, recipe)  # before anything is written
    folder = Path(folder)
    if folder.exists() and not (folder / "MLmodel").is_file():
        raise FileExistsError(f"{str(folder)!r} exists and is not a model folder distmis wrote: not replacing it")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        with _files(networks, recipe, files) as written:
            mlflow.pyfunc.save_model(str(staging / "model"), **written.arguments())
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


def log_model(networks: Sequence[Any], recipe: ModelRecipe, tracking_uri: str, run_id: str, *,
              files: ModelFiles | None = None) -> str:
    """Log the model of ``networks`` (one per fold of ``recipe.folds``, in that order; exactly one when it has none)
    on the (finished) run ``run_id`` as an MLflow model named :data:`MODEL_NAME`, in the run's experiment; the recipe
    also as a run artifact, to read in the UI. Returns the model's URI (``models:/m-...``). MLflow checks the input
    example on the logged model (loads it and predicts the small example once).

    A run holds one such model, logged once: when ``run_id`` holds one already (a search's end that was interrupted
    and is resumed), a model logged whole (READY) is that model, its URI returned and nothing logged; one whose
    logging was cut short (PENDING: the process was killed; FAILED) is completed in place, under its own id
    (:func:`_complete_logged_model`), rather than a second one logged beside it."""
    import mlflow.pyfunc
    from mlflow.entities import LoggedModelStatus
    from mlflow.models import Model
    from mlflow.tracking import MlflowClient

    if files is None:
        check_networks(networks, recipe)  # before a logged model is created
    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(run_id)
    earlier = logged_models(client, run.info.experiment_id, run_id)
    ready = [model for model in earlier if model.status == LoggedModelStatus.READY]
    if ready:  # its recipe beside it on the run again: the interruption may have come between the two
        with tempfile.TemporaryDirectory(prefix="distmis-recipe-") as tmp:
            client.log_artifact(run_id, str(recipe.write(Path(tmp) / RECIPE_FILE)))
        return f"models:/{ready[0].model_id}"
    with fluent_tracking_uri(tracking_uri), _files(networks, recipe, files) as written:
        if earlier:
            _complete_logged_model(client, earlier[0], run_id, written)
            model_uri = f"models:/{earlier[0].model_id}"
        else:
            logged = client.create_logged_model(experiment_id=run.info.experiment_id, name=MODEL_NAME,
                                                source_run_id=run_id, tags={LOGGED_TAG: RECIPE_FILE})
            # Model.log, which mlflow.pyfunc.log_model calls, with the run: logging does not reopen the finished run
            model_uri = Model.log(artifact_path=None, name=MODEL_NAME, flavor=mlflow.pyfunc, run_id=run_id,
                                  model_id=logged.model_id, **written.arguments()).model_uri
        client.log_artifact(run_id, str(written.recipe_file))
    return model_uri


def logged_models(client: Any, experiment_id: str, run_id: str) -> list[Any]:
    """The models distmis logged on run ``run_id`` (named :data:`MODEL_NAME`, tagged :data:`LOGGED_TAG`), in any
    status, oldest first."""
    found = client.search_logged_models([experiment_id], filter_string=f"source_run_id = '{run_id}'")
    ours = [model for model in found if model.name == MODEL_NAME and LOGGED_TAG in model.tags]
    return sorted(ours, key=lambda model: model.creation_timestamp)


def _complete_logged_model(client: Any, logged: Any, run_id: str, written: ModelFiles) -> None:
    """Finish logging the model ``logged`` whose logging on ``run_id`` was cut short: what ``Model.log`` does, under
    the model's own id. The run's link to it (its output) is made unless made already (``Model.log`` would make it
    a second time, which the store refuses), the model folder is written and uploaded whole over whatever part of
    it was, and the model marked READY."""
    import mlflow.pyfunc
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.models import Model

    outputs = client.get_run(run_id).outputs
    if logged.model_id not in {output.model_id for output in (outputs.model_outputs if outputs else [])}:
        client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
    with tempfile.TemporaryDirectory(prefix="distmis-model-") as tmp:
        folder = Path(tmp) / MODEL_NAME
        described = Model(artifact_path=logged.artifact_location, model_uuid=logged.model_id, run_id=run_id,
                          model_id=logged.model_id)
        mlflow.pyfunc.save_model(str(folder), mlflow_model=described, **written.arguments())
        client.log_model_artifacts(logged.model_id, str(folder))
    client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)


def _better(score: float, than: float, mode: str) -> bool:
    return score > than if mode == "max" else score < than


def register_model(tracking_uri: str, model_uri: str, name: str, *, run_id: str, tags: Mapping[str, Any],
                   score: tuple[str, float, str] | None, description: str = "") -> tuple[str, bool]:
    """Register ``model_uri`` as a new version of ``name`` with ``tags``; give it the alias ``best`` when its
    ``score`` (``(metric, value, "max" | "min")``) beats the holder's. Returns the version and whether it is best.

    A model is registered once: when ``name`` has a version of ``model_uri`` from ``run_id`` already (a search's end
    that was interrupted and is resumed), that version is the one, with the tags it was registered with; its
    description and the alias are set again (the interruption may have come before them)."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    all_tags = {key: str(value) for key, value in tags.items()}
    if score is not None:
        all_tags.update({SCORE_KIND_TAG: score[0], SCORE_TAG: repr(float(score[1]))})
    said = io.StringIO()  # MLflow prints "Successfully registered model ..." to stderr: the search's console says it
    version = registered_version(client, name, model_uri, run_id)
    if version is None:
        with fluent_tracking_uri(tracking_uri), redirect_stderr(said):
            version = mlflow.register_model(model_uri, name, tags=all_tags, await_registration_for=60).version
        logger.debug("%s", said.getvalue().strip())
    if description:
        client.update_model_version(name, version, description=description)
    try:
        holder = client.get_model_version_by_alias(name, BEST_ALIAS)
    except MlflowException:
        holder = None
    best = (holder is None or str(holder.version) == str(version) or score is None
            or holder.tags.get(SCORE_KIND_TAG) != score[0])
    if not best and holder is not None and score is not None:
        best = _better(float(score[1]), float(holder.tags.get(SCORE_TAG, "nan")), score[2])
    if best:
        client.set_registered_model_alias(name, BEST_ALIAS, version)
    return str(version), best


def registered_version(client: Any, name: str, model_uri: str, run_id: str) -> str | None:
    """The version of the registered model ``name`` made from ``model_uri`` (logged on ``run_id``), if there is
    one (the newest)."""
    from mlflow.exceptions import MlflowException

    try:
        found = client.search_model_versions(f"run_id = '{run_id}'")
    except MlflowException:  # a registry that cannot search by run: registered as ever (its errors come next)
        return None
    versions = [v for v in found if v.name == name and v.source == model_uri]
    return str(max(int(v.version) for v in versions)) if versions else None
