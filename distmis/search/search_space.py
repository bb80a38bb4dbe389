"""Translate the spec's ``search`` section into Ray Tune objects.

A trial's config is flat: ``{"training.optimizer.lr": 0.001, "model.params.norm": "group"}``.
Each key is a dotted path into the spec; the trial applies them to the base spec.

Each registered search algorithm and scheduler (:mod:`distmis.spec.searchers`) is bound here to what makes its Tune
object (:data:`TUNE_ALGORITHMS`, :data:`TUNE_SCHEDULERS`); with cross-validation folds distmis wraps either
(:mod:`distmis.search.folds`), whichever it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ray import tune

from distmis.spec.schema import Domain, SearchSpec, Spec
from distmis.spec.searchers import algorithm_entry, scheduler_entry

if TYPE_CHECKING:
    from ray.tune.schedulers import TrialScheduler
    from ray.tune.search import Searcher


def to_tune_domain(domain: Domain) -> Any:
    kind = domain.kind
    if kind == "grid":
        return tune.grid_search(list(domain.grid))
    if kind == "choice":
        return tune.choice(list(domain.choice))
    if kind == "uniform":
        return tune.uniform(*domain.uniform)
    if kind == "loguniform":
        return tune.loguniform(*domain.loguniform)
    if kind == "randint":
        low, high = domain.randint
        return tune.randint(low, high + 1)  # the spec's bounds are inclusive, Tune's upper is not
    raise ValueError(f"unknown domain kind {kind!r}")


def param_space(search: SearchSpec) -> dict[str, Any]:
    return {path: to_tune_domain(domain) for path, domain in search.space.items()}


def tune_param_space(spec: Spec) -> dict[str, Any]:
    """What the ``Tuner`` is given as its ``param_space``: the search space, or nothing where distmis's own searcher
    holds it (:func:`gives_every_trial`, or an algorithm made with the space itself)."""
    if gives_every_trial(spec) or algorithm_entry(spec.search.algorithm).holds_space:
        return {}
    return param_space(spec.search)


def graph_affine(spec: Spec) -> bool:
    """Whether a search's trials are handed out by graph (:mod:`distmis.search.affinity`): a grid or random
    search without folds of experiment-mode TensorFlow trials, which keep their traced graphs on their actor. Not
    under population-based training, which Ray Tune runs with its own variant generator only."""
    return (algorithm_entry(spec.search.algorithm).variant_generator and not spec.cv_folds
            and spec.search.scheduler != "pbt"
            and spec.model.framework == "tensorflow" and spec.parallelism.mode == "experiment")


def shuffles_configurations(spec: Spec) -> bool:
    """Whether a grid or random search's configurations are handed out in a random order (seeded with
    ``training.seed``): when its scheduler stops trials. An asynchronous stopping rule judges each trial against those
    that reached its rung before it, the first always going on; in the order a grid is written (a learning rate
    rising), each trial would arrive better than every one before it and none would be stopped."""
    return (algorithm_entry(spec.search.algorithm).variant_generator
            and scheduler_entry(spec.search.scheduler).stops_trials)


def gives_every_trial(spec: Spec) -> bool:
    """Whether distmis's searcher makes every trial (a search with folds, :func:`graph_affine`, or
    :func:`shuffles_configurations`): the ``Tuner`` then has no ``param_space``, and its ``num_samples`` is the number
    of trials (:func:`num_trials`)."""
    return bool(spec.cv_folds) or graph_affine(spec) or shuffles_configurations(spec)


def configuration_graph(spec: Spec):
    """A trial configuration's graph key (:func:`~distmis.train.tf_unet.graph_key` of its trial spec); a
    configuration the trial will refuse as it starts has one of its own."""
    import json

    from distmis.spec.layout import resolve_trial
    from distmis.train.tf_unet import graph_key

    def graph(config: dict[str, Any]) -> str:
        try:
            return graph_key(resolve_trial(spec, config)[0])
        except Exception:  # noqa: BLE001 - the trial fails with the reason when it starts
            return json.dumps({"unresolved": config}, sort_keys=True, default=str)

    return graph


# --------------------------------------------------------------------------- search algorithms
def _optuna(spec: Spec, *, with_space: bool) -> Searcher:
    """Optuna's TPE sampler, seeded with ``training.seed``."""
    import optuna
    from ray.tune.search.optuna import OptunaSearch

    sampler = optuna.samplers.TPESampler(seed=spec.training.seed)
    if not with_space:  # the Tuner gives it the param_space
        return OptunaSearch(sampler=sampler)
    search = spec.search
    return OptunaSearch(space=OptunaSearch.convert_search_space(param_space(search)), metric=search.selected_metric,
                        mode=search.mode, sampler=sampler)


