"""What a trained model expects of a scan and how it is applied: the ``preprocessing.json`` of every model.

A network alone cannot segment a scan: it needs its input made as its training data were (channels in
order, each normalised by its scheme, reoriented and resampled to the training spacing where asked, cropped or
padded and resized to the training grid), it sees one window (the training tile) at a time, and its output
channels mean what the target scheme says (sigmoid regions or softmax classes, and the label values to write). :class:`ModelRecipe` records all of that from the search's spec and the
TFRecord manifest when the model is logged (an artifact of the MLflow model, ``artifacts/preprocessing.json``;
``extra_files/`` in folders saved before), and the model's code, :mod:`distmis.pyfunc_model`, follows it to the
letter (it reads the file as a plain dict: the model needs no distmis).
"""

from __future__ import annotations

import json
import numbers
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Sequence

from distmis.data.layouts import MODALITIES
from distmis.data.manifest import DataManifest
from distmis.data.preprocess import PreprocessConfig

__all__ = ["RECIPE_FILE", "MEMBER_FIELDS", "ModelRecipe", "RecipeError"]

#: File name of the recipe, in the model's folder (``extra_files/``) and on its trial run.
RECIPE_FILE = "preprocessing.json"
RECIPE_VERSION = 7  # 2: channels of any data set, per-channel normalisation, orientation, spacing, target scheme;
#                    3: ``folds`` (a fold ensemble's networks); 4: ``crop_to_nonzero``; 5: ``inference.mirror``;
#                    6: ``postprocessing``; 7: ``configurations`` (a configuration ensemble's)
#: What a configuration of a configuration ensemble has of its own (the rest of the recipe its configurations share).
MEMBER_FIELDS = ("framework", "model", "window", "output", "inference")


class RecipeError(ValueError):
    """A ``preprocessing.json`` that is missing, unreadable or not one distmis wrote."""


def _check_folds(folds: Any) -> None:
    """A fold ensemble's folds: distinct fold numbers (integers >= 0), in the order of its networks."""
    if not isinstance(folds, tuple) or not all(isinstance(f, int) and not isinstance(f, bool) and f >= 0
                                                for f in folds):
        raise RecipeError(f"folds must be fold numbers (integers >= 0), one per network of a fold ensemble, or "
                          f"empty for one network; got {folds!r}")
    repeated = sorted({f for f in folds if folds.count(f) > 1})
    if repeated:
        raise RecipeError(f"folds {list(folds)} name fold(s) {repeated} more than once: one network per fold")


@dataclass(frozen=True)
class InferenceSettings:
    """Sliding-window inference: windows of the network input overlapping by ``overlap``, blended with
    ``mode`` weights (see :class:`distmis.spec.schema.InferenceSpec`), ``batch_size`` windows a pass; each window
    test-time mirrored on the spatial axes ``mirror`` of the preprocessed volume (sorted, distinct, each 0, 1 or 2;
    :func:`distmis.pyfunc_model.mirrored`: the mean of its ``2**len(mirror)`` flipped predictions). ``()``: no
    mirroring (every recipe written before version 5)."""

    overlap: float = 0.5
    mode: Literal["gaussian", "constant"] = "gaussian"
    sigma_scale: float = 0.125
    batch_size: int = 1
    mirror: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        from distmis.pyfunc_model import check_mirror

        try:
            object.__setattr__(self, "mirror", check_mirror(self.mirror, "inference mirror"))
        except ValueError as exc:
            raise RecipeError(str(exc)) from None


