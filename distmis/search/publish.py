"""Publishing a search's best model (the driver, at the search's end): an MLflow model folder in the output, the
model logged on its trial's (or configuration's) run, and a new version of the search's registered model tagged with
the test scores (:mod:`distmis.predict.registry`). The candidates and their test scores: :mod:`distmis.search.evaluate`.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from distmis.predict.registry import PublishedModel
from distmis.search.evaluate import BestModel, Candidate, TestEvaluation
from distmis.search.prepare import PreparedData
from distmis.spec.schema import Spec

if TYPE_CHECKING:
    from distmis.train.protocol import Trainer

logger = logging.getLogger(__name__)

__all__ = ["publish_model"]


def publish_model(trainers: Sequence[Trainer], model: BestModel | Candidate, spec: Spec, data: PreparedData, *,
                  tracking_uri: str, trial_run_id: str | None, search_run_id: str, evaluation: TestEvaluation | None,
                  folder: Path | None, register: bool, folds: Sequence[int] = (),
                  postprocessing: Mapping[str, object] | None = None,
                  configurations: Sequence[tuple[str, Sequence[Trainer]]] = ()) -> PublishedModel:
    """Make the trial's loaded model usable: an MLflow model folder at ``folder`` (a copy that needs no tracking
    store; a python_function model that needs no distmis either), the model logged on the trial's run, and, with ``register``, a new version of the search's registered
    model with the test metrics as tags (see :mod:`distmis.predict.registry`).

    ``trainers``: one per fold of ``folds`` (in that order), which make ONE model, a fold ensemble that averages
    their probabilities; or, with ``folds`` empty, exactly one. The recipe is ``trainers[0].spec``'s, with the
    ``postprocessing`` cross-validation chose (:mod:`distmis.search.postprocessing`; None: none).
    ``configurations``: a configuration ensemble's configurations (name and trainers, one per fold of ``folds``
    each, best first; :mod:`distmis.search.configuration_ensemble`), whose networks the model holds in place of
    ``trainers`` (the first's); empty: one configuration's model.

    The local copy is written first, so a tracking store that is away costs the logging and registration (the
    returned model's ``error`` says why), not the model.
    """
    from distmis.predict.recipe import ModelRecipe
    from distmis.predict.registry import log_model, model_files, save_model

    if not trainers:
        raise ValueError("publish_model needs a trainer (one per fold of a fold ensemble)")
    members = list(configurations) or [("", trainers)]
    recipes = [(name, ModelRecipe.from_spec(own[0].spec, data.manifest, folds=folds,
                                            postprocessing=dict(postprocessing) if postprocessing else None))
               for name, own in members]
    mirror = recipes[0][1].inference.mirror  # the best's, which cross-validation chose the ensemble with
    recipe = ModelRecipe.combined([(name, replace(own, inference=replace(own.inference, mirror=mirror)))
                                   for name, own in recipes])
    networks = [t.model for _, own in members for t in own]
    with model_files(networks, recipe) as files:  # the networks exported once, for the copy and the store
        local = save_model(networks, recipe, folder, files=files) if folder is not None else None
        if trial_run_id is None:
            return PublishedModel(local, None)
        model_uri = None
        try:
            model_uri = log_model(networks, recipe, tracking_uri, trial_run_id, files=files)
            if not register:
                return PublishedModel(local, model_uri)
            return _register(model_uri, model, spec, local, evaluation, tracking_uri, trial_run_id, search_run_id,
                             folds=recipe.folds, configurations=recipe.names)
        except Exception as exc:  # noqa: BLE001  (the store's errors, whatever its kind)
            logger.warning("could not log or register the model of trial %s", model.trial_id, exc_info=True)
            return PublishedModel(local, model_uri, error=f"{type(exc).__name__}: {exc}")


def _register(model_uri: str, model: BestModel | Candidate, spec: Spec, local: Path | None,
              evaluation: TestEvaluation | None, tracking_uri: str, trial_run_id: str, search_run_id: str, *,
              folds: Sequence[int] = (), configurations: Sequence[str] = ()) -> PublishedModel:
    """A new version of the search's registered model, tagged with the test metrics (or the search metric)."""
    from distmis.predict.registry import register_model

    metric, mode = spec.search.selected_metric, spec.search.mode
    tags: dict[str, str] = {"distmis.search_run": search_run_id, "distmis.trial": model.trial_id,
                            f"best_{metric}": f"{model.best_value:.6g}"}
    score: tuple[str, float, str] = (f"best_{metric}", model.best_value, mode)
    if evaluation is not None:
        means = evaluation.means
        tags.update({key: f"{value:.6g}" for key, value in means.items()})
        key = "test_dice_mean" if "test_dice_mean" in means else f"test_dice_{evaluation.regions[0]}"
        score = (key, means[key], "max")
    description = (f"distmis search {spec.name!r}: trial {model.trial_id} ({metric} {model.best_value:.4f}"
                   + (f"; test: {evaluation.summary()}" if evaluation is not None else "") + ")"
                   + (f", fold ensemble of folds {', '.join(map(str, folds))}" if folds else "")
                   + (f", configuration ensemble of {', '.join(configurations)}" if configurations else ""))
    if configurations:
        tags["distmis.configurations"] = "+".join(configurations)
    name = spec.registered_model_name
    version, best = register_model(tracking_uri, model_uri, name, run_id=trial_run_id, tags=tags, score=score,
                                   description=description)
    return PublishedModel(local, model_uri, name, version, best)
