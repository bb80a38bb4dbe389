"""Experiment- vs data-parallel: the paper's Table I for a user's own search and cluster.

For every worker count N (1 included, the baseline), the same search runs twice on N worker slots:
experiment-parallel (N one-worker trials at once) and data-parallel (one trial at a time over N
workers). Each run is timed around ``Tuner.fit`` alone; the data were converted before any timing,
and the order of the two modes alternates from one N to the next so neither always runs second on
warm file caches. The table holds, per mode and N: elapsed seconds, speedup ``T1 / TN`` against the
mode's own 1-worker run, efficiency ``speedup / N``, and the best validation dice (distributing the
search should not change it).

With ``parallelism.repeats`` R (``distmis compare --repeats R``) every cell runs R times, interleaved: the whole
sequence of cells once, then again, R times (:func:`cell_sequence`), so that a slow drift of a shared machine
hits every cell alike and each repeat's 1-worker run is close in time to its N-worker runs. The table then holds
the mean and the sample standard deviation over the repeats that finished, the speedup of each repeat taken
against the 1-worker time of the same repeat (:func:`~distmis.tracking.results.speedup_table`).

Each cell is a search of its own spec (:func:`cell_spec`): the comparison's spec in mode ``experiment``
(N trials at once, one worker each) or ``data`` (N workers per trial), so its trials are laid out, logged
and timed exactly as that search alone would be.

MLflow: a ``compare`` parent run holds the table (CSV, markdown, PNG); each (mode, N) search is its
child run (``data x2``; with repeats, each repeat is one, ``data x2 #2``, tagged ``distmis.compare.repeat``),
with the trials as its children. ``search_state.json`` keeps the cells done by (mode, N, repeat), so a resumed
comparison skips them and resumes the one under way.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable, Sequence

import pandas as pd

from distmis.search.output import (
    ended_unless_recorded, experiment_name, open_search_run, prepare_output, reopen_search_run,
)
from distmis.search.interrupts import let_go
from distmis.search.ray_session import ray_connection
from distmis.search.tune_run import execute_search
from distmis.search.outcome import ComparisonOutcome
from distmis.search.output_lock import output_locked
from distmis.search.plan import fit_problems, node_resources, plan_search, trial_layouts
from distmis.search.preflight import new_state, preflight
from distmis.search.state import SearchState, recorded
from distmis.spec.load import SpecError, spec_to_dict, validate_spec
from distmis.spec.schema import ParallelismSpec, Spec
from distmis.tracking.figures import speedup_figure
from distmis.tracking.mlflow_tracking import SearchRun
from distmis.tracking.results import MODES, PREDICTED_MAKESPAN, REPEAT_TAG, RESUMED_CELL, speedup_table

logger = logging.getLogger(__name__)


def cell_spec(spec: Spec, mode: str, workers: int) -> Spec:
    """The search one cell of the table runs, on ``workers`` worker slots of ``resources_per_worker``:
    ``experiment``: ``workers`` one-worker trials at once; ``data``: one trial at a time over ``workers`` workers;
    ``auto``: mode auto's pool of ``workers`` workers (:mod:`distmis.perf.pool`).

    The cell's spec is validated as a whole, as any spec is (:func:`~distmis.spec.load.validate_spec`: its
    cross-field checks included), so a cell that its own search would refuse is refused before it runs."""
    par = spec.parallelism
    common = {"resources_per_worker": par.resources_per_worker, "lr_scaling": par.lr_scaling,
              "sequence_parallel": par.sequence_parallel, "max_failures": par.max_failures}
    if mode == "experiment":
        cell = ParallelismSpec(mode="experiment", resources_per_trial=par.resources_per_worker,
                               max_concurrent_trials=workers, **common)
    elif mode == "data":
        cell = ParallelismSpec(mode="data", workers=workers, **common)
    elif mode == "auto":
        cell = ParallelismSpec(mode="auto", workers=workers, **common)
    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    tree = {**spec_to_dict(spec), "parallelism": cell.model_dump(mode="json")}
    return validate_spec(tree, source=f"{spec.name} (the comparison's cell {mode} x{workers})")


def cell_sequence(counts: Sequence[int], repeats: int = 1,
                  modes: Sequence[str] = ("experiment", "data")) -> list[tuple[str, int, int]]:
    """The order the cells run in, as ``(mode, workers, repeat)``: for each worker count (ascending) every mode of
    ``modes``, the order turning by one from one count to the next (so none always runs first); that whole sequence
    once per repeat (1-based)."""
    ordered = [mode for mode in MODES if mode in modes]
    once = [(mode, n) for index, n in enumerate(sorted(counts))
            for mode in ordered[index % len(ordered):] + ordered[:index % len(ordered)]]
    return [(mode, n, repeat) for repeat in range(1, repeats + 1) for mode, n in once]


def cell_key(cell: dict[str, Any]) -> tuple[str, int, int]:
    """``(mode, workers, repeat)`` of a cell of the saved state (one saved before repeats is repeat 1)."""
    return cell["mode"], int(cell["workers"]), int(cell.get("repeat", 1))


def cell_label(mode: str, workers: int, repeat: int, repeats: int) -> str:
    """A cell's run name and how the output names it: ``data x2``, or ``data x2 #2`` in a repeated comparison."""
    return f"{mode} x{workers}" + (f" #{repeat}" if repeats > 1 else "")


