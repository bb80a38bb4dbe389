"""What a trained model expects of a scan and how it is applied: the ``preprocessing.json`` of every model.

A network alone cannot segment a scan: it needs its input made as its training data were (modalities in
order, z-scored over the brain, cropped or padded and resized to the training grid) and it sees one window
(the training tile) at a time. :class:`ModelRecipe` records all of that from the search's spec and the
TFRecord manifest when the model is logged (an artifact of the MLflow model, ``artifacts/preprocessing.json``;
``extra_files/`` in folders saved before), and the model's code, :mod:`distmis.pyfunc_model`, follows it to the
letter (it reads the file as a plain dict: the model needs no distmis).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from distmis.data.layouts import MODALITIES
from distmis.data.preprocess import PreprocessConfig

__all__ = ["RECIPE_FILE", "ModelRecipe", "RecipeError"]

#: File name of the recipe, in the model's folder (``extra_files/``) and on its trial run.
RECIPE_FILE = "preprocessing.json"
RECIPE_VERSION = 1


class RecipeError(ValueError):
    """A ``preprocessing.json`` that is missing, unreadable or not one distmis wrote."""


@dataclass(frozen=True)
class InferenceSettings:
    """Sliding-window inference: windows of the network input overlapping by ``overlap``, blended with
    ``mode`` weights (see :class:`distmis.spec.schema.InferenceSpec`), ``batch_size`` windows a pass."""

    overlap: float = 0.5
    mode: Literal["gaussian", "constant"] = "gaussian"
    sigma_scale: float = 0.125
    batch_size: int = 1


@dataclass(frozen=True)
class ModelRecipe:
    """Everything between a raw scan and the network, and between its output and a label map.

    Attributes:
        framework: ``tensorflow`` (a Keras model, channels-last input) or ``torch`` (channels-first).
        model: the architecture's name in the spec (``unet3d``, ``vit-seg``).
        modalities: the input channels, in order (the MSD Task01 order, whatever the data set's layout).
        normalisation: ``zscore-nonzero``: each channel z-scored over its non-zero voxels, background 0.
        layout: label convention of the data the model was trained on.
        labels: ``whole-tumour`` (1 channel) or ``regions`` (WT, TC, ET).
        crop: centre crop / zero pad of the scan before the resize (None: none).
        resize: shape the cropped scan is resampled to (None: none).
        window: the network's input (training tile, or the whole training volume); larger volumes are
            predicted by sliding windows of it, smaller ones zero-padded to it.
        inference: the sliding-window settings.
        output: what the network returns: ``probabilities`` (sigmoid inside) or ``logits``.
        threshold: probability at or above which a voxel belongs to a channel's region.
        spec_name: the search the model comes from.
    """

    framework: Literal["tensorflow", "torch"]
    model: str
    layout: str
    labels: str
    num_classes: int
    window: tuple[int, int, int]
    output: Literal["probabilities", "logits"]
    crop: tuple[int, int, int] | None = None
    resize: tuple[int, int, int] | None = None
    modalities: tuple[str, ...] = MODALITIES
    normalisation: str = "zscore-nonzero"
    inference: InferenceSettings = field(default_factory=InferenceSettings)
    threshold: float = 0.5
    spec_name: str = ""
    version: int = RECIPE_VERSION

    def __post_init__(self) -> None:
        if self.framework not in ("tensorflow", "torch"):
            raise RecipeError(f"framework must be 'tensorflow' or 'torch', got {self.framework!r}")
        if self.output not in ("probabilities", "logits"):
            raise RecipeError(f"output must be 'probabilities' or 'logits', got {self.output!r}")
        if self.normalisation != "zscore-nonzero":
            raise RecipeError(f"normalisation {self.normalisation!r} is not one distmis applies ('zscore-nonzero')")
        if tuple(self.modalities) != MODALITIES:
            raise RecipeError(f"modalities must be {list(MODALITIES)}, got {list(self.modalities)}")
        if self.version > RECIPE_VERSION:
            raise RecipeError(f"recipe version {self.version} is newer than this distmis reads ({RECIPE_VERSION}): "
                              "upgrade distmis")
        self.preprocess_config  # validates layout, labels, crop and resize
        if self.preprocess_config.num_classes != self.num_classes:
            raise RecipeError(f"labels {self.labels!r} means {self.preprocess_config.num_classes} channel(s), "
                              f"but num_classes is {self.num_classes}")

    @property
    def preprocess_config(self) -> PreprocessConfig:
        try:
            return PreprocessConfig(layout=self.layout, labels=self.labels, crop=self.crop, resize=self.resize)
        except ValueError as exc:
            raise RecipeError(str(exc)) from None

    @property
    def channels_last(self) -> bool:
        return self.framework == "tensorflow"

    @classmethod
    def from_spec(cls, spec: Any, manifest: dict[str, Any]) -> ModelRecipe:
        """The recipe of a model trained by ``spec`` (a trial's, resolved) on the data of ``manifest``."""
        from distmis.spec.curriculum import inference_window

        training, made = spec.training, manifest["preprocess"]
        volume = tuple(int(v) for v in manifest["image_shape"][:3])
        return cls(
            framework=spec.model.framework, model=spec.model.name, layout=made["layout"], labels=made["labels"],
            num_classes=int(manifest["num_classes"]),
            crop=tuple(made["crop"]) if made.get("crop") else None,
            resize=tuple(made["resize"]) if made.get("resize") else None,
            window=inference_window(training) or volume,  # the (last curriculum stage's) training input
            output="logits" if spec.model.name == "vit-seg" else "probabilities",
            inference=InferenceSettings(overlap=training.inference.overlap, mode=training.inference.mode,
                                        sigma_scale=training.inference.sigma_scale,
                                        batch_size=training.inference_batch_size),
            spec_name=spec.name,
        )

    # ------------------------------------------------------------------ the file
    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("window", "crop", "resize", "modalities"):
            out[key] = list(out[key]) if out[key] is not None else None
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelRecipe:
        if not isinstance(data, dict):
            raise RecipeError(f"a recipe is a JSON object, got {type(data).__name__}")
        data = dict(data)
        try:
            data["inference"] = InferenceSettings(**data.get("inference", {}))
            for key in ("window", "crop", "resize", "modalities"):
                if data.get(key) is not None:
                    data[key] = tuple(data[key])
            return cls(**data)
        except TypeError as exc:  # a missing or unknown field
            raise RecipeError(f"not a distmis model recipe: {exc}") from None

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, path: str | Path) -> ModelRecipe:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise RecipeError(f"{str(path)!r} not found: the model was not logged by distmis "
                              f"(its folder has no {RECIPE_FILE})") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RecipeError(f"{str(path)!r} is not valid JSON: {exc}") from None
        try:
            return cls.from_dict(data)
        except RecipeError as exc:
            raise RecipeError(f"{str(path)!r}: {exc}") from None
