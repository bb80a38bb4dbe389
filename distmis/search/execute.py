"""One search on a connected Ray: the Ray Tune ``Tuner`` over the spec's trials, recorded in MLflow.

The pieces every way of running a search shares: connecting to Ray, preparing the data (nothing
half-written on failure), opening the search's MLflow parent run, and :func:`execute_search`, which runs
the trials with a :class:`~distmis.search.plan.SearchPlan`. :func:`distmis.search.run.run_search` calls it
once; the comparison (:mod:`distmis.search.compare`) once per mode and worker count.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import threading
import time
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pandas as pd
import yaml
from mlflow.tracking import MlflowClient

from distmis.predict.resolve import LOCAL_MODEL_FOLDER
from distmis.search.console import SearchConsole
from distmis.search.evaluate import (
    BestModel, Candidate, TestEvaluation, best_models, evaluate_ensemble_on_test, fold_candidates, loaded_trainer,
    publish_model, test_spacings,
)
from distmis.search.plan import SearchPlan, node_resources, trials_at_once
from distmis.search.prepare import PreparedData, prepare_data
from distmis.search.progress import SearchProgress
from distmis.search.search_space import num_trials, scheduler, tune_param_space, tune_search
from distmis.search.storage import atomic_local_filesystem
from distmis.search.trainable import data_parallel_trial, runs_on_worker_group, single_process_trial
from distmis.search.worker_group import release_groups
from distmis.service.cluster import joins_single_machine_cluster
from distmis.service.net import LOOPBACK, claim_port, free_port, port_in_use, release_port
from distmis.service.token import prepare_local_token
from distmis.data.split import fold_parts
from distmis.spec.load import spec_to_dict
from distmis.spec.schema import Spec
from distmis.tracking.datasets import TrackedData
from distmis.tracking.figures import learning_curves_figure
from distmis.predict.registry import PublishedModel
from distmis.tracking.mlflow_tracking import (
    MLflowTrialCallback, SearchRun, default_tracking_uri, flatten, mark_interrupted,
)
from distmis.tracking.results import format_results, inference_frame, results_frame
from distmis.tracking.store import process_environment
from distmis.tracking.uri import redact_uri
from distmis.train.startup import loading_libraries
from distmis.train.threads import tensorflow_env

logger = logging.getLogger(__name__)

# Environment every Ray worker process starts with (distmis.train.threads.tensorflow_env: quiet TensorFlow,
# Keras on TF, oneDNN's kernels), set before any of them imports TensorFlow.
TRIAL_ENV = {**tensorflow_env(), "PYTHONUNBUFFERED": "1"}


@dataclass(frozen=True)
class SearchOutcome:
    results: pd.DataFrame
    failed: int
    elapsed_seconds: float  # the whole search run, MLflow bookkeeping included
    search_seconds: float  # Tuner.fit alone: what the speedup table compares
    tracking_uri: str
    experiment: str
    parent_run_id: str
    data: PreparedData
    test: TestEvaluation | None = None  # the best trial on the test split
    test_note: str = ""  # why there is no test evaluation (or no model), if there is none
    model: PublishedModel | None = None  # where the best trial's model went
    problems: tuple[str, ...] = ()  # what the search's end could not do: load, score or publish a model (exit 1)
    failed_trials: tuple[str, ...] = ()  # the ids of the trials that did not finish
    search_error: str = ""  # why Ray Tune itself stopped the search, if it did: ``--resume`` continues it

    @property
    def best(self) -> dict[str, Any] | None:
        ok = self.results[self.results["status"] == "FINISHED"] if not self.results.empty else self.results
        return None if ok.empty else ok.iloc[0].to_dict()


class SearchInterrupted(KeyboardInterrupt):
    """The search was stopped by a signal (Ctrl-C, SIGTERM from ``distmis stop`` or a scheduler); its MLflow runs
    that had not finished are marked KILLED. ``exit_code`` is the shell's: 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        super().__init__(f"search interrupted by {signal.Signals(self.signum).name}; unfinished runs marked KILLED "
                         "(the same command with --resume continues it)")


