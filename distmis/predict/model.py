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
on a GPU when torch sees one; a Keras model trained in float16 is rebuilt in float32 where there is no GPU
(:func:`distmis.pyfunc_model.keras_runnable_here`: TensorFlow has no float16 max pooling on a CPU), whatever code its
folder holds. A fold ensemble (the recipe's ``folds``: one network per cross-validation fold, in a
python_function folder) predicts the mean of its folds' probabilities, or of the ``folds`` asked for; a configuration
ensemble (the recipe's ``configurations``) the mean of its configurations'. Each window is
test-time mirrored on the recipe's ``inference.mirror`` axes, or on the ``mirror`` asked for
(:func:`distmis.pyfunc_model.mirrored`).
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
    """A network and the recipe it was trained with. ``network``: the network; for a fold ensemble (``recipe.folds``)
    the list of its networks, one per fold in that order (a configuration ensemble: each configuration's in turn). ``device``: where a torch network runs. ``pyfunc``: the
    loaded MLflow model (``mlflow.pyfunc.PyFuncModel``) of a python_function model folder; None for a network given
    here or loaded from a folder saved before."""

    recipe: ModelRecipe
    network: Any
    device: str = "cpu"
    pyfunc: Any = None

    def __post_init__(self) -> None:
        count = self.recipe.network_count
        if count > 1 and (not isinstance(self.network, (list, tuple)) or len(self.network) != count):
            got = f"{len(self.network)} network(s)" if isinstance(self.network, (list, tuple)) else \
                type(self.network).__name__
            folds = f"folds {list(self.recipe.folds)}" if self.recipe.folds else "one network each"
            what = (f"a configuration ensemble of {len(self.recipe.members)} configurations ({folds})"
                    if self.recipe.configurations else f"a fold ensemble of {folds}")
            raise ValueError(f"{what} takes a list of {count} network(s), configuration by configuration and fold "
                             f"by fold; got {got}")

    @property
    def folds(self) -> tuple[int, ...]:
        """The folds of a fold ensemble, in the order of :attr:`networks`; ``()`` for one network."""
        return self.recipe.folds

    @property
    def networks(self) -> list[Any]:
        """The model's networks: one, or an ensemble's (each configuration's, one per fold of :attr:`folds`)."""
        return list(self.network) if self.recipe.network_count > 1 else [self.network]

    @property
    def mirror(self) -> tuple[int, ...]:
        """The axes the model mirrors each window on by default (its recipe's ``inference.mirror``; ``()``: none)."""
        return self.recipe.inference.mirror

    def mirrors(self) -> bool:
        """Whether the model's own code can mirror on axes other than its recipe's: always, but for a
        python_function folder saved before test-time mirroring, whose signature declares no ``mirror`` parameter
        (MLflow would drop it) and whose code knows none."""
        if self.pyfunc is None:
            return True
        schema = self.pyfunc.metadata.get_params_schema()
        return schema is not None and "mirror" in {param.name for param in schema.params}

    def check_mirror(self, mirror: Sequence[int] | None) -> tuple[int, ...] | None:
        """``mirror`` as the axes every window is mirrored on (None: the recipe's, :attr:`mirror`); ValueError naming
        the value for one that is not distinct axes 0, 1, 2 (:func:`distmis.pyfunc_model.check_mirror`), and for
        axes other than the recipe's asked of a model folder whose code cannot mirror (:meth:`mirrors`)."""
        if mirror is None:
            return None
        axes = pyfunc_model.check_mirror(mirror, "mirror")
        if axes != self.mirror and not self.mirrors():
            raise ValueError(f"mirror {list(axes)}: this model folder was saved before test-time mirroring; its code "
                             "cannot mirror: it predicts without mirroring only")
        return axes

    def check_folds(self, folds: Sequence[int] | None) -> tuple[int, ...] | None:
        """``folds`` as the folds a prediction averages (None: all); ValueError naming the model's folds when one is
        not among them, or saying the model is not a fold ensemble (:func:`distmis.pyfunc_model.check_folds`)."""
        return pyfunc_model.check_folds(None if folds is None else list(folds), self.recipe.to_dict())

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
        # the folder's own code runs: one saved before fold ensembles holds ``network``, not ``networks``
        networks = getattr(inner, "networks", None) or [inner.network]
        frameworks = [member["framework"] for _, member in pyfunc_model.network_artifacts(recipe.to_dict())]
        if "tensorflow" in frameworks:  # code saved before it rebuilt a float16 Keras model for a CPU itself
            networks = [pyfunc_model.keras_runnable_here(network) if framework == "tensorflow" else network
                        for network, framework in zip(networks, frameworks)]
            if hasattr(inner, "networks"):
                inner.networks = networks
            else:
                inner.network = networks[0]
        return cls(recipe, list(networks) if recipe.network_count > 1 else networks[0], inner.device, loaded)

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
        return cls(recipe, pyfunc_model.keras_runnable_here(mlflow.tensorflow.load_model(str(folder))))

    def probabilities(self, image: np.ndarray, folds: Sequence[int] | None = None,
                      mirror: Sequence[int] | None = None) -> np.ndarray:
        """Float32 probabilities ``(h, w, d, K)`` of one preprocessed channels-last volume ``(h, w, d, C)``,
        predicted by windows of ``recipe.window`` (``recipe.inference``: overlap, weights, batch), each mirrored on
        the axes ``mirror`` (default the recipe's; :meth:`check_mirror`); a fold ensemble's: the mean of its
        ``folds``' probabilities (default all)."""
        chosen, axes = self.check_folds(folds), self.check_mirror(mirror)
        if self.pyfunc is not None:
            inner = self.pyfunc.unwrap_python_model()
            if self.mirrors():
                return inner.probabilities(image, chosen, axes)
            # a folder saved before test-time mirroring (or fold ensembles: its probabilities takes the image only)
            return inner.probabilities(image, chosen) if self.folds else inner.probabilities(image)
        return pyfunc_model.model_probabilities(self.networks, image, self.recipe.to_dict(), self.device, chosen, axes)

    def _written_layout(self, layout: Layout | str | None) -> str:
        """Whose label values to write: a brain-tumour model (the BraTS regions or whole tumour of a BraTS layout or
        MSD Task01) writes a brain-tumour scan's ``layout``'s; any other model its own data set's."""
        own = self.recipe.layout
        if layout is None:
            return own
        wanted = coerce_layout(layout).value
        return wanted if self.recipe.brain_tumour and wanted in pyfunc_model.EDEMA_VALUE else own

    def segment(self, image: np.ndarray, layout: Layout | str | None = None,
                spacing: Sequence[float] | None = None, orientation: str | None = None,
                folds: Sequence[int] | None = None, mirror: Sequence[int] | None = None) -> np.ndarray:
        """The label map ``(H, W, D)`` of a raw image ``(H, W, D, C)`` in the data set's label values (brain-tumour
        label modes: ``layout``'s, default the training data's); ``spacing``: the scan's voxel spacing (mm) and
        ``orientation`` its axis codes (e.g. ``"LPS"``), handed to the model, which needs them when it resamples or
        reorients; ``folds``: a fold ensemble's folds to average (default all); ``mirror``: the axes each window is
        mirrored on (default the recipe's, ``()``: none; :meth:`check_mirror`)."""
        layout = self._written_layout(layout)
        chosen, axes = self.check_folds(folds), self.check_mirror(mirror)
        if self.pyfunc is None:
            return pyfunc_model.segment(image, self.recipe.to_dict(),
                                        lambda volume: self.probabilities(volume, chosen, axes),
                                        layout, spacing, orientation)
        params: dict[str, Any] = {"layout": layout}
        if chosen is not None:
            params["folds"] = list(chosen)
        if axes is not None and self.mirrors():
            params["mirror"] = list(axes)
        if spacing is not None:
            params["spacing"] = [float(s) for s in spacing]
        if orientation is not None:
            params["orientation"] = str(orientation)
        return np.asarray(self.pyfunc.predict(np.asarray(image, dtype=np.float32), params=params))
