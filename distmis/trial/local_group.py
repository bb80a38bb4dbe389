"""A worker group of one, in the trial's own process: how an ``auto`` search's trial trains while the pool gives it a
single CPU worker.

A :class:`~distmis.trial.worker_group.WorkerGroup` of one worker is a second process beside the trial's Tune actor:
started cold (its imports, its framework's set-up), and handing each epoch's checkpoint to the trial as bytes. An
experiment-mode trial has neither cost: it trains in its Tune actor. :class:`LocalGroup` gives an auto trial the same:
it reserves the worker (a placement group of one bundle, named as the pool named the group, pinned to this node, so
that the pool's accounting and its taking back of groups stay as they are) and trains in this process, on a
:class:`~distmis.trial.worker_group.GroupWorker` that the process keeps from one trial to the next (its imports,
thread pools and TensorFlow's traced trainers: warm as an experiment-mode actor's). A trial the pool grows leaves its
local group for a :class:`~distmis.trial.worker_group.WorkerGroup` of the new size, from the same checkpoint.

Only for CPU workers: the Tune actor holds no GPU, so a GPU worker always gets a process of its own.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterator, Sequence

from distmis.spec.layout import TrialLayout
from distmis.spec.schema import Spec
from distmis.trial.worker_group import Files, Framework, GroupWorker, WorkerGroup

if TYPE_CHECKING:
    from distmis.parallel.mesh import TrialMesh
    from distmis.train.loop import Metrics

logger = logging.getLogger(__name__)

__all__ = ["LocalGroup", "serves_locally", "LOCAL_WAIT_SECONDS"]

#: How long a local group waits for its worker on this node before the trial takes a group of its own process
#: instead (the pool's free worker may be on another node).
LOCAL_WAIT_SECONDS = 10.0


def serves_locally(layout: TrialLayout) -> bool:
    """Whether a trial of ``layout`` can train in its own process: one rank, on CPUs only."""
    return layout.world_size == 1 and not layout.gpu


class LocalWorker(GroupWorker):
    """The group worker of this process: no collectives to join, a torch trial's mesh one process's."""

    def _mesh(self, layout: TrialLayout) -> TrialMesh:
        from distmis.parallel.mesh import TrialMesh

        return TrialMesh.local(layout)


#: This process's worker, kept from one local group to the next (None until the first, or after one failed).
_WORKER: LocalWorker | None = None


def _process_worker(framework: Framework, cpus: float) -> LocalWorker:
    global _WORKER
    if _WORKER is None or (_WORKER.framework, _WORKER.cpus) != (framework, cpus):
        _WORKER = LocalWorker(0, framework, cpus)
    return _WORKER


def _forget_worker() -> None:
    global _WORKER
    _WORKER = None


class LocalGroup:
    """A one-worker group of ``layout`` (one rank, CPUs only: :func:`serves_locally`) in this process, its worker
    reserved by a placement group named ``name`` on this node. TimeoutError when this node has no such worker free
    within ``wait`` seconds (nothing is left reserved). The same calls as a
    :class:`~distmis.trial.worker_group.WorkerGroup`'s."""

    def __init__(self, layout: TrialLayout, name: str, framework: Framework = "tensorflow", *,
                 wait: float = LOCAL_WAIT_SECONDS) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        if not serves_locally(layout):
            raise ValueError(f"a local group serves one CPU rank, not {layout.describe()}")
        self.layout = layout
        self.name = name
        self.framework = framework
        bundle = {key: value for key, value in layout.worker_resources.items() if value}
        bundle[f"node:{ray.util.get_node_ip_address()}"] = 0.001  # this node's: the worker is this process
        self.placement_group = placement_group([bundle], strategy="PACK", name=name)
        ready, _ = ray.wait([self.placement_group.ready()], timeout=wait)
        if not ready:
            remove_placement_group(self.placement_group)
            raise TimeoutError(f"no {layout.describe()} free on this node within {wait:g} s")
        self.workers: list[GroupWorker] = [_process_worker(framework, layout.cpu)]

    fits = WorkerGroup.fits  # the same ranks and resources, from the same attributes

    def epochs(self, spec: Spec, layout: TrialLayout, tfrecord_dir: str, checkpoints: Sequence[Files],
               submitted_at: float, scratch: str | None = None) -> Iterator[tuple[Metrics, Files | None]]:
        """The trial's epochs in this process, one per step, with their checkpoint files (as a worker group's). A
        trial stopped between two leaves the worker idle; an error shuts the group down and the process's worker
        is made anew for the next."""
        from distmis.trial.record import with_every_rank_records

        if not self.workers:
            raise RuntimeError(f"local group {self.name} was shut down")
        worker = self.workers[0]
        try:
            worker.start_trial(spec, layout, tfrecord_dir, checkpoints, submitted_at, scratch)
            while (result := worker.next_epoch()) is not None:
                metrics, files = result
                yield with_every_rank_records([metrics]), files
        except GeneratorExit:
            worker.finish_trial()
            raise
        except BaseException:
            _forget_worker()  # a trainer that failed is not restarted for another trial
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Give the worker back (its placement group removed; best effort). The process's worker stays, idle, for
        the next local group."""
        from ray.util.placement_group import remove_placement_group

        for worker in self.workers:
            worker.finish_trial()
        self.workers = []
        try:
            remove_placement_group(self.placement_group)
        except Exception:  # noqa: BLE001 - already removed (the pool took it back)
            logger.debug("placement group %s already removed", self.name, exc_info=True)