@contextmanager
def signals_stop_tune() -> Iterator[dict[str, int]]:
    """While Tune runs, Ctrl-C (SIGINT) and SIGTERM stop it gracefully: Tune ends its loop, stops the running
    trials and saves its state, instead of the driver dying with every run left RUNNING. A second signal stops at
    once (KeyboardInterrupt). Yields what was received (``{"signal": 15}``): Tune ends the trials it stopped as
    TERMINATED, like finished ones, and returns normally, so this is how the caller knows it was interrupted.

    Tune's own SIGINT handler is turned off (``TUNE_DISABLE_SIGINT_HANDLER``) for this one, which records the
    signal and asks Tune to stop through SIGUSR1, which Tune always handles alike.
    """
    received: dict[str, int] = {}
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
        yield received
        return

    def stop(signum: int, frame: Any) -> None:
        if received:  # the second: stop now
            raise KeyboardInterrupt
        received["signal"] = signum
        os.kill(os.getpid(), signal.SIGUSR1)  # Tune's handler ends its loop gracefully

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    tune_handler = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"  # read by Tuner.fit when it starts
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if tune_handler is None:
            os.environ.pop("TUNE_DISABLE_SIGINT_HANDLER", None)
        else:
            os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = tune_handler


@contextmanager
def sigterm_interrupts() -> Iterator[dict[str, int]]:
    """SIGTERM raises KeyboardInterrupt as Ctrl-C does (in the search's end: scoring and publishing the best
    model), so that the caller can mark the search's run KILLED rather than the driver dying with it RUNNING.
    Yields what was received (``{"signal": 15}``; empty for Ctrl-C, whose KeyboardInterrupt Python raises)."""
    received: dict[str, int] = {}
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def interrupt(signum: int, frame: Any) -> None:
        received["signal"] = signum
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def _record_interruption(callback: MLflowTrialCallback, search_run: SearchRun) -> None:
    """Every trial run that had started and not ended, and the search's run, KILLED."""
    callback.kill_unfinished()
    callback.close(timeout=30)
    search_run.finish("KILLED", timeout=30)


# --------------------------------------------------------------------------- set-up shared by every mode
#: Ray's usual dashboard port, which a local Ray's dashboard takes when it is free (:func:`local_ray_options`).
RAY_DASHBOARD_PORT = 8265


def local_ray_options(dashboard_port: int | None = None) -> dict[str, Any]:
    """``ray.init`` arguments of a local Ray started by distmis (:func:`init_local_ray` starts it).

    The dashboard (and Ray's state API, which Ray Train's placement-group cleaner asks every second whether
    its controller lives) listens on 127.0.0.1 only, on Ray's usual port when free. Of two distmis processes that
    start their Rays at the same moment, only the one that claims that port (:func:`claim_port`) takes it, the other
    a free one: both saw it free, and the dashboard that lost the race to bind it used to fail after Ray's timeout.
    """
    port = dashboard_port
    if port is None:  # Ray's usual port when free, and not being taken by another distmis starting at this moment
        port = RAY_DASHBOARD_PORT
        if not claim_port(port) or port_in_use(LOOPBACK, port):
            release_port(port)
            port = free_port(LOOPBACK)
    return {"address": "local", "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": port}


def local_worker_env(options: dict[str, Any]) -> dict[str, str]:
    """The environment every worker of a local Ray started with ``options`` (:func:`local_ray_options`) has:
    :data:`TRIAL_ENV`, and where its state API is (``RAY_API_SERVER_ADDRESS``). Otherwise a worker finds "the"
    cluster through Ray's ``/tmp/ray/ray_current_cluster``, which a ``ray start`` cluster that has since gone leaves
    behind: each Ray Train run then waited about 10 s at its end on a state query to that dead cluster."""
    return {**TRIAL_ENV, "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{options['dashboard_port']}"}


