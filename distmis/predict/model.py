"""A logged model in memory: the network (MLflow's ``pytorch`` or ``tensorflow`` flavour) with its recipe.

The folder is an MLflow model as :mod:`distmis.predict.registry` writes it: ``MLmodel``, the flavour's files,
and ``extra_files/preprocessing.json`` (:class:`~distmis.predict.recipe.ModelRecipe`).
:meth:`SegmentationModel.probabilities` predicts a preprocessed volume by sliding windows of the network's
input, on a GPU when torch sees one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from distmis.predict.recipe import RECIPE_FILE, ModelRecipe, RecipeError
from distmis.train.inference import predict_channels_last, sliding_window

__all__ = ["SegmentationModel", "recipe_path"]


def recipe_path(folder: str | Path) -> Path:
    """Where a model folder keeps its recipe."""
    return Path(folder) / "extra_files" / RECIPE_FILE


def _torch_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class SegmentationModel:
    """A network and the recipe it was trained with. ``device``: where a torch network runs."""

    recipe: ModelRecipe
    network: Any
    device: str = "cpu"

    @classmethod
    def load(cls, folder: str | Path) -> SegmentationModel:
        """Load an MLflow model folder written by distmis (RecipeError when it is not one)."""
        folder = Path(folder)
        if not (folder / "MLmodel").is_file():
            raise RecipeError(f"{str(folder)!r} is not an MLflow model folder (no MLmodel file)")
        recipe = ModelRecipe.read(recipe_path(folder))
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
        recipe = self.recipe
        if image.ndim != 4 or image.shape[-1] != len(recipe.modalities):
            raise ValueError(f"image must be (h, w, d, {len(recipe.modalities)}), got shape {image.shape}")
        settings = recipe.inference
        if recipe.framework == "tensorflow":
            network = self.network

            def predict(batch: np.ndarray) -> np.ndarray:
                return np.asarray(network(batch, training=False))

            return predict_channels_last(predict, image, recipe.window, inference=settings,  # type: ignore[arg-type]
                                         batch_size=settings.batch_size)
        import torch

        network, logits = self.network, recipe.output == "logits"

        def predictor(windows: torch.Tensor) -> torch.Tensor:
            out = network(windows)
            return torch.sigmoid(out) if logits else out

        volume = torch.from_numpy(np.ascontiguousarray(np.moveaxis(image, -1, 0)[None], dtype=np.float32))
        with torch.no_grad():
            prob = sliding_window(predictor, volume.to(self.device), recipe.window, overlap=settings.overlap,
                                  mode=settings.mode, sigma_scale=settings.sigma_scale,
                                  batch_size=settings.batch_size)
        return np.ascontiguousarray(prob[0].cpu().numpy().transpose(1, 2, 3, 0))
