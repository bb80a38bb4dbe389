"""The checkpoints of a single-process trial (a Tune function trainable): which one a restarted trial goes on
from, and the older ones emptied as training goes.

Tune saves its experiment state (among it, each trial's latest checkpoint) every few seconds. After the driver
was killed, that state may name a checkpoint some epochs old, and with ``CheckpointConfig(num_to_keep=...)``
Tune may already have deleted it, so the restore fails ("does not exist on storage anymore"). Instead, Tune keeps
every checkpoint folder (``num_to_keep=None``) and the trial itself empties those older than its last
:data:`KEEP` (:func:`prune_older`; a marker file stays, so a folder Tune's state names still exists). A restarted
trial then goes on from the newest folder holding a complete state (:func:`resume_candidates`), whichever one
Tune names. Data-parallel trials need none of this: Ray Train saves its own state before it deletes a checkpoint.

Works on any storage Ray Tune writes to (local or a pyarrow filesystem such as S3).
"""

from __future__ import annotations

import logging
import posixpath
from typing import Any

from distmis.train.checkpoint import RESUME_DIR, STATE_FILE

logger = logging.getLogger(__name__)

KEEP = 2  # complete checkpoints kept per trial: the newest may be mid-upload when a process dies
PRUNED_MARKER = "PRUNED"  # left in an emptied checkpoint folder


def _checkpoint_folders(checkpoint: Any) -> list[str]:
    """The trial's checkpoint folders (``checkpoint_000012``, ...), newest first."""
    from pyarrow.fs import FileSelector, FileType

    parent = posixpath.dirname(checkpoint.path.rstrip("/"))
    infos = checkpoint.filesystem.get_file_info(FileSelector(parent))
    folders = [info.path for info in infos
               if info.type == FileType.Directory and posixpath.basename(info.path).startswith("checkpoint_")]
    return sorted(folders, reverse=True)


def _has_state(filesystem: Any, folder: str) -> bool:
    from pyarrow.fs import FileType

    return filesystem.get_file_info(posixpath.join(folder, RESUME_DIR, STATE_FILE)).type == FileType.File


def resume_candidates(checkpoint: Any | None, trial_folder: tuple[Any, str] | None = None) -> list[Any]:
    """The checkpoints a restarted trial may go on from, newest first: every folder of the trial that holds a
    training state (the newest may be incomplete, if the process died while saving it: try them in order).

    ``checkpoint``: the one Tune names (None: it knows none). ``trial_folder``: ``(filesystem, path)`` of the trial's
    folder on storage, looked in when Tune names none (its saved state may predate the trial's first checkpoint).
    """
    from ray import tune

    if checkpoint is None:
        if trial_folder is None:
            return []
        filesystem, path = trial_folder
        probe = tune.Checkpoint(posixpath.join(path, "checkpoint_000000"), filesystem=filesystem)  # names the folder
    else:
        filesystem, probe = checkpoint.filesystem, checkpoint
    try:
        folders = _checkpoint_folders(probe)
    except OSError:  # the storage cannot be listed: use what Tune gave
        return [checkpoint] if checkpoint is not None else []
    found = [tune.Checkpoint(path, filesystem=filesystem) for path in folders if _has_state(filesystem, path)]
    return found or ([checkpoint] if checkpoint is not None else [])


def trial_folder() -> tuple[Any, str] | None:
    """This Tune trial's folder on storage, as ``(pyarrow filesystem, path)``; None when it cannot be told.

    Ray's public context gives only the trial's local working folder, so this reads the session's storage context.
    """
    try:
        from ray.train._internal.session import get_session

        storage = get_session().storage
        return storage.storage_filesystem, storage.trial_fs_path
    except Exception:  # noqa: BLE001 - not in a Tune session, or Ray moved it: Tune's own checkpoint still works
        return None


def prune_older(checkpoint: Any, keep: int = KEEP) -> None:
    """Empty the trial's checkpoint folders older than its ``keep`` newest complete ones (``checkpoint``: the one
    just reported). A failure here is logged: disk space is not worth a trial."""
    try:
        filesystem = checkpoint.filesystem
        complete = 0
        for folder in _checkpoint_folders(checkpoint):
            if complete < keep:
                complete += _has_state(filesystem, folder)
                continue
            if not _has_state(filesystem, folder):
                continue  # emptied already (or never complete)
            filesystem.delete_dir_contents(folder)
            with filesystem.open_output_stream(posixpath.join(folder, PRUNED_MARKER)) as stream:
                stream.write(b"emptied by distmis: a newer checkpoint of this trial holds its state\n")
    except OSError:
        logger.warning("could not empty the older checkpoints of %s", checkpoint.path, exc_info=True)