def init_local_ray(options: dict[str, Any]) -> None:
    """``ray.init(**options)`` for a new local Ray (``options``: :func:`local_ray_options`' and more), on a loopback
    node (:func:`loopback_node`), its processes started with :func:`local_worker_env` in their environment.

    The environment is the raylet's, which every worker it starts inherits, rather than a job's
    ``runtime_env``: a worker for a job with a runtime environment is started only once the runtime-env agent has
    set it up for that job, so the workers Ray starts ahead of the first tasks (one per CPU) could not take the
    trials, and every trial process started cold (about 1 s for an actor, against 0.2 to 0.6 s).
    """
    import ray

    with loopback_node(), process_environment(local_worker_env(options)):
        ray.init(**options)


@contextmanager
def ray_connection(address: str | None = None, *, verbose: bool = False) -> Iterator[None]:
    """Join ``address`` or start a local Ray, unless one is already up; shut down only what this started.

    Unless ``verbose``, what the trial processes print is not forwarded to this process's console (it stays in
    Ray's log files) and Ray's own notices below ERROR are not shown: the search's console
    (:class:`~distmis.search.console.SearchConsole`) says what happens.

    Without an address this starts a new local Ray ("local"), rather than Ray's default of joining
    whatever ``ray start`` cluster runs on the machine: ``--address`` says which cluster to use. The local
    Ray's servers listen on 127.0.0.1 only (:func:`loopback_node`), and a start that fails or is interrupted
    (Ctrl-C) leaves none of its processes behind.
    """
    import ray

    if ray.is_initialized():
        yield
        return
    console = {"log_to_driver": verbose, "logging_level": logging.WARNING if verbose else logging.ERROR}
    if address in (None, "local"):
        prepare_local_token()  # made 0600 before Ray writes one readable by everybody
        try:
            _start_local_ray({**local_ray_options(), **console})
        except Exception:  # noqa: BLE001 - another local Ray took the dashboard's port between check and bind
            _start_local_ray({**local_ray_options(free_port(LOOPBACK)), **console})
    else:  # the single-machine head of `cluster up` is joined in Ray's single-machine mode, as it runs
        with loopback_node() if joins_single_machine_cluster(address) else nullcontext():
            ray.init(address=address, runtime_env={"env_vars": TRIAL_ENV}, **console)
    try:
        yield
    finally:
        ray.shutdown()


@contextmanager
def loopback_node() -> Iterator[None]:
    """While a local Ray starts in this process: its node's address is 127.0.0.1, so that every server it starts
    (GCS, raylet, workers, the dashboard and runtime-env agents, the Prometheus metrics export port) listens on
    loopback only.

    Ray 2.60 binds those servers to every interface unless the node's address is loopback, and takes that address
    from the route to the internet: a ``_node_ip_address`` of 127.0.0.1 is replaced by it. Only its single-machine
    mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read once when Ray is imported) keeps 127.0.0.1; this turns that
    mode on for the moment ``ray.init`` takes, in this process (the processes it starts are given the address).
    A Ray without that switch starts as it would anyway (``tests/faults/test_ray_ports.py`` says so).
    """
    from ray._private import ray_constants

    if not isinstance(getattr(ray_constants, "ENABLE_RAY_CLUSTER", None), bool):
        yield
        return
    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def _start_local_ray(options: dict[str, Any]) -> None:
    """``ray.init(**options)`` on a loopback node. When it fails or is interrupted, the processes it had started are
    stopped before this raises: interrupted while its node was being made, Ray has lost track of them, and its
    raylet's agents would outlive the driver."""
    import psutil
    import ray

    me = psutil.Process()
    before = set(me.children(recursive=True))
    try:
        init_local_ray({"logging_level": logging.WARNING, **options})
    except BaseException:
        ray.shutdown()
        _stop_processes([p for p in _descendants(me) if p not in before])
        raise


def _descendants(process: Any) -> list[Any]:
    import psutil

    try:
        return process.children(recursive=True)
    except psutil.Error:
        return []


def _stop_processes(processes: list[Any], grace: float = 2.0) -> None:
    """SIGTERM ``processes`` (listed before any is signalled: a child outlives its parent re-parented), then SIGKILL
    those still alive after ``grace`` seconds (a raylet or GCS whose start was cut short waits on the other; Ray's
    own shutdown kills them so too)."""
    import psutil

    for process in processes:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


