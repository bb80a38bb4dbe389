"""TensorFlow workers kept from one trial to the next of a data-parallel search.

A data-mode search runs its trials one after another on the same N workers. As a Ray Train run per trial,
every trial paid again for what does not change between them (benchmarks/history.md, issue 12): a controller
and N new processes, TensorFlow imported in each (6 to 9 s on 2 cores), ``MultiWorkerMirroredStrategy``'s
cluster, and the tracing of the U-Net's training and prediction graphs (5 to 10 s a model). On a short trial
that was most of it, and more with two workers than with one.

:class:`TensorflowWorkerGroup` is N Ray actors in one placement group (``PACK``, each bundle the layout's
``worker_resources``), joined once by ``TF_CONFIG`` into one strategy. Each trial of the search asks the group
for its epochs (:meth:`TensorflowWorkerGroup.epochs`); the workers keep a trainer per :func:`graph_key`, so a
trial whose model and training graphs equal an earlier one's (a new learning rate, say, or another
cross-validation fold) restarts that trainer (:meth:`UNetTrainer.restart`: the same initial weights, data order
and cases, its fold's, as a new one) instead of tracing again.

The epoch loop is :func:`distmis.train.loop.epoch_reports` in every worker, stepped one epoch per call by
the trial: a trial that Tune stops (or that fails) leaves the workers idle between two epochs, ready for the
next trial. Rank 0's checkpoint folder travels to the trial as bytes, so the trial and its workers may be on
different nodes. A worker that dies, or any error in a trial, discards the group (its actors killed, its
placement group removed): the workers of a failed collective cannot be trusted, and the next trial (or Tune's
retry of this one, from its checkpoint) starts a new group.
"""

from __future__ import annotations

import logging
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

from distmis.trial.kept_trainers import KeptTrainers, trainer_key
from distmis.spec.layout import TrialLayout
from distmis.spec.schema import Spec

if TYPE_CHECKING:
    import tensorflow as tf

    from distmis.train.loop import Metrics
    from distmis.train.protocol import RestartableTrainer

logger = logging.getLogger(__name__)

GROUP_NAME_PREFIX = "distmis-workers-"

Files = dict[str, bytes]  # a checkpoint folder: relative path -> contents


def folder_files(folder: str | Path) -> Files:
    """Every file under ``folder``, by its path relative to it."""
    folder = Path(folder)
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def write_files(files: Files, folder: str | Path) -> Path:
    """Write :func:`folder_files`' output back under ``folder``."""
    folder = Path(folder)
    for name, data in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return folder


class TensorflowWorker:
    """One rank of a :class:`TensorflowWorkerGroup` (a Ray actor): its strategy, trainers and current trial."""

    def __init__(self, rank: int, cpus: float) -> None:
        from distmis.train.loop import quiet_worker
        from distmis.train.threads import pin_threads

        quiet_worker()
        self.rank = rank
        pin_threads(cpus, tensorflow=True, torch=False)
        self.strategy: tf.distribute.Strategy | None = None  # this rank's MultiWorkerMirroredStrategy, once joined
        self.trainers = KeptTrainers()  # by their graphs, traced
        self.trainer: RestartableTrainer | None = None  # the current trial's
        self._epochs: Iterator[tuple[Metrics, Path | None]] | None = None
        self._resume_dir: tempfile.TemporaryDirectory[str] | None = None

    def address(self) -> str:
        from distmis.parallel.tensorflow_cluster import worker_address

        return worker_address()

    def join(self, addresses: list[str]) -> int:
        """Build this rank's ``MultiWorkerMirroredStrategy`` over ``addresses`` (every rank calls it at once)."""
        from distmis.parallel.tensorflow_cluster import multi_worker_strategy, set_tf_config

        set_tf_config(addresses, self.rank)
        import tensorflow as tf

        tf.get_logger().setLevel("ERROR")
        self.strategy = multi_worker_strategy()
        return int(self.strategy.num_replicas_in_sync)

    def start_trial(self, spec: Spec, layout: TrialLayout, tfrecord_dir: str, checkpoints: Sequence[Files],
                    submitted_at: float, scratch: str | None = None) -> None:
        """Set up a trial: restart the trainer of its graphs, or build one; load its checkpoints if it resumes.
        ``scratch``: the trial's working folder, where this rank keeps its scratch files (made on this node if
        need be; None: the system's temporary folder)."""
        from ray.train import Checkpoint

        from distmis.train.loop import epoch_reports
        from distmis.train.startup import StartupClock
        from distmis.train.tf_unet import UNetTrainer

        self.finish_trial()
        clock = StartupClock(since=submitted_at)
        clock.mark("workers")  # the group, new or kept, up to this worker's first line for the trial
        self.trainer = None
        trainer, reused = self.trainers.trainer_for(
            trainer_key(spec, tfrecord_dir), spec, layout,
            lambda: UNetTrainer(spec, tfrecord_dir, layout=layout, strategy=self.strategy))
        clock.mark("data")
        self.trainer = trainer
        resume = []
        if checkpoints:
            if scratch is not None:
                Path(scratch).mkdir(parents=True, exist_ok=True)
            self._resume_dir = tempfile.TemporaryDirectory(prefix=f"distmis-resume-rank{self.rank}-", dir=scratch)
            for index, files in enumerate(checkpoints):
                folder = write_files(files, Path(self._resume_dir.name) / str(index))
                resume.append(Checkpoint.from_directory(str(folder)))
        startup = {**clock.seconds(), "startup_graphs_reused": float(reused)}
        self._epochs = epoch_reports(trainer, spec, checkpoints=resume, rank=self.rank, primary=self.rank == 0,
                                     startup=startup, scratch=scratch)

    def next_epoch(self) -> tuple[Metrics, Files | None] | None:
        """Train the trial's next epoch: its metrics and (rank 0) its checkpoint's files; None after the last."""
        if self._epochs is None:
            raise RuntimeError("no trial started on this worker")
        try:
            metrics, folder = next(self._epochs)
        except StopIteration:
            self.finish_trial()
            return None
        return metrics, (folder_files(folder) if folder is not None and self.rank == 0 else None)

    def finish_trial(self) -> None:
        if self._epochs is not None:
            self._epochs.close()  # its temporary folders go
            self._epochs = None
        if self._resume_dir is not None:
            self._resume_dir.cleanup()
            self._resume_dir = None


