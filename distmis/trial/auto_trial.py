"""One trial of a ``parallelism.mode: auto`` search: a worker group of as many workers as the search's pool gives it,
restarted on more from its last checkpoint when the pool grows it.

The trial's own process (a Tune actor that reserves no CPU: :data:`~distmis.search.plan.DRIVER_RESOURCES`) asks the
pool (:mod:`distmis.perf.pool`'s rule, in the driver's actor) for its workers, waits until it has them, and runs its
epochs on a :class:`~distmis.trial.worker_group.WorkerGroup` of that many data-parallel replicas (TensorFlow's or
torch's), one epoch per step, each reported to Tune with its checkpoint as a data-mode trial reports them. After each
epoch it tells the pool what the epoch measured; when the pool answers with more workers, the trial stops the group
after that epoch, starts one of the new size and hands it that epoch's checkpoint: the weights and optimizer state go on
exactly, the learning rate follows the new replicas (``parallelism.lr_scaling``: the trainers set each epoch's rate
from the layout), and the epochs go on in the same Tune trial, so in the same MLflow run. Each epoch's report says
the workers it ran on (``workers``) and the pool's prediction of its time (``predicted_epoch_seconds``).

Why not Ray Tune's ``ResourceChangingScheduler``: it changes a trial's resources by pausing the trial and starting
it again in a new Tune actor with a new placement group, which the trial's own workers must be inside; distmis's
data-parallel workers are a group of their own (as Ray Train's are), the decision needs what every running trial
measured (the pool), and a pause gives up the trial's process. The mechanism is the same, a checkpoint and a
restart on more workers; it happens inside the trial.

Whatever way the trial ends, its group is shut down and its workers go back to the pool (the driver does both too,
for a trial whose process was killed: :func:`release_trial`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from distmis.spec.layout import TrialLayout, resolve_trial
from distmis.spec.schema import Spec

if TYPE_CHECKING:
    from distmis.perf.pool import Grant
    from distmis.train.loop import Metrics
    from distmis.trial.worker_group import Files, WorkerGroup

logger = logging.getLogger(__name__)

__all__ = ["auto_trial", "resized_epochs", "group_prefix", "find_pool", "release_trial"]

POLL_SECONDS = 0.5  # how often a waiting trial asks the pool again


def group_prefix(search: str, trial_id: str) -> str:
    """The name the worker groups of ``trial_id`` in ``search`` start with (after the groups' own prefix)."""
    return f"{search}-{trial_id}"


def training_cases(spec: Spec, tfrecord_dir: str) -> int:
    """The trial's training cases (its fold's): the most replicas it can use, each training on its own."""
    from distmis.data.manifest import read_manifest
    from distmis.train.epoch import trial_parts

    return trial_parts(read_manifest(tfrecord_dir), spec.dataset.split.fold).num_train


def find_pool(search: str) -> Any:
    """The pool actor of the search ``search`` (its Tune experiment's name), which the driver started."""
    import ray

    from distmis.perf.pool import POOL_NAMESPACE, pool_name

    return ray.get_actor(pool_name(search), namespace=POOL_NAMESPACE)


def _wait_for_workers(pool: Any, trial_id: str, epochs: int, max_workers: int) -> Grant:
    import ray

    while True:
        grant = ray.get(pool.request.remote(trial_id, epochs, max_workers))
        if grant.workers:
            return grant
        time.sleep(POLL_SECONDS)


def resized_epochs(trial: Spec, base: TrialLayout, tfrecord_dir: str, workers: int, checkpoints: Sequence[Files],
                   decide: Callable[[Metrics], int], *, name: str, scratch: str | None = None,
                   ) -> Iterator[tuple[Metrics, Files | None]]:
    """The trial's epochs on a worker group of ``workers`` data-parallel replicas (``base`` with ``dp`` replaced), each
    yielded with its checkpoint (``checkpoints``: what a restarted trial goes on from). After each epoch has been
    handed on, ``decide(metrics)`` says how many workers to go on with: more than the group has, and the group is
    stopped after that epoch and a group of that many (named ``name`` and a suffix) goes on from its checkpoint.
    Each epoch's metrics say the workers it ran on (``workers``)."""
    from distmis.trial.worker_group import WorkerGroup

    group: WorkerGroup | None = None
    try:
        while True:
            layout = dataclasses.replace(base, dp=workers)
            group = WorkerGroup(layout, f"{name}-{uuid.uuid4().hex[:8]}", trial.model.framework)
            epochs = group.epochs(trial, layout, tfrecord_dir, checkpoints, time.time(), scratch=scratch)
            grown: Files | None = None
            for metrics, files in epochs:
                metrics = {**metrics, "workers": layout.world_size}
                yield metrics, files
                wanted = decide(metrics)
                if wanted > layout.world_size and files is not None:
                    logger.info("growing from %d to %d worker(s) after epoch %s", layout.world_size, wanted,
                                metrics["epoch"])
                    grown, workers = files, wanted
                    break
            epochs.close()  # after a growth: the group's workers leave the trial between two epochs
            group.shutdown()
            group = None
            if grown is None:
                return
            checkpoints = [grown]
    finally:
        if group is not None:
            group.shutdown()


def auto_trial(config: dict[str, Any], *, spec: Spec, tfrecord_dir: str, search: str) -> None:
    """The Tune trainable of an ``auto`` search's trial (see the module docstring). ``search``: the Tune experiment's
    name, which names the pool and the trial's worker groups."""
    import ray
    from ray import tune

    from distmis.trial.checkpoints import report_epoch, resume_files, trial_working_folder
    from distmis.trial.worker_group import GROUP_NAME_PREFIX

    from distmis.trial.worker_group import release_groups

    trial, base = resolve_trial(spec, config)
    trial_id = tune.get_context().get_trial_id()
    attempt = uuid.uuid4().hex[:12]  # one run of the trial however often it grows: a growth is not a retry
    pool = find_pool(search)
    release_groups(group_prefix(search, trial_id))  # what an earlier run of this trial (killed) left holding workers
    try:
        grant = _wait_for_workers(pool, trial_id, trial.training.epochs, training_cases(trial, tfrecord_dir))
        checkpoints = resume_files()
        scratch = trial_working_folder()

        def decide(metrics: Metrics) -> int:
            nonlocal grant
            grant = ray.get(pool.report.remote(trial_id, int(metrics["epoch"]), float(metrics["epoch_seconds"]),
                                               metrics.get("validation_seconds"), workers=int(metrics["workers"])))
            return grant.workers

        name = f"{GROUP_NAME_PREFIX}{group_prefix(search, trial_id)}"
        # closing: a trial Tune stops (SystemExit in its report) shuts its group down at once
        with contextlib.closing(resized_epochs(trial, base, tfrecord_dir, grant.workers, checkpoints, decide,
                                               name=name, scratch=scratch)) as epochs:
            for metrics, files in epochs:
                metrics = {**metrics, "attempt": attempt}
                if grant.predicted_epoch_seconds is not None:  # the prediction made before the epoch ran
                    metrics["predicted_epoch_seconds"] = grant.predicted_epoch_seconds
                report_epoch(metrics, files, scratch)
    finally:
        try:
            ray.get(pool.release.remote(trial_id), timeout=30)
        except Exception:  # noqa: BLE001 - the driver releases it too when the trial ends
            logger.debug("could not release trial %s's workers", trial_id, exc_info=True)


def release_trial(search: str, trial_id: str) -> None:
    """The driver's side of a trial's end (finished, stopped, failed, or its process killed): its worker groups
    removed and its workers back in the pool. Best effort: it never raises."""
    from distmis.trial.worker_group import release_groups

    try:
        release_groups(group_prefix(search, trial_id))
        find_pool(search).release.remote(trial_id)
    except Exception:  # noqa: BLE001 - the search has ended, or the pool with it
        logger.debug("could not release trial %s", trial_id, exc_info=True)