def prepare_output(spec: Spec, output_dir: Path, *, progress: bool, created: bool | None = None) -> PreparedData:
    """Prepare the data; on failure remove an output folder this call created (nothing half-written). ``created``:
    whether the search made the folder (its lock did: :mod:`distmis.search.output_lock`); None: if it is missing."""
    created = not output_dir.exists() if created is None else created
    try:
        return prepare_data(spec, output_dir, progress=progress)
    except BaseException:
        if created and output_dir.exists():
            shutil.rmtree(output_dir)
        raise


def tracking_location(spec: Spec, output_dir: Path) -> tuple[str, str | None]:
    """The tracking URI (``tracking.uri``, else ``$MLFLOW_TRACKING_URI``, else a sqlite store in the output folder)
    and the artifact location of the experiment, should the search create it (:func:`artifact_location`)."""
    uri = spec.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(output_dir)
    return uri, artifact_location(uri, spec.tracking.artifact_location)


def artifact_location(uri: str, given: str | None = None) -> str | None:
    """Where a new experiment of the store ``uri`` keeps its artifacts: ``given`` (a folder, made absolute, or a
    URI); for a local sqlite store, ``mlartifacts/`` beside its database file, whatever the working directory
    (MLflow's own default, ``./mlruns``, is relative to it); otherwise None: a tracking server's own artifact
    store (or a database's default)."""
    if given:
        return given if "://" in given or given.startswith("file:") else Path(given).resolve().as_uri()
    if uri.startswith("sqlite:///") and uri.removeprefix("sqlite:///") not in ("", ":memory:"):
        database = Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
        return (database.resolve().parent / "mlartifacts").as_uri()
    return None


def open_search_run(spec: Spec, output_dir: Path, data: PreparedData, *, run_name: str | None = None,
                    role: str = "search", parent_run_id: str | None = None,
                    tags: dict[str, str] | None = None) -> SearchRun:
    """Create the MLflow run of a search (or comparison) with the spec, split and manifest attached."""
    uri, artifacts = tracking_location(spec, output_dir)
    run = SearchRun(uri, spec.experiment_name, run_name=run_name or spec.name, searched=list(spec.search.space),
                    metric=spec.search.metric, mode=spec.search.mode, artifact_location=artifacts,
                    role=role, parent_run_id=parent_run_id, tags=tags)
    with ended_unless_recorded(run):
        resolved = spec_to_dict(spec)
        # The spec's fields as params, except the search space (a tag) and the tracking URI (may hold credentials).
        run.log_params({k: v for k, v in flatten(resolved).items()
                        if not k.startswith(("search.space", "tracking.uri"))})
        if resolved["tracking"]["uri"]:
            resolved["tracking"]["uri"] = redact_uri(resolved["tracking"]["uri"])
        run.log_text(yaml.safe_dump(resolved, sort_keys=False), "spec.yaml")
        run.log_dict(data.split, "split.json")
        run.log_dict(data.manifest, "tfrecord_manifest.json")
        run.log_inputs(tracked_data(spec, data).search_inputs())
    return run


def tracked_data(spec: Spec, data: PreparedData) -> TrackedData:
    """The search's data as MLflow's dataset inputs record it (:mod:`distmis.tracking.datasets`): its TFRecord
    folder's parts, and the parts each trial reads by its fold (:func:`~distmis.data.split.fold_parts`, as the
    trainers read them)."""
    folds = range(len(data.split["folds"])) if data.split.get("folds") is not None else [None]
    return TrackedData.from_manifest(data.manifest, source=spec.dataset.path, tfrecord_dir=data.tfrecord_dir,
                                     trial_parts={fold: fold_parts(data.split, fold) for fold in folds})


