"""What runs for one trial of a search, as Ray Tune function trainables.

Tune calls a trainable with the search's :class:`~distmis.spec.schema.Spec` and the trial's config (dotted
paths into the spec, e.g. ``{"training.optimizer.lr": 0.001}``). The trial applies its config to the spec once
(:func:`~distmis.spec.load.apply_config`), resolves its :class:`~distmis.spec.layout.TrialLayout` once, and
then either

- trains in its own process (:func:`single_process_trial`, experiment-parallel), or
- in a data-mode search, runs on the search's worker group, kept between its trials
  (:func:`group_trial`, :mod:`distmis.trial.worker_group`), or
- in an auto search, runs on a worker group of the size the search's pool gives it, grown onto idle workers
  (:func:`~distmis.trial.auto_trial.auto_trial`), or
- in a hybrid search, drives a Ray Train run of ``layout.world_size`` workers (:func:`data_parallel_trial`): a
  ``DataParallelTrainer`` with ``TF_CONFIG`` (``MultiWorkerMirroredStrategy``) or Ray Train's ``TorchTrainer`` (DDP,
  data x sequence parallel groups for vit-seg, or data x pipeline groups for a pipelined U-Net), each worker running
  :func:`data_parallel_worker` on the trial's spec and layout (typed objects, not re-validated);
  ``TuneReportCallback`` forwards rank 0's reports to Tune.

Each process builds its trainer with the trainer factory (:func:`~distmis.trial.trainers.build_trainer`).

Either way every epoch is reported with the same metrics and a checkpoint to resume from (the last epoch's
state, the best epoch's weights: :mod:`distmis.train.checkpoint`), and a restarted trial goes on from it.
Every process pins its thread pools to the CPUs its layout gives it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, NotRequired, TypedDict

from distmis.trial.auto_trial import auto_trial, ended_trial, release_trial
from distmis.trial.kept_trainers import KeptTrainers, trainer_key
from distmis.trial.trainers import build_trainer, resolve_precision, trial_frameworks
from distmis.trial.worker_group import GROUP_NAME_PREFIX, release_groups, remove_named_groups
from distmis.train.loop import Metrics, StoredCheckpoint, quiet_worker, train_and_report
from distmis.train.startup import StartupClock
from distmis.spec.layout import TrialLayout, resolve_trial
from distmis.spec.schema import Spec

if TYPE_CHECKING:
    from ray.tune.integration.ray_train import TuneReportCallback

    from distmis.train.protocol import Trainer

logger = logging.getLogger(__name__)

# What the driver imports (the Tune functions, and what it must know of them; release_groups: the worker group's
# actors of a search, released at its end; GROUP_NAME_PREFIX and remove_named_groups: an auto search's pool names
# its groups and removes those it takes back) and what the tests reach.
__all__ = ["TrialConfig", "LoopConfig", "single_process_trial", "data_parallel_trial", "data_parallel_worker",
           "group_trial", "auto_trial", "ended_trial", "release_trial", "runs_on_worker_group", "release_groups",
           "GROUP_NAME_PREFIX", "remove_named_groups", "worker_trainer", "worker_working_folder", "train_and_report",
           "resolve_trial"]

#: A trial's config as Tune hands it: the trial's values by their dotted paths into the spec.
TrialConfig = Mapping[str, object]


class LoopConfig(TypedDict):
    """What every Ray Train worker of a distributed trial is given (``train_loop_config``): the trial's spec and
    layout (typed objects, resolved once by the trial), its data, and when the trial submitted the run (the
    workers' start-up clocks count from it: :mod:`distmis.train.startup`)."""

    spec: Spec
    layout: TrialLayout
    tfrecord_dir: str
    submitted_at: NotRequired[float]


def runs_on_worker_group(spec: Spec) -> bool:
    """Whether a search's distributed trials run on one worker group kept between them
    (:mod:`distmis.trial.worker_group`) rather than a Ray Train run each: the trials of a data-mode search,
    which run one at a time. A hybrid search's trials, several at once, are Ray Train runs."""
    return spec.parallelism.mode == "data"



# --------------------------------------------------------------------------- experiment-parallel
# What this process keeps between the experiment-mode trials Tune runs on it in turn (``reuse_actors``): its
# imports and thread pools, and its TensorFlow trainers, their graphs traced (:mod:`distmis.trial.kept_trainers`).
_KEPT = KeptTrainers()
_TRIALS_STARTED = 0


def single_process_trial(config: TrialConfig, *, spec: Spec, tfrecord_dir: str) -> None:
    """One trial in this Tune actor's process, on the CPUs its layout gives it.

    Tune runs a search's trials in turn on the same actor: a TensorFlow trial whose graphs equal an earlier
    trial's restarts that trial's trainer (the same seeded weights, optimizer and data order as a new one) instead of
    tracing again. ``startup_process_reused`` and ``startup_graphs_reused`` (1 or 0) say what was found warm.
    """
    from ray import tune

    from distmis.trial.checkpoints import (
        exploit_candidates, leave_own_line, name_by_epoch, prune_older, resume_candidates, trial_folder, trial_working_folder,
    )
    from distmis.train.threads import pin_threads

    global _TRIALS_STARTED
    clock = StartupClock()
    process_reused = _TRIALS_STARTED > 0
    _TRIALS_STARTED += 1
    quiet_worker()
    trial, layout = resolve_trial(spec, config)
    pin_threads(layout.cpu, **trial_frameworks(trial))
    clock.mark("imports")
    if trial.model.framework == "tensorflow":  # a kept trainer's graphs are those of the resolved precision
        trial = resolve_precision(trial)
    key = trainer_key(trial, tfrecord_dir) if trial.model.framework == "tensorflow" else None
    if key is None:
        trainer, graphs_reused = build_trainer(trial, layout, tfrecord_dir, clock), False
    else:
        trainer, graphs_reused = _KEPT.trainer_for(key, trial, layout,
                                                   lambda: build_trainer(trial, layout, tfrecord_dir))
        clock.mark("data")  # the model and data, or the restart of a kept trainer

    def report(metrics: Metrics, checkpoint: StoredCheckpoint | None = None) -> None:
        if checkpoint is not None:
            name_by_epoch(int(metrics["epoch"]))
        tune.report(metrics, checkpoint=checkpoint)
        if checkpoint is not None:
            prune_older(tune.get_checkpoint())  # the one just persisted

    startup = {**clock.seconds(), "startup_process_reused": float(process_reused),
               "startup_graphs_reused": float(graphs_reused)}
    given = tune.get_checkpoint()
    if trial.search.scheduler == "pbt" and leave_own_line(given, trial_folder()):  # exploited: the donor's
        checkpoints = exploit_candidates(given)
    else:
        checkpoints = resume_candidates(given, trial_folder())
    try:
        train_and_report(trainer, trial, report, tune.Checkpoint, checkpoints=checkpoints, startup=startup,
                         scratch=trial_working_folder())
    except SystemExit:  # Tune stopped the trial (its scheduler, or the search's end) between two epochs
        raise
    except BaseException:
        if key is not None:
            _KEPT.discard(key)  # a trainer that failed is not restarted for another trial
        raise


# --------------------------------------------------------------------------- data-parallel
def worker_trainer(loop_config: LoopConfig,
                   clock: StartupClock | None = None) -> tuple[Spec, TrialLayout, Trainer]:
    """Set up one Ray Train worker of a trial: pin its threads and build its trainer (and process groups)."""
    from distmis.train.threads import pin_threads

    quiet_worker()
    spec, layout = loop_config["spec"], loop_config["layout"]
    pin_threads(layout.cpu, **trial_frameworks(spec))
    if clock is not None:
        clock.mark("imports")
    return spec, layout, build_trainer(spec, layout, loop_config["tfrecord_dir"], clock)


def data_parallel_worker(loop_config: LoopConfig) -> None:
    """One Ray Train worker of a distributed trial (every worker runs this)."""
    clock = StartupClock(since=loop_config.get("submitted_at"))
    clock.mark("workers")  # the controller, the placement group, this process and its backend's set-up
    import ray.train

    spec, _layout, trainer = worker_trainer(loop_config, clock)
    # Every rank adds its own files to an epoch's checkpoint; rank 0 the weights (the same on every rank).
    rank = ray.train.get_context().get_world_rank()
    checkpoint = ray.train.get_checkpoint()  # Ray Train's latest, after a restart
    train_and_report(trainer, spec, ray.train.report, ray.train.Checkpoint, rank=rank, primary=rank == 0,
                     checkpoints=[checkpoint] if checkpoint is not None else [], startup=clock.seconds(),
                     scratch=worker_working_folder())


def worker_working_folder() -> str | None:
    """This Ray Train worker's working folder on its node (Ray Train makes it the worker's working directory, one
    per run, so per trial: the run is named after it): where the worker keeps its scratch files
    (:func:`distmis.train.loop.trial_scratch`, one folder per rank). None when Ray cannot tell it."""
    import ray.train

    try:
        return str(ray.train.get_context().get_storage().local_working_directory)
    except Exception:  # noqa: BLE001 - a DeveloperAPI: where Ray moved it, the system's temporary folder serves
        return None


def data_parallel_trial(
    config: TrialConfig,
    *,
    spec: Spec,
    tfrecord_dir: str,
    storage_path: str,
    worker_loop: Callable[[LoopConfig], None] = data_parallel_worker,
) -> None:
    """One trial as a Ray Train run of ``layout.world_size`` workers running ``worker_loop``; rank 0's
    reports reach Tune.

    The run is named after the trial in ``storage_path``, so a restarted trial (a Tune retry, a resumed search)
    finds its Ray Train checkpoints again and its workers go on from the last epoch; Ray Train itself restarts
    a worker group that lost a worker up to ``parallelism.max_failures`` times.
    """
    from ray import tune
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    from distmis.trial.placement_groups import release_train_placement_groups
    from distmis.trial.storage import atomic_local_filesystem

    trial, layout = resolve_trial(spec, config)
    if runs_on_worker_group(trial):
        if worker_loop is not data_parallel_worker:
            raise ValueError("a data-mode trial runs on the search's worker group, not a worker loop")
        # The search's own workers, kept between its trials (one at a time): the storage folder is the search's.
        group_trial(trial, layout, tfrecord_dir, search=Path(storage_path).name)
        return
    scaling = ScalingConfig(num_workers=layout.world_size, use_gpu=layout.gpu > 0,
                            resources_per_worker=layout.worker_resources)
    run_config = RunConfig(
        name=f"{tune.get_context().get_trial_id()}",
        storage_path=storage_path,
        storage_filesystem=atomic_local_filesystem(),
        callbacks=[_tune_report_every_rank()],
        checkpoint_config=CheckpointConfig(num_to_keep=1),  # the latest epoch's (it holds the best weights too)
        # A worker group that can never start (its workers die at once) fails the trial after 3 tries rather than
        # retrying for ever, unless the cluster may still grow.
        failure_config=FailureConfig(max_failures=trial.parallelism.max_failures,
                                     controller_failure_limit=-1 if trial.parallelism.autoscaling else 3),
    )
    # submitted_at: the workers' start-up clocks count from here (distmis.train.startup)
    loop_config: LoopConfig = {"spec": trial, "layout": layout, "tfrecord_dir": tfrecord_dir,
                               "submitted_at": time.time()}
    if trial.model.framework == "tensorflow":
        # Ray's TensorflowTrainer with a backend that does not import TensorFlow in this process or in the Ray
        # Train controller (distmis.parallel.tensorflow_cluster): only the workers need it.
        from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

        from distmis.parallel.tensorflow_cluster import TensorflowClusterConfig

        trainer = DataParallelTrainer(worker_loop, train_loop_config=loop_config,
                                      backend_config=TensorflowClusterConfig(),
                                      scaling_config=scaling, run_config=run_config)
    else:
        from ray.train.torch import TorchTrainer

        from distmis.parallel.backend import process_group_backend
        from distmis.parallel.torch_backend import GpuCheckedTorchConfig

        backend = process_group_backend(layout)  # NCCL on GPUs, gloo on CPUs; its workers' GPUs checked first
        trainer = TorchTrainer(worker_loop, train_loop_config=loop_config, scaling_config=scaling,
                               run_config=run_config, torch_config=GpuCheckedTorchConfig(backend=backend))
    try:
        trainer.fit()
    finally:  # whatever fit did: a worker group lost while it started keeps its CPUs otherwise
        release_train_placement_groups()


def _tune_report_every_rank() -> TuneReportCallback:
    """Ray Train's ``TuneReportCallback``, which forwards rank 0's report of each epoch to Tune, with every rank's
    system samples in it (:func:`~distmis.trial.record.with_every_rank_records`)."""
    from ray.tune.integration.ray_train import TuneReportCallback

    from distmis.trial.record import with_every_rank_records

    class EveryRankReport(TuneReportCallback):
        def after_report(self, run_context: object, metrics: list[Metrics], checkpoint: object) -> None:
            super().after_report(run_context, [with_every_rank_records(metrics)], checkpoint)

    return EveryRankReport()


def group_trial(trial: Spec, layout: TrialLayout, tfrecord_dir: str, *, search: str) -> None:
    """One trial of a data-mode search on the search's worker group (:mod:`distmis.trial.worker_group`): started
    by the first trial, kept by this reused Tune process for the next ones. Each epoch is reported to Tune with the
    checkpoint its ranks wrote; a restarted trial hands its checkpoints to the workers and goes on after the last
    epoch they hold."""
    from distmis.trial.worker_group import group_for
    from distmis.trial.checkpoints import report_epoch, resume_files, trial_working_folder

    submitted_at = time.time()  # the workers' start-up clocks count from here (distmis.train.startup)
    group = group_for(layout, search, trial.model.framework)
    checkpoints = resume_files()
    scratch = trial_working_folder()  # the workers' scratch files go there too (on their nodes)
    for metrics, files in group.epochs(trial, layout, tfrecord_dir, checkpoints, submitted_at, scratch=scratch):
        report_epoch(metrics, files, scratch)