def check_capacity(spec: Spec, counts: Sequence[int]) -> None:
    """Refuse, before anything runs, a worker count the connected cluster cannot hold (the data-parallel cell
    of N workers is the larger of the two)."""
    if spec.parallelism.autoscaling:
        return
    nodes = node_resources()
    reasons = {n: fit_problems(trial_layouts(cell_spec(spec, "data", n)), nodes) for n in counts}
    too_many = [n for n, problems in reasons.items() if problems]
    if too_many:
        raise SpecError(spec.name, [("parallelism.workers", f"{too_many} worker(s) do not fit: "
                                     f"{reasons[max(too_many)][0]}; lower the counts, add nodes, or set "
                                     "parallelism.autoscaling: true on an autoscaling cluster")])


def run_compare(
    spec: Spec,
    output_dir: str | Path,
    *,
    workers: Sequence[int] | None = None,
    address: str | None = None,
    progress: bool = True,
    verbose: bool = False,
    trainable: Callable[..., None] | None = None,
    resume: bool = False,
) -> ComparisonOutcome:
    """Run the search in both modes for every worker count and record the speedup table.

    ``progress`` and ``verbose``: what each cell prints (see :func:`execute_search`).
    ``trainable`` replaces the Tune function of every trial (see :func:`execute_search`). ``resume`` continues
    an interrupted comparison in ``output_dir``: the cells done are kept, the one under way is resumed (its
    results count, its time does not: status RESUMED), and the rest run. Each cell runs
    ``spec.parallelism.repeats`` times, in the order of :func:`cell_sequence`.
    """
    counts = sorted(set(workers or spec.parallelism.worker_counts) | {1})
    if any(n < 1 for n in counts):
        raise SpecError(spec.name, [("parallelism.workers", f"worker counts must be >= 1, got {counts}")])
    output_dir = Path(output_dir).resolve()
    command = "distmis compare" + (" --resume" if resume else "")
    with output_locked(output_dir, command) as lock:  # one search (or comparison) a folder
        return _compare(spec, output_dir, counts, made_folder=lock.made_folder, address=address, progress=progress,
                        verbose=verbose, trainable=trainable, resume=resume)


