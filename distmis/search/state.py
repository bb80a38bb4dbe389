"""Where a search stands, kept beside its output so that ``distmis run SPEC --resume`` can continue it.

``OUTPUT/search_state.json`` (written by distmis, replaced atomically) names the search's MLflow run, its Ray
Tune experiment folder and, for a comparison, the cells already done and the one under way. The spec it was
started with is kept too: a resume continues the same search, so a changed spec is refused, naming the fields.

The state file holds no secret: the tracking URI is not in it (it comes from the spec) and the spec's own
``tracking.uri`` is stored redacted.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

from distmis.spec.load import SpecError, spec_to_dict
from distmis.spec.schema import Spec
from distmis.tracking.uri import redact_uri

STATE_FILE = "search_state.json"
Kind = Literal["search", "compare"]
Status = Literal["running", "finished", "interrupted", "failed"]


class NothingToResume(Exception):
    """``--resume`` found a search that had finished: there is nothing left to run."""


def spec_digest(spec: Spec) -> str:
    return hashlib.sha256(json.dumps(spec_to_dict(spec), sort_keys=True, default=str).encode()).hexdigest()


def _stored_spec(spec: Spec) -> dict[str, Any]:
    tree = spec_to_dict(spec)
    if tree["tracking"]["uri"]:
        tree["tracking"]["uri"] = redact_uri(tree["tracking"]["uri"])
    return tree


@dataclass
class SearchState:
    kind: Kind
    run_id: str  # the MLflow run of the search (or of the comparison)
    spec_digest: str
    spec: dict[str, Any]
    status: Status = "running"
    experiment: str | None = None  # the Ray Tune experiment folder of the search (of the current cell)
    cells: list[dict[str, Any]] = field(default_factory=list)  # compare: the rows of the cells done
    current: dict[str, Any] | None = None  # compare: the cell under way: mode, workers, run_id

    @classmethod
    def start(cls, kind: Kind, spec: Spec, run_id: str) -> SearchState:
        return cls(kind=kind, run_id=run_id, spec_digest=spec_digest(spec), spec=_stored_spec(spec))

    def save(self, output_dir: str | Path) -> None:
        """Write the state atomically (a reader never sees half a file)."""
        output_dir = Path(output_dir)
        fd, tmp = tempfile.mkstemp(prefix=".search_state.", dir=output_dir)
        with os.fdopen(fd, "w") as handle:
            json.dump(asdict(self), handle, indent=2, default=str)
        os.replace(tmp, output_dir / STATE_FILE)

    @classmethod
    def load(cls, output_dir: str | Path) -> SearchState | None:
        path = Path(output_dir) / STATE_FILE
        if not path.is_file():
            return None
        return cls(**json.loads(path.read_text()))


def _differences(old: Any, new: Any, prefix: str = "") -> list[tuple[str, str]]:
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[tuple[str, str]] = []
        for key in sorted(set(old) | set(new)):
            out += _differences(old.get(key), new.get(key), f"{prefix}{key}.")
        return out
    if old != new:
        return [(prefix.rstrip("."), f"was {old!r} when the search started, now {new!r}")]
    return []


def state_to_resume(spec: Spec, output_dir: str | Path, kind: Kind) -> SearchState:
    """The state of the search ``--resume`` continues in ``output_dir``.

    Raises SpecError when there is none, when it is another kind of search, or when the spec changed since;
    NothingToResume when the search finished.
    """
    output_dir = Path(output_dir)
    state = SearchState.load(output_dir)
    where = f"--resume {output_dir}"
    if state is None:
        raise SpecError(where, [("--output", f"{output_dir / STATE_FILE} does not exist: there is no search to "
                                 "resume there; give the --output of the interrupted search, or run without --resume")])
    if state.kind != kind:
        raise SpecError(where, [("parallelism.mode", f"the search in {output_dir} is a {state.kind}, this spec runs "
                                 f"a {kind}")])
    if state.spec_digest != spec_digest(spec):
        problems = _differences(state.spec, _stored_spec(spec)) or [("tracking.uri", "changed")]
        raise SpecError(where, [(path, f"{message}: a resumed search keeps the spec it started with; run without "
                                 "--resume (and another --output) for a new search") for path, message in problems])
    if state.status == "finished":
        raise NothingToResume(f"the {kind} in {output_dir} finished: nothing to resume (see `distmis results`)")
    return state


@contextmanager
def recorded(state: SearchState, output_dir: str | Path) -> Iterator[SearchState]:
    """Keep ``search_state.json`` saying how the work inside went: running, then finished, interrupted or failed."""
    state.status = "running"
    state.save(output_dir)
    try:
        yield state
    except KeyboardInterrupt:
        state.status = "interrupted"
        state.save(output_dir)
        raise
    except BaseException:
        state.status = "failed"
        state.save(output_dir)
        raise
    state.status = "finished"
    state.save(output_dir)