@contextmanager
def ended_unless_recorded(run: SearchRun) -> Iterator[SearchRun]:
    """While a new search's run is set up, before ``search_state.json`` names it: a Ctrl-C or a failure ends the run
    (KILLED or FAILED) rather than leaving it RUNNING with no state that could resume it."""
    try:
        yield run
    except BaseException as exc:
        run.finish("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED", timeout=10)
        raise


def reopen_search_run(spec: Spec, output_dir: Path, run_id: str) -> SearchRun:
    """The MLflow run of an interrupted search, RUNNING again; what its killed driver left RUNNING is KILLED."""
    uri, _ = tracking_location(spec, output_dir)
    mark_interrupted(MlflowClient(tracking_uri=uri), run_id)
    return SearchRun.reopen(uri, run_id)


def experiment_name(spec: Spec, plan: SearchPlan, run_id: str) -> str:
    """The Ray Tune experiment folder of a search, under ``OUTPUT/ray_results``: one per MLflow search run."""
    return f"{spec.name}-{plan.mode}-{plan.largest.world_size}w-{run_id[:8]}"


# --------------------------------------------------------------------------- one search
def _search_run_killed_on_interrupt(execute: Callable[..., SearchOutcome]) -> Callable[..., SearchOutcome]:
    """``execute_search`` interrupted outside Tune's loop (Ctrl-C or SIGTERM while it sets Tune up, or while it
    scores and publishes the best model after the trials): the search's run KILLED, not left RUNNING, and
    :class:`SearchInterrupted` raised (``--resume`` then scores and publishes what the trials left)."""
    @functools.wraps(execute)
    def interruptible(spec: Spec, data: PreparedData, plan: SearchPlan, search_run: SearchRun, *args: Any,
                      **kwargs: Any) -> SearchOutcome:
        with sigterm_interrupts() as received:
            try:
                return execute(spec, data, plan, search_run, *args, **kwargs)
            except SearchInterrupted:  # in Tune's loop: its runs are KILLED already
                raise
            except KeyboardInterrupt:
                search_run.finish("KILLED", timeout=30)
                raise SearchInterrupted(received.get("signal", signal.SIGINT)) from None

    return interruptible


def warm_driver_imports(spec: Spec) -> threading.Thread:
    """Import, in a background thread, what the driver needs once the trials end: the trials' framework (to load
    and score the best model) and matplotlib (the figures). Started before Ray and the data, whose start-up mostly
    waits on other processes, the imports (seconds for TensorFlow) are done by the time the trials end instead of
    adding to the search's wall time after them.

    Not at a lowered priority: the thread holds the GIL while it imports, and one the scheduler starves would
    starve the driver's Tune loop with it (the trials then wait for their results to be taken).

    The imports run in :func:`~distmis.train.startup.loading_libraries`: the cyclic garbage collector waits while
    they load, and their objects are frozen once loaded, so that the driver's later full collections, as it loads
    and scores the best model, and the interpreter's at exit, skip them."""

    def imports() -> None:
        try:
            with loading_libraries():
                if spec.model.framework == "tensorflow":
                    import keras  # noqa: F401
                    import tensorflow  # noqa: F401
                else:
                    import torch  # noqa: F401
                import matplotlib.pyplot  # noqa: F401
        except Exception:  # noqa: BLE001 - the same import after the trials will say what is wrong
            logger.debug("warming the driver's imports failed", exc_info=True)

    for key, value in tensorflow_env().items():  # as the trials import it (quiet, oneDNN's kernels)
        os.environ.setdefault(key, value)
    thread = threading.Thread(target=imports, name="distmis-warm-imports", daemon=True)
    thread.start()
    return thread


