"""Workers kept from one trial to the next of a data-parallel search, TensorFlow's and torch's.

A data-mode search runs its trials one after another on the same N workers. As a Ray Train run per trial,
every trial paid again for what does not change between them: a controller and N new processes, the framework
imported in each, the collective set-up, and for TensorFlow the tracing of the U-Net's training and prediction
graphs (5 to 10 s a model). A Ray Train run of two torch workers that do nothing takes 16 to 20 s on this project's
2-core machine (``benchmarks/ray_train_floor.py``), TensorFlow's more (benchmarks/history.md, issue 12): on a short
trial that was most of it.

:class:`WorkerGroup` is N :class:`GroupWorker` Ray actors in one placement group (``PACK``, each bundle the layout's
``worker_resources``), joined once: TensorFlow's by ``TF_CONFIG`` into one ``MultiWorkerMirroredStrategy``, torch's
into one default process group (NCCL on GPUs, gloo on CPUs: :func:`~distmis.parallel.backend.process_group_backend`)
over a TCP store at rank 0, each worker's GPU checked first as Ray Train's torch workers are. Each trial of the search
asks the group for its epochs (:meth:`WorkerGroup.epochs`). A torch trial builds its trainer over the
:class:`~distmis.parallel.mesh.TrialMesh` of its layout (its data-, sequence- and pipeline-parallel subgroups made
once per layout and kept); TensorFlow workers keep a trainer per :func:`graph_key`, so a trial whose model and
training graphs equal an earlier one's (a new learning rate, say, or another cross-validation fold) restarts that
trainer (:meth:`UNetTrainer.restart`: the same initial weights, data order and cases, its fold's, as a new one)
instead of tracing again.

The epoch loop is :func:`distmis.train.loop.epoch_reports` in every worker, stepped one epoch per call by
the trial: a trial that Tune stops (or that fails) leaves the workers idle between two epochs, ready for the
next trial. Every rank's part of an epoch's checkpoint (rank 0's weights and state; a torch rank's random-number
state, a pipeline stage's optimizer state) travels to the trial as bytes and is merged into one folder, as Ray Train
merges its workers' checkpoints, so the trial and its workers may be on different nodes. A worker that dies, or any
error in a trial, discards the group (its actors killed, its placement group removed): the workers of a failed
collective cannot be trusted, and the next trial (or Tune's retry of this one, from its checkpoint) starts a new group.
"""

from __future__ import annotations

import datetime
import logging
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Literal, Sequence

from distmis.trial.kept_trainers import KeptTrainers, trainer_key
from distmis.spec.layout import TrialLayout
from distmis.spec.schema import Spec

if TYPE_CHECKING:
    import tensorflow as tf

    from distmis.parallel.mesh import TrialMesh
    from distmis.train.loop import Metrics
    from distmis.train.protocol import Trainer

logger = logging.getLogger(__name__)

GROUP_NAME_PREFIX = "distmis-workers-"

Framework = Literal["tensorflow", "torch"]

Files = dict[str, bytes]  # a checkpoint folder: relative path -> contents

#: How long a torch rank waits for the others at the process group's set-up and at each collective, as Ray Train's
#: ``TorchConfig`` (30 min): a slow epoch of a large model on another rank is not a failure.
PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=30)


def folder_files(folder: str | Path) -> Files:
    """Every file under ``folder``, by its path relative to it."""
    folder = Path(folder)
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def merged_files(results: Sequence[tuple[object, Files | None]]) -> Files | None:
    """One epoch's checkpoint from every rank's part of it (rank 0's first: a file two ranks both wrote is rank 0's),
    as Ray Train merges its workers' checkpoint folders; None when no rank wrote one."""
    parts = [files for _, files in results if files is not None]
    if not parts:
        return None
    merged: Files = {}
    for files in reversed(parts):
        merged.update(files)
    return merged


def write_files(files: Files, folder: str | Path) -> Path:
    """Write :func:`folder_files`' output back under ``folder``."""
    folder = Path(folder)
    for name, data in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return folder


