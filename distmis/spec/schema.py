"""The search spec: what a researcher writes in YAML, as pydantic models.

Every section forbids unknown keys, so a typo (``lrr: 1e-3``) is an error rather than a silently
ignored setting. Cross-field rules that need more than one section (a tile the U-Net can pool,
search-space paths that exist) live in :mod:`distmis.spec.load`.
"""

from __future__ import annotations

import math
import os
import posixpath
import re
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, SerializeAsAny,
                      SerializerFunctionWrapHandler, ValidationError, ValidationInfo, field_validator, model_serializer,
                      model_validator)
from pydantic_core import PydanticCustomError

from distmis.models.params import NetworkParams
from distmis.models.registry import ModelEntry, model_entry, model_names
from distmis.spec.searchers import ALGORITHMS, SCHEDULERS, algorithm_entry, scheduler_entry

Shape3 = Annotated[tuple[int, int, int], Field(description="(H, W, D) in voxels")]


class StrictModel(BaseModel):
    """Base for every spec section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _check_positive_shape(shape: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
    if shape is not None and any(s < 1 for s in shape):
        raise ValueError(f"every dimension must be >= 1, got {list(shape)}")
    return shape


# --------------------------------------------------------------------------- dataset
class SplitSpec(StrictModel):
    """Fractions of cases for training, validation and test, and the seed of the shuffle.

    ``folds: k`` (cross-validation): the ``test`` fraction is kept aside as without folds, and the other cases are
    split into k folds by the same seeded shuffle; a trial trains on k - 1 folds and validates on the one left out
    (which: ``search.folds``). ``train`` and ``val`` are then not given. ``fold`` is the fold one trial validates
    on: the search sets it for each trial, a spec does not.
    """

    train: float = Field(0.7, gt=0, lt=1)
    val: float = Field(0.15, gt=0, lt=1)
    test: float = Field(0.15, ge=0, lt=1)
    seed: int = 0
    folds: int | None = Field(None, ge=2, le=100, description="cross-validation: split the non-test cases into this "
                                                             "many folds")
    fold: int | None = Field(None, ge=0, description="the fold a trial validates on (set by the search per trial)")

    @model_validator(mode="after")
    def _fractions_sum_to_one(self) -> SplitSpec:
        if self.folds is not None:
            # a trial's spec is rebuilt from a whole dump (the defaults included): only other values are refused
            given = [name for name in ("train", "val") if name in self.model_fields_set
                     and getattr(self, name) != type(self).model_fields[name].default]
            if given:
                raise ValueError(f"with folds, every non-test case is in one fold: give test (and seed) only, not "
                                 f"{' or '.join(given)}")
            if self.fold is not None and self.fold >= self.folds:
                raise ValueError(f"fold {self.fold} is not one of the {self.folds} folds (0 to {self.folds - 1})")
            return self
        if self.fold is not None:
            raise ValueError(f"fold {self.fold} needs folds (dataset.split.folds: k)")
        total = self.train + self.val + self.test
        if not math.isclose(total, 1.0, abs_tol=1e-6):
            raise ValueError(f"train + val + test must be 1, got {total:g}")
        return self


class SyntheticSpec(StrictModel):
    """Generate a synthetic dataset at ``dataset.path`` when that folder does not exist.

    ``kind``: ``brain`` (four MRI channels, a tumour with three nested labels) or ``ct`` (one CT-like channel, three
    organ classes, anisotropic spacings that differ between cases; ``msd`` and ``nnunet`` layouts). ``lps_cases``:
    how many of the cases (the last ones) are written in LPS orientation (the rest RAS)."""

    cases: int = Field(10, ge=3, le=10_000)
    shape: Shape3 = (64, 64, 64)
    seed: int = 0
    kind: Literal["brain", "ct"] = "brain"
    lps_cases: int = Field(0, ge=0)

    _shape = field_validator("shape")(_check_positive_shape)

    @model_validator(mode="after")
    def _lps_fits(self) -> SyntheticSpec:
        if self.lps_cases > self.cases:
            raise ValueError(f"lps_cases ({self.lps_cases}) must be at most cases ({self.cases})")
        return self


NormalizationScheme = Literal["zscore", "ct"]


class DatasetSpec(StrictModel):
    """The data: where and how it is laid out, what to predict, and how intensities and geometry are made uniform.

    ``normalization``: one scheme for every channel, one per channel (a list), or ``{channel name: scheme}``; a
    channel not named follows its name (``CT`` -> ``ct``, anything else ``zscore``, nnU-Net's rule).
    ``orientation: RAS`` reorients every case first. ``spacing``: resample every case to this voxel spacing in mm,
    ``[x, y, z]`` along the (reoriented) array axes, or ``auto``: the median spacing of the non-test cases, as
    nnU-Net picks it (with its rule for an anisotropic axis: :func:`distmis.data.statistics.anisotropic_target`).
    ``interpolation``: how images are resampled (labels: nearest neighbour). ``crop_to_nonzero: true`` crops every
    case to the box of its image's non-zero voxels first (any channel, as nnU-Net crops; the label with it), before
    reorientation and resampling: the zero border of a skull-stripped MRI goes, and ``crop`` (needed with it) centres
    the cases' regions in one shape. ``distmis predict`` and the registered model crop a scan the same way and put
    the prediction back in place (background outside the box).
    """

    path: str = Field(min_length=1)
    layout: Literal["msd", "nnunet", "brats", "brats2023"] = "msd"
    labels: Literal["whole-tumour", "regions", "classes"] = "whole-tumour"
    normalization: NormalizationScheme | list[NormalizationScheme] | dict[str, NormalizationScheme] | None = None
    orientation: Literal["RAS"] | None = None
    spacing: Literal["auto"] | tuple[float, float, float] | None = None
    interpolation: Literal["linear", "bspline"] = "linear"
    crop: Shape3 | None = None
    crop_to_nonzero: bool = False
    resize: Shape3 | None = None
    split: SplitSpec = SplitSpec()
    synthetic: SyntheticSpec | None = None

    _shapes = field_validator("crop", "resize")(_check_positive_shape)

    @field_validator("spacing")
    @classmethod
    def _positive_spacing(cls, value: Any) -> Any:
        if isinstance(value, tuple) and not all(math.isfinite(v) and v > 0 for v in value):
            raise ValueError(f"spacing must be 'auto' or three positive numbers (mm), got {list(value)}")
        return value

    @model_validator(mode="after")
    def _nonzero_crop_has_a_shape(self) -> DatasetSpec:
        if self.crop_to_nonzero and self.crop is None:
            raise ValueError("crop_to_nonzero needs crop: [x, y, z], the one shape the cases' non-zero regions are "
                             "centre-cropped or padded to (their shapes differ; distmis init proposes one)")
        return self

    @model_validator(mode="after")
    def _synthetic_fits_layout(self) -> DatasetSpec:
        if self.synthetic is not None and self.synthetic.kind == "ct" and self.layout not in ("msd", "nnunet"):
            raise ValueError(f"synthetic.kind 'ct' is written in the 'msd' or 'nnunet' layout, not {self.layout!r}")
        return self

    @property
    def num_classes(self) -> int:
        """Output channels as far as the spec alone tells (the performance model's estimate; the trainers read the
        data's own): 1 for whole-tumour, 3 for regions, 4 for classes (the data set's classes + background)."""
        return {"whole-tumour": 1, "regions": 3}.get(self.labels, 4)

    @property
    def in_channels(self) -> int:
        """Image channels as far as the spec alone tells: 4 for the brain-tumour layouts and the synthetic brain,
        1 for a synthetic CT, else 4 (the trainers read the data's own count)."""
        if self.synthetic is not None and self.synthetic.kind == "ct":
            return 1
        return 4


# --------------------------------------------------------------------------- model
def unknown_argument(model: str, key: str) -> str:
    """The message of a ``model.params`` key that ``model``'s constructor does not take, naming the ones it takes."""
    allowed = ", ".join(model_entry(model).params.model_fields)
    return f"{model} takes no argument {key!r}; allowed: {allowed}"


def _line_error(err: Any, loc: tuple[Any, ...]) -> dict[str, Any]:
    """One of pydantic's errors (``ValidationError.errors()``) at ``loc``, to raise again."""
    if err["type"] in ("unknown_argument", "unknown_model"):  # ours: the message is whole
        return {"type": PydanticCustomError(err["type"], err["msg"]), "loc": loc, "input": err["input"]}
    return {**{k: err[k] for k in ("type", "input", "ctx") if k in err}, "loc": loc}


def validate_params(model: str, value: Any) -> NetworkParams:
    """``value`` (a mapping, or params) validated by the params class of the registered ``model``; a
    ValidationError whose unknown keys name the model and every argument it takes."""
    params_class = model_entry(model).params
    if isinstance(value, BaseModel):
        value = value.model_dump()
    try:
        return params_class.model_validate({} if value is None else value)
    except ValidationError as exc:
        errors = []
        for err in exc.errors():
            if err["type"] == "extra_forbidden":
                # a message with no {placeholders}: the allowed names hold no braces
                message = unknown_argument(model, str(err["loc"][-1]))
                errors.append({"type": PydanticCustomError("unknown_argument", message), "loc": err["loc"],
                               "input": err["input"]})
            else:
                errors.append(_line_error(err, err["loc"]))
        raise ValidationError.from_exception_data(exc.title, errors) from None


class ModelSpec(StrictModel):
    """Which registered network (:mod:`distmis.models.registry`) a trial trains, in which framework, with which
    constructor arguments (``params``: the entry's params class validates them).

    ``per_model``: when ``search.space`` searches ``model.name``, the params of each model it may pick other than
    this one (``{swinunetr: {feature_size: 12}}``): a trial that picks another model takes that model's entry here as
    its ``model.params`` (its defaults when it has none), with the trial's searched ``model.params.*`` on top."""

    name: str = Field("unet3d", description="a registered network: " + ", ".join(model_names()))
    framework: Literal["tensorflow", "torch"] = "tensorflow"
    # The params' fields depend on the model: validated by the params class of ``name``'s registry entry.
    params: SerializeAsAny[NetworkParams] = Field(default=None, validate_default=True)  # type: ignore[assignment]
    per_model: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="params for the models a searched model.name may pick: "
                                          "{swinunetr: {feature_size: 12}}")

    @field_validator("name")
    @classmethod
    def _registered(cls, value: str) -> str:
        model_entry(value)  # ValueError naming the registered networks
        return value

    @field_validator("params", mode="before")
    @classmethod
    def _params_of_the_model(cls, value: Any, info: ValidationInfo) -> Any:
        if "name" not in info.data:  # the name was refused: its own error says why
            raise ValueError("the model's params are validated once model.name is a registered network")
        return validate_params(info.data["name"], value)

    @field_validator("per_model")
    @classmethod
    def _params_of_each_model(cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        errors, checked = [], {}
        for model, params in value.items():
            if model not in model_names():
                errors.append({"type": PydanticCustomError("unknown_model", f"no model {model!r}; registered: "
                                                                            f"{', '.join(model_names())}"),
                               "loc": (model,), "input": model})
                continue
            try:
                checked[model] = validate_params(model, params).model_dump(exclude_unset=True)
            except ValidationError as exc:
                errors += [_line_error(err, (model, *err["loc"])) for err in exc.errors()]
        if errors:
            raise ValidationError.from_exception_data("per_model", errors)
        return checked

    @model_validator(mode="after")
    def _per_model_names_other_models(self) -> ModelSpec:
        if self.name in self.per_model:
            raise ValueError(f"per_model names {self.name!r}, which is model.name: its params are model.params "
                             "(per_model holds the params of the other models a searched model.name may pick)")
        return self

    @model_validator(mode="after")
    def _framework_of_the_model(self) -> ModelSpec:
        entry = self.entry
        if self.framework not in entry.frameworks:
            raise ValueError(f"model {self.name!r} is built in {' and '.join(entry.frameworks)} only: set framework: "
                             f"{entry.frameworks[0]} (got {self.framework!r})")
        return self

    @property
    def entry(self) -> ModelEntry:
        """The network's registry entry."""
        return model_entry(self.name)

    @property
    def input_multiple(self) -> int:
        """Every spatial dimension of the network input must divide by this (pooling, or patch size)."""
        return self.entry.input_multiple(self.params)

    @property
    def input_rule(self) -> str:
        return self.entry.input_rule(self.params)


# --------------------------------------------------------------------------- training
#: ``training.optimizer.name``: the optimizers a trial may train with. Each is built for both frameworks by its
#: entry in :mod:`distmis.train.optimizers` (the spec imports no trainer code; a test keeps the two lists equal).
OptimizerName = Literal["adam", "adamw", "sgd"]

#: The fields of :class:`OptimizerSpec` each optimizer takes besides ``name`` and ``lr``.
OPTIMIZER_FIELDS: dict[str, tuple[str, ...]] = {
    "adam": ("beta1", "beta2", "amsgrad", "epsilon", "weight_decay"),
    "adamw": ("beta1", "beta2", "amsgrad", "epsilon", "weight_decay"),
    "sgd": ("momentum", "nesterov", "weight_decay"),
}

#: ``weight_decay`` when the spec gives none: none for Adam and SGD, torch's ``AdamW`` default for AdamW.
DEFAULT_WEIGHT_DECAY: dict[str, float] = {"adam": 0.0, "adamw": 0.01, "sgd": 0.0}


class OptimizerSpec(StrictModel):
    """The optimizer of a trial, the same in both frameworks (built by :mod:`distmis.train.optimizers`).

    - ``adam``: Adam (``beta1``, ``beta2``, ``epsilon``, ``amsgrad``); ``weight_decay`` is an L2 term added to the
      gradient (torch's ``Adam(weight_decay=)``), 0 by default.
    - ``adamw``: the same Adam with decoupled weight decay, ``w -= lr * weight_decay * w`` at each step beside the
      update (Loshchilov and Hutter; torch's ``AdamW``, Keras's ``AdamW``), 0.01 by default as torch's.
    - ``sgd``: SGD with ``momentum`` (0.99) and Nesterov's momentum (``nesterov``: on by default where momentum > 0),
      nnU-Net v2's optimizer; ``weight_decay`` is L2 added to the gradient, so it goes through the momentum
      (torch's ``SGD(weight_decay=)``), 0 by default (nnU-Net: 3e-5, with lr 1e-2).

    A field that does not apply to ``name`` (``momentum`` with ``adam``, ``amsgrad`` with ``sgd``) is refused when it
    is given a value other than its default (a resolved spec's dump and a trial's rebuilt section hold every field
    at its default). ``nesterov`` and ``weight_decay`` are None unless given: :attr:`effective_nesterov` and
    :attr:`effective_weight_decay` are what the optimizer uses. A dump (``model_dump``) holds the fields of the
    chosen optimizer only, those two resolved.
    """

    name: OptimizerName = "adam"
    lr: float = Field(1e-4, gt=0, le=10)
    beta1: float = Field(0.9, ge=0, lt=1, description="adam, adamw")
    beta2: float = Field(0.999, ge=0, lt=1, description="adam, adamw")
    amsgrad: bool = Field(False, description="adam, adamw")
    epsilon: float = Field(1e-7, gt=0, description="adam, adamw")
    momentum: float = Field(0.99, ge=0, lt=1, description="sgd (nnU-Net v2: 0.99)")
    nesterov: bool | None = Field(None, description="sgd: Nesterov's momentum (default: on where momentum > 0)")
    weight_decay: float | None = Field(None, ge=0, allow_inf_nan=False,
                                       description="all: L2 on the gradient (adam, sgd; default 0) or decoupled "
                                                   "(adamw; default 0.01)")

    @field_validator("beta1", "beta2", "amsgrad", "epsilon", "momentum", "nesterov")
    @classmethod
    def _applies_to_the_optimizer(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.data.get("name")
        field = info.field_name
        if name not in OPTIMIZER_FIELDS or field in OPTIMIZER_FIELDS[name]:  # an unknown name has its own error
            return value
        if value == cls.model_fields[field].default:  # a whole section (a dump, a trial's rebuild) holds defaults
            return value
        takers = ", ".join(other for other, fields in OPTIMIZER_FIELDS.items() if field in fields)
        raise ValueError(f"{field} does not apply to optimizer {name!r}, which takes lr, "
                         f"{', '.join(OPTIMIZER_FIELDS[name])} ({field} goes with {takers})")

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> OptimizerSpec:
        if self.name == "sgd" and self.nesterov and self.momentum == 0:
            raise ValueError("nesterov: true needs momentum > 0 (Nesterov's momentum without momentum is plain SGD, "
                             "and torch refuses it): give momentum > 0, or nesterov: false")
        return self

    @property
    def effective_nesterov(self) -> bool:
        """Whether SGD uses Nesterov's momentum: ``nesterov``, or, not given, whenever ``momentum`` > 0."""
        return self.momentum > 0 if self.nesterov is None else self.nesterov

    @property
    def effective_weight_decay(self) -> float:
        """``weight_decay``, or the optimizer's default (:data:`DEFAULT_WEIGHT_DECAY`)."""
        return DEFAULT_WEIGHT_DECAY[self.name] if self.weight_decay is None else self.weight_decay

    @model_serializer(mode="wrap")
    def _only_the_optimizers_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The chosen optimizer's fields only, ``nesterov`` and ``weight_decay`` resolved: what a run's resolved spec
        and its tracked parameters show is what the trial trains with (and rebuilds to the same spec)."""
        data = handler(self)
        resolved = {"nesterov": self.effective_nesterov, "weight_decay": self.effective_weight_decay}
        taken = OPTIMIZER_FIELDS[self.name]
        return {key: resolved.get(key, value) for key, value in data.items()
                if key in ("name", "lr") or key in taken}


class LossSpec(StrictModel):
    """Soft dice per sample (and per channel), averaged; ``dice-bce`` adds binary cross-entropy; ``dice-ce`` adds
    cross-entropy: categorical over the classes for ``dataset.labels: classes`` (dice over the foreground classes, as
    nnU-Net), binary otherwise (the same as ``dice-bce``)."""

    name: Literal["dice", "dice-bce", "dice-ce"] = "dice"
    smooth: float = Field(1.0, ge=0)


InferenceMode = Literal["gaussian", "constant"]


class InferenceSpec(StrictModel):
    """Whole-volume prediction by sliding windows of the network input (the tile), for validation and test.

    Windows overlap by ``overlap`` of their size; where they overlap, predictions are averaged with weights
    that are constant or a Gaussian centred on each window (``sigma_scale`` times the window per axis), as
    nnU-Net and MONAI do: a window's borders, where context is missing, count less.
    """

    overlap: float = Field(0.5, ge=0, lt=1)
    mode: InferenceMode = "gaussian"
    sigma_scale: float = Field(0.125, gt=0)
    batch_size: int | None = Field(None, ge=1, description="windows per forward pass (default training.batch_size)")
    compare: bool = Field(False, description="after training, time and score the best epoch's model on the "
                                             "validation cases by whole-volume and by sliding-window inference "
                                             "(LAMP's question; U-Nets)")
    mirror: list[int] = Field(default_factory=list, description=(
        "test-time mirroring (nnU-Net's: [0, 1, 2]): the spatial axes 0, 1, 2 of the preprocessed volume each "
        "sliding window is flipped on; a window's prediction is the mean of its 2^k flipped predictions' "
        "probabilities, flipped back. Applied to the test split and by the published model (recorded in its recipe), "
        "not to validation during training, which it would cost 2^k times as much (8x for all three axes). "
        "[]: off"))

    @field_validator("mirror", mode="before")
    @classmethod
    def _mirror_axes(cls, value: Any) -> Any:
        # the rule of distmis.pyfunc_model.check_mirror, which the model applies (the spec does not import it)
        allowed = "a list of distinct spatial axes 0, 1, 2 (e.g. [0, 1, 2]; [] for none)"
        axes = [value] if isinstance(value, int) and not isinstance(value, bool) else value
        if not isinstance(axes, (list, tuple)) or any(isinstance(a, bool) or a not in (0, 1, 2) or
                                                      not isinstance(a, int) for a in axes):
            raise ValueError(f"mirror must be {allowed}")  # the loader adds the value given
        repeated = sorted({a for a in axes if list(axes).count(a) > 1})
        if repeated:
            raise ValueError(f"mirror {list(axes)} names axis(es) {repeated} more than once; it must be {allowed}")
        return sorted(axes)


#: ``training.precision``: fp32, or mixed precision with fp32 master weights computing in bfloat16 or float16, or
#: ``auto``: bf16 where the trial's device computes it natively, else fp32 (:mod:`distmis.train.auto_precision`).
Precision = Literal["fp32", "bf16", "fp16", "auto"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "auto")

LRScheduleName = Literal["constant", "cosine", "cyclic", "poly"]
ScheduleInterval = Literal["epoch", "step"]

# The trough of a schedule whose min_factor is not given: cosine anneals to 0 (PyTorch's CosineAnnealingLR);
# a cyclic schedule swings between a quarter of the peak and the peak (Smith 2017 sets the base 3-4 times lower).
DEFAULT_TROUGH = {"cosine": 0.0, "cyclic": 0.25}


class LRScheduleSpec(StrictModel):
    """How the learning rate moves during a trial; ``training.optimizer.lr`` (scaled for data parallelism) is
    its peak. The formulas: :mod:`distmis.train.schedules`."""

    name: LRScheduleName = "constant"
    interval: ScheduleInterval = Field("epoch", description="change the rate at every epoch's start or every step")
    warmup_epochs: float = Field(0.0, ge=0, description="linear warm-up first, from warmup_start_factor x peak")
    warmup_start_factor: float = Field(0.1, gt=0, le=1)
    min_factor: float | None = Field(None, ge=0, lt=1, description="cosine's end, cyclic's trough, x peak")
    cycle_epochs: float = Field(4.0, gt=0, description="cyclic: the length of one up-and-down cycle")
    power: float = Field(0.9, gt=0, description="poly: the exponent (nnU-Net: 0.9)")

    @property
    def trough_factor(self) -> float:
        """``min_factor``, or the schedule's own default (:data:`DEFAULT_TROUGH`)."""
        return self.min_factor if self.min_factor is not None else DEFAULT_TROUGH.get(self.name, 0.0)


Probability = Annotated[float, Field(ge=0, le=1)]


class AugmentSpec(StrictModel):
    """Random transforms of the training inputs (never of validation or test), the same in both frameworks:
    MONAI's dictionary transforms for torch (:mod:`distmis.data.augment_torch`), graph ops inside the ``tf.data``
    pipeline for TensorFlow (:mod:`distmis.data.augment_tf`). Applied to each training input after its tile is cut,
    in the order below; geometric transforms move image and label together (the image interpolated linearly, the
    label by nearest neighbour, zeros outside), intensity transforms touch the image only. Draws are seeded by
    ``training.seed`` and the epoch.

    Off unless ``enabled``; the probabilities and ranges below are then the recipe (flips and small rotations
    and zooms as the seeds use, nnU-Net's intensity probabilities), each searchable by its path.
    """

    enabled: bool = False
    flip: Probability = Field(0.5, description="mirror along each spatial axis, drawn per axis")
    rotate90: Probability = Field(0.0, description="k x 90 degrees (k in 1..3), drawn per plane of equal extents")
    affine: Probability = Field(0.2, description="a small rotation and zoom")
    rotate_degrees: float = Field(15.0, ge=0, le=180, description="affine: rotation about each axis in +-this")
    scale_range: float = Field(0.1, ge=0, lt=1, description="affine: zoom factor in 1 +- this, per axis")
    elastic: Probability = Field(0.0, description="elastic deformation (smoothed random displacements)")
    elastic_sigma: tuple[float, float] = Field((5.0, 8.0), description="voxels: the smoothing Gaussian's sigma")
    elastic_magnitude: tuple[float, float] = Field((100.0, 200.0), description="x the smoothed unit noise, voxels")
    intensity_scale: Probability = Field(0.15, description="multiply the image by 1 + u, u in +-range")
    intensity_scale_range: float = Field(0.1, ge=0, lt=1)
    intensity_shift: Probability = Field(0.15, description="add u in +-range to the image")
    intensity_shift_range: float = Field(0.1, ge=0)
    noise: Probability = Field(0.15, description="add Gaussian noise of a std drawn in [0, noise_std]")
    noise_std: float = Field(0.1, ge=0)

    @field_validator("elastic_sigma", "elastic_magnitude")
    @classmethod
    def _ordered_range(cls, value: tuple[float, float], info: ValidationInfo) -> tuple[float, float]:
        low, high = value
        if not 0 <= low <= high:
            raise ValueError(f"{info.field_name} must be [low, high] with 0 <= low <= high, got {list(value)}")
        if info.field_name == "elastic_sigma" and low <= 0:
            raise ValueError(f"elastic_sigma must be positive, got {list(value)}")
        return value

    @property
    def active(self) -> bool:
        """Whether any transform can fire."""
        probabilities = (self.flip, self.rotate90, self.affine, self.elastic, self.intensity_scale,
                         self.intensity_shift, self.noise)
        return self.enabled and any(p > 0 for p in probabilities)


class CurriculumStageSpec(StrictModel):
    """One stage of ``training.curriculum``: ``epochs`` epochs on ``tile`` (null: the whole volume) in batches of
    ``batch_size`` (default ``training.batch_size``), ``tile_sampling`` of the tiles centred on foreground
    (default ``training.tile_sampling``)."""

    tile: Shape3 | None
    epochs: int = Field(ge=1, le=100_000)
    batch_size: int | None = Field(None, ge=1)
    tile_sampling: float | None = Field(None, ge=0, le=1)

    _tile = field_validator("tile")(_check_positive_shape)

    @model_validator(mode="after")
    def _sampling_needs_a_tile(self) -> CurriculumStageSpec:
        if self.tile_sampling and self.tile is None:
            raise ValueError(f"tile_sampling ({self.tile_sampling:g}) needs a tile: a stage with tile null trains on "
                             "whole volumes")
        return self


#: ``training.recipe``: the registered recipes (:data:`distmis.spec.recipes.RECIPES`; a test keeps them equal).
RecipeName = Literal["nnunet"]


class PerformanceSpec(StrictModel):
    """``training.performance``: how a torch trial's training step runs, chosen by measuring
    (:mod:`distmis.train.step_settings`); what it computes stays the same."""

    memory_format: Literal["auto", "contiguous", "channels_last"] = Field(
        "auto", description="the layout of the torch network's 3D activations and convolution weights: contiguous "
                            "(channels first, PyTorch's default) or channels_last (torch.channels_last_3d). auto: a "
                            "trial of one process times a few training steps in each on a copy of its network at its "
                            "start (or reads an earlier measurement of the same network, input, batch, precision and "
                            "device from the cache) and trains in the faster; a trial over several processes trains "
                            "contiguous. The TensorFlow U-Net is channels-last already")
    compile: Literal["auto", "off", "on"] = Field(
        "auto", description="the torch training step through torch.compile (TorchInductor). on: compiled, eager with "
                            "the reason logged where the network does not compile; off: eager. auto: a trial of one "
                            "process whose planned training is at least ten minutes long measures the compiled step "
                            "on a copy of its network (or reads the measurement from the cache) and compiles where the "
                            "time saved over its planned steps exceeds the compilation's; shorter trials run eager. "
                            "Trials split by sequence parallelism or pipeline stages run eager. TensorFlow: on "
                            "compiles the step with XLA (jit_compile; trials of one replica, parallelism.mode "
                            "experiment); off runs the traced graph; auto: a trial of one replica whose planned "
                            "training left after its first epoch is at least ten minutes runs its next steps through "
                            "XLA and keeps the faster step (XLA's step measured 16x slower on a CPU)")


class TrainingSpec(StrictModel):
    epochs: int = Field(10, ge=1, le=100_000)
    batch_size: int = Field(2, ge=1)
    tile: Shape3 | None = None
    tile_sampling: float = Field(0.0, ge=0, le=1, description="fraction of training tiles centred on foreground")
    steps_per_epoch: int | None = Field(
        None, ge=1, le=1_000_000, description="the training steps (batches per data-parallel replica) of an epoch; "
                                              "the cases are drawn in seeded passes over the training split, one "
                                              "pass continuing where the last epoch stopped. null: one pass over the "
                                              "training cases (nnU-Net: 250)")
    optimizer: OptimizerSpec = OptimizerSpec()
    clip_grad_norm: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="before each step the trial's whole gradient is scaled to this global L2 norm where it is larger "
                    "(torch's clip_grad_norm_ rule, in both frameworks; nnU-Net v2: 12). null: no clipping")
    lr_schedule: LRScheduleSpec = LRScheduleSpec()
    augment: AugmentSpec = AugmentSpec()
    loss: LossSpec = LossSpec()
    inference: InferenceSpec = InferenceSpec()
    seed: int = 0
    precision: Precision = Field(
        "fp32", description="fp32, or mixed precision: bf16 (the forward computes in bfloat16) or fp16 (float16, "
                            "the loss scaled against underflow); the weights, gradients and optimizer state stay "
                            "fp32 either way. auto: bf16 where the trial's device computes bfloat16 natively (a GPU "
                            "of compute capability 8.0 or later, a CPU with AVX512-BF16 or AMX), fp32 otherwise, "
                            "resolved in the trial's process; the driver plans memory for it as for fp32")
    performance: PerformanceSpec = PerformanceSpec()
    cudnn_benchmark: bool = Field(
        False, description="torch on a GPU: cuDNN times its convolution algorithms for each new input shape and "
                           "keeps the fastest (torch.backends.cudnn.benchmark). Faster steps for a trial's fixed "
                           "tiles, at the cost of a slower first step per shape and an algorithm choice that can "
                           "differ between runs, so results are not bit-for-bit repeatable. No effect on CPUs or "
                           "in TensorFlow")
    recipe: RecipeName | None = Field(
        None, description="a published method's training defaults, filled in where the spec leaves a field unset "
                          "(distmis.spec.recipes): 'nnunet', nnU-Net v2's")
    deep_supervision: bool = Field(
        False, description="train on the decoder's lower-resolution outputs too, with nnU-Net's weights (halving "
                           "per level, the lowest left out, normalized) on targets downsampled by nearest neighbour; "
                           "validation, inference and the registered model use the full-resolution output only. "
                           "For the networks whose registry entry has deep supervision heads (unet3d and dynunet in "
                           "torch)")
    curriculum: list[CurriculumStageSpec] | None = Field(
        None, description="stages of training on growing inputs (LAMP): each {tile, epochs, batch_size, "
                          "tile_sampling}; the epochs add up to training.epochs, and the last stage's input is the "
                          "one validated, tested and predicted with")

    @model_validator(mode="before")
    @classmethod
    def _epochs_of_the_curriculum(cls, data: Any) -> Any:
        """With a curriculum, ``epochs`` defaults to the sum of its stages' epochs."""
        if isinstance(data, dict) and data.get("curriculum") and "epochs" not in data:
            stages = data["curriculum"]
            if isinstance(stages, list) and all(isinstance(s, dict) and isinstance(s.get("epochs"), int)
                                                for s in stages):
                data = {**data, "epochs": sum(s["epochs"] for s in stages)}
        return data

    @model_validator(mode="after")
    def _curriculum_gives_the_tiles_and_epochs(self) -> TrainingSpec:
        if self.curriculum is None:
            return self
        if not self.curriculum:
            raise ValueError("curriculum needs at least one stage (or leave it out)")
        if self.tile is not None:
            raise ValueError(f"training.tile ({list(self.tile)}) and training.curriculum both set the training input: "
                             "with a curriculum each stage gives its tile; leave training.tile out")
        total = sum(stage.epochs for stage in self.curriculum)
        if total != self.epochs:
            raise ValueError(f"the curriculum's stages train {total} epochs, but training.epochs is {self.epochs}: "
                             "make them agree (or leave training.epochs out)")
        return self

    @model_validator(mode="after")
    def _tile_sampling_needs_tiles(self) -> TrainingSpec:
        if self.tile_sampling and self.tile is None and self.curriculum is None:
            raise ValueError(f"tile_sampling ({self.tile_sampling:g}) needs training.tile: without tiles every "
                             "training input is the whole volume")
        return self

    @model_validator(mode="after")
    def _rotations_have_a_plane(self) -> TrainingSpec:
        augment = self.augment
        if augment.enabled and augment.rotate90 and self.tile is not None:
            if not any(self.tile[a] == self.tile[b] for a, b in ((0, 1), (0, 2), (1, 2))):
                raise ValueError(f"augment.rotate90 ({augment.rotate90:g}) turns only planes whose two extents are "
                                 f"equal, and the tile {list(self.tile)} has none: set rotate90 to 0 or use a tile "
                                 "with two equal sides")
        return self

    @model_validator(mode="after")
    def _warmup_within_training(self) -> TrainingSpec:
        warmup = self.lr_schedule.warmup_epochs
        if warmup and warmup >= self.epochs:
            raise ValueError(f"lr_schedule.warmup_epochs ({warmup:g}) must be fewer than training.epochs "
                             f"({self.epochs}): the schedule would never leave its warm-up")
        return self

    @field_validator("tile", "batch_size", mode="before")
    @classmethod
    def _planned_first(cls, value: Any, info: Any) -> Any:
        if value == "auto":
            raise ValueError(f"'auto' asks distmis to plan training.{info.field_name} from the data and "
                             "parallelism.memory_per_worker; `distmis run`, `validate`, `plan` and `submit` plan it "
                             "before the spec is validated (distmis.search.input_plan.planned_tree, for a program)")
        return value

    def epoch_steps(self, train_cases: int, batch_size: int, replicas: int = 1) -> int:
        """The steps of an epoch for each of ``replicas`` data-parallel replicas over ``train_cases`` cases in batches
        of ``batch_size``: ``steps_per_epoch``, or one pass, ``ceil(train_cases / (batch_size * replicas))``."""
        if self.steps_per_epoch is not None:
            return self.steps_per_epoch
        return max(1, math.ceil(train_cases / (batch_size * replicas)))

    @property
    def planned_precision(self) -> Literal["fp32", "bf16", "fp16"]:
        """The precision the driver plans memory and time for: ``precision``, fp32 for ``auto`` (the trial resolves
        it on a device the driver does not know; fp32's step bounds bf16's from above)."""
        return "fp32" if self.precision == "auto" else self.precision  # type: ignore[return-value]

    @property
    def inference_batch_size(self) -> int:
        """Windows per forward pass of sliding-window inference."""
        return self.inference.batch_size or self.batch_size

    _tile = field_validator("tile")(_check_positive_shape)

    @field_validator("precision", mode="before")
    @classmethod
    def _known_precision(cls, value: Any) -> Any:
        if not isinstance(value, str) or value not in PRECISIONS:
            raise ValueError("precision must be 'fp32', 'bf16', 'fp16' (bf16 and fp16: mixed precision with fp32 "
                             "master weights) or 'auto' (bf16 where the device computes it natively, else fp32)")
        return value


# --------------------------------------------------------------------------- search
DOMAIN_KINDS = ("grid", "choice", "uniform", "loguniform", "randint")


class Domain(StrictModel):
    """One search dimension: exactly one of the keys below."""

    grid: list[Any] | None = None
    choice: list[Any] | None = None
    uniform: tuple[float, float] | None = None
    loguniform: tuple[float, float] | None = None
    randint: tuple[int, int] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> Domain:
        given = [k for k in DOMAIN_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"a domain has exactly one of {', '.join(DOMAIN_KINDS)}; got {given or 'none'}"
            )
        kind = given[0]
        value = getattr(self, kind)
        if kind in ("grid", "choice") and not value:
            raise ValueError(f"'{kind}' needs at least one value")
        if kind in ("uniform", "loguniform", "randint") and not value[0] < value[1]:
            raise ValueError(f"'{kind}' needs [low, high] with low < high, got {list(value)}")
        if kind == "loguniform" and value[0] <= 0:
            raise ValueError(f"'loguniform' needs low > 0, got {value[0]}")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in DOMAIN_KINDS if getattr(self, k) is not None)

    @property
    def values(self) -> list[Any]:
        """Values that bound the domain: every grid/choice value, or the two ends of a range."""
        return list(getattr(self, self.kind))


class AshaSpec(StrictModel):
    grace_period: int = Field(1, ge=1)
    reduction_factor: float = Field(2.0, gt=1)


class HyperBandSpec(StrictModel):
    """``scheduler: hyperband``: asynchronous HyperBand (Li et al., MLSys 2020), successive halving in ``brackets``
    brackets whose first rungs are at ``grace_period * reduction_factor ** s`` epochs (bracket ``s``)."""

    grace_period: int = Field(1, ge=1)
    reduction_factor: float = Field(3.0, gt=1)
    brackets: int = Field(3, ge=1, le=10)


class StageAshaSpec(StrictModel):
    """``scheduler: stage-asha``: ASHA whose rungs are the ends of ``training.curriculum``'s stages."""

    reduction_factor: float = Field(2.0, gt=1, description="a trial goes on past a stage when its result is in the "
                                                           "top 1 / reduction_factor of those recorded there")


class StageHalvingSpec(StrictModel):
    """``scheduler: stage-halving``: synchronous successive halving whose rungs are the ends of
    ``training.curriculum``'s stages."""

    reduction_factor: float = Field(2.0, gt=1, description="at each stage's end, when every trial has reached it, "
                                                           "the best 1 / reduction_factor go on")


class MedianSpec(StrictModel):
    """``scheduler: median``: Ray Tune's median stopping rule (Golovin et al., KDD 2017)."""

    grace_period: int = Field(1, ge=1, description="the epochs a trial trains before it may be stopped")
    min_samples: int = Field(3, ge=1, description="the trials that must have reported an epoch before the median "
                                                  "of their running means judges another trial there")


class PBTSpec(StrictModel):
    """``scheduler: pbt``: population-based training (Jaderberg et al., 2017) as Ray Tune runs it: every
    ``interval`` epochs a trial in the bottom ``quantile`` of the population goes on from the newest complete
    checkpoint of one in the top ``quantile`` (exploit) with its searched values perturbed (explore): each
    ``mutations`` value is resampled from its domain with ``resample_probability``, otherwise multiplied by one of
    ``factors`` (a list's value moves to a neighbour), and kept within its domain's bounds."""

    interval: int = Field(2, ge=1, description="epochs between a trial's perturbations")
    quantile: float = Field(0.25, gt=0, le=0.5, description="the share of trials at the bottom that exploit, and "
                                                           "at the top that are exploited")
    resample_probability: float = Field(0.25, ge=0, le=1)
    factors: tuple[float, float] = Field((0.8, 1.2), description="explore multiplies a value by one of these")
    mutations: list[str] | None = Field(None, description="the searched paths explore changes (None: every "
                                                          "searched path PBT may change mid-training)")

    @field_validator("factors")
    @classmethod
    def _positive(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(factor > 0 for factor in value):
            raise ValueError(f"perturbation factors are positive, got {list(value)}")
        return value


_DURATION = re.compile(r"^\s*(?:(?P<h>\d+(?:\.\d+)?)\s*h)?\s*(?:(?P<m>\d+(?:\.\d+)?)\s*m)?\s*"
                       r"(?:(?P<s>\d+(?:\.\d+)?)\s*s)?\s*$")


def duration_seconds(value: Any) -> float:
    """Seconds of a duration: a number (seconds) or text such as ``6h``, ``90m``, ``1h30m``, ``45s``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = _DURATION.match(str(value)) if isinstance(value, str) else None
    if match is None or not any(match.groupdict().values()):
        raise ValueError(f"a duration is a number of seconds or text such as 6h, 90m, 1h30m or 45s, got {value!r}")
    return sum(float(match[unit] or 0) * factor for unit, factor in (("h", 3600), ("m", 60), ("s", 1)))


class BudgetSpec(StrictModel):
    """``search.budget``: the search ends when either is spent (:mod:`distmis.search.budget`)."""

    wall: float | None = Field(None, gt=0, description="the trials' wall time over every run of the search: "
                                                       "seconds, or 6h, 90m, 1h30m, 45s")
    worker_hours: float | None = Field(None, gt=0, allow_inf_nan=False,
                                       description="each trial's workers times its time, added up")

    @field_validator("wall", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        return None if value is None else duration_seconds(value)

    @model_validator(mode="after")
    def _something(self) -> BudgetSpec:
        if self.wall is None and self.worker_hours is None:
            raise ValueError("a budget names wall, worker_hours or both (e.g. {wall: 6h, worker_hours: 200})")
        return self


#: ``search.selection``: the best epoch by the metric's value, or by its exponential moving average
#: (:mod:`distmis.train.selection`).
SelectionRule = Literal["epoch", "moving-average"]


class SearchSpec(StrictModel):
    algorithm: str = Field("grid", description="a registered search algorithm: " + ", ".join(ALGORITHMS))
    num_samples: int = Field(1, ge=1)
    metric: str = Field("val_dice", description="val_dice (the mean over the scored classes or regions), val_loss, "
                                                "train_loss, or one class's or region's val_dice_<key> "
                                                "(e.g. val_dice_spleen: the data set's names, checked against them "
                                                "before the search starts)")
    mode: Literal["max", "min"] | None = None
    scheduler: str = Field("none", description="a registered trial scheduler: " + ", ".join(SCHEDULERS))
    asha: AshaSpec = AshaSpec()
    hyperband: HyperBandSpec = HyperBandSpec()
    median: MedianSpec = MedianSpec()
    pbt: PBTSpec = PBTSpec()
    stage_asha: StageAshaSpec = StageAshaSpec()
    stage_halving: StageHalvingSpec = StageHalvingSpec()
    cost_limit: float | None = Field(None, gt=0, allow_inf_nan=False,
                                     description="worker-hours: the registered model is the best trial (with folds: "
                                                 "configuration, its folds together) within them, not the best of all")
    budget: BudgetSpec | None = Field(None, description="the search ends when its wall time or its worker-hours "
                                                         "are spent: {wall: 6h, worker_hours: 200}")
    space: dict[str, Domain] = Field(default_factory=dict)
    evaluate_top: int = Field(1, ge=0, description="after the search, the best k trials' best epochs are scored on the "
                                                   "test split (0: none)")
    max_trials: int = Field(10_000, ge=1, description="the most trials the search may hold (grid points x "
                                                      "num_samples): a larger one is refused before anything starts")
    folds: Literal["all"] | list[int] = Field("all", description="with dataset.split.folds: the folds each "
                                                                   "configuration trains (one trial per fold), all "
                                                                   "by default")
    selection: SelectionRule = Field(
        "epoch", description="how a trial's best epoch is chosen, the checkpoint kept and the trials ranked: "
                             "'epoch', the epoch with the best value of the metric; 'moving-average', the epoch "
                             "with the best exponential moving average of it (nnU-Net's, ema_<metric>)")
    smoothing: float = Field(0.9, ge=0, lt=1, description="selection moving-average: ema = smoothing x ema + "
                                                          "(1 - smoothing) x the epoch's value (nnU-Net: 0.9)")

    @field_validator("algorithm")
    @classmethod
    def _registered_algorithm(cls, value: str) -> str:
        algorithm_entry(value)  # ValueError naming the registered algorithms
        return value

    @field_validator("scheduler")
    @classmethod
    def _registered_scheduler(cls, value: str) -> str:
        scheduler_entry(value)  # ValueError naming the registered schedulers
        return value

    @field_validator("folds")
    @classmethod
    def _distinct_folds(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("folds must be 'all' or a non-empty list of fold numbers")
            if len(set(value)) != len(value) or any(v < 0 for v in value):
                raise ValueError(f"folds must be distinct fold numbers >= 0, got {value}")
            return sorted(value)
        return value

    @property
    def trial_count(self) -> int:
        """How many trials the search runs: grid points x ``num_samples``."""
        points = 1
        for domain in self.space.values():
            if domain.kind == "grid":
                points *= len(domain.grid)
        return points * self.num_samples

    @model_validator(mode="after")
    def _within_max_trials(self) -> SearchSpec:
        count = self.trial_count
        if count > self.max_trials:
            grids = " x ".join(f"{len(d.grid)} ({p})" for p, d in self.space.items() if d.kind == "grid")
            raise ValueError(
                f"the search holds {count:,} trials ({grids or 'no grid'}{' x ' if grids else ', '}num_samples "
                f"{self.num_samples}), more than search.max_trials {self.max_trials:,}: search fewer values, or raise "
                "search.max_trials if you mean it")
        return self

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, value: str) -> str:
        if value in ("val_dice", "val_loss", "train_loss") or re.fullmatch(r"val_dice_[A-Za-z0-9_.-]+", value):
            return value
        raise ValueError(f"metric must be 'val_dice', 'val_loss', 'train_loss' or 'val_dice_<key>' (one class's or "
                         f"region's dice, e.g. 'val_dice_spleen'), got {value!r}")

    @model_validator(mode="after")
    def _smoothing_averages(self) -> SearchSpec:
        # (a dumped spec holds the default: only another value is refused)
        if self.smoothing != type(self).model_fields["smoothing"].default and self.selection != "moving-average":
            raise ValueError(f"smoothing ({self.smoothing:g}) weighs the moving average of selection "
                             f"'moving-average'; selection is {self.selection!r}: set it to 'moving-average' or leave "
                             "smoothing out")
        return self

    @property
    def selected_metric(self) -> str:
        """What picks a trial's best epoch and ranks the trials: ``metric``, or ``ema_<metric>`` (its exponential
        moving average, which the trials report beside it) with ``selection: moving-average``."""
        return f"ema_{self.metric}" if self.selection == "moving-average" else self.metric

    @model_validator(mode="after")
    def _default_mode(self) -> SearchSpec:
        if self.mode is None:
            # Bypass validate_assignment recursion: set the field on the instance dict.
            self.__dict__["mode"] = "max" if self.metric.startswith("val_dice") else "min"
        return self


# --------------------------------------------------------------------------- parallelism
class ResourcesSpec(StrictModel):
    cpu: float = Field(1, gt=0)
    gpu: float = Field(0, ge=0)


def parse_size(value: Any) -> float:
    """Bytes from ``16GB``, ``6GiB``, ``512MB`` or a plain positive number of bytes; ValueError otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        size = float(value)
    elif isinstance(value, str):
        units = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20,
                 "GIB": 2**30, "TIB": 2**40}
        text = value.strip().upper()
        number = text.rstrip("BIKMGT").strip()
        try:
            size = float(number) * units[text[len(number):].strip()]
        except (ValueError, KeyError):
            raise ValueError(f"{value!r} is not a size: give e.g. 16GB, 6GiB, 512MB or a number of bytes") from None
    else:
        raise ValueError(f"{value!r} is not a size: give e.g. 16GB, 6GiB, 512MB or a number of bytes")
    if not size > 0 or not math.isfinite(size):
        raise ValueError(f"a size must be positive, got {value!r}")
    return size


