"""MLflow records of a search: one parent run per search, one child run per trial.

With cross-validation folds (:mod:`distmis.search.folds`) the search's children are its configurations, one run
each (role ``configuration``: the searched values as params, ``cv_<metric>`` and ``cv_<metric>_std`` once its folds
have ended), and each fold's trial is a run under its configuration's, tagged ``distmis.fold``.

All writes happen in the driver process. Trials report to Ray Tune, and
:class:`MLflowTrialCallback` (a Tune ``Callback``, running in the driver) turns each report into
MLflow calls. A sqlite store accepts one writer at a time, so logging from N concurrent trial
processes could drop metrics; logging from the driver cannot.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Mapping

import numpy as np
from mlflow.entities import DatasetInput, Metric, Param, RunStatus
from mlflow.tracking import MlflowClient
from ray import tune

from distmis.tracking.predicted import predict_trial
from distmis.spec.layout import TrialLayout, resolve_trial
from distmis.spec.load import CONFIGURATION_KEY, FOLD_KEY, SpecError, searched_config, spec_to_dict
from distmis.spec.schema import Spec
from distmis.spec.searchers import pbt_mutations
from distmis.tracking.datasets import TrackedData
from distmis.tracking.lineage import EXPLOITS_TAG, PBT_PREFIX, Exploit, best_epoch, exploit_entry
from distmis.tracking.new_store import seed_sqlite_store
from distmis.tracking.writer import ResilientWriter
from distmis.trial.record import (
    CLASS_DICE_PREFIX, DEVICE_KEY, HISTORY_KEY, NODES_KEY, STARTUP_PREFIX, SYSTEM_KEY, epoch_metric_names,
    samples_from_json,
)

ROLE_TAG = "distmis.role"
SEARCHED_TAG = "distmis.searched"
METRIC_TAG = "distmis.metric"
MODE_TAG = "distmis.mode"
PARENT_TAG = "mlflow.parentRunId"
RUN_NAME_TAG = "mlflow.runName"
TRIAL_ID_TAG = "distmis.trial_id"
ATTEMPTS_TAG = "distmis.attempts"  # processes (or worker groups) that trained a trial: > 1 after a retry or resume
CHECKPOINT_TAG = "distmis.checkpoint"  # a trial's latest checkpoint folder: its best epoch's weights at the root
DEVICE_TAG = "distmis.device"  # where a trial's model trained, as its first report says: "cpu", "cuda:0 (NVIDIA ...)"
NODES_TAG = "distmis.nodes"  # the Ray node of each of a trial's processes (rank 0 first), as its first report says
RESUMES_TAG = "distmis.resumes"  # times a search (or a trial in it) was resumed after an interruption
SEARCH_RUN_TAG = "distmis.search_run"  # every trial run: its search's run (a fold's parent is its configuration's)
CONFIGURATION_TAG = "distmis.configuration"  # cross-validation: a configuration's id, on its run and its folds'
FOLD_TAG = "distmis.fold"  # cross-validation: the fold a trial's run validated on
STOPPED_TAG = "distmis.stopped"  # a trial stopped early: "<scheduler or budget> at epoch <n> of <N>"
LOST_TAG = "distmis.lost"  # a resumed search's deleted run: why its trial was lost and will not run again
CONFIGURATION_ROLE = "configuration"

logger = logging.getLogger(__name__)

# What a trial reports each epoch that is logged as an MLflow metric (step = epoch). step_seconds, peak_memory_mb
# and fom come from the PyTorch trainers (distmis.train.metering.StepMeter; fom where the model has a perf_shape); the
# curriculum's stage and tile from trials with a training.curriculum.
# training.inference.compare: whole-volume against sliding-window inference (distmis.train.inference_timing)
INFERENCE_METRICS = ("whole_volume_dice", "whole_volume_seconds", "sliding_window_dice", "sliding_window_seconds")
EPOCH_METRICS = epoch_metric_names()  # the fields of distmis.trial.record.EpochMetrics
# Each scored channel's validation dice, val_dice_<key> (the data set's class or region: distmis.data.targets), is
# logged every epoch beside them (CLASS_DICE_PREFIX).
# A trial's system samples (distmis.train.system_metrics), under MLflow's prefix for system metrics: the UI's
# "System metrics" tab draws every metric whose key starts with it, against time.
SYSTEM_PREFIX = "system/"
MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limit


def run_workers(run: Any) -> int:
    """The workers a trial's MLflow run held: its ``trial.workers`` param (1 where it has none)."""
    workers = str(run.data.params.get("trial.workers", "1"))
    return int(workers) if workers.isdigit() else 1


def default_tracking_uri(output_dir: str | Path) -> str:
    return f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}} -> {"a.b": 1}``; lists stay values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, prefix=f"{path}."))
        else:
            out[path] = value
    return out


def _param_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, tuple, dict)) or value is None else str(value)


def log_params(client: MlflowClient, run_id: str, params: Mapping[str, Any]) -> None:
    items = [Param(k, _param_value(v)) for k, v in params.items()]
    for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
        client.log_batch(run_id, params=items[i : i + 100])


# MLflow 3's UI opens an experiment in its GenAI (traces) view unless the experiment says it holds model training.
EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"


def get_or_create_experiment(client: MlflowClient, name: str, artifact_location: str | None) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage == "deleted":
            client.restore_experiment(experiment.experiment_id)
        return experiment.experiment_id
    return client.create_experiment(name, artifact_location=artifact_location,
                                    tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND})


# Field names that say little without their section: shown with it (``lr_schedule.name``, ``augment.enabled``).
GENERIC_FIELDS = frozenset({"name", "enabled", "mode", "interval"})


def short_name(path: str) -> str:
    """A searched path as a table column or run name shows it: ``training.optimizer.lr`` -> ``lr``, but
    ``training.lr_schedule.name`` -> ``lr_schedule.name`` (a bare ``name`` would not say which)."""
    parts = path.split(".")
    return ".".join(parts[-2:]) if parts[-1] in GENERIC_FIELDS and len(parts) > 1 else parts[-1]


def searched_values(config: Mapping[str, Any]) -> str:
    """A trial's searched values as a person reads them: ``"lr=0.005 norm=group"`` (a cross-validation trial's
    fold last: ``"lr=0.005 fold=1"``)."""
    shown = [*searched_config(config).items(), *([(FOLD_KEY, config[FOLD_KEY])] if FOLD_KEY in config else [])]
    return " ".join(f"{short_name(path)}={value:g}" if isinstance(value, float)
                    else f"{short_name(path)}={value}" for path, value in shown)