class GroupWorker:
    """One rank of a :class:`WorkerGroup` (a Ray actor): its framework's collective set-up, its trainers and its
    current trial."""

    def __init__(self, rank: int, framework: Framework, cpus: float) -> None:
        from distmis.train.loop import quiet_worker
        from distmis.train.threads import pin_threads

        quiet_worker()
        self.rank = rank
        self.framework = framework
        self.cpus = cpus
        pin_threads(cpus, tensorflow=framework == "tensorflow", torch=framework == "torch")
        self.strategy: tf.distribute.Strategy | None = None  # TensorFlow: this rank's strategy, once joined
        self.device = "cpu"  # torch: this rank's device, once joined
        self.meshes: dict[tuple[int, int, int], TrialMesh] = {}  # torch: the meshes made, by (dp, sp, pp)
        self.trainers = KeptTrainers()  # TensorFlow: by their graphs, traced
        self.trainer: Trainer | None = None  # the current trial's
        self._epochs: Iterator[tuple[Metrics, Path | None]] | None = None
        self._resume_dir: tempfile.TemporaryDirectory[str] | None = None
        self.trials_started = 0  # the trials this rank has served (a kept group's serve the next: warm)

    def address(self) -> str:
        from distmis.parallel.tensorflow_cluster import worker_address

        return worker_address()

    def join(self, addresses: list[str], layout: TrialLayout) -> int:
        """Join the group (every rank calls it at once, ``addresses`` in rank order): TensorFlow's strategy, or
        torch's default process group over rank 0's address. The number of ranks joined."""
        if self.framework == "tensorflow":
            from distmis.parallel.tensorflow_cluster import multi_worker_strategy, set_tf_config

            set_tf_config(addresses, self.rank)
            import tensorflow as tf

            tf.get_logger().setLevel("ERROR")
            self.strategy = multi_worker_strategy()
            return int(self.strategy.num_replicas_in_sync)
        import torch
        import torch.distributed as dist

        from distmis.parallel.backend import process_group_backend
        from distmis.parallel.devices import check_process_gpus

        backend = process_group_backend(layout)  # NCCL on GPUs (one whole GPU a rank), gloo on CPUs
        if check_process_gpus(torch=True):  # a GPU Ray gave that torch cannot see is refused here, before NCCL
            torch.cuda.set_device(0)  # the one Ray gave this actor (CUDA_VISIBLE_DEVICES)
            self.device = "cuda:0"
        dist.init_process_group(backend, init_method=f"tcp://{addresses[0]}", rank=self.rank,
                                world_size=len(addresses), timeout=PROCESS_GROUP_TIMEOUT)
        return dist.get_world_size()

    def start_trial(self, spec: Spec, layout: TrialLayout, tfrecord_dir: str, checkpoints: Sequence[Files],
                    submitted_at: float, scratch: str | None = None) -> None:
        """Set up a trial: its trainer (TensorFlow: the kept trainer of its graphs restarted, or a new one; torch: a
        new one over its layout's mesh); load its checkpoints if it resumes. ``scratch``: the trial's working
        folder, where this rank keeps its scratch files (made on this node if need be; None: the system's
        temporary folder)."""
        from ray.train import Checkpoint

        from distmis.train.loop import epoch_reports
        from distmis.train.startup import StartupClock

        self.finish_trial()
        clock = StartupClock(since=submitted_at)
        clock.mark("workers")  # the group, new or kept, up to this worker's first line for the trial
        self.trainer = None
        trainer, reused = self._trainer(spec, layout, tfrecord_dir)
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
        startup = {**clock.seconds(), "startup_process_reused": float(self.trials_started > 0),
                   "startup_graphs_reused": float(reused)}
        self.trials_started += 1
        self._epochs = epoch_reports(trainer, spec, checkpoints=resume, rank=self.rank, primary=self.rank == 0,
                                     startup=startup, scratch=scratch)

    def _trainer(self, spec: Spec, layout: TrialLayout, tfrecord_dir: str) -> tuple[Trainer, bool]:
        """The trial's trainer, and whether it was kept from an earlier trial (its graphs not traced again)."""
        if self.framework == "tensorflow":
            from distmis.train.tf_unet import UNetTrainer

            return self.trainers.trainer_for(
                trainer_key(spec, tfrecord_dir), spec, layout,
                lambda: UNetTrainer(spec, tfrecord_dir, layout=layout, strategy=self.strategy))
        from distmis.trial.trainers import build_trainer

        return build_trainer(spec, layout, tfrecord_dir, mesh=self._mesh(layout), device=self.device), False

    def _mesh(self, layout: TrialLayout) -> TrialMesh:
        """This rank's mesh for ``layout``: its subgroups made by the first trial of that shape (collective: every
        rank starts the trial at once), the later ones' from them."""
        import dataclasses

        from distmis.parallel.mesh import TrialMesh

        shape = (layout.dp, layout.sp, layout.pp)
        if shape not in self.meshes:
            self.meshes[shape] = TrialMesh.build(layout)
        return dataclasses.replace(self.meshes[shape], layout=layout)

    def next_epoch(self) -> tuple[Metrics, Files | None] | None:
        """Train the trial's next epoch: its metrics and this rank's part of its checkpoint (None when it has
        none); None after the last."""
        if self._epochs is None:
            raise RuntimeError("no trial started on this worker")
        try:
            metrics, folder = next(self._epochs)
        except StopIteration:
            self.finish_trial()
            return None
        return metrics, (folder_files(folder) if folder is not None else None)

    def finish_trial(self) -> None:
        if self._epochs is not None:
            self._epochs.close()  # its temporary folders go
            self._epochs = None
        if self._resume_dir is not None:
            self._resume_dir.cleanup()
            self._resume_dir = None