class TensorflowWorkerGroup:
    """``layout.world_size`` :class:`TensorflowWorker` actors in one placement group, joined into one strategy."""

    def __init__(self, layout: TrialLayout, name: str) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.layout = layout
        self.name = name
        resources = {key: value for key, value in layout.worker_resources.items() if value}
        self.placement_group = placement_group([dict(resources)] * layout.world_size, strategy="PACK", name=name)
        ray.get(self.placement_group.ready())
        actor = ray.remote(TensorflowWorker)
        self.workers = [
            actor.options(
                num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0),
                resources={k: v for k, v in resources.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, rank),
            ).remote(rank, layout.cpu)
            for rank in range(layout.world_size)
        ]
        addresses = ray.get([worker.address.remote() for worker in self.workers])
        replicas = ray.get([worker.join.remote(addresses) for worker in self.workers])
        if any(n != layout.world_size for n in replicas):
            raise RuntimeError(f"the trial's layout has {layout.world_size} rank(s) ({layout.describe()}), but "
                               f"MultiWorkerMirroredStrategy has {replicas} replicas")

    def fits(self, layout: TrialLayout) -> bool:
        return (layout.world_size, layout.worker_resources, layout.cpu) == (
            self.layout.world_size, self.layout.worker_resources, self.layout.cpu)

    def epochs(self, spec: Spec, layout: TrialLayout, tfrecord_dir: str, checkpoints: Sequence[Files],
               submitted_at: float, scratch: str | None = None) -> Iterator[tuple[Metrics, Files | None]]:
        """Run a trial on the group, one epoch per step: rank 0's metrics (with every rank's system samples) and
        checkpoint files. Any error (a worker's exception or death) shuts the group down before it is raised.
        ``scratch``: the trial's working folder, where each worker keeps its scratch files (:meth:`start_trial`)."""
        import ray

        from distmis.trial.record import with_every_rank_records

        try:
            ray.get([worker.start_trial.remote(spec, layout, tfrecord_dir, checkpoints, submitted_at, scratch)
                     for worker in self.workers])
            while True:
                results = ray.get([worker.next_epoch.remote() for worker in self.workers])
                if results[0] is None:
                    return
                yield with_every_rank_records([metrics for metrics, _ in results]), results[0][1]
        except GeneratorExit:  # the trial stopped early (Tune's scheduler, an interruption): the workers idle
            ray.get([worker.finish_trial.remote() for worker in self.workers])
            raise
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Kill the workers and give their resources back (best effort)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for worker in self.workers:
            try:
                ray.kill(worker)
            except Exception:  # noqa: BLE001 - already dead
                pass
        try:
            remove_placement_group(self.placement_group)
        except Exception:  # noqa: BLE001 - already removed
            logger.debug("placement group %s already removed", self.name, exc_info=True)
        self.workers = []


# --------------------------------------------------------------------------- one group per search, per process
_GROUP: TensorflowWorkerGroup | None = None


def group_for(layout: TrialLayout, search: str) -> TensorflowWorkerGroup:
    """The worker group of this (reused) Tune trial process for ``layout``: the one kept from the search's
    previous trial, or a new one (a group that does not fit ``layout`` is shut down first).

    ``search``: a name unique to the search. Groups of the same search that another process left behind (a Tune
    actor that was not reused) are removed first: a data-mode search runs one trial at a time, so they are stale,
    and they would hold the CPUs the new group needs.
    """
    global _GROUP
    if _GROUP is not None and _GROUP.workers and _GROUP.fits(layout):
        return _GROUP
    if _GROUP is not None:
        _GROUP.shutdown()
        _GROUP = None
    release_groups(search)
    _GROUP = TensorflowWorkerGroup(layout, f"{GROUP_NAME_PREFIX}{search}-{uuid.uuid4().hex[:8]}")
    return _GROUP


def release_groups(search: str) -> list[str]:
    """Remove the placement groups of ``search``'s worker groups still alive (their workers die with them);
    their names. Called by a trial before it starts a group and by the driver after the search."""
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group
    from ray._raylet import PlacementGroupID

    removed = []
    for group_id, info in placement_group_table().items():
        name = info.get("name") or ""
        if name.startswith(f"{GROUP_NAME_PREFIX}{search}-") and info.get("state") != "REMOVED":
            remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(group_id)))
            removed.append(name)
    return removed
