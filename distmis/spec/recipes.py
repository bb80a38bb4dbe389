"""Named training recipes (``training.recipe``): a published method's defaults, filled in where a spec leaves a field
unset, before the spec is validated.

A recipe is a list of :class:`RecipeValue`: a dotted path into the spec, the value, where the method sets it, and
when it applies (a value that needs something of the spec: deep supervision needs a network with heads in the
trial's framework, foreground-centred tiles need tiles). A field the spec gives keeps the spec's value; the
optimizer is one unit (``training.optimizer.name`` given or searched: none of the recipe's optimizer values is used,
so that an Adam trial gets no SGD momentum). A searched path (``search.space``) overrides both in each trial, as ever. The spec
then holds the filled values like any others: ``distmis validate`` and the run's ``spec.yaml`` and params show them.

``nnunet``: nnU-Net v2's ``nnUNetTrainer`` (Isensee et al., Nature Methods 2021; the nnU-Net v2 code), each value's
source in :data:`NNUNET`. What it does that distmis does not (yet) is listed in ``docs/spec.md``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["RecipeValue", "Recipe", "RECIPES", "NNUNET", "recipe_entry", "fill_recipe", "recipe_values"]

_MISSING = object()


def _always(tree: Mapping[str, Any]) -> bool:
    return True


@dataclass(frozen=True)
class RecipeValue:
    """One default of a recipe: ``value`` at ``path`` (dotted, from the spec's root) unless the spec sets it, when
    ``applies(tree)`` holds for the spec's mapping; ``unit``: the section whose presence (a given
    ``training.optimizer.name``) keeps the recipe's value out even where this field is unset."""

    path: str
    value: Any
    source: str
    applies: Callable[[Mapping[str, Any]], bool] = _always
    unit: str | None = None


@dataclass(frozen=True)
class Recipe:
    name: str
    values: tuple[RecipeValue, ...]
    summary: str


def _get(tree: Mapping[str, Any], path: str) -> Any:
    """The value at ``path``, or ``_MISSING``. A section given as a validated model (a program's ``Spec(...)``) holds
    every one of its fields."""
    node: Any = tree
    for key in path.split("."):
        if isinstance(node, Mapping):
            if key not in node:
                return _MISSING
            node = node[key]
        elif hasattr(node, "model_fields"):
            node = getattr(node, key, _MISSING)
        else:
            return _MISSING
    return node


def _has_deep_supervision(tree: Mapping[str, Any]) -> bool:
    """Whether the spec's network has deep supervision heads in its framework (``tree`` holds the model's name and
    framework: :func:`fill_recipe` adds the schema's defaults)."""
    from distmis.models.registry import MODELS

    entry = MODELS.get(_get(tree, "model.name"))  # type: ignore[arg-type]
    return entry is not None and _get(tree, "model.framework") in entry.deep_supervision


def _has_tiles(tree: Mapping[str, Any]) -> bool:
    return _get(tree, "training.tile") not in (_MISSING, None) or _get(tree, "training.curriculum") not in (
        _MISSING, None)