def trial_run_name(trial_id: str, config: Mapping[str, Any]) -> str:
    """A child run's name that says which trial it is: ``"00003 lr=0.005 norm=group"``."""
    index = trial_id.rsplit("_", 1)[-1]
    return f"{index} {searched_values(config)}".strip()


def error_summary(text: str | None) -> str:
    """The line of a traceback that says what went wrong (``FloatingPointError: ...``), with the lines of a
    message that goes on below it (a SpecError lists its problems)."""
    if not text:
        return "unknown error"
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for index in range(len(lines) - 1, -1, -1):
        head = lines[index].split(":", 1)[0]
        if head.endswith(("Error", "Exception")) and "ray." not in head and "TuneError" not in head:
            return " ".join(lines[index:])[:500]
    return lines[-1][:500] if lines else "unknown error"


def trial_error_text(trial: Any) -> str | None:
    """The traceback Tune wrote for a failed trial: the driver-side error file, else the synced copy."""
    try:
        local = trial.error_file
        if local and Path(local).is_file():
            return Path(local).read_text()
        text = trial.get_error()
        return None if text is None else str(text)
    except Exception:  # noqa: BLE001 - an unreadable error file must not stop the search
        return traceback.format_exc()


def mark_interrupted(client: MlflowClient, run_id: str) -> list[str]:
    """A run whose driver was killed, and every run below it (trials; a comparison's searches and theirs): those
    still RUNNING are set KILLED, as an interruption is recorded. Returns the ids it changed."""
    killed = RunStatus.to_string(RunStatus.KILLED)
    run = client.get_run(run_id)
    changed = []
    if run.info.status == "RUNNING":
        client.set_terminated(run_id, killed)
        changed.append(run_id)
    for child in client.search_runs([run.info.experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{run_id}'",
                                    max_results=10_000):
        changed += mark_interrupted(client, child.info.run_id)
    return changed


def source_tags(command: str | None = None) -> dict[str, str]:
    """MLflow's source tags for a run distmis starts: which program (``mlflow.source.name``: ``distmis run``,
    never its arguments, which may hold a store's password), how (``mlflow.source.type``: ``JOB`` under the Ray
    Jobs API, else ``LOCAL``), the git commit of the working directory's repository when there is one (the
    specs and data a researcher keeps under version control), and distmis's own version."""
    import subprocess
    import sys
    from importlib.metadata import PackageNotFoundError, version

    if command is None:
        words = [a for a in sys.argv[1:3] if not a.startswith("-")]
        command = " ".join(["distmis", *words[:1]])
    in_job = bool(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"))  # what the Ray Jobs API gives a job's driver
    tags = {"mlflow.source.name": command, "mlflow.source.type": "JOB" if in_job else "LOCAL"}
    try:
        tags["distmis.version"] = version("distmis")
    except PackageNotFoundError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):  # no git here
        return tags
    if commit.returncode == 0 and len(commit.stdout.strip()) == 40:
        tags["mlflow.source.git.commit"] = commit.stdout.strip()
    return tags


class SearchRun:
    """The parent MLflow run of one search.

    Its writes (params, artifacts, tags, metrics, its end) go through one :class:`ResilientWriter`, shared with its
    trials' callback: a store that is away for a while delays them, in order, never fails the search. Only the
    run's creation (or reopening) asks the store directly: a search starts only once it has a run.
    """

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        *,
        run_name: str,
        searched: list[str],
        metric: str,
        mode: str,
        artifact_location: str | None = None,
        role: str = "search",
        parent_run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
    ):
        self.tracking_uri = tracking_uri
        seed_sqlite_store(tracking_uri)  # a new local store: a copy of an empty one, not MLflow's migrations again
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.experiment_id = get_or_create_experiment(self.client, experiment, artifact_location)
        self.metric, self.mode = metric, mode
        self.source_tags = source_tags()
        all_tags = {ROLE_TAG: role, SEARCHED_TAG: json.dumps(searched), METRIC_TAG: metric, MODE_TAG: mode,
                    **self.source_tags}
        if parent_run_id:
            all_tags[PARENT_TAG] = parent_run_id
        all_tags.update(tags or {})
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=all_tags)
        self.run_id = run.info.run_id
        self.writer = ResilientWriter()
        self._started = time.perf_counter()

    @classmethod
    def reopen(cls, tracking_uri: str, run_id: str) -> SearchRun:
        """The run of an interrupted search, RUNNING again (``distmis run --resume``)."""
        self = cls.__new__(cls)
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri)
        run = self.client.get_run(run_id)
        self.run_id, self.experiment_id = run_id, run.info.experiment_id
        self.metric = run.data.tags.get(METRIC_TAG, "val_dice")
        self.mode = run.data.tags.get(MODE_TAG, "max")
        resumes = int(run.data.tags.get(RESUMES_TAG, "0")) + 1
        self.source_tags = {k: v for k, v in run.data.tags.items() if k.startswith("mlflow.source.")}
        self.client.update_run(run_id, status="RUNNING")
        self.client.set_tag(run_id, RESUMES_TAG, str(resumes))
        self.writer = ResilientWriter()
        self._started = time.perf_counter()
        return self

    def _submit(self, what: str, write: Callable[[MlflowClient, str], None]) -> None:
        self.writer.submit(f"search run: {what}", lambda: write(self.client, self.run_id))

    def log_params(self, params: Mapping[str, Any]) -> None:
        params = dict(params)
        self._submit("params", lambda client, run_id: log_params(client, run_id, params))

    def set_tag(self, key: str, value: str) -> None:
        self._submit(f"tag {key}", lambda client, run_id: client.set_tag(run_id, key, value))

    def log_text(self, text: str, artifact_file: str) -> None:
        self._submit(artifact_file, lambda client, run_id: client.log_text(run_id, text, artifact_file))

    def log_dict(self, data: Mapping[str, Any], artifact_file: str) -> None:
        data = dict(data)
        self._submit(artifact_file, lambda client, run_id: client.log_dict(run_id, data, artifact_file))

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        """Log a matplotlib figure as a PNG (drawn now, the figure closed), written when the store takes it."""
        import io

        import matplotlib.pyplot as plt

        buffer = io.BytesIO()
        try:
            figure.savefig(buffer, format="png", dpi=figure.dpi)
        finally:
            plt.close(figure)
        png = buffer.getvalue()
        self._submit(artifact_file, lambda client, run_id: _log_bytes(client, run_id, png, artifact_file))

    def log_metrics(self, metrics: Mapping[str, float], run_id: str | None = None, *, step: int = 0) -> None:
        """Metrics at ``step`` (default 0) on the search's run (or on ``run_id``, a trial's run)."""
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self._submit("metrics", lambda client, own: client.log_batch(run_id or own, metrics=batch))

    def log_inputs(self, inputs: list[DatasetInput], run_id: str | None = None) -> None:
        """MLflow dataset inputs (:mod:`distmis.tracking.datasets`) of the search's run (or of ``run_id``)."""
        inputs = list(inputs)
        if inputs:
            self._submit("datasets", lambda client, own: client.log_inputs(run_id or own, datasets=inputs))

    def trial_callback(self, spec: Spec, *, volume: tuple[int, ...] | None = None,
                       data: TrackedData | None = None) -> MLflowTrialCallback:
        return MLflowTrialCallback(self, spec, self.writer, volume=volume, data=data)

    def finish(self, status: str = "FINISHED", timeout: float = 300.0) -> float:
        """End the run with ``status`` once every write waiting for the store is made (retried up to ``timeout``
        seconds); returns the run's elapsed seconds."""
        elapsed = time.perf_counter() - self._started
        self.log_metrics({"elapsed_seconds": elapsed})
        self._submit("status", lambda client, run_id: client.set_terminated(run_id, status))
        if not self.writer.close(timeout):
            logger.warning("the tracking store took not every write of search run %s (%d left)", self.run_id,
                           len(self.writer.pending))
        return elapsed