class SequenceParallelSpec(StrictModel):
    """Sequence parallelism inside one trial (``model.name: vit-seg`` only): the tokens of a tile are split
    over ``degree`` Ray Train workers. See docs/spec.md and :mod:`distmis.parallel.sequence`.

    ``degree: auto`` lets the performance model choose, per trial: the smallest degree (up to ``max_degree``)
    whose predicted per-rank peak memory fits ``memory_per_worker``
    (:mod:`distmis.spec.sizing`)."""

    degree: int | Literal["auto"] = 1
    attention: Literal["allgather-kv", "ulysses", "dsp"] = Field(
        "allgather-kv", description="allgather-kv or ulysses (any model), or dsp (dynamic sequence parallelism: "
                                    "model.params.attention 'axial' only)")
    decoder: Literal["gather", "no-gather"] = "gather"
    split: Literal["ordered", "spatial"] = "ordered"
    memory_per_worker: float | None = Field(
        None, description="bytes a worker (a GPU's memory, or a CPU worker's share of its node) may hold; "
                          "'6GB', '16GiB' or a number. Sizes degree: auto")
    max_degree: int = Field(8, ge=1, le=1024, description="degree: auto tries 1, 2, ... up to this")

    @field_validator("degree", mode="before")
    @classmethod
    def _degree(cls, value: Any) -> Any:
        if isinstance(value, bool) or (not isinstance(value, int) and value != "auto"):
            raise ValueError(f"degree must be a positive int or 'auto', got {value!r}")
        if isinstance(value, int) and value < 1:
            raise ValueError(f"degree must be >= 1 (or 'auto'), got {value}")
        return value

    @field_validator("memory_per_worker", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return None if value is None else parse_size(value)

    @model_validator(mode="after")
    def _auto_needs_memory(self) -> SequenceParallelSpec:
        if self.degree == "auto" and self.memory_per_worker is None:
            raise ValueError("degree 'auto' chooses the smallest degree whose predicted memory fits a worker: set "
                             "memory_per_worker (e.g. '16GB', a GPU's memory or a CPU worker's share)")
        return self


class PipelineSpec(StrictModel):
    """Pipeline parallelism inside one trial (the torch ``unet3d`` only; LAMP): the U-Net cut into ``stages``
    stages on as many Ray Train workers, every batch into ``microbatches`` micro-batches that flow through them
    (``schedule``: GPipe, all forwards then all backwards, or 1F1B, which interleaves them and holds fewer
    micro-batches' activations). See docs/spec.md and :mod:`distmis.parallel.pipeline`. ``stages: 1`` (the
    default) is no pipeline, and ``microbatches`` is then unused."""

    stages: int = Field(1, ge=1, description="pipeline stages (workers) per data-parallel replica; 1: none; "
                                             "'auto': the fewest whose per-rank peak fits memory_per_worker")
    microbatches: int = Field(1, ge=1, description="micro-batches per batch: must divide training.batch_size")
    schedule: Literal["gpipe", "1f1b"] = "gpipe"

    @field_validator("stages", mode="before")
    @classmethod
    def _planned_first(cls, value: Any) -> Any:
        if value == "auto":
            raise ValueError("'auto' asks distmis to plan parallelism.pipeline.stages from "
                             "parallelism.memory_per_worker; `distmis run`, `validate`, `plan` and `submit` plan it "
                             "before the spec is validated (distmis.search.input_plan.planned_tree, for a program)")
        return value


class ParallelismSpec(StrictModel):
    """How trials use the cluster.

    ``experiment``: Ray Tune runs many trials at once. With ``workers_per_trial: 1`` each trial is one
    process with ``resources_per_trial``; with ``workers_per_trial: k > 1`` (hybrid) each trial is
    itself data-parallel over k Ray Train workers of ``resources_per_worker``.
    ``data``: trials run one after another, each data-parallel over ``workers`` workers.
    ``auto``: the search holds ``workers`` workers and gives each trial as many as finish the search soonest: a
    trial starts on its share of the free ones and is grown (checkpoint, restart on more workers) when workers fall
    idle (:mod:`distmis.perf.pool`).
    ``compare``: the search runs in both modes for every worker count in ``workers`` (1 included)
    and the speedup table is recorded.
    """

    mode: Literal["experiment", "data", "auto", "compare"] = "experiment"
    resources_per_trial: ResourcesSpec = ResourcesSpec()
    workers: int | list[int] = 1
    workers_per_trial: int = Field(1, ge=1)
    resources_per_worker: ResourcesSpec = ResourcesSpec()
    lr_scaling: Literal["linear", "none"] = "linear"
    max_concurrent_trials: int | None = Field(None, ge=1)
    sequence_parallel: SequenceParallelSpec = SequenceParallelSpec()
    pipeline: PipelineSpec = PipelineSpec()
    autoscaling: bool = Field(False, description="the cluster adds nodes on demand: do not refuse a trial that "
                                                 "does not fit the nodes there are now")
    memory_per_worker: float | None = Field(
        None, description="bytes one process of a trial may hold (a GPU's memory, or a CPU worker's share of its "
                          "node): '24GB', '16GiB' or a number. training.tile / batch_size 'auto' are planned to fit it")
    max_failures: int = Field(0, ge=0, description="times a trial whose process or worker died is restarted from "
                                                   "its last epoch's checkpoint before it counts as failed")
    repeats: int = Field(1, ge=1, le=100, description="compare: run every (mode, workers) cell this many times, in "
                                                    "an interleaved order, for a mean and std of each figure")
    modes: list[Literal["experiment", "data", "auto"]] = Field(
        ["experiment", "data"], description="compare: the modes each worker count runs in (auto: mode 'auto' on "
                                            "that many workers)")

    @field_validator("memory_per_worker", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return None if value is None else parse_size(value)

    @model_validator(mode="after")
    def _workers_fit_the_mode(self) -> ParallelismSpec:
        counts = self.workers if isinstance(self.workers, list) else [self.workers]
        if not counts or any(n < 1 for n in counts):
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.mode in ("data", "auto") and isinstance(self.workers, list):
            raise ValueError(f"mode {self.mode!r} takes one worker count, got {self.workers}; use mode 'compare' for "
                             "a list")
        if self.mode == "compare":
            self.__dict__["workers"] = sorted(set(counts) | {1})  # 1 worker is the baseline
        if self.mode == "experiment" and counts != [1]:
            raise ValueError("mode 'experiment' sizes trials with workers_per_trial; 'workers' is for modes data, auto "
                             "and compare")
        if self.mode != "experiment" and self.workers_per_trial != 1:
            raise ValueError(f"workers_per_trial is for mode 'experiment' (hybrid), not {self.mode!r}")
        if not self.modes or len(set(self.modes)) != len(self.modes):
            raise ValueError(f"modes must name each mode to compare once, got {self.modes}")
        return self

    @property
    def worker_counts(self) -> list[int]:
        return list(self.workers) if isinstance(self.workers, list) else [self.workers]


# --------------------------------------------------------------------------- tracking
def registered_model_name_problem(name: str) -> str | None:
    """Why MLflow's model registry would refuse ``name`` for a registered model (None: it takes it).

    MLflow 3's rule, checked when a model is registered (that is, after the whole search): its
    ``mlflow.utils.validation._validate_model_name``, which every registry store applies (not blank, no ``/`` or
    ``:``, a name that stays itself as a path: ``posixpath.normpath`` leaves it unchanged, not ``.``, not starting
    with ``..`` or ``/``), and its file store's own (no path separator of the platform, no ``%``). Written out here:
    importing MLflow to ask it costs seconds, and the spec imports no tracking library (tests/spec checks the two
    agree)."""
    if not name.strip():
        return "a blank name"
    held = [c for c in dict.fromkeys(("/", ":", "%", os.sep, os.altsep)) if c and c in name]
    if held:
        return f"it holds {' and '.join(repr(c) for c in held)}"
    normal = posixpath.normpath(name)
    if normal != name:
        return f"as a path it would resolve to {normal!r}"
    if name == "." or name.startswith(".."):
        return "a path's '.' or '..'" if name in (".", "..") else "it starts with '..'"
    return None


def _registrable(name: str) -> str:
    why = registered_model_name_problem(name)
    if why is not None:
        raise ValueError(f"MLflow's model registry refuses this name ({why}): a registered model's name must not be "
                         "blank, hold '/', ':' or '%', be '.' or start with '..' (e.g. 'brats-unet3d')")
    return name


class TrackingSpec(StrictModel):
    uri: str | None = None
    experiment: str | None = None
    artifact_location: str | None = Field(
        None, min_length=1,
        description="where a new experiment keeps its artifacts (a folder or a URI: s3://..., file:///...); default: "
                    "mlartifacts/ beside a local sqlite store, a tracking server's own artifact store")
    register_model: bool = Field(True, description="register the search's best model in the MLflow model registry")
    model_name: Annotated[str, AfterValidator(_registrable)] | None = Field(
        None, min_length=1, description="its registered name (default: the search's name)")
    system_metrics: bool = Field(True, description="record each trial's CPU, memory and GPU use on its run "
                                                   "(MLflow's system metrics, system/...)")
    system_metrics_interval: float = Field(5.0, ge=1.0, le=3600.0,
                                           description="seconds between two system-metrics samples (and one more at "
                                                       "each epoch's end)")


NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class Spec(StrictModel):
    """A whole search spec."""

    name: str
    dataset: DatasetSpec
    model: ModelSpec = ModelSpec()
    training: TrainingSpec = TrainingSpec()
    search: SearchSpec = SearchSpec()
    parallelism: ParallelismSpec = ParallelismSpec()
    tracking: TrackingSpec = TrackingSpec()
    # The whole preprocessed volume of the data set on disk and where it comes from, when no field fixes it (no
    # dataset.crop or resize): never in the YAML, set on a copy by distmis.spec.load.with_volume for the checks
    # against the data.
    _volume: tuple[tuple[int, int, int], str] | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _recipe_first(cls, data: Any) -> Any:
        """``training.recipe``: its values where the spec leaves them unset (:func:`distmis.spec.recipes.fill_recipe`)."""
        if isinstance(data, dict):
            from distmis.spec.recipes import fill_recipe

            model = ModelSpec.model_fields
            return fill_recipe(data, {"model.name": model["name"].default,
                                      "model.framework": model["framework"].default})
        return data

    @field_validator("name")
    @classmethod
    def _name_is_a_folder_name(cls, value: str) -> str:
        if not NAME_PATTERN.fullmatch(value):  # fullmatch: "$" alone lets a trailing newline through
            raise ValueError(
                f"must start with a letter or digit and hold only letters, digits, '_', '.', '-', got {value!r}"
            )
        return value

    @property
    def experiment_name(self) -> str:
        return self.tracking.experiment or self.name

    @property
    def registered_model_name(self) -> str:
        return self.tracking.model_name or self.name

    @property
    def cv_folds(self) -> tuple[int, ...]:
        """The folds each configuration trains, one trial each (``search.folds`` of ``dataset.split.folds``); ``()``
        for a search without cross-validation."""
        k = self.dataset.split.folds
        if k is None:
            return ()
        return tuple(range(k)) if self.search.folds == "all" else tuple(self.search.folds)