def _compare(spec: Spec, output_dir: Path, counts: list[int], *, made_folder: bool | None, address: str | None,
             progress: bool, verbose: bool, trainable: Callable[..., None] | None,
             resume: bool) -> ComparisonOutcome:
    """:func:`run_compare` with the output folder's lock held (``made_folder``: the folder was made for the lock, so
    a preparation that fails removes it; None: no lock was taken)."""
    repeats = spec.parallelism.repeats
    state = preflight(spec, output_dir, "compare", resume=resume)  # before any data is converted or Ray starts
    with ray_connection(address, verbose=verbose):
        check_capacity(spec, counts)  # before any data is converted
        data = prepare_output(spec, output_dir, progress=progress, created=made_folder)
        if state is None:
            compare_run = open_search_run(spec, output_dir, data, run_name=f"{spec.name} compare", role="compare",
                                          tags={"distmis.workers": ",".join(map(str, counts)),
                                                "distmis.repeats": str(repeats)})
            with ended_unless_recorded(compare_run):
                state = new_state("compare", spec, output_dir, compare_run.run_id)
                state.save(output_dir)
        else:
            compare_run = reopen_search_run(spec, output_dir, state.run_id)
        try:
            with recorded(state, output_dir):
                done = {cell_key(c) for c in state.cells}  # before the comparison was interrupted
                for mode, n, repeat in cell_sequence(counts, repeats, spec.parallelism.modes):
                    if (mode, n, repeat) in done:
                        continue
                    state.cells.append(_run_cell(spec, data, mode, n, repeat, compare_run, output_dir, progress,
                                                 verbose, trainable, state))
                    state.current = None
                    state.save(output_dir)
                _predict_cells(spec, state.cells, compare_run)
                table = speedup_table(state.cells)
                _log_table(compare_run, table, spec)
                failed_cells = [cell_label(*cell_key(c), repeats) for c in state.cells
                                if c["status"] not in ("FINISHED", RESUMED_CELL) or c["failed_trials"]]
                compare_run.log_metrics({"failed_cells": len(failed_cells)})
                compare_run.finish("FINISHED")
        except KeyboardInterrupt as interrupt:  # SearchInterrupted included: the cell's runs are KILLED already
            let_go(interrupt)
            compare_run.finish("KILLED", timeout=30)
            raise
        except BaseException:
            compare_run.finish("FAILED", timeout=30)
            raise
    return ComparisonOutcome(table, failed_cells, compare_run.tracking_uri, spec.experiment_name, compare_run.run_id)


def _run_cell(spec: Spec, data: Any, mode: str, workers: int, repeat: int, compare_run: SearchRun,
              output_dir: Path, progress: bool, verbose: bool, trainable: Callable[..., None] | None,
              state: SearchState) -> dict[str, Any]:
    """One run (``repeat``, 1-based) of the (mode, workers) search as a child run of the comparison; a crash is
    recorded, not raised.

    The cell under way is named in ``state.current``; a resumed comparison continues that cell's search.
    """
    search = cell_spec(spec, mode, workers)
    plan = plan_search(search)
    current = state.current
    resume = bool(current and cell_key(current) == (mode, workers, repeat))
    label = cell_label(mode, workers, repeat, spec.parallelism.repeats)
    if current is not None and resume:
        run = reopen_search_run(search, output_dir, current["run_id"])
        experiment = current["experiment"]
    else:
        run = open_search_run(search, output_dir, data, run_name=label, parent_run_id=compare_run.run_id,
                              tags={"distmis.compare.mode": mode, "distmis.compare.workers": str(workers),
                                    REPEAT_TAG: str(repeat)})
        experiment = experiment_name(search, plan, run.run_id)
        state.current = {"mode": mode, "workers": workers, "repeat": repeat, "run_id": run.run_id,
                         "experiment": experiment}
        state.save(output_dir)
    best_key = f"best_{spec.search.selected_metric}"
    cell: dict[str, Any] = {"mode": mode, "workers": workers, "repeat": repeat, "elapsed_s": math.nan,
                            best_key: math.nan, "trials": 0, "failed_trials": 0, "status": "FAILED"}
    try:
        # a cell's best model is logged on its trial's run; registering each cell's would fill the registry
        outcome = execute_search(search, data, plan, run, output_dir, experiment=experiment, resume=resume,
                                 progress=progress, verbose=verbose, keep_model=False, trainable=trainable)
    except Exception as exc:  # noqa: BLE001 - the comparison goes on and says which cell failed
        logger.error("comparison cell %s failed: %s", label, exc)
        logger.debug("comparison cell %s", label, exc_info=True)  # the traceback with --verbose
        return cell | {"error": f"{type(exc).__name__}: {exc}"}
    best = outcome.results.get(f"cv_{spec.search.selected_metric}" if spec.cv_folds else best_key)  # folds: configurations
    if best is not None and best.notna().any():
        cell[best_key] = float(best.max() if spec.search.mode == "max" else best.min())
    status = "FINISHED" if outcome.failed == 0 else "TRIALS_FAILED"
    return cell | {
        "run_id": run.run_id,
        # a resumed cell's time covers only the part after the resume: not a figure to compare
        "elapsed_s": math.nan if resume else round(outcome.search_seconds, 2),
        "trials": len(outcome.results),
        "failed_trials": outcome.failed,
        "status": RESUMED_CELL if resume and status == "FINISHED" else status,
    }