def trial_function(plan: SearchPlan, spec: Spec, data: PreparedData, output_dir: Path, experiment: str,
                   trainable: Callable[..., None] | None = None) -> Any:
    """The Tune trainable for a plan, with the search's spec and its resources bound."""
    from ray import tune

    if plan.distributed:
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
    from their saved state. (A search killed before Tune saved anything starts its trials afresh.)
    """
    from ray import tune
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    search_run.set_tag("distmis.layout", plan.label)
    callback = search_run.trial_callback(spec, volume=tuple(int(v) for v in data.manifest["image_shape"][:3]),
                                         data=tracked_data(spec, data))
    if resume:
        callback.adopt_existing_runs()
    # One checkpoint per epoch makes Tune warn about snapshot frequency; expected here. Tune saves its own state
    # (which trials ended, the searcher's) every few seconds, so little is run again after the driver is killed.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "2")
    # Tune's result files (result.json, progress.csv) but not its TensorBoard logger: importing tensorboardX
    # imports torch into the driver (1.2 s of a 2-core machine as the trials start) and it writes every result
    # again; MLflow holds the curves.
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    function = trial_function(plan, spec, data, output_dir, experiment, trainable)
    storage = output_dir / "ray_results"
    # the search as a whole after each trial's end: on the search run (always) and the console (unless --quiet)
    tracker = SearchProgress(spec, total=num_trials(spec), at_once=trials_at_once(plan, node_resources()),
                             record=lambda metrics, step: search_run.log_metrics(metrics, step=step))
    if resume:
        tracker.adopt(callback.best, callback.epochs)
    console = SearchConsole(spec, tracker) if progress else None
    if not verbose:  # Tune's newer output prints its experiment box and paths even at verbose=0; the older is silent
        os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    handle = callback.handle(tracker, *([console] if console else []))
    filesystem = atomic_local_filesystem()  # a driver killed while Tune saves leaves whole files (storage.py)
    if resume and tune.Tuner.can_restore(str(storage / experiment), storage_filesystem=filesystem):
        tuner = tune.Tuner.restore(str(storage / experiment), trainable=function, param_space=tune_param_space(spec),
                                   resume_unfinished=True, resume_errored=True, storage_filesystem=filesystem)
    else:
        # Ray Train restarts a data-parallel trial's workers itself (trainable.py); Tune restarts the others, and
        # the trials on a search's worker group (which start a new group).
        retries = 0 if plan.distributed and not runs_on_worker_group(spec) else spec.parallelism.max_failures
        tuner = tune.Tuner(
            function,
            param_space=tune_param_space(spec),
            tune_config=tune.TuneConfig(
                metric=spec.search.metric,
                mode=spec.search.mode,
                # search_alg, num_samples, max_concurrent_trials: with folds, the fold searcher says when it is done
                **tune_search(spec, plan.max_concurrent_trials),
                scheduler=scheduler(spec),
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
                verbose=1 if verbose else 0,  # Tune's boxed tables: --verbose only
            ),
        )
    logger.info("running %d trial(s) of %s: %s", num_trials(spec), spec.name, plan.label)
    if console is not None:
        console.header(spec, trials=num_trials(spec), layout=plan.label,
                       store=redact_uri(search_run.tracking_uri), experiment=spec.experiment_name)
    start = time.perf_counter()
    tune_failure = ""  # why Ray Tune itself stopped, if it did (e.g. it could not write a trial's error file)
    received: dict[str, int] = {}
    try:
        with signals_stop_tune() as received:
            grid = tuner.fit()
    except KeyboardInterrupt:  # a second Ctrl-C or SIGTERM: Tune did not stop gracefully
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
        if plan.distributed and runs_on_worker_group(spec):
            release_groups(experiment)
    if (received or callback.unfinished) and not tune_failure:  # Tune stopped on Ctrl-C or SIGTERM
        _record_interruption(callback, search_run)
        raise SearchInterrupted(received.get("signal", signal.SIGINT))
    search_seconds = time.perf_counter() - start
    if spec.cv_folds:  # each configuration's folds' outcome on its run, before the results are read
        callback.summarize_configurations(final=True)
    callback.close()  # the trial records a store outage held back, before the results are read
    # Counted from each trial's own final status as the callback recorded it: Tune's grid.errors misses a trial
    # whose error file could not be written (a full or read-only disk).
    failed_trials = tuple(callback.failed)
    failed = len(failed_trials)

    client = search_run.client
    search_run.log_figure(learning_curves_figure(client, client.get_run(search_run.run_id), "val_dice"),
                          "val_dice_curves.png")
    test, test_note, model, problems = _finish_with_best_models(
        search_run, grid, callback, spec, data, output_dir / LOCAL_MODEL_FOLDER if keep_model else None)
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
    ranked_by = f"{'cv' if spec.cv_folds else 'best'}_{spec.search.metric}"  # the table's order
    best_column = results.get(ranked_by)
    if best_column is not None and best_column.notna().any():
        search_run.log_metrics({ranked_by: float(best_column.iloc[0])})
    elapsed = search_run.finish("FAILED" if tune_failure else "FINISHED")
    return SearchOutcome(results, failed, elapsed, search_seconds, search_run.tracking_uri, spec.experiment_name,
                         search_run.run_id, data, test, test_note, model, tuple(problems), failed_trials, tune_failure)


def _last_line(exc: BaseException) -> str:
    """An exception's reason on one line: a TuneError carries the whole traceback of what failed; its last line
    names it (``PermissionError: ... error.pkl``)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:400]