@dataclass(frozen=True)
class ModelRecipe:
    """Everything between a raw scan and the network, and between its output and a label map.

    Attributes:
        framework: ``tensorflow`` (a Keras model, channels-last input) or ``torch`` (channels-first).
        model: the architecture's name in the spec (``unet3d``, ``vit-seg``).
        modalities: the input channels' names, in order (the data set's ``modality`` / ``channel_names``; the
            four BraTS modalities for the BraTS layouts).
        normalisation: ``zscore-nonzero`` in recipes of version 1 (every channel z-scored over its non-zero
            voxels); version 2 records ``normalization`` instead.
        normalization: per channel, ``{"scheme": "zscore"}`` or ``{"scheme": "ct", "lower", "upper", "mean",
            "std"}`` (None: every channel ``zscore``).
        orientation: ``RAS`` when every scan is reoriented there first (None: kept as stored).
        spacing: the voxel spacing (mm) every scan is resampled to (None: kept).
        interpolation: ``linear`` or ``bspline``: how images are resampled to ``spacing``.
        layout: on-disk layout of the data the model was trained on.
        labels: ``whole-tumour``, ``regions`` or ``classes``.
        targets: the target scheme (:mod:`distmis.data.targets`): what each output channel means and which label
            value it is written back with (None in version 1: the BraTS scheme of ``layout`` and ``labels``).
        dataset: the training data set's description (:class:`~distmis.data.description.DatasetDescription`
            as a dict: its channels and labels; None in version 1: the layout's own).
        crop: centre crop / zero pad of the scan before the resize (None: none).
        resize: shape the cropped scan is resampled to (None: none).
        window: the network's input (training tile, or the whole training volume); larger volumes are
            predicted by sliding windows of it, smaller ones zero-padded to it.
        inference: the sliding-window settings, test-time mirroring (``mirror``) included.
        output: what the network returns: ``probabilities`` (its activation inside) or ``logits``.
        threshold: probability at or above which a voxel belongs to a sigmoid channel's region.
        spec_name: the search the model comes from.
        folds: the cross-validation folds of a fold ensemble, in the order of its networks (one network per fold,
            trained with that fold held out; the model averages their probabilities before thresholding or
            argmax); ``()``: one network (every recipe written before version 3).
        postprocessing: the largest-connected-component removals a cross-validated search chose on its
            out-of-fold predictions, ``{"foreground": bool, "channels": [key, ...]}``
            (:func:`distmis.pyfunc_model.postprocess_masks`); None: none (every recipe before version 6).
        configurations: a configuration ensemble's configurations, best ranked first, each a dict of its ``name``
            (its configuration in the search) and its own :data:`MEMBER_FIELDS` (``window`` a list, ``inference``
            a dict), the first's equal to the recipe's own; the model's probabilities are the mean of theirs, each
            its folds' mean (:func:`distmis.pyfunc_model.model_probabilities`); ``()``: one configuration (every
            recipe before version 7). Made by :meth:`combined`; :attr:`members` gives each one's recipe.
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
    crop_to_nonzero: bool = False
    modalities: tuple[str, ...] = MODALITIES
    normalisation: str = "zscore-nonzero"
    normalization: tuple[dict[str, Any], ...] | None = None
    orientation: str | None = None
    spacing: tuple[float, float, float] | None = None
    interpolation: str = "linear"
    targets: dict[str, Any] | None = None
    dataset: dict[str, Any] | None = None
    inference: InferenceSettings = field(default_factory=InferenceSettings)
    threshold: float = 0.5
    spec_name: str = ""
    folds: tuple[int, ...] = ()
    postprocessing: dict[str, Any] | None = None
    configurations: tuple[dict[str, Any], ...] = ()
    version: int = RECIPE_VERSION

    __hash__ = None  # type: ignore[assignment]  # holds dicts

    def __post_init__(self) -> None:
        if self.framework not in ("tensorflow", "torch"):
            raise RecipeError(f"framework must be 'tensorflow' or 'torch', got {self.framework!r}")
        if self.output not in ("probabilities", "logits"):
            raise RecipeError(f"output must be 'probabilities' or 'logits', got {self.output!r}")
        if self.normalisation != "zscore-nonzero":
            raise RecipeError(f"normalisation {self.normalisation!r} is not one distmis applies ('zscore-nonzero')")
        if not self.modalities or not all(isinstance(m, str) and m for m in self.modalities):
            raise RecipeError(f"modalities must name the input channels, got {list(self.modalities)}")
        if self.version > RECIPE_VERSION:
            raise RecipeError(f"recipe version {self.version} is newer than this distmis reads ({RECIPE_VERSION}): "
                              "upgrade distmis")
        _check_folds(self.folds)
        config = self.preprocess_config  # validates layout, labels, crop, resize, normalisation, geometry, targets
        if config.num_classes != self.num_classes:
            raise RecipeError(f"labels {self.labels!r} means {config.num_classes} channel(s), "
                              f"but num_classes is {self.num_classes}")
        if self.postprocessing is not None:
            from distmis.pyfunc_model import check_postprocessing

            try:
                object.__setattr__(self, "postprocessing", check_postprocessing(self.postprocessing, self.scheme))
            except ValueError as exc:
                raise RecipeError(str(exc)) from None
        if self.configurations:
            self._check_configurations()

    def _check_configurations(self) -> None:
        """A configuration ensemble's configurations: 2 or more, named once each, each with exactly its name and
        :data:`MEMBER_FIELDS`, each a valid recipe over the shared fields, the first the recipe's own."""
        members = self.configurations
        if not isinstance(members, tuple) or len(members) < 2 or not all(isinstance(m, dict) for m in members):
            raise RecipeError(f"configurations must list 2 or more configurations (objects) of a configuration "
                              f"ensemble, or be empty for one configuration; got {members!r}")
        names = [member.get("name") for member in members]
        if not all(isinstance(name, str) and name for name in names) or len(set(names)) != len(names):
            raise RecipeError(f"the configurations of a configuration ensemble need distinct names, got {names}")
        wanted = {"name", *MEMBER_FIELDS}
        for member in members:
            if set(member) != wanted:
                raise RecipeError(f"configuration {member['name']!r} must hold exactly {sorted(wanted)}, got "
                                  f"{sorted(member)}")
        first = self.members[0]
        if _member_fields(first) != _member_fields(replace(self, configurations=())):
            raise RecipeError(f"the first configuration ({names[0]!r}) must be the recipe's own (its framework, "
                              f"model, window, output and inference): {_member_fields(first)} differs from "
                              f"{_member_fields(replace(self, configurations=()))}")

    @property
    def members(self) -> list[ModelRecipe]:
        """Each configuration's own recipe (a configuration ensemble's, best ranked first), or ``[self]``."""
        if not self.configurations:
            return [self]
        found = []
        for member in self.configurations:
            fields = {key: member[key] for key in MEMBER_FIELDS}
            try:
                fields["window"] = tuple(fields["window"])
                fields["inference"] = InferenceSettings(**fields["inference"])
                found.append(replace(self, configurations=(), **fields))
            except (TypeError, RecipeError) as exc:
                raise RecipeError(f"configuration {member.get('name')!r}: {exc}") from None
        return found

    @property
    def names(self) -> tuple[str, ...]:
        """A configuration ensemble's configurations' names (``()`` for one configuration)."""
        return tuple(member["name"] for member in self.configurations)

    @property
    def network_count(self) -> int:
        """How many networks the model holds: one per fold (or one) of each configuration."""
        return len(self.members) * (len(self.folds) or 1)

    @classmethod
    def combined(cls, named: Sequence[tuple[str, ModelRecipe]]) -> ModelRecipe:
        """The recipe of a configuration ensemble of ``named`` (its configurations' names and recipes, best
        first), which must share everything but :data:`MEMBER_FIELDS` (one search's preprocessing, targets, folds
        and postprocessing) and their test-time mirroring (``inference.mirror``); one configuration: its own
        recipe."""
        if not named:
            raise RecipeError("a configuration ensemble needs a configuration")
        if len(named) == 1:
            return named[0][1]
        shared = [_shared_fields(recipe) for _, recipe in named]
        for (name, _), fields in zip(named[1:], shared[1:]):
            differ = sorted(key for key in fields if fields[key] != shared[0][key])
            if differ:
                raise RecipeError(f"configuration {name!r} differs from {named[0][0]!r} in {differ}: the "
                                  "configurations of an ensemble share their preprocessing, targets and folds")
        mirrors = {name: recipe.inference.mirror for name, recipe in named}
        if len(set(mirrors.values())) > 1:
            raise RecipeError(f"the configurations of an ensemble mirror on the same axes (the model's mirror "
                              f"parameter is one for all), got {mirrors}")
        members = tuple({"name": name, **_member_fields(recipe)} for name, recipe in named)
        return replace(named[0][1], configurations=members)

    @property
    def preprocess_config(self) -> PreprocessConfig:
        try:
            return PreprocessConfig(layout=self.layout, labels=self.labels, crop=self.crop, resize=self.resize,
                                    crop_to_nonzero=self.crop_to_nonzero,
                                    channels=self.modalities, normalization=self.normalization,
                                    orientation=self.orientation, spacing=self.spacing,
                                    interpolation=self.interpolation,  # type: ignore[arg-type]
                                    targets=self.targets)
        except ValueError as exc:
            raise RecipeError(str(exc)) from None

    @property
    def scheme(self) -> dict[str, Any]:
        """The target scheme (for a version-1 recipe, the BraTS one of its layout and label mode)."""
        return self.preprocess_config.scheme

    @property
    def description(self) -> Any:
        """The training data set's :class:`~distmis.data.description.DatasetDescription` (for a recipe that does
        not record it, its layout's own)."""
        from distmis.data.dataset_layouts import layout_description
        from distmis.data.description import DatasetDescription

        if self.dataset is not None:
            return DatasetDescription.from_dict(self.dataset)
        return layout_description(self.layout)

    @property
    def brain_tumour(self) -> bool:
        """Whether the model predicts the BraTS whole tumour or regions of a brain-tumour layout: it can write the
        label values of another brain-tumour layout (a BraTS scan segmented by an MSD-trained model)."""
        from distmis.pyfunc_model import brain_tumour

        return brain_tumour({"layout": self.layout, "labels": self.labels, "targets": self.scheme})

    @property
    def channels_last(self) -> bool:
        return self.framework == "tensorflow"

    @property
    def ensemble(self) -> bool:
        """Whether the model is a fold ensemble (several networks, one per fold of ``folds``)."""
        return bool(self.folds)

    @classmethod
    def from_spec(cls, spec: Any, manifest: DataManifest, folds: Sequence[int] = (),
                  postprocessing: dict[str, Any] | None = None) -> ModelRecipe:
        """The recipe of a model trained by ``spec`` (a trial's, resolved) on the data of ``manifest``; ``folds``:
        the folds of a fold ensemble, one network each, in the order of its networks (empty: one network);
        ``postprocessing``: what its cross-validation chose (None: none)."""
        from distmis.spec.curriculum import inference_window

        training = spec.training
        made = PreprocessConfig.from_dict(manifest.preprocess)
        volume = manifest.volume
        return cls(
            framework=spec.model.framework, model=spec.model.name, layout=made.layout.value,
            labels=made.labels.value, num_classes=manifest.num_classes, crop=made.crop, resize=made.resize,
            crop_to_nonzero=made.crop_to_nonzero,
            modalities=tuple(manifest.channels or made.channels or MODALITIES),
            normalization=made.normalization, orientation=made.orientation, spacing=made.spacing,
            interpolation=made.interpolation, targets=made.scheme, dataset=manifest.dataset,
            window=inference_window(training) or volume,  # the (last curriculum stage's) training input
            output=spec.model.entry.output,  # what the network returns (its registry entry says)
            inference=InferenceSettings(overlap=training.inference.overlap, mode=training.inference.mode,
                                        sigma_scale=training.inference.sigma_scale,
                                        batch_size=training.inference_batch_size,
                                        mirror=tuple(training.inference.mirror)),
            spec_name=spec.name,
            folds=tuple(int(f) if isinstance(f, numbers.Integral) and not isinstance(f, bool) else f for f in folds),
            postprocessing=postprocessing,
        )

    # ------------------------------------------------------------------ the file
    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("window", "crop", "resize", "modalities", "spacing", "normalization", "folds"):
            out[key] = list(out[key]) if out[key] is not None else None
        out["inference"]["mirror"] = list(out["inference"]["mirror"])
        out["configurations"] = [dict(member) for member in self.configurations]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelRecipe:
        if not isinstance(data, dict):
            raise RecipeError(f"a recipe is a JSON object, got {type(data).__name__}")
        data = dict(data)
        try:
            data["inference"] = InferenceSettings(**data.get("inference", {}))
            for key in ("window", "crop", "resize", "modalities", "spacing", "normalization", "folds",
                        "configurations"):
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


def _member_fields(recipe: ModelRecipe) -> dict[str, Any]:
    """A configuration's own fields (:data:`MEMBER_FIELDS`), as its recipe's JSON holds them."""
    out = recipe.to_dict()
    return {key: out[key] for key in MEMBER_FIELDS}


def _shared_fields(recipe: ModelRecipe) -> dict[str, Any]:
    """What the configurations of an ensemble share: the recipe's JSON but its :data:`MEMBER_FIELDS`, its
    ``configurations``, ``spec_name`` and ``version``."""
    out = recipe.to_dict()
    return {key: value for key, value in out.items()
            if key not in {*MEMBER_FIELDS, "configurations", "spec_name", "version"}}
