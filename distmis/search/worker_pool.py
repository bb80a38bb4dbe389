"""The worker pool of a ``parallelism.mode: auto`` search as a Ray actor: started, found and ended by the driver,
which also gives back the workers of a trial Tune ended (finished, stopped, failed, or its process killed). The pool
names the search's worker groups (so that the driver's end of the search removes them all) and removes the placement
groups it takes back (:func:`~distmis.trial.worker_group.remove_named_groups`).

The rule it runs (each trial's share, growth onto idle workers) is :class:`distmis.perf.pool.WorkerPool`; the trials
reach the actor by its name (:func:`distmis.trial.auto_trial.find_pool`).
"""

from __future__ import annotations

from typing import Any, Iterable

from distmis.perf.pool import POOL_NAMESPACE, WorkerPool, pool_name

__all__ = ["start_pool", "stop_pool", "pool_callback"]


def start_pool(experiment: str, workers: int, trials: int, *, begun: Iterable[str] = ()) -> Any:
    """Start the pool of a search as a Ray actor of no resources, named :func:`pool_name`; its methods are
    :class:`WorkerPool`'s. The driver owns it and must hold the handle returned for as long as the search runs (Ray
    ends an actor whose every handle is gone)."""
    import ray

    name = pool_name(experiment)
    try:  # the pool of an earlier run of this driver (a comparison's cells, the tests): a fresh one
        ray.kill(ray.get_actor(name, namespace=POOL_NAMESPACE))
    except ValueError:
        pass
    from distmis.trial.trainables import GROUP_NAME_PREFIX, remove_named_groups

    actor = ray.remote(num_cpus=0)(WorkerPool).options(name=name, namespace=POOL_NAMESPACE, max_concurrency=1)
    pool = actor.remote(workers, trials, begun=sorted(begun), group_prefix=f"{GROUP_NAME_PREFIX}{experiment}-",
                        remove_groups=remove_named_groups)
    ray.get(pool.__ray_ready__.remote())  # named and running before any trial looks for it
    return pool


def stop_pool(experiment: str) -> None:
    """End the search's pool (best effort: it never raises)."""
    import ray

    try:
        ray.kill(ray.get_actor(pool_name(experiment), namespace=POOL_NAMESPACE))
    except Exception:  # noqa: BLE001 - gone already
        pass


def pool_callback(experiment: str) -> Any:
    """A Tune callback (driver side) that tells the pool of every trial Tune ends: finished or stopped by the
    scheduler (its process lives on, and may keep its group for its next trial:
    :func:`~distmis.trial.auto_trial.ended_trial`), or failed, its process killed perhaps, which runs no clean-up of
    its own (its workers back and its groups removed before Tune retries it:
    :func:`~distmis.trial.auto_trial.release_trial`)."""
    from ray import tune

    from distmis.trial.trainables import ended_trial, release_trial

    class ReleaseEndedTrials(tune.Callback):
        def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            ended_trial(experiment, trial.trial_id)

        def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            release_trial(experiment, trial.trial_id)

        def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            release_trial(experiment, trial.trial_id)  # failed, to be retried: it asks for workers again

    return ReleaseEndedTrials()