def cell_predictions(spec: Spec, cells: Sequence[dict[str, Any]], client: Any) -> dict[tuple[str, int], float]:
    """The makespan the model predicts for each (mode, workers) of ``cells``, calibrated on the comparison's first
    finished 1-worker experiment-parallel cell (:func:`~distmis.search.makespan_plan.calibrate_run`: a worker's rate,
    a trial's start-up and cold start as it measured them; ``client``: the store it ran in); ``{}`` when no such cell
    ran. The 1-worker cell's own prediction is a check of the calibration, the others are predictions."""
    from distmis.search.data_shape import trial_device
    from distmis.search.makespan_plan import calibrate_run, predicted_makespan

    base = next((c for c in cells if (c["mode"], int(c["workers"])) == ("experiment", 1) and c.get("run_id")
                 and c["status"] == "FINISHED"), None)
    if base is None:
        return {}
    earlier = cell_spec(spec, "experiment", 1)
    device, threads = trial_device(earlier)
    hardware = calibrate_run(client, base["run_id"], earlier, "experiment x1", device=device,
                             threads=threads).hardware()
    keys = dict.fromkeys((c["mode"], int(c["workers"])) for c in cells)
    return {(mode, n): predicted_makespan(cell_spec(spec, mode, n), mode, n, hardware, device=device, threads=threads)
            for mode, n in keys}


def _predict_cells(spec: Spec, cells: list[dict[str, Any]], compare_run: SearchRun) -> None:
    """Each cell's :func:`cell_predictions` as its ``predicted_s``, and on its run (``distmis results`` rebuilds the
    table from the runs); nothing, with a warning, when it cannot be predicted."""
    try:
        predictions = cell_predictions(spec, cells, compare_run.client)
        for cell in cells:
            key = (cell["mode"], int(cell["workers"]))
            if key in predictions:
                cell["predicted_s"] = round(predictions[key], 2)
                if cell.get("run_id"):
                    compare_run.client.log_metric(cell["run_id"], PREDICTED_MAKESPAN, cell["predicted_s"])
    except Exception as exc:  # noqa: BLE001 - steps that cannot be traced, a store that does not answer: the table
        logger.warning("the comparison's makespans cannot be predicted: %s", exc)  # has its measured figures still


def _log_table(run: SearchRun, table: pd.DataFrame, spec: Spec) -> None:
    from distmis.tracking.results import format_results

    run.log_text(format_results(table, "csv"), "speedup.csv")
    run.log_text(format_results(table, "markdown"), "speedup.md")
    run.log_figure(speedup_figure(table, title=f"{spec.name}: experiment- vs data-parallel"), "speedup.png")