@dataclass(frozen=True)
class CrossValidated:
    """A configuration whose every fold finished: each fold's best value of the search metric, their mean and
    sample standard deviation (NaN with one fold)."""

    configuration: str
    values: dict[int, float]  # fold -> that fold's best value

    @property
    def mean(self) -> float:
        return float(np.mean(list(self.values.values())))

    @property
    def std(self) -> float:
        return float(np.std(list(self.values.values()), ddof=1)) if len(self.values) > 1 else math.nan


def _log_bytes(client: MlflowClient, run_id: str, data: bytes, artifact_file: str) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / Path(artifact_file).name
        path.write_bytes(data)
        folder = str(Path(artifact_file).parent)
        client.log_artifact(run_id, str(path), None if folder == "." else folder)


class MLflowTrialCallback(tune.Callback):
    """Logs every Tune trial as a child run of the search's parent run, from the driver.

    Every write goes through a :class:`~distmis.tracking.writer.ResilientWriter`: a tracking store that is away
    for a while delays the records, never the trials. Call :meth:`close` after ``Tuner.fit`` to flush them.

    A trial keeps one run whatever happens to it: a retried or resumed trial (:meth:`adopt_existing_runs` after
    an interruption) logs into the run it had, only the epochs that run does not hold yet (one point per epoch,
    no duplicates), and its ``distmis.attempts`` tag counts the processes that trained it.

    Tune pickles its callbacks into the experiment folder; this one would carry the tracking URI (credentials
    included) and a live client, so Tune is given a :class:`TrialCallbackHandle` to it instead (:meth:`handle`).

    A ViT-seg trial's run also gets the performance model's predictions for its layout at step 0
    (:func:`~distmis.tracking.predicted.predict_trial`: ``predicted_*``); ``volume``, the preprocessed volume's
    shape, lets it predict trials that train on whole volumes the spec alone does not size. ``data``: the search's
    data, whose parts each trial's run gets as MLflow dataset inputs (:mod:`distmis.tracking.datasets`). The system
    samples a trial's reports carry are logged on its run as MLflow's system metrics (``system/...``).
    """

    def __init__(self, search_run: SearchRun, spec: Spec, writer: ResilientWriter | None = None, *,
                 volume: tuple[int, ...] | None = None, data: TrackedData | None = None):
        self.search = search_run
        self.client = search_run.client
        self.spec = spec
        self.volume = volume
        self.data = data
        self.writer = writer or ResilientWriter()
        self.last_checkpoint: dict[str, str] = {}  # trial id -> the path of its latest checkpoint
        self.configs: dict[str, dict[str, Any]] = {}  # trial id -> its config (searched paths), as Tune gave it
        self.run_ids: dict[str, str] = {}  # filled when the (possibly delayed) create_run has been made
        self.started: set[str] = set()
        self.ended: set[str] = set()  # completed or errored
        self.statuses: dict[str, str] = {}  # trial id -> the final status recorded: FINISHED, FAILED or KILLED
        self.finished_before: set[str] = set()  # trials whose run had finished before a resume: left untouched
        self.unfinished: list[str] = []  # trials Tune left unfinished (it was stopped): set at the experiment's end
        self.best: dict[str, tuple[float, int]] = {}
        self.epochs: dict[str, int] = {}  # the last epoch logged per trial
        self.attempts: dict[str, set[str]] = {}  # attempt ids seen this session
        self.attempts_before: dict[str, int] = {}  # attempts recorded before a resume
        self.adopted: set[str] = set()  # trials whose runs a resumed search took over
        self.trial_workers: dict[str, int] = {}  # trial id -> the workers it holds (its layout's world size)
        self.stopped_by: dict[str, str] = {}  # trial id -> what stopped it besides its scheduler ("budget")
        self.worker_seconds: dict[str, float] = {}  # trial id -> its workers times its time, once it ended
        # search.scheduler pbt: the paths it changes, and each trial's exploits (distmis.tracking.lineage)
        self.pbt_paths = tuple(pbt_mutations(spec.search)) if spec.search.scheduler == "pbt" else ()
        self.exploits: dict[str, list[dict[str, Any]]] = {}
        # trial id -> its exploits (indices) whose first report from the donor's line is not seen yet, oldest first;
        # and those PBT decided on the report the callback is about to see (Tune asks its scheduler first), whose
        # replay can only come in a later report
        self.exploit_pending: dict[str, list[int]] = {}
        self.exploit_deciding: dict[str, list[int]] = {}
        # search.budget: why it ended the search ("" while it has not): set by the search (distmis.search.budget)
        self.budget_ended: Callable[[], str] = lambda: ""
        # trial id -> worker-seconds beyond trial_workers x its time, from the epochs an auto search's pool grew it for
        self.grown_worker_seconds: dict[str, float] = {}
        self.num_parameters_logged: set[str] = set()
        self.reopened: set[str] = set()
        # cross-validation (spec.cv_folds): the folds every configuration trains, and the configurations' runs
        self.folds = spec.cv_folds
        self.trial_folds: dict[str, tuple[str, int]] = {}  # trial id -> (configuration, fold)
        self.configuration_runs: dict[str, str] = {}  # configuration -> its run's id, once created
        self.configurations_started: set[str] = set()
        self.summarized: set[str] = set()  # configurations whose run holds their folds' outcome and final status
        self.cv: dict[str, CrossValidated] = {}  # the configurations whose every fold finished

    def close(self, timeout: float = 300.0) -> bool:
        """Flush the writes still waiting for the store; False if some could not be made."""
        return self.writer.close(timeout)

    def handle(self, *others: tune.Callback) -> TrialCallbackHandle:
        """What to give Tune's ``RunConfig(callbacks=...)`` (see the class docstring); Tune's calls also reach
        ``others`` (the console's), in this driver process, after this callback's."""
        return TrialCallbackHandle(self, *others)

    # -- a resumed search
    def adopt_existing_runs(self) -> None:
        """Take over the trial runs a search recorded before it was interrupted (the store must answer).

        Each run is found by its trial id; its last logged epoch, best value and attempts are read back. A run
        that had finished is left as it is; the others are reopened when their trials start again (those a killed
        driver left RUNNING were marked KILLED first: :func:`mark_interrupted`).
        """
        runs = {}
        for tag in (PARENT_TAG, SEARCH_RUN_TAG):  # the search's children; a fold's run is its configuration's child
            for run in self.client.search_runs([self.search.experiment_id], max_results=10_000,
                                               filter_string=f"tags.`{tag}` = '{self.search.run_id}'"):
                runs[run.info.run_id] = run
        for run in runs.values():
            if run.data.tags.get(ROLE_TAG) == CONFIGURATION_ROLE:
                self._adopt_configuration(run)
                continue
            trial_id = run.data.tags.get(TRIAL_ID_TAG)
            if not trial_id:
                continue
            run_id = run.info.run_id
            if FOLD_TAG in run.data.tags:
                self.trial_folds[trial_id] = (run.data.tags[CONFIGURATION_TAG], int(run.data.tags[FOLD_TAG]))
            self.run_ids[trial_id] = run_id
            self.started.add(trial_id)
            self.adopted.add(trial_id)
            if "model.num_parameters" in run.data.params:
                self.num_parameters_logged.add(trial_id)
            self.attempts_before[trial_id] = int(run.data.tags.get(ATTEMPTS_TAG, "0"))
            if EXPLOITS_TAG in run.data.tags:
                self.exploits[trial_id] = json.loads(run.data.tags[EXPLOITS_TAG])
            self.trial_workers[trial_id] = run_workers(run)
            if "worker_seconds" in run.data.metrics:
                self.worker_seconds[trial_id] = float(run.data.metrics["worker_seconds"])
            epochs = self.client.get_metric_history(run_id, "epoch_seconds")  # logged with every epoch
            self.epochs[trial_id] = max((m.step for m in epochs), default=0)
            history = [m for m in self.client.get_metric_history(run_id, self.spec.search.selected_metric)
                       if math.isfinite(m.value)]
            if history:
                pick = max if self.search.mode == "max" else min
                best = pick(history, key=lambda m: m.value)
                self.best[trial_id] = (best.value, best.step)
            if run.info.status == "FINISHED":
                self.finished_before.add(trial_id)
                self.ended.add(trial_id)
                self.statuses[trial_id] = "FINISHED"

    def _adopt_configuration(self, run: Any) -> None:
        """A configuration's run of the interrupted search: kept as it is when its folds had all finished, else
        RUNNING again until they have ended (a FAILED one's failed folds run again: its error becomes
        ``distmis.previous_error``)."""
        configuration, run_id = run.data.tags[CONFIGURATION_TAG], run.info.run_id
        self.configuration_runs[configuration] = run_id
        self.configurations_started.add(configuration)
        if run.info.status == "FINISHED":
            self.summarized.add(configuration)
            return
        error = run.data.tags.get("error")

        def reopen() -> None:
            if error is not None:
                self.client.set_tag(run_id, "distmis.previous_error", error)
                self.client.delete_tag(run_id, "error")
            self.client.update_run(run_id, status="RUNNING")

        self.writer.submit(f"reopen ({configuration})", reopen)

    def set_aside_lost_runs(self, resumed: Collection[str]) -> list[str]:
        """Delete the adopted runs of the trials that had not finished and that Tune will not run again:
        ``resumed`` holds the trials of the state Tune resumes from (none when it starts afresh). Returns their ids.

        Tune saves its state every few seconds: a driver killed just after a trial began leaves a state without it,
        though the trial's run exists. Tune never runs that trial again: the searcher makes a new trial in its place,
        with a run of its own (a cross-validated search's fold searcher hands the same configuration and fold out
        again: :meth:`~distmis.search.folds.FoldSearcher.reconcile`). Kept, the lost run would count as a trial that
        failed and as a second run of its configuration (and fold). It is moved to MLflow's deleted runs (``mlflow
        runs restore`` brings it back), tagged with why: the search's runs are then those an uninterrupted search
        has."""
        lost = sorted(self.adopted - self.finished_before - set(resumed))
        for trial_id in lost:
            run_id = self.run_ids.pop(trial_id)
            for known in (self.started, self.adopted, self.num_parameters_logged):
                known.discard(trial_id)
            for by_trial in (self.trial_folds, self.attempts_before, self.epochs, self.best):
                by_trial.pop(trial_id, None)
            reason = ("the search was interrupted just after this trial began, before Ray Tune saved its state: "
                      "the resumed search made a new trial in its place")

            def delete(run_id: str = run_id) -> None:
                self.client.set_tag(run_id, LOST_TAG, reason)
                self.client.delete_run(run_id)

            self.writer.submit(f"set aside ({trial_id})", delete)
        if lost:
            logger.info("set aside the runs of %d trial(s) Ray Tune's saved state did not hold: %s", len(lost),
                        ", ".join(lost))
        return lost

    def _reopen(self, trial_id: str) -> None:
        """An interrupted or failed trial runs again: its run is RUNNING again and counts the resume."""
        def reopen(run_id: str) -> None:
            run = self.client.get_run(run_id)
            if "error" in run.data.tags:
                self.client.set_tag(run_id, "distmis.previous_error", run.data.tags["error"])
                self.client.delete_tag(run_id, "error")
            self.client.set_tag(run_id, RESUMES_TAG, str(int(run.data.tags.get(RESUMES_TAG, "0")) + 1))
            self.client.update_run(run_id, status="RUNNING")

        self.writer.submit(f"reopen ({trial_id})", lambda: reopen(self.run_ids[trial_id]))

    # -- helpers
    def _write(self, trial: Any, what: str, write: Callable[[str], None]) -> None:
        """Submit ``write(run_id)`` for the trial's run (created first, in order, if it is not yet)."""
        if trial.trial_id not in self.started:
            self._start(trial)
        trial_id = trial.trial_id
        self.writer.submit(f"{what} ({trial_id})", lambda: write(self.run_ids[trial_id]))

    def _start(self, trial: Any) -> None:
        trial_id, config = trial.trial_id, dict(trial.config)
        self.started.add(trial_id)
        self.configs[trial_id] = config
        try:  # the trial's spec and layout as the trial itself resolves them ("1e-3" in YAML is logged as 0.001)
            spec, layout = resolve_trial(self.spec, config)
        except SpecError as exc:  # the trial fails alone, with this reason; the search goes on
            params, invalid, predicted = dict(config), str(exc), {}
        else:
            params = {k: v for k, v in flatten(spec_to_dict(spec)).items() if not k.startswith(("search.", "tracking."))}
            params.update({"trial.workers": layout.world_size, "trial.data_parallel": layout.dp,
                           "training.optimizer.effective_lr": layout.effective_lr})
            self.trial_workers[trial_id] = layout.world_size
            invalid = None
            predicted = self._predict(trial_id, spec, layout)
        tags = {ROLE_TAG: "trial", TRIAL_ID_TAG: trial_id, SEARCH_RUN_TAG: self.search.run_id,
                **self.search.source_tags}
        if invalid:
            tags["error"] = invalid[:500]
        configuration = config.get(CONFIGURATION_KEY)
        if configuration is not None:  # a cross-validation fold: its run goes under its configuration's
            configuration = str(configuration)
            self.trial_folds[trial_id] = (configuration, int(config[FOLD_KEY]))
            tags.update({CONFIGURATION_TAG: configuration, FOLD_TAG: str(config[FOLD_KEY])})
            self._start_configuration(configuration, config, params)

        def create() -> None:
            if trial_id not in self.run_ids:  # a retried write must not create a second run
                parent = self.configuration_runs[configuration] if configuration is not None else self.search.run_id
                run = self.client.create_run(self.search.experiment_id, run_name=trial_run_name(trial_id, config),
                                             tags={**tags, PARENT_TAG: parent})
                self.run_ids[trial_id] = run.info.run_id

        self.writer.submit(f"create run ({trial_id})", create)
        self.writer.submit(f"params ({trial_id})", lambda: log_params(self.client, self.run_ids[trial_id], params))
        if self.data is not None:  # the parts it trains and validates on
            inputs = self.data.trial_inputs(int(config[FOLD_KEY]) if FOLD_KEY in config else None)
            self.writer.submit(f"datasets ({trial_id})",
                               lambda: self.client.log_inputs(self.run_ids[trial_id], datasets=inputs))
        if predicted:
            now = int(time.time() * 1000)
            metrics = [Metric(key, value, now, 0) for key, value in predicted.items()]
            self.writer.submit(f"predictions ({trial_id})",
                               lambda: self.client.log_batch(self.run_ids[trial_id], metrics=metrics))

    def _start_configuration(self, configuration: str, config: Mapping[str, Any], params: Mapping[str, Any]) -> None:
        """The run of a configuration whose first fold starts: a child of the search's, named by its searched values,
        with the trial's params but the fold."""
        if configuration in self.configurations_started:
            return
        self.configurations_started.add(configuration)
        name = f"{configuration} {searched_values(searched_config(config))}".strip()
        tags = {PARENT_TAG: self.search.run_id, ROLE_TAG: CONFIGURATION_ROLE, CONFIGURATION_TAG: configuration,
                **self.search.source_tags}
        shared = {key: value for key, value in params.items() if key != FOLD_KEY}

        def create() -> None:
            if configuration not in self.configuration_runs:
                run = self.client.create_run(self.search.experiment_id, run_name=name, tags=tags)
                self.configuration_runs[configuration] = run.info.run_id

        self.writer.submit(f"create run ({configuration})", create)
        self.writer.submit(f"params ({configuration})",
                           lambda: log_params(self.client, self.configuration_runs[configuration], shared))
        if self.data is not None:  # the folds it trains and validates on in turn
            inputs = self.data.configuration_inputs(self.folds)
            self.writer.submit(f"datasets ({configuration})", lambda: self.client.log_inputs(
                self.configuration_runs[configuration], datasets=inputs))

    def summarize_configurations(self, *, final: bool) -> dict[str, CrossValidated]:
        """Each configuration whose folds have all ended gets its outcome on its run: ``cv_<metric>`` (the mean over
        its folds of each fold's best value), ``cv_<metric>_std`` (their sample standard deviation, with two folds
        or more) and ``fold<i>_<metric>``, status FINISHED; or FAILED, naming the folds that did not finish.
        ``final``: the search is over, so a configuration with folds that never ran fails too. Returns the
        configurations whose every fold finished, by id."""
        metric = self.spec.search.selected_metric
        by_configuration: dict[str, dict[int, str]] = {}
        for trial_id, (configuration, fold) in self.trial_folds.items():
            by_configuration.setdefault(configuration, {})[fold] = trial_id
        for configuration in sorted(self.configurations_started | set(by_configuration)):
            folds = by_configuration.get(configuration, {})
            ended = {fold: self.statuses.get(trial_id) for fold, trial_id in folds.items()}
            if set(folds) == set(self.folds) and all(status == "FINISHED" for status in ended.values()) \
                    and all(folds[fold] in self.best for fold in self.folds):
                self.cv[configuration] = CrossValidated(
                    configuration, {fold: self.best[folds[fold]][0] for fold in self.folds})
            if configuration in self.summarized:
                continue
            complete = set(folds) == set(self.folds) and all(status is not None for status in ended.values())
            if not complete and not final:
                continue
            self.summarized.add(configuration)
            metrics: dict[str, float] = {}
            if configuration in self.cv:
                result = self.cv[configuration]
                metrics = {f"cv_{metric}": result.mean,
                           **{f"fold{fold}_{metric}": value for fold, value in result.values.items()}}
                if len(self.folds) > 1:
                    metrics[f"cv_{metric}_std"] = result.std
                status, error = "FINISHED", ""
            else:
                missing = [fold for fold in self.folds if ended.get(fold) != "FINISHED"]
                unscored = [fold for fold in self.folds if fold in folds and folds[fold] not in self.best]
                error = (f"fold(s) {', '.join(map(str, missing))} did not finish" if missing else
                         f"fold(s) {', '.join(map(str, unscored))} reported no finite {metric}")
                status = "FAILED"
            self._summarize(configuration, metrics, status, error)
        return dict(self.cv)

    def _summarize(self, configuration: str, metrics: dict[str, float], status: str, error: str) -> None:
        now = int(time.time() * 1000)
        batch = [Metric(key, value, now, 0) for key, value in metrics.items() if math.isfinite(value)]

        def write() -> None:
            run_id = self.configuration_runs[configuration]
            if batch:
                self.client.log_batch(run_id, metrics=batch)
            if error:
                self.client.set_tag(run_id, "error", error[:500])
            self.client.set_terminated(run_id, status)

        self.writer.submit(f"summary ({configuration})", write)

    def _end_configurations(self, status: str, reason: str = "") -> None:
        """The search stopped: the configurations that had not ended end with ``status``."""
        for configuration in sorted(self.configurations_started - self.summarized):
            self.summarized.add(configuration)
            self._summarize(configuration, {}, status, reason)

    def _predict(self, trial_id: str, spec: Spec, layout: TrialLayout) -> dict[str, float]:
        """The performance model's numbers for a ViT-seg trial (``{}`` for other models, or when they cannot be
        computed: a warning, never an error, which would stop the search)."""
        try:
            predicted = predict_trial(spec, layout, volume=self.volume)
        except Exception as exc:  # noqa: BLE001 - a prediction is a record, never a reason for a trial to fail
            logger.warning("no performance-model prediction for trial %s: %s", trial_id, exc)
            return {}
        return {key: float(value) for key, value in predicted.items() if math.isfinite(value)}

    def kill_unfinished(self) -> None:
        """Mark the runs of trials that started and never ended KILLED (the search was interrupted)."""
        killed = RunStatus.to_string(RunStatus.KILLED)
        for trial_id in sorted(self.started - self.ended):
            self.writer.submit(f"status ({trial_id})",
                               lambda trial_id=trial_id: self.client.set_terminated(self.run_ids[trial_id], killed))
            self.ended.add(trial_id)
            self.statuses[trial_id] = killed
        self.summarize_configurations(final=False)  # those whose folds had all ended keep their outcome
        self._end_configurations(killed)

    def fail_unfinished(self, reason: str) -> None:
        """Ray Tune itself stopped: mark the runs of trials that started and never ended FAILED, saying why."""
        failed = RunStatus.to_string(RunStatus.FAILED)
        summary = f"the search stopped before this trial ended: {reason}"[:500]
        for trial_id in sorted(self.started - self.ended):
            def write(trial_id: str = trial_id) -> None:
                self.client.set_tag(self.run_ids[trial_id], "error", summary)
                self.client.set_terminated(self.run_ids[trial_id], failed)

            self.writer.submit(f"status ({trial_id})", write)
            self.ended.add(trial_id)
            self.statuses[trial_id] = failed
        self.summarize_configurations(final=False)
        self._end_configurations(failed, f"the search stopped before this configuration's folds ended: {reason}")

    @property
    def finished(self) -> set[str]:
        """The trials whose own final status is FINISHED: the only ones a search may score, publish or register."""
        return {trial_id for trial_id, status in self.statuses.items() if status == "FINISHED"}

    @property
    def failed(self) -> list[str]:
        """The trials that started and did not finish (FAILED, or never ended), sorted: what a search counts as
        failed, whatever Tune could or could not write about them."""
        return sorted(trial_id for trial_id in self.started | set(self.statuses) if trial_id not in self.finished)

    def _finish(self, trial: Any, status: str) -> None:
        self.ended.add(trial.trial_id)
        self.statuses[trial.trial_id] = status
        last = trial.last_result or {}
        summary: dict[str, float] = {}
        if "time_total_s" in last:
            summary["elapsed_seconds"] = float(last["time_total_s"])
            # the workers' time it held: what it cost the cluster (accounting: distmis.tracking.accounting)
            summary["worker_seconds"] = (self.trial_workers.get(trial.trial_id, 1) * float(last["time_total_s"])
                                         + self.grown_worker_seconds.get(trial.trial_id, 0.0))
            self.worker_seconds[trial.trial_id] = summary["worker_seconds"]
        if trial.trial_id in self.best:
            value, epoch = self.best[trial.trial_id]
            summary[f"best_{self.spec.search.selected_metric}"] = value
            summary["best_epoch"] = float(epoch)
        summary["epochs_completed"] = float(self.epochs.get(trial.trial_id, 0))
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, 0) for k, v in summary.items()]
        self._write(trial, "summary", lambda run_id: self.client.log_batch(run_id, metrics=metrics))
        stopped = self._stopped_early(trial, status)
        if stopped:  # finished, not failed: its scheduler ended it at a rung (ASHA, HyperBand) or below the median
            self._write(trial, "stopped", lambda run_id: self.client.set_tag(run_id, STOPPED_TAG, stopped))
        self._write(trial, "status", lambda run_id: self.client.set_terminated(run_id, status))

    def _stopped_early(self, trial: Any, status: str) -> str:
        """What :data:`STOPPED_TAG` says of a trial that ended ``status``: what stopped it (the search's budget,
        or its scheduler) and the epoch it was stopped at, for a FINISHED trial that trained fewer epochs than its
        own ``training.epochs`` and that one of them stopped; ``""`` otherwise."""
        from distmis.spec.searchers import scheduler_entry

        scheduler = self.spec.search.scheduler
        by = self.stopped_by.get(trial.trial_id) or (scheduler if scheduler_entry(scheduler).stops_trials else "")
        planned = int(trial.config.get("training.epochs", self.spec.training.epochs))
        done = self.epochs.get(trial.trial_id, 0)
        if status != "FINISHED" or not by or not 0 < done < planned:
            return ""
        return f"{by} at epoch {done} of {planned}"

    def stopped_by_budget(self, trial_id: str) -> None:
        """``search.budget`` stops the trial at the epoch it reports now (:mod:`distmis.search.budget`)."""
        self.stopped_by[trial_id] = "budget"

    def exploited(self, exploit: Exploit) -> None:
        """Population-based training restarts ``exploit.trial`` from the donor's checkpoint (:mod:`~distmis.search.pbt`
        tells it, in this driver process): recorded on the trial's run, and its record follows the donor's line from
        the trial's next report (:meth:`_go_on_from_donor`)."""
        exploits = self.exploits.setdefault(exploit.trial, [])
        exploits.append(exploit_entry(exploit, self.run_ids))
        self.exploit_deciding.setdefault(exploit.trial, []).append(len(exploits) - 1)
        self._tag_exploits(exploit.trial)

    def _tag_exploits(self, trial_id: str) -> None:
        value = json.dumps(self.exploits[trial_id], default=str)
        self.writer.submit(f"exploits ({trial_id})",
                           lambda: self.client.set_tag(self.run_ids[trial_id], EXPLOITS_TAG, value))

    def _go_on_from_donor(self, trial_id: str, replayed: list[dict[str, Any]]) -> None:
        """The first report after an exploit replays the donor's epochs up to the checkpoint the trial went on from:
        they stay on the donor's run; this run's epochs go on after it, and its best is the donor line's (the
        weights its checkpoint keeps). The report that made PBT exploit may itself be the first of an earlier
        exploit's line: each such report is the oldest pending exploit's. It may also be the first after the trial
        went on from its own checkpoint (PBT pauses a trial while another waits), a replay of its own line: never the
        exploit it made's, which is pending only from the next report on."""
        index = self.exploit_pending[trial_id].pop(0)
        went_on_after = max(int(entry["epoch"]) for entry in replayed)
        self.exploits[trial_id][index]["went_on_after"] = went_on_after
        self._tag_exploits(trial_id)
        self.epochs[trial_id] = went_on_after
        best = best_epoch(replayed, self.spec.search.selected_metric, self.search.mode)
        if best is None:
            self.best.pop(trial_id, None)
        else:
            self.best[trial_id] = best

    def _count_attempt(self, trial: Any, attempt: str) -> None:
        seen = self.attempts.setdefault(trial.trial_id, set())
        if attempt in seen:
            return
        seen.add(attempt)
        count = str(self.attempts_before.get(trial.trial_id, 0) + len(seen))
        self._write(trial, "attempts", lambda run_id: self.client.set_tag(run_id, ATTEMPTS_TAG, count))

    # -- Tune hooks
    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if trial.trial_id in self.finished_before:
            return
        if trial.trial_id not in self.started:
            self._start(trial)
        elif trial.trial_id in self.adopted and trial.trial_id not in self.reopened:  # resumed: its first start
            self.reopened.add(trial.trial_id)
            self._reopen(trial.trial_id)

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        trial_id = trial.trial_id
        if trial_id in self.finished_before:
            return
        if result.get("checkpoint_path"):  # forwarded by Ray Train's TuneReportCallback
            self._record_checkpoint(trial, str(result["checkpoint_path"]))
        if result.get("attempt"):
            self._count_attempt(trial, str(result["attempt"]))
        if result.get(DEVICE_KEY):
            device = str(result[DEVICE_KEY])
            self._write(trial, "device", lambda run_id: self.client.set_tag(run_id, DEVICE_TAG, device))
        if result.get(NODES_KEY):
            nodes = str(result[NODES_KEY])
            self._write(trial, "nodes", lambda run_id: self.client.set_tag(run_id, NODES_TAG, nodes))
        if result.get("workers") and result.get("time_this_iter_s") is not None:  # parallelism.mode 'auto'
            more = int(result["workers"]) - self.trial_workers.get(trial_id, 1)
            self.grown_worker_seconds[trial_id] = (self.grown_worker_seconds.get(trial_id, 0.0)
                                                   + more * float(result["time_this_iter_s"]))
        epoch = int(result.get("epoch", result.get("training_iteration", 0)))
        # A restarted trial's first report replays the epochs it trained before: log those the run lacks.
        replayed = json.loads(result[HISTORY_KEY]) if result.get(HISTORY_KEY) else []
        if self.exploit_pending.get(trial_id) and replayed:
            self._go_on_from_donor(trial_id, replayed)
            replayed = []
        self.exploit_pending.setdefault(trial_id, []).extend(self.exploit_deciding.pop(trial_id, []))
        for entry in [*replayed, {**result, "epoch": epoch}]:
            self._log_epoch(trial, int(entry["epoch"]), entry)
        if result.get(SYSTEM_KEY):
            self._log_system(trial, epoch, str(result[SYSTEM_KEY]))
        if "num_parameters" in result and trial_id not in self.num_parameters_logged:
            self.num_parameters_logged.add(trial_id)
            count = int(result["num_parameters"])
            self._write(trial, "num_parameters",
                        lambda run_id: self.client.log_param(run_id, "model.num_parameters", count))

    def _log_epoch(self, trial: Any, epoch: int, result: Mapping[str, Any]) -> None:
        """One epoch's metrics (step = epoch), unless the trial's run holds that epoch already."""
        trial_id = trial.trial_id
        if epoch <= self.epochs.get(trial_id, 0):
            return  # a restarted trial repeats epochs its run already holds (its checkpoint was older)
        now = int(time.time() * 1000)
        keys = [*EPOCH_METRICS,
                *([self.spec.search.selected_metric] if self.spec.search.selection != "epoch" else []),  # ema_<metric>
                *(k for k in result if k.startswith(CLASS_DICE_PREFIX)),  # per scored channel: val_dice_<key>
                *INFERENCE_METRICS,  # the inference comparison: the last report only
                *(k for k in result if k.startswith(STARTUP_PREFIX))]  # start-up: first report only
        metrics = [
            Metric(key, float(result[key]), now, epoch)
            for key in keys
            if key in result and result[key] is not None and math.isfinite(float(result[key]))
        ]
        metrics += [Metric(f"{PBT_PREFIX}{path}", float(trial.config[path]), now, epoch)  # search.scheduler pbt
                    for path in self.pbt_paths if path in trial.config]
        self._write(trial, f"epoch {epoch}", lambda run_id: self.client.log_batch(run_id, metrics=metrics))
        self.epochs[trial_id] = epoch
        value = result.get(self.spec.search.selected_metric)
        if value is not None and math.isfinite(float(value)):
            best = self.best.get(trial_id)
            if best is None or (value > best[0] if self.search.mode == "max" else value < best[0]):
                self.best[trial_id] = (float(value), epoch)

    def _log_system(self, trial: Any, epoch: int, samples: str) -> None:
        """The system samples a report carries (:mod:`distmis.train.system_metrics`), each at its own time, as
        ``system/<name>`` metrics with step = the epoch whose report carried them."""
        metrics = [Metric(f"{SYSTEM_PREFIX}{key}", value, sample.timestamp_ms, epoch)
                   for sample in samples_from_json(samples)
                   for key, value in sample.values.items() if math.isfinite(value)]
        for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            batch = metrics[start:start + MAX_METRICS_PER_BATCH]
            self._write(trial, f"system metrics {epoch}",
                        lambda run_id, batch=batch: self.client.log_batch(run_id, metrics=batch))

    def on_checkpoint(self, iteration: int, trials: list, trial: Any, checkpoint: Any, **info: Any) -> None:
        if trial.trial_id not in self.finished_before and getattr(checkpoint, "path", None):
            self._record_checkpoint(trial, str(checkpoint.path))

    def _record_checkpoint(self, trial: Any, path: str) -> None:
        """The trial's latest checkpoint (its best epoch's weights at the root), tagged on its run when it changes."""
        if self.last_checkpoint.get(trial.trial_id) == path:
            return
        self.last_checkpoint[trial.trial_id] = path
        self._write(trial, "checkpoint", lambda run_id: self.client.set_tag(run_id, CHECKPOINT_TAG, path))

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        for trial in trials:
            restored_ended = trial.trial_id in self.adopted and trial.trial_id not in self.reopened  # not run here
            if restored_ended and trial.trial_id not in self.ended and trial.status in ("TERMINATED", "ERROR"):
                self._settle(trial)
        spent = self.budget_ended()
        if spent:  # the budget ended the search: a trial it kept from going on stopped where it was
            for trial in trials:
                if trial.trial_id not in self.started or trial.trial_id in self.ended:
                    continue
                if self.epochs.get(trial.trial_id, 0):
                    self.stopped_by[trial.trial_id] = "budget"
                    self._settle(trial)
                else:  # failed before its first epoch; its retry was not started
                    self._write(trial, "error", lambda run_id: self.client.set_tag(
                        run_id, "error", f"no epoch trained before the search's budget was spent ({spent})"))
                    self._finish(trial, RunStatus.to_string(RunStatus.FAILED))
        self.unfinished = [t.trial_id for t in trials if t.trial_id not in self.ended]

    def _settle(self, trial: Any) -> None:
        """A trial Tune's saved state says ended, whose end the store never got (the driver was killed between
        Tune's save and the run's write; a resumed search does not run it again): its epochs from its newest
        checkpoint, then its status."""
        if trial.status == "TERMINATED":
            for entry in _checkpoint_history(trial.checkpoint or self.last_checkpoint.get(trial.trial_id)):
                self._log_epoch(trial, int(entry["epoch"]), entry)
        status = RunStatus.FINISHED if trial.status == "TERMINATED" else RunStatus.FAILED
        self._finish(trial, RunStatus.to_string(status))

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if trial.trial_id in self.finished_before:
            return
        self._finish(trial, RunStatus.to_string(RunStatus.FINISHED))

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        text = trial_error_text(trial)
        summary = error_summary(text)
        self._write(trial, "error", lambda run_id: self.client.set_tag(run_id, "error", summary))
        if text:
            self._write(trial, "error.txt", lambda run_id: self.client.log_text(run_id, text, "error.txt"))
        self._finish(trial, RunStatus.to_string(RunStatus.FAILED))


