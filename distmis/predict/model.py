"""A model folder in memory: the network with its recipe, whichever way distmis saved it.

* Since the model became an MLflow ``python_function`` model from code (:mod:`distmis.predict.registry`), a folder
  holds ``MLmodel`` with the ``python_function`` flavour only, the code file (:mod:`distmis.pyfunc_model`) and
  ``artifacts/`` (the recipe, ``preprocessing.json``, and the network: ``network.pt2`` or ``model.keras``). It is
  loaded with ``mlflow.pyfunc.load_model``, as anyone without distmis loads it, and :meth:`SegmentationModel.segment`
  calls that model's ``predict``: ``distmis predict`` and the MLflow model give the same label map by construction.
* Folders saved before (``MLmodel`` with the ``pytorch`` or ``tensorflow`` flavour and
  ``extra_files/preprocessing.json``, :class:`~distmis.predict.recipe.ModelRecipe`) are loaded with that flavour,
  and segmented by the same functions of :mod:`distmis.pyfunc_model` around the unpickled network.

:meth:`SegmentationModel.probabilities` predicts a preprocessed volume by sliding windows of the network's input,
on a GPU when torch sees one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from distmis import pyfunc_model
from distmis.data.layouts import Layout, coerce_layout
from distmis.predict.recipe import RECIPE_FILE, ModelRecipe, RecipeError

__all__ = ["SegmentationModel", "model_flavours", "recipe_path"]

#: The flavours of the models distmis saved before its models were python_function models from code.
OLD_FLAVOURS = ("pytorch", "tensorflow")


def model_flavours(folder: str | Path) -> dict[str, Any]:
    """The flavours of the MLflow model folder ``folder``, as its ``MLmodel`` file lists them (RecipeError when
    there is none, or it cannot be read)."""
    import yaml

    path = Path(folder) / "MLmodel"
    if not path.is_file():
        raise RecipeError(f"{str(folder)!r} is not an MLflow model folder (no MLmodel file)")
    try:
        flavours = (yaml.safe_load(path.read_text()) or {}).get("flavors")
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError) as exc:
        raise RecipeError(f"{str(path)!r} is not a readable MLmodel file: {exc}") from None
    if not isinstance(flavours, dict):
        raise RecipeError(f"{str(path)!r} lists no model flavours")
    return flavours


def recipe_path(folder: str | Path) -> Path:
    """Where a model folder keeps its recipe: ``artifacts/`` (a python_function model), ``extra_files/`` (before)."""
    folder = Path(folder)
    current = folder / "artifacts" / RECIPE_FILE
    return current if current.is_file() else folder / "extra_files" / RECIPE_FILE


def _torch_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class SegmentationModel:
    """A network and the recipe it was trained with. ``device``: where a torch network runs. ``pyfunc``: the loaded
    MLflow model (``mlflow.pyfunc.PyFuncModel``) of a python_function model folder; None for a network given here or
    loaded from a folder saved before."""

    recipe: ModelRecipe
    network: Any
    device: str = "cpu"
    pyfunc: Any = None

    @classmethod
    def load(cls, folder: str | Path) -> SegmentationModel:
        """Load an MLflow model folder written by distmis (RecipeError when it is not one)."""
        folder = Path(folder)
        flavours = model_flavours(folder)
        if any(name in flavours for name in OLD_FLAVOURS):
            return cls._load_flavour(folder)
        if "model_code_path" not in (flavours.get("python_function") or {}):
            raise RecipeError(f"{str(folder)!r} is an MLflow model ({', '.join(flavours)}) that distmis did not "
                              "write: neither a python_function model from code nor a pytorch or tensorflow one")
        recipe = ModelRecipe.read(recipe_path(folder))  # a recipe this distmis reads, before the network is loaded
        import mlflow.pyfunc

        logging.getLogger("absl").setLevel(logging.ERROR)
        # the requirements name public versions (torch==2.13.0, tensorflow==...): no warnings about local builds
        loaded = mlflow.pyfunc.load_model(str(folder), suppress_warnings=True)
        inner = loaded.unwrap_python_model()
        return cls(recipe, inner.network, inner.device, loaded)

    @classmethod
    def _load_flavour(cls, folder: Path) -> SegmentationModel:
        recipe = ModelRecipe.read(folder / "extra_files" / RECIPE_FILE)
        if recipe.framework == "torch":
            import mlflow.pytorch

            device = _torch_device()
            network = mlflow.pytorch.load_model(str(folder), map_location=device)
            network.eval()
            return cls(recipe, network, device)
        import mlflow.tensorflow

        logging.getLogger("absl").setLevel(logging.ERROR)
        return cls(recipe, mlflow.tensorflow.load_model(str(folder)))

    def probabilities(self, image: np.ndarray) -> np.ndarray:
        """Float32 probabilities ``(h, w, d, K)`` of one preprocessed channels-last volume ``(h, w, d, C)``,
        predicted by windows of ``recipe.window`` (``recipe.inference``: overlap, weights, batch)."""
        if self.pyfunc is not None:
            return self.pyfunc.unwrap_python_model().probabilities(image)
        return pyfunc_model.network_probabilities(self.network, image, self.recipe.to_dict(), self.device)

    def _written_layout(self, layout: Layout | str | None) -> str:
        """Whose label values to write: a brain-tumour model (the BraTS regions or whole tumour of a BraTS layout or
        MSD Task01) writes a brain-tumour scan's ``layout``'s; any other model its own data set's."""
        own = self.recipe.layout
        if layout is None:
            return own
        wanted = coerce_layout(layout).value
        return wanted if self.recipe.brain_tumour and wanted in pyfunc_model.EDEMA_VALUE else own

    def segment(self, image: np.ndarray, layout: Layout | str | None = None,
                spacing: Sequence[float] | None = None, orientation: str | None = None) -> np.ndarray:
        """The label map ``(H, W, D)`` of a raw image ``(H, W, D, C)`` in the data set's label values (brain-tumour
        label modes: ``layout``'s, default the training data's); ``spacing``: the scan's voxel spacing (mm) and
        ``orientation`` its axis codes (e.g. ``"LPS"``), handed to the model, which needs them when it resamples or
        reorients."""
        layout = self._written_layout(layout)
        if self.pyfunc is None:
            return pyfunc_model.segment(image, self.recipe.to_dict(), self.probabilities, layout, spacing, orientation)
        params: dict[str, Any] = {"layout": layout}
        if spacing is not None:
            params["spacing"] = [float(s) for s in spacing]
        if orientation is not None:
            params["orientation"] = str(orientation)
        return np.asarray(self.pyfunc.predict(np.asarray(image, dtype=np.float32), params=params))