#: nnU-Net v2's defaults, as its ``nnUNetTrainer`` sets them.
NNUNET = Recipe(
    name="nnunet",
    summary="nnU-Net v2's training: SGD with Nesterov momentum, poly schedule, dice + cross-entropy, deep "
            "supervision, its augmentation, a third of the tiles on foreground, mirroring at test time, the "
            "checkpoint by a moving average of the validation dice",
    values=(
        RecipeValue("training.optimizer.name", "sgd", "nnUNetTrainer.configure_optimizers: torch.optim.SGD",
                    unit="training.optimizer.name"),
        RecipeValue("training.optimizer.lr", 1e-2, "nnUNetTrainer.initial_lr = 1e-2", unit="training.optimizer.name"),
        RecipeValue("training.optimizer.momentum", 0.99, "SGD(momentum=0.99)", unit="training.optimizer.name"),
        RecipeValue("training.optimizer.nesterov", True, "SGD(nesterov=True)", unit="training.optimizer.name"),
        RecipeValue("training.optimizer.weight_decay", 3e-5, "nnUNetTrainer.weight_decay = 3e-5",
                    unit="training.optimizer.name"),
        RecipeValue("training.clip_grad_norm", 12.0, "train_step: clip_grad_norm_(network.parameters(), 12)"),
        RecipeValue("training.lr_schedule.name", "poly", "PolyLRScheduler, stepped once per epoch"),
        RecipeValue("training.lr_schedule.power", 0.9, "PolyLRScheduler(exponent=0.9)"),
        RecipeValue("training.lr_schedule.interval", "epoch", "lr_scheduler.step(epoch) at each epoch's start"),
        RecipeValue("training.loss.name", "dice-ce", "DC_and_CE_loss (DC_and_BCE_loss for regions), weights 1 and 1"),
        RecipeValue("training.loss.smooth", 1e-5, "MemoryEfficientSoftDiceLoss(smooth=1e-5)"),
        RecipeValue("training.deep_supervision", True, "enable_deep_supervision = True", applies=_has_deep_supervision),
        RecipeValue("training.steps_per_epoch", 250, "num_iterations_per_epoch = 250"),
        RecipeValue("training.tile_sampling", 0.33, "oversample_foreground_percent = 0.33", applies=_has_tiles),
        RecipeValue("training.augment.enabled", True, "get_training_transforms"),
        RecipeValue("training.augment.flip", 0.5, "MirrorTransform on axes (0, 1, 2), each with probability 0.5"),
        RecipeValue("training.augment.rotate90", 0.0, "none"),
        RecipeValue("training.augment.affine", 0.2, "SpatialTransform p_rotation = p_scaling = 0.2"),
        RecipeValue("training.augment.rotate_degrees", 30.0, "rotation_for_DA: +-30 degrees per axis (3D)"),
        RecipeValue("training.augment.scale_range", 0.3, "scaling (0.7, 1.4): here 1 +- 0.3"),
        RecipeValue("training.augment.elastic", 0.0, "p_elastic_deform = 0"),
        RecipeValue("training.augment.intensity_scale", 0.15, "MultiplicativeBrightnessTransform p = 0.15"),
        RecipeValue("training.augment.intensity_scale_range", 0.25, "multiplier_range (0.75, 1.25)"),
        RecipeValue("training.augment.intensity_shift", 0.0, "none"),
        RecipeValue("training.augment.noise", 0.1, "GaussianNoiseTransform p = 0.1"),
        RecipeValue("training.augment.noise_std", 0.32, "noise_variance (0, 0.1): std up to sqrt(0.1)"),
        RecipeValue("training.inference.overlap", 0.5, "tile_step_size = 0.5"),
        RecipeValue("training.inference.mode", "gaussian", "use_gaussian = True"),
        RecipeValue("training.inference.sigma_scale", 0.125, "compute_gaussian(sigma_scale=1/8)"),
        RecipeValue("training.inference.mirror", [0, 1, 2], "use_mirroring = True, allowed_mirroring_axes (0, 1, 2)"),
        RecipeValue("search.selection", "moving-average", "the checkpoint_best by ema_fg_dice"),
        RecipeValue("search.smoothing", 0.9, "ema_fg_dice = 0.9 * ema + 0.1 * mean_fg_dice", unit="search.selection"),
    ),
)

RECIPES: dict[str, Recipe] = {recipe.name: recipe for recipe in (NNUNET,)}


def recipe_entry(name: str) -> Recipe:
    """The recipe ``name``; ValueError naming the registered ones."""
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"no training recipe {name!r}; registered: {', '.join(RECIPES)}") from None


def _searched(tree: Mapping[str, Any], path: str) -> bool:
    """Whether ``search.space`` searches ``path`` or a section above it (``training.optimizer``)."""
    space = _get(tree, "search.space")
    keys = space.keys() if isinstance(space, Mapping) else ()
    return any(path == key or path.startswith(f"{key}.") for key in keys)


def _set(tree: dict[str, Any], path: str, value: Any) -> None:
    """``value`` at ``path`` in ``tree``, making the mappings above it (where ``_get`` found the path missing)."""
    node = tree
    *parents, last = path.split(".")
    for key in parents:
        if node.get(key) is None:
            node[key] = {}
        node = node[key]
    node[last] = value


def recipe_values(recipe: Recipe, tree: Mapping[str, Any],
                  defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The values ``recipe`` fills into the spec mapping ``tree``: dotted path -> value. ``defaults`` (dotted path ->
    value): what the schema gives a field ``tree`` leaves unset, as the recipe's conditions read it (the model's
    name and framework)."""
    view = copy.deepcopy(dict(tree))
    for path, value in (defaults or {}).items():
        if _get(view, path) is _MISSING:
            _set(view, path, value)
    filled: dict[str, Any] = {}
    for entry in recipe.values:
        if _get(tree, entry.path) is not _MISSING:
            continue
        if entry.unit is not None and (_get(tree, entry.unit) is not _MISSING or _searched(tree, entry.unit)):
            continue
        if entry.applies(view):
            filled[entry.path] = copy.deepcopy(entry.value)
    return filled


def fill_recipe(tree: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``tree`` with its ``training.recipe``'s values filled in where it leaves them unset (a copy). ``defaults``:
    see :func:`recipe_values`. ValueError for a recipe that is not registered."""
    name = _get(tree, "training.recipe")
    if name in (_MISSING, None):
        return dict(tree)
    if not isinstance(name, str):
        raise ValueError(f"training.recipe must be a recipe's name ({', '.join(RECIPES)}), got {name!r}")
    out = copy.deepcopy(dict(tree))
    for path, value in recipe_values(recipe_entry(name), tree, defaults).items():
        _set(out, path, value)
    return out
