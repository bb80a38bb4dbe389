"""``distmis run``: a search in its ``parallelism.mode``, from spec to results table; ``--resume`` continues one.

``experiment`` and ``data`` run one search (:func:`~distmis.search.tune_run.execute_search`) laid out by
:func:`~distmis.search.plan.plan_search`; ``compare`` runs one search per mode and worker count
(:func:`~distmis.search.compare.run_compare`). Either keeps ``OUTPUT/search_state.json``
(:mod:`distmis.search.state`), from which ``resume=True`` continues an interrupted search or runs its failed trials
again, and holds the output folder's lock (:mod:`distmis.search.output_lock`) while it runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from distmis.search.compare import run_compare
from distmis.search.outcome import Outcome, SearchOutcome
from distmis.search.output_lock import output_locked
from distmis.search.output import (
    ended_unless_recorded, experiment_name, open_search_run, prepare_output, reopen_search_run,
)
from distmis.search.ray_session import ray_connection
from distmis.search.tune_run import execute_search
from distmis.search.warm_imports import warm_driver_imports
from distmis.search.plan import check_fit, node_resources, plan_search, trial_layouts, worker_slots
from distmis.search.preflight import new_state, preflight
from distmis.search.state import recorded
from distmis.spec.schema import Spec


def run_search(spec: Spec, output_dir: str | Path, *, address: str | None = None, progress: bool = True,
               verbose: bool = False, trainable: Callable[..., None] | None = None, resume: bool = False) -> Outcome:
    """Run the spec's search in its ``parallelism.mode``; returns its results (best first).

    ``resume``: continue the interrupted search in ``output_dir`` (started with the same spec), or run its failed
    trials again, instead of starting a new one. ``progress``: print a line per trial epoch (and the data
    preparation's progress);
    ``verbose``: Ray Tune's reporter and the trial processes' output too. ``trainable`` replaces the Tune function run for each trial (it receives the same
    keyword arguments as :func:`~distmis.trial.trainables.single_process_trial` or
    :func:`~distmis.trial.trainables.data_parallel_trial`).
    """
    if spec.parallelism.mode == "compare":
        return run_compare(spec, output_dir, address=address, progress=progress, verbose=verbose,
                           trainable=trainable, resume=resume)
    output_dir = Path(output_dir).resolve()
    with output_locked(output_dir, "distmis run" + (" --resume" if resume else "")) as lock:  # one search a folder
        return _run_search(spec, output_dir, made_folder=lock.made_folder, address=address, progress=progress,
                           verbose=verbose, trainable=trainable, resume=resume)


def _run_search(spec: Spec, output_dir: Path, *, made_folder: bool | None, address: str | None, progress: bool,
                verbose: bool, trainable: Callable[..., None] | None, resume: bool) -> SearchOutcome:
    """:func:`run_search` of an experiment- or data-mode search, with the output folder's lock held (``made_folder``:
    the folder was made for the lock, so a preparation that fails removes it; None: no lock was taken)."""
    state = preflight(spec, output_dir, "search", resume=resume)  # before any data is converted or Ray starts
    warm_driver_imports(spec)  # while Ray and the data start: ready when the best model is scored
    with ray_connection(address, verbose=verbose):
        check_fit(spec)  # before any data is converted: a trial that cannot fit would wait forever
        data = prepare_output(spec, output_dir, progress=progress, created=made_folder)
        plan = plan_search(spec, cluster_slots=worker_slots(trial_layouts(spec)[0], node_resources()))
        if state is None:
            search_run = open_search_run(spec, output_dir, data)
            with ended_unless_recorded(search_run):
                state = new_state("search", spec, output_dir, search_run.run_id)
                state.experiment = experiment_name(spec, plan, search_run.run_id)
                state.save(output_dir)
        else:
            search_run = reopen_search_run(spec, output_dir, state.run_id)
        with recorded(state, output_dir):
            outcome = execute_search(spec, data, plan, search_run, output_dir, experiment=str(state.experiment),
                                     resume=resume, progress=progress, verbose=verbose, trainable=trainable)
            if outcome.search_error:  # Tune stopped: its unfinished trials failed, --resume runs them again
                state.status = "failed"
            elif outcome.failed:  # every trial ended, some failed: --resume runs them again
                state.status = "trials_failed"
            state.failed_trials = list(outcome.failed_trials)
            return outcome

