"""What a search checks before any work: nothing converted, no Ray started, nothing written when one fails.

:func:`preflight` runs first in ``distmis run`` (and ``compare``): the output folder's state (a resume must
find its search, its data and its store as they were; a plain run must not replace an unfinished search), that
it can be written in (whatever the store: the converted data and Ray's results go there), the data set's path and
tiles, every training step against ``parallelism.memory_per_worker`` where it is set, and the tracking store, asked
once with a short timeout. Every refusal is exit 2.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from distmis.search.output import tracking_location
from distmis.search.input_fit import check_dataset_path
from distmis.search.memory_fit import check_trials_fit
from distmis.search.prepare import dataset_files
from distmis.search.state import (
    Kind, SearchState, SearchStateError, check_resume_matches, refuse_unfinished, state_to_resume,
)
from distmis.spec.schema import Spec
from distmis.tracking.store import check_store


def preflight(spec: Spec, output_dir: Path, kind: Kind, *, resume: bool) -> SearchState | None:
    """The state a resume continues (None for a new search), once everything a search needs is known to be there.

    Raises SpecError, DataError, SearchStateError or StoreUnreachable, naming the culprit."""
    if resume:
        state: SearchState | None = state_to_resume(spec, output_dir, kind)
    else:
        refuse_unfinished(output_dir)
        state = None
    check_output_writable(output_dir)  # needed whatever the store: the converted data and Ray's results go there
    check_dataset_path(spec)
    check_trials_fit(spec)
    uri, _ = tracking_location(spec, output_dir)
    if state is not None:
        check_resume_matches(state, dataset=dataset_files(spec), tracking_store=uri, output_dir=output_dir)
    check_store(uri)
    return state


class OutputUnwritable(SearchStateError):
    """The output folder cannot be made or written in (exit 2, before anything starts)."""


def check_output_writable(output_dir: Path) -> None:
    """OutputUnwritable, naming the folder and the system's reason, unless ``output_dir`` (or, while it does not
    exist, the nearest folder on the way to it, where it would be made) takes a new file: a probe file is written
    and deleted there, so a read-only disk, a missing permission (which root's bypass makes the only true test) and
    a full disk are all found. Nothing stays behind."""
    folder = Path(output_dir).absolute()
    existing = folder
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    where = "" if existing == folder else f" (it would be made in {str(existing)!r})"
    if not existing.is_dir():
        raise OutputUnwritable(f"the output folder {str(folder)!r} cannot be made: {str(existing)!r} is not a "
                               "folder. Nothing was started: choose another --output")
    try:
        handle, probe = tempfile.mkstemp(prefix=".distmis-probe-", dir=existing)
        try:
            os.write(handle, b"distmis\n")
        finally:
            os.close(handle)
            os.unlink(probe)
    except OSError as exc:
        raise OutputUnwritable(f"the output folder {str(folder)!r} cannot be written in{where}: "
                               f"{exc.strerror or exc}. Nothing was started: choose an --output this user can "
                               "write in, on a disk with free space") from None


def new_state(kind: Kind, spec: Spec, output_dir: Path, run_id: str) -> SearchState:
    """The state of a search just started (its data prepared): what a resume will have to find again."""
    uri, _ = tracking_location(spec, output_dir)
    return SearchState.start(kind, spec, run_id, dataset=dataset_files(spec), tracking_store=uri)
