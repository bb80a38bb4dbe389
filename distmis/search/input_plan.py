"""``training.tile: auto`` and ``training.batch_size: auto``: the largest tile, then the largest batch, whose
training step every network of the search is predicted to fit in ``parallelism.memory_per_worker``.

The rule is nnU-Net's (Isensee et al., docs/references.md), with the traced step (:mod:`distmis.estimate`) in place
of its estimate of a U-Net's memory:

1. **The tile** starts as the preprocessed volume, each side rounded down to what the network divides by
   (``model.input_multiple``). While the step does not fit, the side longest against the volume's (ties: the
   longest, then the first) is shortened by that multiple. With ``augment.rotate90`` the volume's two longest sides
   stay equal, so the rotation keeps a plane. The tiles form one sequence, largest first, and the planner searches
   it by bisection: it traces the step of about log2(length) tiles, not all of them. The tile chosen fits, and the
   next larger one in the sequence was traced and does not (:attr:`InputPlan.next_larger`).
2. **The batch**: at least 2, grown while the step fits, and no larger than nnU-Net's cap: the batch whose tiles
   hold 5% of the data set's voxels. A fixed ``batch_size`` is kept; ``auto`` falls to 1 only when no tile fits 2.

A step's peak is the largest over the networks the search can pick (each combination of the searched ``model.*``
values, precision and loss), so that every trial of the search trains the same tile and batch: their validation
scores compare like with like. The channels in and out are the data set's own (its ``dataset.json``), and the rules
are the trial's device's (a GPU's when its processes are given one, else a CPU's with its threads).

``parallelism.pipeline.stages: auto`` is planned here too, by :mod:`distmis.search.stage_plan`: the fewest stages
whose every rank fits, for the spec's tile and batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from pydantic import ValidationError

from distmis.perf.sizing import PROCESS_RESERVE
from distmis.spec.load import (
    SpecError, apply_config, problems_from_validation_error, read_spec_file, searched_combinations,
    validate_spec, values_to_check, with_overrides,
)
from distmis.spec.schema import Spec
from distmis.search.stage_plan import STAGES_PATH, StagePlan
from distmis.search.tile_search import DATASET_SHARE, MIN_BATCH, Candidate, NothingFits, Tile, mib, plan_inputs

__all__ = ["AUTO_FIELDS", "InputPlan", "load_planned_spec", "network_configs", "plan_spec", "planned_tree"]

AUTO_FIELDS = ("training.tile", "training.batch_size")
#: Searched fields that a plan would have to follow trial by trial: refused beside ``auto``.
_SETS_THE_INPUT = ("training", "training.tile", "training.batch_size", "training.curriculum")


@dataclass(frozen=True)
class InputPlan:
    """What ``auto`` chose (``fields``: which fields asked), against ``usable`` bytes per worker
    (``parallelism.memory_per_worker`` less :data:`~distmis.perf.sizing.PROCESS_RESERVE`)."""

    fields: tuple[str, ...]
    tile: Tile
    batch: int
    usable: float
    volume: Tile
    device: Literal["cpu", "cuda"]
    considered: tuple[Candidate, ...]

    @property
    def chosen(self) -> Candidate:
        return next(c for c in self.considered if c.tile == self.tile and c.batch == self.batch)

    @property
    def next_larger(self) -> Candidate | None:
        """The smallest traced candidate larger than the chosen one (a larger tile at its batch, or, for the batch,
        the next batch at its tile): it does not fit."""
        chosen = self.chosen
        larger = [c for c in self.considered if not c.fits and (
            (c.batch == chosen.batch and math.prod(c.tile) > math.prod(chosen.tile))
            or (c.tile == chosen.tile and c.batch > chosen.batch))]
        return min(larger, key=lambda c: (math.prod(c.tile), c.batch), default=None)

    def describe(self) -> str:
        """One line for the console."""
        chosen = self.chosen
        line = (f"planned {' and '.join(self.fields)}: tile {list(self.tile)}, batch {self.batch} "
                f"({mib(chosen.peak)} MiB predicted per step, {mib(self.usable)} MiB usable per worker, "
                f"{self.device} rules")
        nxt = self.next_larger
        if nxt is not None:
            line += f"; tile {list(nxt.tile)} at batch {nxt.batch} would need {mib(nxt.peak)} MiB"
        return line + ")"


# --------------------------------------------------------------------------- a spec's plan
def _auto_fields(tree: Mapping[str, Any]) -> tuple[str, ...]:
    training = tree.get("training")
    fields = tuple(f"training.{name}" for name in ("tile", "batch_size")
                   if isinstance(training, Mapping) and training.get(name) == "auto")
    parallelism = tree.get("parallelism")
    pipeline = parallelism.get("pipeline") if isinstance(parallelism, Mapping) else None
    if isinstance(pipeline, Mapping) and pipeline.get("stages") == "auto":
        fields += (STAGES_PATH,)
    return fields


def _stage_refusals(spec: Spec, fields: Sequence[str]) -> list[tuple[str, str]]:
    """What ``stages: auto`` cannot plan for: with the tile or batch planned too, a searched pipeline, sequence
    parallelism, a network that is not cut into stages."""
    problems = []
    if len(fields) > 1:
        problems.append((STAGES_PATH, "'auto' plans the stages for the spec's tile and batch: give them, or plan "
                                      "them with stages 1 first"))
    for path in spec.search.space:
        if path in ("parallelism", "parallelism.pipeline") or path.startswith("parallelism.pipeline."):
            problems.append((f"search.space.{path}", f"searches what {STAGES_PATH} 'auto' plans"))
    if spec.parallelism.sequence_parallel.degree != 1:
        problems.append((STAGES_PATH, "'auto' plans stages of a whole network: not beside sequence parallelism"))
    for config in network_configs(spec):
        entry = apply_config(spec, config).model.entry
        if not entry.supports("pp"):
            problems.append((STAGES_PATH, f"'auto' plans pipeline stages, which {entry.name} does not take (the "
                                          "torch unet3d does)"))
    return problems


def _refusals(spec: Spec, fields: Sequence[str]) -> list[tuple[str, str]]:
    """What ``auto`` cannot plan for: no memory to fit, a search over the planned input, a curriculum."""
    problems = []
    if spec.parallelism.memory_per_worker is None:
        problems.append(("parallelism.memory_per_worker", f"{' and '.join(fields)} 'auto' fit(s) the training step "
                                                          "to a worker's memory: set it (e.g. '24GB' for a GPU of "
                                                          "24 GB, or a CPU worker's share of its node)"))
    for path in spec.search.space:
        if path in _SETS_THE_INPUT:
            problems.append((f"search.space.{path}", f"searches what {' and '.join(fields)} 'auto' plans: search "
                                                     "it with fixed values, or let the plan choose"))
    if spec.training.curriculum:
        problems.append(("training.curriculum", "gives each stage's tile and batch: 'auto' plans one tile"))
    if spec.parallelism.memory_per_worker is not None and spec.parallelism.memory_per_worker <= PROCESS_RESERVE:
        problems.append(("parallelism.memory_per_worker", f"{spec.parallelism.memory_per_worker:g} bytes is no "
                                                          f"more than the {mib(PROCESS_RESERVE)} MiB a process "
                                                          "holds itself"))
    return problems


def network_configs(spec: Spec) -> list[dict[str, Any]]:
    """Every combination of the searched values that changes a network's step besides its input: ``model.*``, the
    precision and the loss (a range: its ends)."""
    paths = {path: values_to_check(domain) for path, domain in spec.search.space.items()
             if path.startswith("model.") or path in ("training.precision", "training.loss.name")}
    return list(searched_combinations(paths)) if paths else [{}]


def plan_spec(spec: Spec, fields: Sequence[str]) -> InputPlan:
    """The plan of ``fields`` (``training.tile``, ``training.batch_size``) for ``spec``, whose planned fields hold
    placeholders (a whole volume, batch 2). ValueError when the data or the memory leave nothing to plan."""
    from distmis.search.data_shape import data_shape, trial_device
    from distmis.search.memory_fit import step_rules
    from distmis.spec.load import apply_config

    data = data_shape(spec)
    device, threads = trial_device(spec)
    assert spec.parallelism.memory_per_worker is not None
    usable = spec.parallelism.memory_per_worker - PROCESS_RESERVE
    trials = [apply_config(spec, config) for config in network_configs(spec)]
    multiple = math.lcm(*(trial.model.input_multiple for trial in trials))
    # a tile not planned is the spec's, or (null) the whole volume
    fixed_tile = None if "training.tile" in fields else tuple(spec.training.tile or data.volume)
    fixed_batch = None if "training.batch_size" in fields else spec.training.batch_size

    valid, peak = step_rules(trials, data, device, threads)
    pipe = spec.parallelism.pipeline

    def preferred(tile: Tile) -> bool:  # every network's own preference (a DynUNet planned from its tile)
        return all(trial.model.entry.tile_preference(trial.model.params, tile) for trial in trials
                   if trial.model.entry.tile_preference is not None)

    tile, batch, considered = plan_inputs(
        data.volume, multiple, peak, usable, tile=fixed_tile, batch=fixed_batch,  # type: ignore[arg-type]
        batch_cap=lambda tile: round(DATASET_SHARE * data.voxels / math.prod(tile)),
        batch_multiple=pipe.microbatches if pipe.stages > 1 else 1,
        equal_pair=bool(spec.training.augment.enabled and spec.training.augment.rotate90), valid=valid,
        preferred=preferred)
    return InputPlan(tuple(fields), tile, batch, usable, data.volume, device, tuple(considered))


def planned_tree(tree: Mapping[str, Any], source: str = "<spec>"
                 ) -> tuple[dict[str, Any], InputPlan | StagePlan | None]:
    """``tree`` with ``training.tile`` / ``training.batch_size`` ``auto`` replaced by the plan (or
    ``parallelism.pipeline.stages`` ``auto``: :mod:`distmis.search.stage_plan`), and the plan (None and ``tree`` as
    it is when nothing asks for one). SpecError, naming the field, when the plan cannot be made."""
    fields = _auto_fields(tree)
    if not fields:
        return dict(tree), None
    placeholders: dict[str, Any] = {"training.tile": None, "training.tile_sampling": 0.0} \
        if "training.tile" in fields else {}
    if "training.batch_size" in fields:
        placeholders["training.batch_size"] = MIN_BATCH
    if STAGES_PATH in fields:
        placeholders[STAGES_PATH] = 1
    try:
        spec = Spec.model_validate(with_overrides(tree, placeholders))
    except ValidationError as exc:  # the spec's own errors, as validate_spec words them
        raise SpecError(source, problems_from_validation_error(exc)) from None
    problems = _refusals(spec, fields) + (_stage_refusals(spec, fields) if STAGES_PATH in fields else [])
    if problems:
        raise SpecError(source, list(dict.fromkeys(problems)))
    try:
        if STAGES_PATH in fields:
            from distmis.search.data_shape import data_shape
            from distmis.search.stage_plan import plan_stages

            trials = [apply_config(spec, config) for config in network_configs(spec)]
            staged = plan_stages(spec, trials, data_shape(spec))
            return with_overrides(tree, {STAGES_PATH: staged.stages}), staged
        plan = plan_spec(spec, fields)
    except ValueError as exc:
        if isinstance(exc, SpecError):
            raise
        where = "parallelism.memory_per_worker" if isinstance(exc, NothingFits) else fields[0]
        raise SpecError(source, [(where, f"'auto': {exc}")]) from None
    values = {"training.tile": list(plan.tile), "training.batch_size": plan.batch}
    return with_overrides(tree, {field: values[field] for field in fields}), plan


def load_planned_spec(path: str | Path, overrides: Mapping[str, Any] | None = None
                      ) -> tuple[Spec, InputPlan | StagePlan | None]:
    """Read, override, plan (:func:`planned_tree`) and validate a spec file: the CLI's entry point."""
    source = str(path)
    tree, plan = planned_tree(with_overrides(read_spec_file(path), overrides or {}), source)
    return validate_spec(tree, source=source), plan