def _checkpoint_history(checkpoint: Any) -> list[dict[str, Any]]:
    """Every epoch's metrics as the newest complete checkpoint of a trial holds them (``checkpoint``: one of its
    folders, a Tune checkpoint or a local path); ``[]`` when none can be read."""
    if checkpoint is None:
        return []
    import posixpath

    from distmis.trial.record import complete_folders, stored_state

    try:
        if isinstance(checkpoint, (str, Path)):
            from pyarrow.fs import LocalFileSystem

            filesystem, path = LocalFileSystem(), str(checkpoint)
        else:
            filesystem, path = checkpoint.filesystem, checkpoint.path
        folders = complete_folders(filesystem, posixpath.dirname(path.rstrip("/")))
        state = stored_state(filesystem, folders[0][1]) if folders else None
    except Exception:  # noqa: BLE001 - a record to complete, never a reason to fail the search
        logger.warning("could not read the epochs of checkpoint %s", checkpoint, exc_info=True)
        return []
    return [] if state is None else [{**entry, "epoch": entry.get("epoch", i + 1)}
                                     for i, entry in enumerate(state.history)]


class TrialCallbackHandle(tune.Callback):
    """What Tune holds for a search's :class:`MLflowTrialCallback` (and the console's callback): the search run's
    id, nothing secret.

    Tune pickles its callbacks into the experiment folder (``tuner.pkl``) and ``Tuner.restore`` brings them back;
    this handle forwards Tune's calls to the callbacks registered under its id in this (driver) process, so a
    restored search reports to the callbacks the resumed driver made.
    """

    _registry: dict[str, tuple[tune.Callback, ...]] = {}

    def __init__(self, callback: MLflowTrialCallback, *others: tune.Callback) -> None:
        self.key = callback.search.run_id
        self._registry[self.key] = (callback, *others)

    def _forward(self, hook: str, *args: Any, **kwargs: Any) -> None:
        # none in a process that did not register them: nothing to record there
        for target in self._registry.get(self.key, ()):
            getattr(target, hook)(*args, **kwargs)

    def on_trial_recover(self, *args: Any, **kwargs: Any) -> None:
        self._forward("on_trial_recover", *args, **kwargs)

    def on_trial_start(self, *args: Any, **kwargs: Any) -> None:
        self._forward("on_trial_start", *args, **kwargs)

    def on_trial_result(self, *args: Any, **kwargs: Any) -> None:
        self._forward("on_trial_result", *args, **kwargs)

    def on_trial_complete(self, *args: Any, **kwargs: Any) -> None:
        self._forward("on_trial_complete", *args, **kwargs)

    def on_trial_error(self, *args: Any, **kwargs: Any) -> None:
        self._forward("on_trial_error", *args, **kwargs)

    def on_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        self._forward("on_checkpoint", *args, **kwargs)

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self._forward("on_step_end", *args, **kwargs)

    def on_experiment_end(self, *args: Any, **kwargs: Any) -> None:
        self._forward("on_experiment_end", *args, **kwargs)
