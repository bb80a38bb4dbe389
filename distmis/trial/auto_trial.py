"""One trial of a ``parallelism.mode: auto`` search: a worker group of as many workers as the search's pool gives it,
restarted on more from its last checkpoint when the pool grows it.

The trial's own process (a Tune actor that reserves no CPU: :data:`~distmis.search.plan.DRIVER_RESOURCES`) asks the
pool (:mod:`distmis.perf.pool`'s rule, in the driver's actor) for its workers, waits until it has them, and runs its
epochs on a :class:`~distmis.trial.worker_group.WorkerGroup` of that many data-parallel replicas (TensorFlow's or
torch's; one CPU worker is a :class:`~distmis.trial.local_group.LocalGroup`, this process itself, as an
experiment-mode trial trains in its own), one epoch per step, each reported to Tune with its checkpoint as a data-mode trial reports them. After each
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

The pool names every group. When a trial ends (its last epoch, or stopped by Tune's scheduler between two), its
process keeps its group idle, and offers it to the pool (``keep``): the next trial Tune gives the process (Tune reuses
it: ``reuse_actors``) goes on with that group when the pool grants it as many workers (``Grant.reuse``), warm as a
data-mode search's kept group is (no new processes; a TensorFlow trainer of the same graphs restarted, not traced
again). The pool takes a kept group back (removes it) when another trial needs its workers, and once no trial waits or
is to come, so that the running trials can grow onto them. A trial that fails shuts its group down; the driver tells the
pool of every trial's end (:func:`ended_trial`, :func:`release_trial`), which removes the groups of a trial whose
process was killed.
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
    from distmis.trial.local_group import LocalGroup
    from distmis.trial.worker_group import Files, WorkerGroup

logger = logging.getLogger(__name__)

__all__ = ["auto_trial", "resized_epochs", "GroupSlot", "new_group", "group_prefix", "find_pool", "ended_trial", "release_trial"]

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


def _wait_for_workers(pool: Any, trial_id: str, epochs: int, max_workers: int, kept: str) -> Grant:
    import ray

    while True:
        grant = ray.get(pool.request.remote(trial_id, epochs, max_workers, kept=kept))
        if grant.workers:
            return grant
        time.sleep(POLL_SECONDS)


@dataclasses.dataclass
class GroupSlot:
    """The worker group a trial process holds: its running trial's, then, idle, the next trial's when the pool says
    so (``Grant.reuse``: warm, its workers' imports and TensorFlow's traced graphs kept, as a data-mode search keeps
    its group between trials)."""

    group: WorkerGroup | LocalGroup | None = None

    def offered(self, base: TrialLayout, framework: str) -> str:
        """The name of the kept group to offer the pool for a trial of ``base`` in ``framework`` ("" when none, or
        one that cannot serve it: it goes)."""
        if self.group is not None and not (
                self.group.workers and self.group.fits(dataclasses.replace(base, dp=self.group.layout.world_size),
                                                       framework)):  # type: ignore[arg-type]
            self.drop()
        return self.group.name if self.group is not None else ""

    def take(self, grant: Grant, base: TrialLayout, framework: str) -> WorkerGroup | LocalGroup:
        """The group ``grant`` names: the kept one when it says ``reuse``, else a new one of its workers (the kept
        one shut down first: its workers are the pool's again)."""
        if grant.reuse and self.group is not None and self.group.name == grant.group:
            return self.group
        if grant.reuse:
            raise RuntimeError(f"the pool gave back group {grant.group}, which this process does not hold")
        self.drop()
        self.group = new_group(dataclasses.replace(base, dp=grant.workers), grant.group, framework)
        return self.group

    def drop(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None


def new_group(layout: TrialLayout, name: str, framework: str) -> WorkerGroup | LocalGroup:
    """A group of ``layout`` named ``name``: of one CPU worker, in this process (:mod:`distmis.trial.local_group`:
    no second process, warm as an experiment-mode trial), unless this node has none free; else a worker group."""
    from distmis.trial.local_group import LocalGroup, serves_locally
    from distmis.trial.worker_group import WorkerGroup

    if serves_locally(layout):
        try:
            return LocalGroup(layout, name, framework)  # type: ignore[arg-type]
        except TimeoutError as exc:
            logger.info("trial group %s in a process of its own: %s", name, exc)
    return WorkerGroup(layout, name, framework)  # type: ignore[arg-type]


#: This Tune process's group, kept from one trial to the next (Tune reuses the process: ``reuse_actors``).
_SLOT = GroupSlot()


def resized_epochs(trial: Spec, base: TrialLayout, tfrecord_dir: str, grant: Grant, checkpoints: Sequence[Files],
                   decide: Callable[[Metrics], Grant], *, slot: GroupSlot, scratch: str | None = None,
                   ) -> Iterator[tuple[Metrics, Files | None]]:
    """The trial's epochs on the worker group ``grant`` names, of ``grant.workers`` data-parallel replicas (``base``
    with ``dp`` replaced), each yielded with its checkpoint (``checkpoints``: what a restarted trial goes on from).
    After each epoch has been handed on, ``decide(metrics)`` says how many workers to go on with: more than the group
    has, and the group is stopped after that epoch and the new one the grant names goes on from its checkpoint. Each
    epoch's metrics say the workers it ran on (``workers``, set by the epoch loop, which keeps it in the history a
    restarted trial replays).

    ``slot`` holds the group: after the last epoch, or when the trial is stopped between two (the generator closed),
    the group stays in it, its workers idle, for the process's next trial; an error removes it."""
    framework = trial.model.framework
    group = slot.take(grant, base, framework)
    try:
        while True:
            layout = dataclasses.replace(base, dp=group.layout.world_size)
            epochs = group.epochs(trial, layout, tfrecord_dir, checkpoints, time.time(), scratch=scratch)
            grown: Files | None = None
            try:
                for metrics, files in epochs:  # each says the workers it ran on (train.loop: ``workers``)
                    yield metrics, files
                    grant = decide(metrics)
                    if grant.workers > layout.world_size and files is not None:
                        logger.info("growing from %d to %d worker(s) after epoch %s", layout.world_size,
                                    grant.workers, metrics["epoch"])
                        grown = files
                        break
            finally:
                epochs.close()  # its workers leave the trial between two epochs, idle
            if grown is None:
                return
            group = slot.take(grant, base, framework)
            checkpoints = [grown]
    except GeneratorExit:  # stopped between two epochs: the group stays, idle
        raise
    except BaseException:
        slot.drop()
        raise


def auto_trial(config: dict[str, Any], *, spec: Spec, tfrecord_dir: str, search: str) -> None:
    """The Tune trainable of an ``auto`` search's trial (see the module docstring). ``search``: the Tune experiment's
    name, which names the pool (and, through it, the trial's worker groups)."""
    import ray
    from ray import tune

    from distmis.trial.checkpoints import report_epoch, resume_files, trial_working_folder

    trial, base = resolve_trial(spec, config)
    trial_id = tune.get_context().get_trial_id()
    attempt = uuid.uuid4().hex[:12]  # one run of the trial however often it grows: a growth is not a retry
    pool = find_pool(search)
    kept = False
    try:
        grant = _wait_for_workers(pool, trial_id, trial.training.epochs, training_cases(trial, tfrecord_dir),
                                  _SLOT.offered(base, trial.model.framework))
        checkpoints = resume_files()
        scratch = trial_working_folder()

        def decide(metrics: Metrics) -> Grant:
            nonlocal grant
            reused = metrics.get("startup_process_reused")  # the first epoch on a group: was its process warm
            grant = ray.get(pool.report.remote(trial_id, int(metrics["epoch"]), float(metrics["epoch_seconds"]),
                                               metrics.get("validation_seconds"), workers=int(metrics["workers"]),
                                               new_processes=None if reused is None else not reused))
            return grant

        try:
            # closing: a trial Tune stops (SystemExit in its report) leaves its group idle at once
            with contextlib.closing(resized_epochs(trial, base, tfrecord_dir, grant, checkpoints, decide,
                                                   slot=_SLOT, scratch=scratch)) as epochs:
                for metrics, files in epochs:
                    metrics = {**metrics, "attempt": attempt}
                    if grant.predicted_epoch_seconds is not None:  # the prediction made before the epoch ran
                        metrics["predicted_epoch_seconds"] = grant.predicted_epoch_seconds
                    report_epoch(metrics, files, scratch)
        except SystemExit:  # stopped by Tune between two epochs: its group may serve the next trial all the same
            kept = _keep(pool, trial_id)
            raise
        kept = _keep(pool, trial_id)
    finally:
        if not kept:
            _SLOT.drop()
            try:
                ray.get(pool.release.remote(trial_id), timeout=30)
            except Exception:  # noqa: BLE001 - the driver releases it too when the trial ends
                logger.debug("could not release trial %s's workers", trial_id, exc_info=True)


def _keep(pool: Any, trial_id: str) -> bool:
    """Offer the pool this process's group, idle after ``trial_id``: whether it keeps it for the next trial."""
    import ray

    if _SLOT.group is None or not _SLOT.group.workers:
        return False
    return bool(ray.get(pool.keep.remote(trial_id, _SLOT.group.name), timeout=30))


def ended_trial(search: str, trial_id: str) -> None:
    """The driver's side of a trial Tune ended (finished, or stopped by its scheduler) whose process lives on: its
    workers back in the pool, its group kept for the process's next trial while one may come
    (:meth:`~distmis.perf.pool.WorkerPool.ended`). Waits for the pool, so that a trial Tune starts next finds it
    done. Best effort: it never raises."""
    _tell_pool(search, "ended", trial_id)


def release_trial(search: str, trial_id: str) -> None:
    """The driver's side of a trial that failed (its process killed, perhaps): its workers back in the pool and its
    worker groups removed, before Tune retries it (waits for the pool). Best effort: it never raises."""
    _tell_pool(search, "release", trial_id)


def _tell_pool(search: str, method: str, trial_id: str) -> None:
    import ray

    try:
        ray.get(getattr(find_pool(search), method).remote(trial_id), timeout=30)
    except Exception:  # noqa: BLE001 - the search has ended, or the pool with it
        logger.debug("could not tell the pool that trial %s ended", trial_id, exc_info=True)