def _results_so_far(tuner: Any) -> Any:
    """The trials' results as Tune saved them, after ``Tuner.fit`` failed (``[]`` when they cannot be read)."""
    try:
        return tuner.get_results()
    except Exception:  # noqa: BLE001 - nothing saved to read: no trial is scored
        logger.warning("could not read the results Ray Tune saved", exc_info=True)
        return []


def _finish_with_best_models(search_run: SearchRun, grid: Any, callback: MLflowTrialCallback, spec: Spec,
                             data: PreparedData, model_folder: Path | None
                             ) -> tuple[TestEvaluation | None, str, PublishedModel | None, list[str]]:
    """What follows the trials: the ``search.evaluate_top`` best candidates scored on the test split (each on its
    own run; the best also on the search's run), the best one's overlay, and the best one's model published
    (:func:`~distmis.search.evaluate.publish_model`; ``model_folder`` None: logged on its run, not copied nor
    registered). A candidate is a finished trial, or with cross-validation folds a configuration whose every fold
    finished: its fold models predict as one ensemble (the mean of their probabilities), which is scored on the
    configuration's run, each fold on its own, and published. Only trials whose own final status is FINISHED count.

    Returns the best's scores (None if none), a note for the user, where the model went, and the problems: what
    could not be done (a model that did not load, a test split that could not be scored, a model that could not be
    published), each naming the trial and why. The trials' records are safe by now: these are logged and tagged on
    the search run, and make the command exit 1, not raise.
    """
    top = spec.search.evaluate_top
    finished = callback.finished
    problems: list[str] = []
    notes: list[str] = [] if top else ["search.evaluate_top is 0: the test split was not evaluated"]

    def problem(text: str, tag: str) -> None:
        problems.append(text)
        notes.append(text)
        search_run.set_tag(tag, text[:500])

    if spec.cv_folds:
        models = best_models(grid, callback.last_checkpoint, callback.configs, callback.best, spec.search.mode,
                             top=len(finished), finished=finished)
        means = {configuration: result.mean for configuration, result in callback.cv.items()}
        candidates = fold_candidates(models, callback.trial_folds, means, spec.cv_folds, spec.search.mode,
                                     top=max(top, 1))
        unit = "configuration whose every fold finished"
    else:
        candidates = [Candidate.of(model) for model in best_models(
            grid, callback.last_checkpoint, callback.configs, callback.best, spec.search.mode, top=max(top, 1),
            finished=finished)]
        unit = "trial"
    if not candidates:
        if finished:  # trials finished, no candidate has weights to load
            problem(f"no finished {unit} has a checkpoint to load its best weights from "
                    f"(trials {', '.join(sorted(finished))})", "distmis.test_error")
        else:
            notes.append("no trial finished: there is no model to evaluate")
        return None, "; ".join(notes), None, problems
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
                if rank == 0:
                    _log_overlay(search_run, next(iter(trainers.values())))
                evaluation = None
                if evaluate:
                    try:
                        spacings = spacings or test_spacings(spec, data)
                        each, evaluation = evaluate_ensemble_on_test(trainers, data, candidate.name, spacings)
                        if candidate.folds:  # each fold's own scores on its own run
                            for fold, fold_evaluation in each.items():
                                _record_test(search_run, callback.run_ids.get(candidate.models[fold].trial_id),
                                             fold_evaluation, candidate.models[fold], best=False, data=callback.data)
                        _record_test(search_run, run_id, evaluation, candidate, best=rank == 0, data=callback.data)
                    except Exception as exc:  # noqa: BLE001
                        logger.warning("could not evaluate %s on the test split", candidate.name, exc_info=True)
                        problem(f"{_named(candidate)} could not be scored on the test split: "
                                f"{type(exc).__name__}: {exc}", "distmis.test_error")
                if rank == 0:
                    best = evaluation
                    ordered = [trainers[fold] for fold in candidate.folds] if candidate.folds else [trainers[None]]
                    published = _publish(ordered, candidate, spec, data, search_run, run_id, evaluation,
                                         model_folder, problem)
        except _NotLoaded as failure:
            model, exc = failure.model, failure.__cause__
            logger.warning("could not load trial %s's best weights", model.trial_id, exc_info=exc)
            problem(f"trial {model.trial_id}'s best weights could not be loaded from {_where(model.checkpoint)}: "
                    f"{type(exc).__name__}: {exc}", "distmis.test_error")
    return best, "; ".join(notes), published, problems


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


