"""The checkpoints of a single-process trial (a Tune function trainable): where each epoch's goes, which one a
restarted trial goes on from, which one the search evaluates, and the older ones emptied as training goes.

Tune saves its experiment state (among it, each trial's latest checkpoint) every few seconds. After the driver
was killed, that state may name a checkpoint some epochs old, and with ``CheckpointConfig(num_to_keep=...)``
Tune may already have deleted it, so the restore fails ("does not exist on storage anymore"). Instead:

- Tune keeps every checkpoint folder (``num_to_keep=None``) and the trial itself empties those older than its
  last :data:`KEEP` (:func:`prune_older`; a marker file stays, so a folder Tune's state names still exists).
- Folders are ranked by the epoch they hold (``resume/state.json``), never by their names: Tune numbers a
  restored trial's new checkpoints from the index its (older) saved state knew, so names alone would say an
  emptied folder is newer than the one just written.
- Each epoch's checkpoint goes to a folder named after its epoch (:func:`name_by_epoch`:
  ``checkpoint_000007`` holds epoch 7), so a resumed trial never writes into a folder that holds a newer state.
- A restarted trial goes on from the newest complete folder (:func:`resume_candidates`), and the search
  evaluates the newest complete one (:func:`newest_complete`), whichever one Tune names.

Data-parallel trials need none of this: Ray Train saves its own state before it deletes a checkpoint.

Works on any storage Ray Tune writes to (local or a pyarrow filesystem such as S3).
"""

from __future__ import annotations

import logging
import posixpath
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distmis.trial.record import CHECKPOINT_PREFIX, complete_folders

if TYPE_CHECKING:
    from distmis.train.loop import Metrics
    from distmis.trial.worker_group import Files

logger = logging.getLogger(__name__)

KEEP = 2  # complete checkpoints kept per trial: the newest may be mid-upload when a process dies
PRUNED_MARKER = "PRUNED"  # left in an emptied checkpoint folder


def _parent(checkpoint: Any) -> str:
    return posixpath.dirname(checkpoint.path.rstrip("/"))


def resume_candidates(checkpoint: Any | None, trial_folder: tuple[Any, str] | None = None) -> list[Any]:
    """The checkpoints a restarted trial may go on from, the newest epoch first: every folder of the trial that
    holds a training state (the newest may be incomplete, if the process died while saving it: try them in order).

    ``checkpoint``: the one Tune names (None: it knows none). ``trial_folder``: ``(filesystem, path)`` of the trial's
    folder on storage, looked in when Tune names none (its saved state may predate the trial's first checkpoint).
    """
    from ray import tune

    if checkpoint is not None:
        filesystem, parent = checkpoint.filesystem, _parent(checkpoint)
    elif trial_folder is not None:
        filesystem, parent = trial_folder
    else:
        return []
    try:
        found = [tune.Checkpoint(folder, filesystem=filesystem) for _, folder in complete_folders(filesystem, parent)]
    except OSError:  # the storage cannot be listed: use what Tune gave
        return [checkpoint] if checkpoint is not None else []
    return found or ([checkpoint] if checkpoint is not None else [])


def exploit_candidates(checkpoint: Any) -> list[Any]:
    """After a population-based-training exploit: the donor's checkpoint Tune names (``checkpoint``, the one PBT
    chose) first, then the donor's older complete ones, newest first; if none of those is complete any more (the
    donor trains on and empties its older checkpoints), its newer ones, oldest first: the nearest to PBT's choice."""
    from ray import tune

    filesystem, parent = checkpoint.filesystem, _parent(checkpoint)
    name = posixpath.basename(checkpoint.path.rstrip("/"))
    chosen = int(name.removeprefix(CHECKPOINT_PREFIX)) if name.removeprefix(CHECKPOINT_PREFIX).isdigit() else None
    try:
        found = complete_folders(filesystem, parent)  # newest first
    except OSError:  # the storage cannot be listed: use what Tune gave
        return [checkpoint]
    at_or_before = [folder for epoch, folder in found if chosen is None or epoch <= chosen]
    after = [folder for epoch, folder in reversed(found) if chosen is not None and epoch > chosen]
    return [tune.Checkpoint(folder, filesystem=filesystem) for folder in at_or_before + after] or [checkpoint]


def newest_complete(checkpoint: Any) -> Any:
    """The trial's checkpoint holding the latest epoch (its best weights so far at the root), whichever one Tune
    names: after a resume, Tune's record of a trial's latest checkpoint may be an older, emptied folder.
    ``checkpoint``: one of the trial's checkpoints, a Ray ``Checkpoint`` or a local path (as Ray Train reports it)."""
    from ray import tune

    if isinstance(checkpoint, (str, Path)):
        checkpoint = tune.Checkpoint(str(checkpoint))
    candidates = resume_candidates(checkpoint)
    return candidates[0] if candidates else checkpoint


def trial_folder() -> tuple[Any, str] | None:
    """This Tune trial's folder on storage, as ``(pyarrow filesystem, path)``; None when it cannot be told.

    Ray's public context gives only the trial's local working folder, so this reads the session's storage context.
    """
    storage = _session_storage()
    return None if storage is None else (storage.storage_filesystem, storage.trial_fs_path)