def _optuna_cost(spec: Spec, *, with_space: bool) -> Searcher:
    """Optuna's multi-objective TPE over the search metric and worker-hours, seeded with ``training.seed``; made with
    the search space whether or not ``with_space`` (its objectives are its own, not the Tuner's one metric)."""
    import optuna

    from distmis.search.cost_objective import CostAwareOptuna

    return CostAwareOptuna(spec, CostAwareOptuna.convert_search_space(param_space(spec.search)),
                           optuna.samplers.TPESampler(seed=spec.training.seed))


#: A registered search algorithm's Tune searcher, by name (:data:`distmis.spec.searchers.ALGORITHMS`):
#: ``(spec, with_space=...) -> Searcher``, or None for Ray Tune's variant generator (grid, random).
#: ``with_space``: the searcher is given the search space itself (folds: distmis's fold searcher drives it).
TUNE_ALGORITHMS: dict[str, Callable[..., Searcher] | None] = {"grid": None, "random": None, "optuna": _optuna,
                                                               "optuna-cost": _optuna_cost}


def search_algorithm(spec: Spec) -> Searcher | None:
    """``None`` (Tune's variant generator: grid and random), the entry's searcher (``OptunaSearch``), or, with
    cross-validation folds, a :class:`~distmis.search.folds.FoldSearcher` around either (grid and random: their
    configurations, drawn as Tune draws them, seeded with ``training.seed``). Grid and random searches under a
    scheduler that stops trials hand out those configurations in a seeded random order
    (:func:`shuffles_configurations`); those of experiment-mode TensorFlow trials by graph
    (:class:`~distmis.search.affinity.GraphAffineConfigurations`)."""
    search, folds, shuffle = spec.search, spec.cv_folds, shuffles_configurations(spec)
    if graph_affine(spec):
        from distmis.search.affinity import GraphAffineConfigurations

        return GraphAffineConfigurations(param_space(search), search.num_samples, spec.training.seed,
                                         configuration_graph(spec), shuffle=shuffle)
    from distmis.search.folds import Configurations, FoldSearcher

    make = TUNE_ALGORITHMS[search.algorithm]
    if make is not None:
        inner = make(spec, with_space=bool(folds))
    elif folds or shuffle:  # grid and random: every configuration, made here
        inner = Configurations(param_space(search), search.num_samples, spec.training.seed, shuffle=shuffle)
    else:
        return None
    if not folds:
        return inner
    return FoldSearcher(inner, folds, search.selected_metric, search.mode, limit=num_configurations(search))


def tune_search(spec: Spec, max_concurrent: int | None) -> dict[str, Any]:
    """The ``TuneConfig`` arguments that say which trials the search makes: ``search_alg``, ``num_samples`` and
    ``max_concurrent_trials`` (``max_concurrent``: at most that many trials at once; None: as many as fit).

    With cross-validation folds the fold searcher caps the configurations itself and says when it is done: Tune is
    given it in a :class:`~distmis.search.folds.FoldSearchGenerator` (which limits the trials at once) with
    ``num_samples=-1``, so that Tune's own count of trials never stops a resumed search short of a fold (Ray Tune
    2.x: a search algorithm's trials are made until it says ``FINISHED`` or ``num_samples`` are made; -1 is no
    limit). Grid and random searches handed out by graph give every trial and then say they are done too;
    ``num_samples`` is their number of trials."""
    searcher = search_algorithm(spec)
    if spec.cv_folds:
        from distmis.search.folds import FoldSearchGenerator

        return {"search_alg": FoldSearchGenerator(searcher, max_concurrent), "num_samples": -1,
                "max_concurrent_trials": None}
    samples = num_trials(spec) if gives_every_trial(spec) else spec.search.num_samples
    return {"search_alg": searcher, "num_samples": samples, "max_concurrent_trials": max_concurrent}


