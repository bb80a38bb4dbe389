"""One search's trials on a connected Ray: the Ray Tune ``Tuner`` (new, or restored on ``--resume``) over the spec's
trials laid out by a :class:`~distmis.search.plan.SearchPlan`, recorded in MLflow by the trial callback, stopped
gracefully by a signal (:mod:`distmis.search.interrupts`), and ended by :func:`~distmis.search.finish.end_search`.
:func:`distmis.search.run.run_search` calls :func:`execute_search` once; the comparison
(:mod:`distmis.search.compare`) once per mode and worker count.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from distmis.predict.resolve import LOCAL_MODEL_FOLDER
from distmis.search.budget import (
    BudgetScheduler, BudgetSpent, BudgetStopper, LiveBudget, SearchBudget, register, unregister,
)
from distmis.search import pbt
from distmis.search.console import SearchConsole
from distmis.search.finish import end_search
from distmis.search.interrupts import SearchInterrupted, let_go, signals_stop_tune, sigterm_interrupts
from distmis.search.outcome import SearchOutcome
from distmis.search.output import tracked_data
from distmis.search.plan import SearchPlan, node_resources, trials_at_once
from distmis.search.prepare import PreparedData
from distmis.search.progress import SearchProgress
from distmis.search.search_space import num_trials, scheduler, tune_param_space, tune_search
from distmis.search.tune_state import restored_trials, running_when_saved
from distmis.trial.storage import atomic_local_filesystem
from distmis.trial.trainables import (
    auto_trial, data_parallel_trial, release_groups, runs_on_worker_group, single_process_trial,
)

from distmis.spec.schema import Spec
from distmis.spec.searchers import scheduler_entry
from distmis.tracking.mlflow_tracking import MLflowTrialCallback, SearchRun
from distmis.tracking.uri import redact_uri

if TYPE_CHECKING:
    from ray.tune import ResultGrid, Tuner

logger = logging.getLogger(__name__)

__all__ = ["execute_search", "trial_function"]


def _record_interruption(callback: MLflowTrialCallback, search_run: SearchRun) -> None:
    """Every trial run that had started and not ended, and the search's run, KILLED."""
    callback.kill_unfinished()
    callback.close(timeout=30)
    search_run.finish("KILLED", timeout=30)


def _search_run_killed_on_interrupt(execute: Callable[..., SearchOutcome]) -> Callable[..., SearchOutcome]:
    """``execute_search`` interrupted outside Tune's loop (Ctrl-C or SIGTERM while it sets Tune up, or while it
    scores and publishes the best model after the trials): the search's run KILLED, not left RUNNING, and
    :class:`SearchInterrupted` raised (``--resume`` then scores and publishes what the trials left)."""
    @functools.wraps(execute)
    def interruptible(spec: Spec, data: PreparedData, plan: SearchPlan, search_run: SearchRun, *args: object,
                      **kwargs: object) -> SearchOutcome:
        with sigterm_interrupts() as received:
            try:
                return execute(spec, data, plan, search_run, *args, **kwargs)
            except SearchInterrupted:  # in Tune's loop: its runs are KILLED already
                raise
            except KeyboardInterrupt as interrupt:
                let_go(interrupt)
                search_run.finish("KILLED", timeout=30)
                raise SearchInterrupted(received.get("signal", signal.SIGINT)) from None

    return interruptible


def trial_function(plan: SearchPlan, spec: Spec, data: PreparedData, output_dir: Path, experiment: str,
                   trainable: Callable[..., None] | None = None) -> Callable[..., None]:
    """The Tune trainable for a plan, with the search's spec and its resources bound."""
    from ray import tune

    if plan.mode == "auto":
        bound = tune.with_parameters(trainable or auto_trial, spec=spec, tfrecord_dir=str(data.tfrecord_dir),
                                     search=experiment)
    elif plan.distributed:
        bound = tune.with_parameters(trainable or data_parallel_trial, spec=spec, tfrecord_dir=str(data.tfrecord_dir),
                                     storage_path=str(output_dir / "ray_train" / experiment))
    else:
        bound = tune.with_parameters(trainable or single_process_trial, spec=spec, tfrecord_dir=str(data.tfrecord_dir))
    return tune.with_resources(bound, plan.trial_resources)


