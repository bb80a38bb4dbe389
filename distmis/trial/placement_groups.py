"""Give back the CPUs of a Ray Train worker group that died while it started (a gap in Ray Train 2.60).

Ray Train loses a worker group whose worker dies after the group's state is built and before
``WorkerGroup.create`` returns: in the backend set-up (the gloo / NCCL process group) or while the train function
is launched (a worker loop that exits at once). ``WorkerGroup._start`` skips its clean-up because the group counts
as started, and the controller never receives the group to shut it down. Its placement group was created by the
(non-detached) ``TrainController`` actor, so Ray removes it only when the job, the distmis driver, ends: until
then it holds its CPUs and the search's later trials wait for them forever.

:func:`release_train_placement_groups` runs after every data-parallel trial's ``fit``. The public placement-group
table does not say which actor created a group, so it reads Ray's own tables (``ray._private.state``; checked by
``tests/search/test_worker_startup_failure.py`` on each Ray upgrade).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def release_train_placement_groups() -> list[str]:
    """Remove the placement groups left by the Ray Train runs this process started; their ids (hex).

    Only groups whose creator is a ``TrainController`` actor owned by this very process (this trial's Tune actor)
    are removed: other trials' groups are never touched. Best effort: it never raises.
    """
    try:
        import ray
        from ray._private.state import state
        from ray._raylet import PlacementGroupID
        from ray.core.generated import gcs_pb2
        from ray.util.placement_group import PlacementGroup, remove_placement_group

        context = ray.get_runtime_context()
        me = bytes.fromhex(context.get_worker_id())
        accessor = state._connect_and_get_accessor()
        controllers = set()
        for raw in accessor.get_actor_table(ray.JobID.from_hex(context.get_job_id()), None):
            actor = gcs_pb2.ActorTableData.FromString(raw)
            if actor.class_name == "TrainController" and actor.owner_address.worker_id == me:
                controllers.add(actor.actor_id)
        removed: list[str] = []
        for raw in accessor.get_placement_group_table() if controllers else ():
            group = gcs_pb2.PlacementGroupTableData.FromString(raw)
            if group.creator_actor_id in controllers and group.state != gcs_pb2.PlacementGroupTableData.REMOVED:
                remove_placement_group(PlacementGroup(PlacementGroupID(group.placement_group_id)))
                removed.append(group.placement_group_id.hex())
        if removed:
            logger.warning("removed %d placement group(s) left by a Ray Train worker group that died while it "
                           "started: %s", len(removed), ", ".join(removed))
        return removed
    except Exception:  # noqa: BLE001 - a clean-up must not hide the trial's own error
        logger.warning("could not look for placement groups left by this trial's Ray Train run", exc_info=True)
        return []
