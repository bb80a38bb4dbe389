"""The search algorithms and trial schedulers a spec may name (``search.algorithm``, ``search.scheduler``): one entry
each, with what the spec's checks need to know of it.

An entry here is what a spec is validated against (no Ray is imported to read it). The Ray Tune object each one
makes is bound to its name in :mod:`distmis.search.search_space` (``TUNE_ALGORITHMS``, ``TUNE_SCHEDULERS``), as the
networks' code is bound to the model registry in :mod:`distmis.networks`. Adding a search algorithm or a scheduler
is one entry here, one binding there, and their test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["PBT_MUTABLE", "pbt_mutations", "DOMAIN_KINDS", "AlgorithmEntry", "SchedulerEntry", "ALGORITHMS", "SCHEDULERS", "algorithm_entry",
           "scheduler_entry"]

#: The kinds of a search-space domain (:class:`~distmis.spec.schema.Domain`).
DOMAIN_KINDS = frozenset({"grid", "choice", "uniform", "loguniform", "randint"})


#: What population-based training may change in a trial mid-training (``search.pbt.mutations``): values the next
#: step reads afresh, that leave the network, its tiles and its weights' shapes as they are. The optimizer's
#: ``lr``, ``weight_decay`` and ``momentum``, and each augmentation's probability and strength.
PBT_MUTABLE = frozenset({
    "training.optimizer.lr", "training.optimizer.weight_decay", "training.optimizer.momentum",
    *(f"training.augment.{name}" for name in (
        "flip", "rotate90", "affine", "rotate_degrees", "scale_range", "elastic", "intensity_scale",
        "intensity_scale_range", "intensity_shift", "intensity_shift_range", "noise", "noise_std")),
})


@dataclass(frozen=True)
class AlgorithmEntry:
    """A search algorithm: which domain kinds it takes (``refusal(kind)``: why it refuses another, and what to use),
    and whether its configurations are Ray Tune's variant generator's (grid and random: every configuration known
    up front, which distmis may hand out itself, by graph or by fold), not a model's that learns from results."""

    name: str
    domains: frozenset[str]
    refusal: Callable[[str], str]
    variant_generator: bool
    summary: str
    holds_space: bool = False  # its searcher is made with the search space and its objectives (the Tuner gives none)
    takes_folds: bool = True  # with dataset.split.folds, distmis's fold searcher drives it


@dataclass(frozen=True)
class SchedulerEntry:
    """A trial scheduler: whether it stops trials early (their records then end before ``training.epochs``), and
    ``planned_epochs(trials, spec)``: the epochs each of ``trials`` trials is expected to train, longest first, for
    the makespan plan (None: every trial all its epochs, an upper bound for a scheduler that stops trials)."""

    name: str
    stops_trials: bool
    summary: str
    planned_epochs: Callable[[int, Any], list[float]] | None = None
    #: its trials wait paused for others (synchronous halving): no limit on the trials at once, which Ray Tune's
    #: concurrency limiter would apply to paused trials too, and none would be left to start
    waits_paused: bool = False


def _asha_epochs(trials: int, spec: Any) -> list[float]:
    from distmis.perf.makespan import asha_epochs

    asha = spec.search.asha
    return asha_epochs(trials, spec.training.epochs, asha.grace_period, asha.reduction_factor)


def _curriculum_rungs(spec: Any) -> list[int]:
    """The epochs at which ``training.curriculum``'s stages end, but the last's."""
    rungs, last = [], 0
    for stage in (spec.training.curriculum or [])[:-1]:
        last += stage.epochs
        rungs.append(last)
    return rungs


def _stage_asha_epochs(trials: int, spec: Any) -> list[float]:
    from distmis.perf.makespan import asha_epochs_at_rungs

    return asha_epochs_at_rungs(trials, _curriculum_rungs(spec), spec.training.epochs,
                                spec.search.stage_asha.reduction_factor)


