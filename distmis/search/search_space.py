"""Translate the spec's ``search`` section into Ray Tune objects.

A trial's config is flat: ``{"training.optimizer.lr": 0.001, "model.params.norm": "group"}``.
Each key is a dotted path into the spec; the trial applies them to the base spec.
"""

from __future__ import annotations

from typing import Any

from ray import tune

from distmis.spec.schema import Domain, SearchSpec, Spec


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
    """What the ``Tuner`` is given as its ``param_space``: the search space, or nothing in a search with folds, whose
    searcher holds the space (:class:`~distmis.search.folds.FoldSearcher`)."""
    return {} if spec.cv_folds else param_space(spec.search)


def search_algorithm(spec: Spec):
    """``None`` (Tune's variant generator: grid and random), an ``OptunaSearch``, or, with cross-validation folds,
    a :class:`~distmis.search.folds.FoldSearcher` around either (grid and random: their configurations, drawn as
    Tune draws them, seeded with ``training.seed``)."""
    search, folds = spec.search, spec.cv_folds
    optuna_search = None
    if search.algorithm == "optuna":
        import optuna
        from ray.tune.search.optuna import OptunaSearch

        sampler = optuna.samplers.TPESampler(seed=spec.training.seed)
        if not folds:
            return OptunaSearch(sampler=sampler)
        optuna_search = OptunaSearch(space=param_space(search), metric=search.metric, mode=search.mode,
                                     sampler=sampler)
    if not folds:
        return None
    from distmis.search.folds import Configurations, FoldSearcher

    inner = optuna_search or Configurations(param_space(search), search.num_samples, spec.training.seed)
    return FoldSearcher(inner, folds, search.metric, search.mode, limit=num_configurations(search))


def scheduler(spec: Spec):
    """ASHA when ``search.scheduler`` asks for it (with folds: one ASHA per fold,
    :class:`~distmis.search.folds.FoldScheduler`); None otherwise."""
    search = spec.search
    if search.scheduler != "asha":
        return None
    from ray.tune.schedulers import ASHAScheduler

    def asha() -> ASHAScheduler:
        return ASHAScheduler(
            time_attr="epoch",  # what a trial reports; a resumed trial's Tune iteration count may differ
            max_t=spec.training.epochs,
            grace_period=min(search.asha.grace_period, spec.training.epochs),
            reduction_factor=search.asha.reduction_factor,
        )

    if not spec.cv_folds:
        return asha()
    from distmis.search.folds import FoldScheduler

    return FoldScheduler(spec.cv_folds, asha)


def num_configurations(search: SearchSpec) -> int:
    """How many configurations the search tries: grid points x num_samples."""
    return search.trial_count


def num_trials(spec: Spec) -> int:
    """How many trials the search runs: its configurations, times the folds each trains with cross-validation."""
    return num_configurations(spec.search) * max(1, len(spec.cv_folds))
