"""A search's end, once its trials are over: the best models loaded, scored on the test split and published
(:func:`end_search`), the results table logged, and the search's MLflow run ended with a :class:`SearchOutcome`.

A problem here (a model that does not load, a test split that cannot be scored, a model that cannot be published)
is logged and tagged on the search's run and makes the command exit 1: the trials' records are safe by now.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import pandas as pd

from distmis.predict.registry import PublishedModel
from distmis.search.evaluate import (
    BestModel, Candidate, TestEvaluation, best_models, evaluate_ensemble_on_test, fold_candidates, loaded_trainer,
    test_spacings,
)
from distmis.search.configuration_ensemble import LARGEST
from distmis.search.cost_limit import within_cost_limit
from distmis.search.publish import publish_model
from distmis.search.outcome import SearchOutcome
from distmis.search.prepare import PreparedData
from distmis.spec.schema import Spec
from distmis.train.protocol import Trainer
from distmis.tracking.datasets import TrackedData
from distmis.tracking.figures import learning_curves_figure
from distmis.tracking.mlflow_tracking import MLflowTrialCallback, SearchRun
from distmis.tracking.pareto import record_pareto
from distmis.tracking.results import format_results, inference_frame, results_frame

logger = logging.getLogger(__name__)

__all__ = ["end_search"]


def end_search(spec: Spec, data: PreparedData, search_run: SearchRun, grid: Any, callback: MLflowTrialCallback, *,
               search_seconds: float, capacity: int = 1, tune_failure: str = "",
               model_folder: Path | None = None) -> SearchOutcome:
    """What follows the trials of a search (``grid``: Tune's results; ``callback``: the trials' records, closed):
    the learning curves, what the search cost (:func:`_record_accounting`; ``capacity``: the workers its trials
    could hold at once), the best candidates scored on the test split and the best one published (``model_folder``:
    where its model is kept; None: logged on its run only), the results tables on the search's run, and the run
    ended (FAILED when Ray Tune itself stopped the search: ``tune_failure`` says why)."""
    # Counted from each trial's own final status as the callback recorded it: Tune's grid.errors misses a trial
    # whose error file could not be written (a full or read-only disk).
    failed_trials = tuple(callback.failed)
    failed = len(failed_trials)

    client = search_run.client
    search_run.log_figure(learning_curves_figure(client, client.get_run(search_run.run_id), "val_dice"),
                          "val_dice_curves.png")
    _record_accounting(search_run, capacity)
    best = _finish_with_best_models(search_run, grid, callback, spec, data, model_folder)
    problems = list(best.problems)
    if tune_failure:
        problems.insert(0, f"{tune_failure} (the same command with --resume continues it)")
        search_run.set_tag("distmis.search_error", tune_failure[:500])
    search_run.writer.close(timeout=60)  # the test scores written before the table reads them
    results = results_frame(client, client.get_run(search_run.run_id))  # with the test dice of those scored
    search_run.log_text(format_results(results, "csv"), "results.csv")
    search_run.log_text(format_results(results, "markdown"), "results.md")
    inference = inference_frame(results)
    if not inference.empty:  # training.inference.compare: LAMP's whole-volume against sliding-window table
        search_run.log_text(format_results(inference, "csv"), "inference.csv")
        search_run.log_text(format_results(inference, "markdown"), "inference.md")
    search_run.log_metrics({"trials": len(results), "failed_trials": failed, "search_seconds": search_seconds})
    ranked_by = f"{'cv' if spec.cv_folds else 'best'}_{spec.search.selected_metric}"  # the table's order
    record_pareto(search_run, results, ranked_by, spec.search.mode)
    best_column = results.get(ranked_by)
    if best_column is not None and best_column.notna().any():
        search_run.log_metrics({ranked_by: float(best_column.iloc[0])})
    elapsed = search_run.finish("FAILED" if tune_failure else "FINISHED")
    return SearchOutcome(results, failed, elapsed, search_seconds, search_run.tracking_uri, spec.experiment_name,
                         search_run.run_id, data, best.test, best.note, best.model, tuple(problems), failed_trials,
                         tune_failure)


def _record_accounting(search_run: SearchRun, capacity: int) -> None:
    """The search's ``span_seconds``, ``worker_hours`` and ``idle_fraction`` of ``capacity`` workers, and the
    schedule that ran, drawn (``schedule.png``): :mod:`distmis.tracking.accounting`."""
    from distmis.tracking.accounting import measured_schedule, search_accounting, trial_spans
    from distmis.tracking.figures import gantt_figure

    try:
        spans = trial_spans(search_run.client, search_run.run_id)
    except Exception as exc:  # noqa: BLE001 - a record of the cost never stops the search's end
        logger.warning("no accounting of the search's workers: its trial runs could not be read: %s", exc)
        return
    figures = search_accounting(spans, capacity)
    if not figures:
        return
    search_run.log_metrics(figures)
    schedule = measured_schedule(spans, capacity)
    search_run.log_figure(gantt_figure([schedule], title=f"what ran where: {figures['worker_hours']:.3g} "
                                                         f"worker-hours on {capacity} worker(s)"), "schedule.png")


@dataclass(frozen=True)
class BestModels:
    """What became of a search's best models: the best's test scores (None if none was scored), a note for the user
    (why there are none, if there are none), where its model went, and what could not be done."""

    test: TestEvaluation | None
    note: str
    model: PublishedModel | None
    problems: tuple[str, ...] = ()


def _finish_with_best_models(search_run: SearchRun, grid: Any, callback: MLflowTrialCallback, spec: Spec,
                             data: PreparedData, model_folder: Path | None
                             ) -> BestModels:
    """What follows the trials: the ``search.evaluate_top`` best candidates scored on the test split (each on its
    own run; the best also on the search's run), the best one's overlay, and the best one's model published
    (:func:`~distmis.search.publish.publish_model`; ``model_folder`` None: logged on its run, not copied nor
    registered). A candidate is a finished trial, or with cross-validation folds a configuration whose every fold
    finished: its fold models predict as one ensemble (the mean of their probabilities), which is scored on the
    configuration's run, each fold on its own, and published; unless the best configuration's out-of-fold
    predictions, and its runners-up's (:data:`~distmis.search.configuration_ensemble.LARGEST` in all), choose a
    configuration ensemble (:func:`_choose_model`), which is then scored on the search's run and published in its
    place, with the postprocessing chosen on the same predictions. Only trials whose own final status is FINISHED
    count.

    Returns (:class:`BestModels`) the best's scores (None if none), a note for the user, where the model went, and
    the problems: what could not be done (a model that did not load, a test split that could not be scored, a
    model that could not be published), each naming the trial and why. The trials' records are safe by now: these
    are logged and tagged on the search run, and make the command exit 1, not raise.
    """
    top = spec.search.evaluate_top
    # search.cost_limit: only the trials (configurations) within it may become the model
    finished = within_cost_limit(callback.finished, callback.worker_seconds, callback.trial_folds,
                                 spec.search.cost_limit)
    if spec.search.cost_limit is not None:
        search_run.set_tag("distmis.cost_limit", f"{len(finished)} of {len(callback.finished)} finished trials "
                                                 f"within {spec.search.cost_limit:g} worker-hours")
    problems: list[str] = []
    notes: list[str] = [] if top else ["search.evaluate_top is 0: the test split was not evaluated"]

    def problem(text: str, tag: str) -> None:
        problems.append(text)
        notes.append(text)
        search_run.set_tag(tag, text[:500])

    runners_up: list[Candidate] = []  # a cross-validated search's next best configurations, to ensemble
    if spec.cv_folds:
        models = best_models(grid, callback.last_checkpoint, callback.configs, callback.best, spec.search.mode,
                             top=len(finished), finished=finished)
        means = {configuration: result.mean for configuration, result in callback.cv.items()}
        ranked = fold_candidates(models, callback.trial_folds, means, spec.cv_folds, spec.search.mode,
                                 top=max(top, 1, LARGEST))
        candidates, runners_up = ranked[:max(top, 1)], ranked[1:LARGEST]
        unit = "configuration whose every fold finished"
    else:
        candidates = [Candidate.of(model) for model in best_models(
            grid, callback.last_checkpoint, callback.configs, callback.best, spec.search.mode, top=max(top, 1),
            finished=finished)]
        unit = "trial"
    if not candidates:
        if callback.finished and not finished:  # search.cost_limit left none
            cheapest = min(callback.worker_seconds.get(trial, float("inf")) for trial in callback.finished) / 3600
            problem(f"no finished {unit} is within search.cost_limit {spec.search.cost_limit:g} worker-hours "
                    f"(the cheapest trial took {cheapest:.3g}): no model", "distmis.test_error")
        elif finished:  # trials finished, no candidate has weights to load
            problem(f"no finished {unit} has a checkpoint to load its best weights from "
                    f"(trials {', '.join(sorted(finished))})", "distmis.test_error")
        else:
            notes.append("no trial finished: there is no model to evaluate")
        return BestModels(None, "; ".join(notes), None, tuple(problems))
    best: TestEvaluation | None = None
    published: PublishedModel | None = None
    spacings: dict[str, tuple[float, float, float]] = {}
    evaluate = bool(top and data.split.get("test"))
    if top and not evaluate:
        notes.append("the test split is empty: nothing to evaluate")
        search_run.set_tag("distmis.test", notes[-1])
    for rank, candidate in enumerate(candidates if evaluate else candidates[:1]):
        run_id = (callback.configuration_runs.get(candidate.name) if candidate.folds
                  else callback.run_ids.get(candidate.name))
        try:
            with ExitStack() as stack:
                trainers = {}
                for fold, model in candidate.models.items():
                    try:
                        trainers[fold] = stack.enter_context(loaded_trainer(model, spec, data))
                    except Exception as exc:  # noqa: BLE001  (its weights could not be loaded)
                        raise _NotLoaded(model) from exc
                chosen = _Chosen({candidate.name: trainers}, None)
                if rank == 0:
                    _log_overlay(search_run, next(iter(trainers.values())))
                    if candidate.folds:
                        others = _loaded_runners_up(runners_up, spec, data, stack)
                        chosen = _choose_model(search_run, {candidate.name: trainers, **others}, data, candidate,
                                               problem)
                alone = chosen.members == (candidate.name,)  # the candidate alone is what is published
                evaluation = None
                if evaluate:
                    try:
                        spacings = spacings or test_spacings(spec, data)
                        each, evaluation = evaluate_ensemble_on_test(
                            trainers, data, candidate.name, spacings,
                            postprocessing=chosen.postprocessing if alone else None)
                        if candidate.folds:  # each fold's own scores on its own run
                            for fold, fold_evaluation in each.items():
                                _record_test(search_run, callback.run_ids.get(candidate.models[fold].trial_id),
                                             fold_evaluation, candidate.models[fold].trial_id, best=False,
                                             data=callback.data)
                        _record_test(search_run, run_id, evaluation, candidate.trial_id, best=rank == 0 and alone,
                                     data=callback.data)
                        if not alone:  # the configuration ensemble chosen, scored on the search's run
                            evaluation = _evaluate_chosen(chosen, data, spacings)
                            _record_test(search_run, None, evaluation, evaluation.trial_id, best=True)
                    except Exception as exc:  # noqa: BLE001
                        logger.warning("could not evaluate %s on the test split", candidate.name, exc_info=True)
                        problem(f"{_named(candidate)} could not be scored on the test split: "
                                f"{type(exc).__name__}: {exc}", "distmis.test_error")
                if rank == 0:
                    best = evaluation
                    ordered = [trainers[fold] for fold in candidate.folds] if candidate.folds else [trainers[None]]
                    published = _publish(ordered, candidate, spec, data, search_run, run_id, evaluation,
                                         model_folder, problem, chosen)
        except _NotLoaded as failure:
            model, exc = failure.model, failure.__cause__
            logger.warning("could not load trial %s's best weights", model.trial_id, exc_info=exc)
            problem(f"trial {model.trial_id}'s best weights could not be loaded from {_where(model.checkpoint)}: "
                    f"{type(exc).__name__}: {exc}", "distmis.test_error")
    return BestModels(best, "; ".join(notes), published, tuple(problems))


class _NotLoaded(Exception):
    """A candidate's trial whose best weights could not be loaded (the cause says why)."""

    def __init__(self, model: BestModel) -> None:
        super().__init__(model.trial_id)
        self.model = model


def _named(candidate: Candidate) -> str:
    """``trial 00002``, or ``configuration c001 (folds 0, 1, 2)``."""
    if not candidate.folds:
        return f"trial {candidate.name}"
    return f"configuration {candidate.name} (folds {', '.join(map(str, candidate.folds))})"


def _where(checkpoint: Any) -> str:
    return str(getattr(checkpoint, "path", checkpoint))


def _record_test(search_run: SearchRun, run_id: str | None, evaluation: TestEvaluation, name: str, *,
                 best: bool, data: TrackedData | None = None) -> None:
    """``evaluation``'s test scores on ``run_id`` (None: none), and with ``best`` on the search's run, whose tag
    ``distmis.test_trial`` names what was scored (``name``: a trial, a configuration, or an ensemble's)."""
    csv = format_results(evaluation.cases, "csv")
    if run_id is not None:
        search_run.log_metrics(_unrecorded(search_run, run_id, evaluation.means), run_id=run_id)
        if data is not None:  # the test part, as a dataset input of the run it scored
            search_run.log_inputs(data.test_inputs(), run_id=run_id)
        search_run.writer.submit(f"test_cases.csv ({name})",
                                 lambda: search_run.client.log_text(run_id, csv, "test_cases.csv"))
    if best:
        search_run.log_metrics(_unrecorded(search_run, search_run.run_id, evaluation.means))
        search_run.log_text(csv, "test_cases.csv")
        search_run.set_tag("distmis.test_trial", name)


def _unrecorded(search_run: SearchRun, run_id: str, metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` but those the run ``run_id`` holds already: a search's end that was interrupted and is resumed
    scores the test split again, and each test score is logged once (the first stands). A store that cannot be read
    now takes them all (its writer retries)."""
    try:
        held = search_run.client.get_run(run_id).data.metrics
    except Exception:  # noqa: BLE001 - the store is away: nothing is known to be there
        return dict(metrics)
    return {key: value for key, value in metrics.items() if key not in held}


@dataclass(frozen=True)
class _Chosen:
    """The model a search publishes: its configurations' trainers (name -> fold -> trainer, best first; one for a
    configuration alone) and the postprocessing cross-validation chose for it (None: none)."""

    configurations: dict[str, Mapping[int | None, Trainer]]
    postprocessing: dict[str, Any] | None

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(self.configurations)


def _loaded_runners_up(runners_up: list[Candidate], spec: Spec, data: PreparedData, stack: ExitStack
                       ) -> dict[str, Mapping[int | None, Trainer]]:
    """The next best configurations' trainers (name -> fold -> trainer), to ensemble with the best; one whose
    weights do not load is left out (and says so), the best's model is published whatever becomes of them."""
    loaded = {}
    for other in runners_up:
        try:
            with ExitStack() as own:
                trainers = {fold: own.enter_context(loaded_trainer(model, spec, data))
                            for fold, model in other.models.items()}
                stack.enter_context(own.pop_all())
            loaded[other.name] = trainers
        except Exception:  # noqa: BLE001
            logger.warning("configuration %s is left out of the configuration ensembles: its weights did not load",
                           other.name, exc_info=True)
    return loaded


def _choose_model(search_run: SearchRun, configurations: dict[str, Mapping[int | None, Trainer]], data: PreparedData,
                  candidate: Candidate, problem: Callable[[str, str], None]) -> _Chosen:
    """The model of a cross-validated search, chosen on its out-of-fold predictions
    (:func:`distmis.search.model_choice.choose_model`): the best configuration (``candidate``) alone or ensembled
    with the next best of ``configurations``, and its postprocessing; both recorded on the search's run (every
    option's dice, ``configuration_ensemble.md``; the dice before and after the postprocessing,
    ``postprocessing.json``). A failure is a ``problem`` (exit 1): the best configuration is published alone,
    without postprocessing."""
    from distmis.search.model_choice import choose_model

    try:
        choice = choose_model(configurations, data)
    except Exception as exc:  # noqa: BLE001
        logger.warning("could not choose the model of %s", candidate.name, exc_info=True)
        problem(f"{_named(candidate)}: its configuration ensemble and postprocessing could not be chosen on its "
                f"out-of-fold predictions: {type(exc).__name__}: {exc}", "distmis.postprocessing_error")
        return _Chosen({candidate.name: configurations[candidate.name]}, None)
    ensemble, post = choice.ensemble, choice.postprocessing
    for line in (ensemble.summary(), post.summary()):
        logger.info("%s", line)
    search_run.log_metrics(_unrecorded(search_run, search_run.run_id, {**ensemble.metrics(), **post.metrics()}))
    search_run.log_text(format_results(pd.DataFrame(ensemble.table()), "markdown"), "configuration_ensemble.md")
    search_run.set_tag("distmis.configuration_ensemble", ensemble.summary()[:500])
    search_run.log_dict({**post.postprocessing, "configurations": list(ensemble.members), "cases": post.cases,
                         "dice_before": post.before, "dice_after": post.after}, "postprocessing.json")
    search_run.set_tag("distmis.postprocessing", post.summary()[:500])
    return _Chosen({name: configurations[name] for name in ensemble.members},
                   post.postprocessing if post.applies else None)


def _evaluate_chosen(chosen: _Chosen, data: PreparedData, spacings: dict[str, tuple[float, float, float]]
                     ) -> TestEvaluation:
    """The test scores of a configuration ensemble, as its model predicts: the mean of every network's
    probabilities (its configurations share their folds, so the mean of the configurations' fold means), with its
    postprocessing."""
    networks = {(name, fold): trainer for name, trainers in chosen.configurations.items()
                for fold, trainer in trainers.items()}
    return evaluate_ensemble_on_test(networks, data, "+".join(chosen.members), spacings,
                                     postprocessing=chosen.postprocessing)[1]


def _publish(trainers: list[Any], candidate: Candidate, spec: Spec, data: PreparedData, search_run: SearchRun,
             run_id: str | None, evaluation: TestEvaluation | None, folder: Path | None,
             problem: Callable[[str, str], None], chosen: _Chosen) -> PublishedModel | None:
    """The best candidate's model (one trial's, a fold ensemble, or the configuration ensemble ``chosen`` names),
    saved, logged on ``run_id`` (its trial's or best configuration's run) and registered; a failure is a
    ``problem`` (exit 1), not a raise."""
    ensemble = [(name, [own[fold] for fold in candidate.folds]) for name, own in chosen.configurations.items()]
    try:
        published = publish_model(trainers, candidate, spec, data, tracking_uri=search_run.tracking_uri,
                                  trial_run_id=run_id, search_run_id=search_run.run_id,
                                  evaluation=evaluation, folder=folder, folds=candidate.folds,
                                  postprocessing=chosen.postprocessing,
                                  configurations=ensemble if len(ensemble) > 1 else (),
                                  register=folder is not None and spec.tracking.register_model)
    except Exception as exc:  # noqa: BLE001
        logger.warning("could not save, log or register the best model", exc_info=True)
        problem(f"{_named(candidate)}'s model could not be published: {type(exc).__name__}: {exc}",
                "distmis.model_error")
        return None
    if published.error:
        problem(f"{_named(candidate)}'s model is in {published.folder}, but could not be logged or registered: "
                f"{published.error}", "distmis.model_error")
    tags = {"distmis.model_trial": candidate.name}  # the best configuration, whose run holds the model
    if len(chosen.members) > 1:
        tags["distmis.model_configurations"] = "+".join(chosen.members)
    if published.model_uri:
        tags["distmis.model"] = published.model_uri
    if published.registry_uri:
        tags["distmis.registered_model"] = published.registry_uri
    for key, value in tags.items():
        search_run.set_tag(key, value)
    return published


def _log_overlay(search_run: SearchRun, trainer: Any) -> None:
    """The best trial's prediction of the first validation case, as a PNG (a picture for the UI: never raises)."""
    try:
        from distmis.tracking.figures import segmentation_overlay_figure

        case_id, image, label = trainer.val_cases[0]
        prob = trainer.predict_volume(image)
        title = f"best trial, validation case {case_id}: dice {float(trainer.case_dice(prob, label).mean()):.3f}"
        figure = segmentation_overlay_figure(image, label, prob, title=title, targets=trainer.targets)
        search_run.log_figure(figure, "best_trial_overlay.png")
    except Exception:  # noqa: BLE001
        logger.warning("could not draw the segmentation overlay of the best trial", exc_info=True)
