"""``distmis predict MODEL ...``: which model MODEL names, as a local MLflow model folder.

MODEL is one of
* a registry URI: ``models:/<name>/<version>`` or ``models:/<name>@<alias>`` (a search registers its model under
  the search's name, alias ``best``);
* a run URI: ``runs:/<run id>`` (the model logged on that trial's run) or ``runs:/<run id>/model``;
* a logged model's URI ``models:/m-...``;
* a local folder: an MLflow model folder, or a search's output folder (its best model, in ``OUTPUT/model``).
URIs are read from the tracking server or store given by ``--tracking-uri`` (default ``$MLFLOW_TRACKING_URI``).
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from distmis.tracking.uri import redact_uri

__all__ = ["ModelNotFound", "model_folder", "LOCAL_MODEL_FOLDER"]

#: Where a search keeps a copy of its best model, under its output folder.
LOCAL_MODEL_FOLDER = "model"
URI_SCHEMES = ("models:/", "runs:/", "mlflow-artifacts:/")


class ModelNotFound(ValueError):
    """MODEL names no model distmis can load."""


def _local(path: Path) -> Path:
    if (path / "MLmodel").is_file():
        return path
    if (path / LOCAL_MODEL_FOLDER / "MLmodel").is_file():
        return path / LOCAL_MODEL_FOLDER
    if (path / "search_state.json").is_file():
        raise ModelNotFound(f"search folder {str(path)!r} holds no model ({LOCAL_MODEL_FOLDER}/ is missing): the "
                            "search did not finish, no trial finished, or it was a comparison (whose cells log their "
                            "models on their trial runs only); use a models:/ or runs:/ URI instead")
    raise ModelNotFound(f"{str(path)!r} is neither an MLflow model folder (with an MLmodel file) nor a search's output "
                        f"folder (with {LOCAL_MODEL_FOLDER}/MLmodel)")


@contextmanager
def model_folder(reference: str, tracking_uri: str | None = None) -> Iterator[Path]:
    """The model ``reference`` names, as a local folder for the duration of the context (a URI's model is
    downloaded to a temporary folder, removed afterwards). ModelNotFound when it names none."""
    if not reference.startswith(URI_SCHEMES):
        path = Path(reference)
        if not path.exists():
            raise ModelNotFound(f"model {reference!r}: no such folder, and not a models:/ or runs:/ URI")
        if not path.is_dir():
            raise ModelNotFound(f"model {reference!r} is a file; MODEL is a folder or a models:/ or runs:/ URI")
        yield _local(path)
        return
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise ModelNotFound(f"model {reference!r}: a URI is read from an MLflow tracking store; give --tracking-uri "
                            "(e.g. sqlite:///runs/quickstart/mlflow.db or http://127.0.0.1:5000) or set "
                            "MLFLOW_TRACKING_URI")
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise ModelNotFound(f"--tracking-uri {uri}: no such sqlite file")
    if reference.startswith("runs:/") and reference.rstrip("/").count("/") == 1:
        reference = reference.rstrip("/") + f"/{LOCAL_MODEL_FOLDER}"
    import mlflow.artifacts

    from distmis.predict.registry import fluent_tracking_uri

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    with tempfile.TemporaryDirectory(prefix="distmis-model-") as tmp:
        try:
            with fluent_tracking_uri(uri):  # the registry of a models:/ URI is the tracking store's
                local = Path(mlflow.artifacts.download_artifacts(reference, dst_path=tmp, tracking_uri=uri))
        except Exception as exc:  # noqa: BLE001  (MLflow raises MlflowException, OSError, requests' errors)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelNotFound(f"model {reference!r} does not resolve in {redact_uri(uri)}: {first}") from None
        if not (local / "MLmodel").is_file():
            raise ModelNotFound(f"model {reference!r} in {redact_uri(uri)} is not an MLflow model (no MLmodel file)")
        yield local
