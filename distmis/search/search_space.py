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


def search_algorithm(spec: Spec):
    """``None`` (Tune's variant generator: grid and random) or an ``OptunaSearch``."""
    search = spec.search
    if search.algorithm == "optuna":
        import optuna
        from ray.tune.search.optuna import OptunaSearch

        return OptunaSearch(sampler=optuna.samplers.TPESampler(seed=spec.training.seed))
    return None


def scheduler(spec: Spec):
    search = spec.search
    if search.scheduler == "asha":
        from ray.tune.schedulers import ASHAScheduler

        return ASHAScheduler(
            time_attr="epoch",  # what a trial reports; a resumed trial's Tune iteration count may differ
            max_t=spec.training.epochs,
            grace_period=min(search.asha.grace_period, spec.training.epochs),
            reduction_factor=search.asha.reduction_factor,
        )
    return None


def num_trials(search: SearchSpec) -> int:
    """How many trials the search runs: grid points x num_samples."""
    return search.trial_count