class WorkerGroup:
    """``layout.world_size`` :class:`GroupWorker` actors of ``framework`` in one placement group, joined once."""

    def __init__(self, layout: TrialLayout, name: str, framework: Framework = "tensorflow") -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.layout = layout
        self.name = name
        self.framework = framework
        resources = {key: value for key, value in layout.worker_resources.items() if value}
        self.placement_group = placement_group([dict(resources)] * layout.world_size, strategy="PACK", name=name)
        self.workers: list = []
        try:
            ray.get(self.placement_group.ready())
            actor = ray.remote(GroupWorker)
            self.workers = [
                actor.options(
                    num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0),
                    resources={k: v for k, v in resources.items() if k not in ("CPU", "GPU")},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, rank),
                ).remote(rank, framework, layout.cpu)
                for rank in range(layout.world_size)
            ]
            addresses = ray.get([worker.address.remote() for worker in self.workers])
            joined = ray.get([worker.join.remote(addresses, layout) for worker in self.workers])
        except BaseException:  # a worker that cannot start or join (a GPU torch cannot see): nothing is kept
            self.shutdown()
            raise
        if any(n != layout.world_size for n in joined):
            self.shutdown()
            what = "MultiWorkerMirroredStrategy replicas" if framework == "tensorflow" else "process group ranks"
            raise RuntimeError(f"the trial's layout has {layout.world_size} rank(s) ({layout.describe()}), but the "
                               f"group's workers count {joined} {what}")

    def fits(self, layout: TrialLayout, framework: Framework) -> bool:
        """Whether the group serves a trial of ``layout`` in ``framework``: the same ranks and resources (a torch
        trial's mesh, its degrees, is made per layout)."""
        return (framework, layout.world_size, layout.worker_resources, layout.cpu) == (
            self.framework, self.layout.world_size, self.layout.worker_resources, self.layout.cpu)

    def epochs(self, spec: Spec, layout: TrialLayout, tfrecord_dir: str, checkpoints: Sequence[Files],
               submitted_at: float, scratch: str | None = None) -> Iterator[tuple[Metrics, Files | None]]:
        """Run a trial on the group, one epoch per step: rank 0's metrics (with every rank's system samples) and
        the epoch's checkpoint files (every rank's, merged; None for an epoch without one). Any error (a worker's
        exception or death) shuts the group down before it is raised. ``scratch``: the trial's working folder, where
        each worker keeps its scratch files (:meth:`start_trial`)."""
        from distmis.trial.record import with_every_rank_records

        try:
            _all([worker.start_trial.remote(spec, layout, tfrecord_dir, checkpoints, submitted_at, scratch)
                  for worker in self.workers])
            while True:
                results = _all([worker.next_epoch.remote() for worker in self.workers])
                if results[0] is None:
                    return
                yield with_every_rank_records([metrics for metrics, _ in results]), merged_files(results)
        except GeneratorExit:  # the trial stopped early (Tune's scheduler, an interruption): the workers idle
            try:
                _all([worker.finish_trial.remote() for worker in self.workers])
            except Exception:  # noqa: BLE001 - its workers were taken back as it stopped (an auto search's pool)
                logger.debug("group %s: its workers are gone", self.name, exc_info=True)
                self.shutdown()
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


def _all(refs: list) -> list:
    """The results of the ranks' calls, in rank order; the first error raised as soon as any rank fails (a rank
    whose peer died may otherwise wait in a collective until the process group's timeout)."""
    import ray

    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done)  # raises a rank's exception, or its death
    return ray.get(refs)


# --------------------------------------------------------------------------- one group per search, per process
_GROUP: WorkerGroup | None = None


def group_for(layout: TrialLayout, search: str, framework: Framework = "tensorflow") -> WorkerGroup:
    """The worker group of this (reused) Tune trial process for ``layout``: the one kept from the search's
    previous trial, or a new one (a group that does not fit ``layout`` is shut down first).

    ``search``: a name unique to the search. Groups of the same search that another process left behind (a Tune
    actor that was not reused) are removed first: a data-mode search runs one trial at a time, so they are stale,
    and they would hold the CPUs the new group needs.
    """
    global _GROUP
    if _GROUP is not None and _GROUP.workers and _GROUP.fits(layout, framework):
        return _GROUP
    if _GROUP is not None:
        _GROUP.shutdown()
        _GROUP = None
    release_groups(search)
    _GROUP = WorkerGroup(layout, f"{GROUP_NAME_PREFIX}{search}-{uuid.uuid4().hex[:8]}", framework)
    return _GROUP


def release_groups(search: str) -> list[str]:
    """Remove the placement groups of ``search``'s worker groups still alive (their workers die with them);
    their names. Called by a trial before it starts a group and by the driver after the search."""
    return _remove_groups(lambda name: name.startswith(f"{GROUP_NAME_PREFIX}{search}-"))


def remove_named_groups(names: Sequence[str]) -> list[str]:
    """Remove the worker groups named ``names`` that are still alive (their placement groups; their workers die with
    them); the names removed. What an auto search's pool takes back (:class:`~distmis.perf.pool.WorkerPool`)."""
    wanted = set(names)
    return _remove_groups(lambda name: name in wanted)


def _remove_groups(chosen: Callable[[str], bool]) -> list[str]:
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group
    from ray._raylet import PlacementGroupID

    removed = []
    for group_id, info in placement_group_table().items():
        name = info.get("name") or ""
        if chosen(name) and info.get("state") != "REMOVED":
            remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(group_id)))
            removed.append(name)
    return removed