@_search_run_killed_on_interrupt
def execute_search(spec: Spec, data: PreparedData, plan: SearchPlan, search_run: SearchRun, output_dir: Path, *,
                   experiment: str, resume: bool = False, progress: bool = True, verbose: bool = False,
                   keep_model: bool = True, trainable: Callable[..., None] | None = None) -> SearchOutcome:
    """Run the spec's trials with ``plan`` (Ray must be connected) and record the results on ``search_run``.

    ``progress``: print the search's header and a line per trial epoch, end, failure and retry
    (:class:`~distmis.search.console.SearchConsole`), and after each end where the search stands (its figures go to
    ``search_run`` either way: :mod:`distmis.search.progress`); ``verbose``: Ray Tune's own reporter too.

    ``experiment``: the Tune experiment's folder name under ``OUTPUT/ray_results``. With ``resume``, a search
    that was interrupted goes on (``Tuner.restore``): finished trials stay as they are, unfinished and failed
    ones continue from their last checkpoint in their own MLflow runs, and the searcher and scheduler carry on
    from their saved state. (A search killed before Tune saved anything starts its trials afresh.) The runs of
    trials Tune's saved state does not hold are set aside: Tune makes new trials in their place
    (:meth:`~distmis.tracking.mlflow_tracking.MLflowTrialCallback.set_aside_lost_runs`).
    """
    from ray import tune
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    search_run.set_tag("distmis.layout", plan.label)
    callback = search_run.trial_callback(spec, volume=data.manifest.volume,
                                         data=tracked_data(spec, data))
    storage = output_dir / "ray_results"
    filesystem = atomic_local_filesystem()  # a driver killed while Tune saves leaves whole files (storage.py)
    restore = resume and tune.Tuner.can_restore(str(storage / experiment), storage_filesystem=filesystem)
    if resume:
        callback.adopt_existing_runs()
        resumed = (restored_trials(str(storage / experiment)) or {}) if restore else {}  # Tune's trials, by id
        callback.set_aside_lost_runs(resumed)
    # One checkpoint per epoch makes Tune warn about snapshot frequency; expected here. Tune saves its own state
    # (which trials ended, the searcher's) every few seconds, so little is run again after the driver is killed.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "2")
    # Tune's result files (result.json, progress.csv) but not its TensorBoard logger: importing tensorboardX
    # imports torch into the driver (1.2 s of a 2-core machine as the trials start) and it writes every result
    # again; MLflow holds the curves.
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    function = trial_function(plan, spec, data, output_dir, experiment, trainable)
    # the search as a whole after each trial's end: on the search run (always) and the console (unless --quiet)
    at_once = trials_at_once(plan, node_resources())
    tracker = SearchProgress(spec, total=num_trials(spec), at_once=at_once,
                             record=lambda metrics, step: search_run.log_metrics(metrics, step=step))
    if resume:
        tracker.adopt(callback.best, callback.epochs)
    console = SearchConsole(spec, tracker) if progress else None
    if not verbose:  # Tune's newer output prints its experiment box and paths even at verbose=0; the older is silent
        os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    others: list[tune.Callback] = [tracker, *([console] if console else [])]
    if plan.mode == "auto":  # the pool the trials share their workers through; it goes with the search
        from distmis.search.worker_pool import pool_callback, start_pool

        pool = start_pool(experiment, plan.pool_workers, num_trials(spec), begun=callback.started)  # noqa: F841
        others.append(pool_callback(experiment))
    handle = callback.handle(*others)
    live = _search_budget(spec, search_run, callback, resume=resume,
                          running=running_when_saved(str(storage / experiment)) if restore else set())
    if spec.search.scheduler == "pbt":  # each exploit recorded on its trial's run
        pbt.listen(search_run.run_id, callback.exploited)
    if live is not None and console is not None:
        console.budget_line = live.budget.summary
    if restore:
        tuner = tune.Tuner.restore(str(storage / experiment), trainable=function, param_space=tune_param_space(spec),
                                   resume_unfinished=True, resume_errored=True, storage_filesystem=filesystem)
    else:
        # Ray Train restarts a hybrid search's trial's workers itself (trial.trainables); Tune restarts the others,
        # and the trials on a data-mode search's worker group or an auto search's (which start a new group).
        hybrid = plan.distributed and plan.mode != "auto" and not runs_on_worker_group(spec)
        retries = 0 if hybrid else spec.parallelism.max_failures
        tuner = tune.Tuner(
            function,
            param_space=tune_param_space(spec),
            tune_config=tune.TuneConfig(
                metric=spec.search.selected_metric,
                mode=spec.search.mode,
                # search_alg, num_samples, max_concurrent_trials: with folds, the fold searcher says when it is done
                # search.budget: trials made only as they can start, so that none waits queued when it is spent
                # a scheduler whose paused trials wait for the others: no limit (Tune's would count them)
                **tune_search(spec, None if scheduler_entry(spec.search.scheduler).waits_paused
                              else plan.max_concurrent_trials or (at_once if spec.search.budget else None)),
                # search.budget: no trial starts once it is spent (the scheduler's), each stops at its next epoch
                scheduler=(BudgetScheduler(scheduler(spec, search_run.run_id), search_run.run_id)
                           if spec.search.budget else scheduler(spec, search_run.run_id)),
                # One process serves the search's trials in turn rather than a new one per trial: its imports,
                # and an experiment-mode trial's traced graphs (trainable.single_process_trial).
                reuse_actors=True,
            ),
            run_config=tune.RunConfig(
                name=experiment,
                storage_path=str(storage),
                storage_filesystem=filesystem,
                callbacks=[handle, JsonLoggerCallback(), CSVLoggerCallback()],
                # Every folder stays for Tune's saved state to name; the trials empty the old ones (trial_checkpoints).
                checkpoint_config=tune.CheckpointConfig(num_to_keep=None),
                failure_config=tune.FailureConfig(max_failures=retries),
                stop=BudgetStopper(search_run.run_id) if spec.search.budget else None,
                verbose=1 if verbose else 0,  # Tune's boxed tables: --verbose only
            ),
        )
    logger.info("running %d trial(s) of %s: %s", num_trials(spec), spec.name, plan.label)
    if console is not None:
        console.header(spec, trials=num_trials(spec), layout=plan.label,
                       store=redact_uri(search_run.tracking_uri), experiment=spec.experiment_name)
    start = time.perf_counter()
    if live is not None:
        live.budget.restart()  # the wall time counted from here (and what earlier runs spent)
    tune_failure = ""  # why Ray Tune itself stopped, if it did (e.g. it could not write a trial's error file)
    received: dict[str, int] = {}
    try:
        with signals_stop_tune() as received:
            grid = tuner.fit()
    except KeyboardInterrupt as interrupt:  # a second Ctrl-C or SIGTERM: Tune did not stop gracefully
        let_go(interrupt)
        _record_interruption(callback, search_run)
        raise SearchInterrupted(received.get("signal", signal.SIGINT)) from None
    except Exception as exc:  # noqa: BLE001 - Tune's own failure: the trials' records are kept, the rest fail
        logger.warning("Ray Tune stopped the search", exc_info=True)
        tune_failure = f"Ray Tune stopped the search: {_last_line(exc)}"
        grid = _results_so_far(tuner)
        callback.fail_unfinished(tune_failure)
    except BaseException:
        callback.close(timeout=30)
        search_run.finish("FAILED", timeout=30)
        raise
    finally:  # the workers died with the last trial's process; their placement group outlives it
        if live is not None:
            live.budget.record_now()
            unregister(search_run.run_id)
        pbt.unlisten(search_run.run_id)
        if plan.distributed and (runs_on_worker_group(spec) or plan.mode == "auto"):
            release_groups(experiment)
        if plan.mode == "auto":
            from distmis.search.worker_pool import stop_pool

            stop_pool(experiment)
    spent = live.ended if live is not None else ""
    if spent and not received:  # the budget ended it: the trials it never started are not run
        search_run.set_tag("distmis.budget", f"spent: {spent}")
        callback.fail_unfinished(f"the search's budget was spent ({spent}) before this trial could go on")
    elif (received or callback.unfinished) and not tune_failure:  # Tune stopped on Ctrl-C or SIGTERM
        _record_interruption(callback, search_run)
        raise SearchInterrupted(received.get("signal", signal.SIGINT))
    search_seconds = time.perf_counter() - start
    if spec.cv_folds:  # each configuration's folds' outcome on its run, before the results are read
        callback.summarize_configurations(final=True)
    callback.close()  # the trial records a store outage held back, before the results are read
    return end_search(spec, data, search_run, grid, callback, search_seconds=search_seconds,
                      capacity=plan.pool_workers or at_once * plan.largest.world_size,
                      tune_failure=tune_failure, model_folder=output_dir / LOCAL_MODEL_FOLDER if keep_model else None)