def _stage_halving_epochs(trials: int, spec: Any) -> list[float]:
    from distmis.perf.makespan import halving_epochs_at_rungs

    return halving_epochs_at_rungs(trials, _curriculum_rungs(spec), spec.training.epochs,
                                   spec.search.stage_halving.reduction_factor)


ALGORITHMS: dict[str, AlgorithmEntry] = {
    entry.name: entry
    for entry in (
        AlgorithmEntry("grid", frozenset({"grid"}), variant_generator=True,
                       refusal=lambda kind: f"algorithm 'grid' takes only 'grid' domains, got '{kind}'; use algorithm "
                                            "'random' or 'optuna' to sample",
                       summary="every combination of the grid values (times num_samples)"),
        AlgorithmEntry("random", DOMAIN_KINDS, variant_generator=True, refusal=lambda kind: "",
                       summary="num_samples draws from the domains (grid values: every one, times num_samples)"),
        AlgorithmEntry("optuna", DOMAIN_KINDS - {"grid"}, variant_generator=False,
                       refusal=lambda kind: "algorithm 'optuna' samples; use 'choice' instead of 'grid'",
                       summary="Optuna's TPE sampler, told each trial's result (seeded with training.seed)"),
        AlgorithmEntry("optuna-cost", DOMAIN_KINDS - {"grid"}, variant_generator=False, holds_space=True,
                       takes_folds=False,
                       refusal=lambda kind: "algorithm 'optuna-cost' samples; use 'choice' instead of 'grid'",
                       summary="Optuna's multi-objective TPE over each trial's best search.metric and its "
                               "worker-hours (seeded with training.seed)"),
    )
}

SCHEDULERS: dict[str, SchedulerEntry] = {
    entry.name: entry
    for entry in (
        SchedulerEntry("none", stops_trials=False, summary="every trial trains every epoch"),
        SchedulerEntry("asha", stops_trials=True, planned_epochs=_asha_epochs,
                       summary="asynchronous successive halving: search.asha's grace period and reduction factor"),
        SchedulerEntry("hyperband", stops_trials=True,
                       summary="asynchronous HyperBand: search.hyperband's brackets of successive halving, each "
                               "with its own grace period, every trial drawn into one"),
        SchedulerEntry("stage-asha", stops_trials=True, planned_epochs=_stage_asha_epochs,
                       summary="asynchronous successive halving whose rungs are the ends of training.curriculum's "
                               "stages: multi-fidelity over the input size (search.stage_asha)"),
        SchedulerEntry("stage-halving", stops_trials=True, planned_epochs=_stage_halving_epochs, waits_paused=True,
                       summary="synchronous successive halving at the ends of training.curriculum's stages: each "
                               "trial waits at a stage's end for all the others, and the best go on "
                               "(search.stage_halving)"),
        SchedulerEntry("pbt", stops_trials=False,
                       summary="population-based training: every search.pbt.interval epochs a trial in the "
                               "bottom quantile goes on from a top trial's checkpoint with its values perturbed"),
        SchedulerEntry("median", stops_trials=True,
                       summary="median stopping: a trial whose best result so far is below the median of the "
                               "other trials' running means at the same epoch is stopped (search.median)"),
    )
}


def pbt_mutations(search: Any) -> list[str]:
    """The searched paths population-based training changes: ``search.pbt.mutations``, or every searched path it
    may change (:data:`PBT_MUTABLE`). ``search``: a :class:`~distmis.spec.schema.SearchSpec`."""
    named = search.pbt.mutations
    return list(named) if named is not None else [path for path in search.space if path in PBT_MUTABLE]


def algorithm_entry(name: str) -> AlgorithmEntry:
    """The entry of ``name``; ValueError naming the registered algorithms."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"no search algorithm {name!r}; registered: {', '.join(ALGORITHMS)}") from None


def scheduler_entry(name: str) -> SchedulerEntry:
    """The entry of ``name``; ValueError naming the registered schedulers."""
    try:
        return SCHEDULERS[name]
    except KeyError:
        raise ValueError(f"no trial scheduler {name!r}; registered: {', '.join(SCHEDULERS)}") from None