# --------------------------------------------------------------------------- trial schedulers
def _asha(spec: Spec, key: str) -> TrialScheduler:
    """Asynchronous successive halving over the epochs a trial reports (``search.asha``)."""
    from ray.tune.schedulers import ASHAScheduler

    return ASHAScheduler(
        time_attr="epoch",  # what a trial reports; a resumed trial's Tune iteration count may differ
        max_t=spec.training.epochs,
        grace_period=min(spec.search.asha.grace_period, spec.training.epochs),
        reduction_factor=spec.search.asha.reduction_factor,
    )


def _hyperband(spec: Spec, key: str) -> TrialScheduler:
    """Asynchronous HyperBand: ASHA in ``search.hyperband.brackets`` brackets, each trial drawn into one by Tune's
    ``AsyncHyperBandScheduler`` (no trial is paused, so none restarts from its checkpoint at a rung), its draws
    seeded with ``training.seed``."""
    from distmis.search.seeded_hyperband import SeededAsyncHyperBand

    hyperband = spec.search.hyperband
    return SeededAsyncHyperBand(time_attr="epoch", max_t=spec.training.epochs,
                                grace_period=min(hyperband.grace_period, spec.training.epochs),
                                reduction_factor=hyperband.reduction_factor, brackets=hyperband.brackets,
                                seed=spec.training.seed)


def _median(spec: Spec, key: str) -> TrialScheduler:
    """The median stopping rule over the epochs (``search.median``), stopping (not pausing) a trial below it."""
    from ray.tune.schedulers import MedianStoppingRule

    median = spec.search.median
    return MedianStoppingRule(time_attr="epoch", grace_period=median.grace_period,
                              min_samples_required=median.min_samples, hard_stop=True)


def _stage_asha(spec: Spec, key: str) -> TrialScheduler:
    """Asynchronous successive halving whose rungs are the ends of ``training.curriculum``'s stages
    (``search.stage_asha``)."""
    from distmis.search.stage_rungs import StageRungASHA, stage_rungs

    return StageRungASHA(stage_rungs(spec.training), spec.training.epochs, spec.search.stage_asha.reduction_factor)


def _stage_halving(spec: Spec, key: str) -> TrialScheduler:
    """Synchronous successive halving of all the search's trials at the ends of ``training.curriculum``'s stages
    (``search.stage_halving``)."""
    from distmis.search.stage_rungs import StageRungHalving, stage_rungs

    return StageRungHalving(stage_rungs(spec.training), spec.training.epochs,
                            spec.search.stage_halving.reduction_factor, trials=num_trials(spec))


def _pbt(spec: Spec, key: str) -> TrialScheduler:
    """Population-based training (``search.pbt``), its exploits told to the search run ``key``'s listener."""
    from distmis.search.pbt import pbt_scheduler

    return pbt_scheduler(spec, key)


#: A registered scheduler's Tune scheduler, by name (:data:`distmis.spec.searchers.SCHEDULERS`): ``(spec, key) -> a
#: new TrialScheduler`` (``key``: the search run's id, by which a scheduler finds what the driver listens with), or
#: None for Tune's default (first in, first out: every trial trains every epoch).
TUNE_SCHEDULERS: dict[str, Callable[[Spec, str], TrialScheduler] | None] = {
    "none": None, "asha": _asha, "hyperband": _hyperband, "median": _median, "pbt": _pbt,
    "stage-asha": _stage_asha, "stage-halving": _stage_halving}


def scheduler(spec: Spec, key: str = "") -> TrialScheduler | None:
    """The scheduler ``search.scheduler`` names (with folds: one per fold, each seeing only its fold's trials,
    :class:`~distmis.search.folds.FoldScheduler`); None for Tune's default. ``key``: the search run's id."""
    make = TUNE_SCHEDULERS[spec.search.scheduler]
    if make is None:
        return None
    if not spec.cv_folds:
        return make(spec, key)
    from distmis.search.folds import FoldScheduler

    return FoldScheduler(spec.cv_folds, lambda: make(spec, key))


def num_configurations(search: SearchSpec) -> int:
    """How many configurations the search tries: grid points x num_samples."""
    return search.trial_count


def num_trials(spec: Spec) -> int:
    """How many trials the search runs: its configurations, times the folds each trains with cross-validation."""
    return num_configurations(spec.search) * max(1, len(spec.cv_folds))
