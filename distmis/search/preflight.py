"""What a search checks before any work: nothing converted, no Ray started, nothing written when one fails.

:func:`preflight` runs first in ``distmis run`` (and ``compare``): the output folder's state (a resume must
find its search, its data and its store as they were; a plain run must not replace an unfinished search), the
data set's path and tiles, and the tracking store, asked once with a short timeout. Every refusal is exit 2.
"""

from __future__ import annotations

from pathlib import Path

from distmis.search.execute import tracking_location
from distmis.search.prepare import check_dataset_path, dataset_files
from distmis.search.state import Kind, SearchState, check_resume_matches, refuse_unfinished, state_to_resume
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
    check_dataset_path(spec)
    uri, _ = tracking_location(spec, output_dir)
    if state is not None:
        check_resume_matches(state, dataset=dataset_files(spec), tracking_store=uri, output_dir=output_dir)
    check_store(uri)
    return state


def new_state(kind: Kind, spec: Spec, output_dir: Path, run_id: str) -> SearchState:
    """The state of a search just started (its data prepared): what a resume will have to find again."""
    uri, _ = tracking_location(spec, output_dir)
    return SearchState.start(kind, spec, run_id, dataset=dataset_files(spec), tracking_store=uri)