def _record_test(search_run: SearchRun, run_id: str | None, evaluation: TestEvaluation, model: Any, *,
                 best: bool, data: TrackedData | None = None) -> None:
    csv = format_results(evaluation.cases, "csv")
    if run_id is not None:
        search_run.log_metrics(_unrecorded(search_run, run_id, evaluation.means), run_id=run_id)
        if data is not None:  # the test part, as a dataset input of the run it scored
            search_run.log_inputs(data.test_inputs(), run_id=run_id)
        search_run.writer.submit(f"test_cases.csv ({model.trial_id})",
                                 lambda: search_run.client.log_text(run_id, csv, "test_cases.csv"))
    if best:
        search_run.log_metrics(_unrecorded(search_run, search_run.run_id, evaluation.means))
        search_run.log_text(csv, "test_cases.csv")
        search_run.set_tag("distmis.test_trial", model.trial_id)


def _unrecorded(search_run: SearchRun, run_id: str, metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` but those the run ``run_id`` holds already: a search's end that was interrupted and is resumed
    scores the test split again, and each test score is logged once (the first stands). A store that cannot be read
    now takes them all (its writer retries)."""
    try:
        held = search_run.client.get_run(run_id).data.metrics
    except Exception:  # noqa: BLE001 - the store is away: nothing is known to be there
        return dict(metrics)
    return {key: value for key, value in metrics.items() if key not in held}


def _publish(trainers: list[Any], candidate: Candidate, spec: Spec, data: PreparedData, search_run: SearchRun,
             run_id: str | None, evaluation: TestEvaluation | None, folder: Path | None,
             problem: Callable[[str, str], None]) -> PublishedModel | None:
    """The best candidate's model (one trial's, or a fold ensemble), saved, logged on ``run_id`` (its trial's or
    configuration's run) and registered; a failure is a ``problem`` (exit 1), not a raise."""
    try:
        published = publish_model(trainers, candidate, spec, data, tracking_uri=search_run.tracking_uri,
                                  trial_run_id=run_id, search_run_id=search_run.run_id,
                                  evaluation=evaluation, folder=folder, folds=candidate.folds,
                                  register=folder is not None and spec.tracking.register_model)
    except Exception as exc:  # noqa: BLE001
        logger.warning("could not save, log or register the best model", exc_info=True)
        problem(f"{_named(candidate)}'s model could not be published: {type(exc).__name__}: {exc}",
                "distmis.model_error")
        return None
    if published.error:
        problem(f"{_named(candidate)}'s model is in {published.folder}, but could not be logged or registered: "
                f"{published.error}", "distmis.model_error")
    tags = {"distmis.model_trial": candidate.name}
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