def _search_budget(spec: Spec, search_run: SearchRun, callback: MLflowTrialCallback, *,
                   resume: bool, running: set[str]) -> LiveBudget | None:
    """``search.budget``'s live state in this driver, registered under the search run's id for Tune's scheduler and
    stopper (:mod:`distmis.search.budget`); a resumed search starts from what its run recorded as spent, and the
    trials that were ``running`` when it was stopped each owe a report. None without a budget."""
    if spec.search.budget is None:
        return None
    before = BudgetSpent.from_metrics(search_run.client.get_run(search_run.run_id).data.metrics) if resume \
        else BudgetSpent()
    budget = SearchBudget(spec.search.budget, before, record=search_run.log_metrics)

    def workers(trial_id: str, result: dict) -> int:  # mode auto's trials say theirs with each epoch
        return int(result.get("workers") or callback.trial_workers.get(trial_id, 1))

    live = register(search_run.run_id, LiveBudget(budget, workers, callback.stopped_by_budget, owed=set(running)))
    callback.budget_ended = lambda: live.ended  # the trials it kept from going on: stopped, not failed
    return live


def _last_line(exc: BaseException) -> str:
    """An exception's reason on one line: a TuneError carries the whole traceback of what failed; its last line
    names it (``PermissionError: ... error.pkl``)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:400]


def _results_so_far(tuner: Tuner) -> ResultGrid | list[object]:
    """The trials' results as Tune saved them, after ``Tuner.fit`` failed (``[]`` when they cannot be read)."""
    try:
        return tuner.get_results()
    except Exception:  # noqa: BLE001 - nothing saved to read: no trial is scored
        logger.warning("could not read the results Ray Tune saved", exc_info=True)
        return []