def trial_working_folder() -> str | None:
    """This Tune trial's working folder on this node (Ray makes it the trial process's working directory, unless
    ``RAY_CHDIR_TO_TRIAL_DIR=0``): where the trial keeps its scratch files (:func:`distmis.train.loop.trial_scratch`),
    so that what a killed trial leaves goes with the trial's folder. None when it cannot be told.

    Ray's public context gives the trial's driver-side folder only (``get_trial_dir``), so this reads the session's
    storage context, as :func:`trial_folder` does."""
    storage = _session_storage()
    try:
        return None if storage is None else str(storage.trial_working_directory)
    except Exception:  # noqa: BLE001 - no trial named yet, or Ray moved it: the system's temporary folder serves
        return None


def _session_storage() -> Any | None:
    try:
        from ray.train._internal.session import get_session

        return get_session().storage
    except Exception:  # noqa: BLE001 - not in a Tune session, or Ray moved it: Tune's own checkpoint still works
        return None


def name_by_epoch(epoch: int) -> None:
    """Make this trial's next reported checkpoint go to ``checkpoint_<epoch>`` (Tune adds one to its index as it
    reports). A folder of that name left by an earlier attempt holds a state this attempt did not go on from
    (it could not be loaded), so it is emptied first: the new checkpoint never mixes with its files.

    Outside a Tune session (or where Ray moved its storage context) Tune's own numbering stays; the folders are
    still ranked by the epochs they hold.
    """
    storage = _session_storage()
    if storage is None or not hasattr(storage, "current_checkpoint_index"):
        return
    storage.current_checkpoint_index = epoch - 1
    folder = posixpath.join(storage.trial_fs_path, f"{CHECKPOINT_PREFIX}{epoch:06d}")
    try:
        from pyarrow.fs import FileType

        if storage.storage_filesystem.get_file_info(folder).type == FileType.Directory:
            storage.storage_filesystem.delete_dir_contents(folder)
    except OSError:
        logger.warning("could not empty %s before writing epoch %d's checkpoint there", folder, epoch, exc_info=True)


def prune_older(checkpoint: Any, keep: int = KEEP) -> None:
    """Empty the trial's complete checkpoint folders but its ``keep`` newest by the epoch they hold
    (``checkpoint``: the one just reported, never emptied). A failure here is logged: disk space is not worth a
    trial."""
    try:
        filesystem = checkpoint.filesystem
        reported = checkpoint.path.rstrip("/")
        kept = 0
        for _, folder in complete_folders(filesystem, _parent(checkpoint)):
            if folder.rstrip("/") == reported or kept < keep:
                kept += 1
                continue
            _empty(filesystem, folder, b"emptied by distmis: a newer checkpoint of this trial holds its state\n")
    except OSError:
        logger.warning("could not empty the older checkpoints of %s", checkpoint.path, exc_info=True)


def _empty(filesystem: Any, folder: str, why: bytes) -> None:
    """Empty one of distmis's checkpoint folders, leaving ``why`` in its :data:`PRUNED_MARKER`."""
    filesystem.delete_dir_contents(folder)
    with filesystem.open_output_stream(posixpath.join(folder, PRUNED_MARKER)) as stream:
        stream.write(why)


def leave_own_line(checkpoint: Any | None, trial_folder: tuple[Any, str] | None) -> bool:
    """Population-based training: a trial Tune restarts from another trial's checkpoint (``checkpoint``, in that
    trial's folder) goes on from there, so its own complete checkpoints are emptied: neither a later restart nor the
    search's end may take one of them (their epochs may be newer) for its newest. Whether it was such a restart."""
    if checkpoint is None or trial_folder is None:
        return False
    filesystem, own = trial_folder
    if _parent(checkpoint).rstrip("/") == own.rstrip("/"):
        return False
    try:
        for _, folder in complete_folders(filesystem, own):
            _empty(filesystem, folder, b"emptied by distmis: the trial went on from another trial's checkpoint\n")
    except OSError:
        logger.warning("could not empty the checkpoints of %s", own, exc_info=True)
    return True


def resume_files() -> list[Files]:
    """This restarted Tune trial's checkpoints (:func:`resume_candidates`, newest first), each as its files, for a
    worker group whose ranks may be on other nodes (none for a trial that starts afresh)."""
    from ray import tune

    from distmis.trial.worker_group import folder_files

    files = []
    for checkpoint in resume_candidates(tune.get_checkpoint(), trial_folder()):
        with checkpoint.as_directory() as folder:
            files.append(folder_files(folder))
    return files


def report_epoch(metrics: Metrics, files: Files | None, scratch: str | None) -> None:
    """Report one epoch of a worker group to Tune, with the checkpoint its ranks wrote (``files``: none, for an
    epoch without one), written to a temporary folder in ``scratch`` for Tune to persist as ``checkpoint_<epoch>``;
    the trial's older checkpoints are emptied after it."""
    from ray import tune

    from distmis.trial.worker_group import write_files

    if files is None:
        tune.report(metrics)
        return
    name_by_epoch(int(metrics["epoch"]))
    with tempfile.TemporaryDirectory(prefix="distmis-checkpoint-", dir=scratch) as tmp:
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(str(write_files(files, tmp))))
    prune_older(tune.get_checkpoint())  # the one just persisted
