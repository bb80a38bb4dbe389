"""Where a search stands, kept beside its output so that ``distmis run SPEC --resume`` can continue it.

``OUTPUT/search_state.json`` (written by distmis, replaced atomically) names the search's MLflow run, its Ray
Tune experiment folder and, for a comparison, the cells already done and the one under way. The spec it was
started with is kept too: a resume continues the same search, so a changed spec is refused, naming the fields.

Its status says how the search last stopped: ``running`` (still running, or killed before it could say more),
``interrupted`` (Ctrl-C, SIGTERM), ``failed`` (Ray Tune itself stopped the search, or the driver raised),
``trials_failed`` (every trial ended, some of them failed: ``--resume`` runs those again) or ``finished`` (every
trial finished: nothing to resume). All but ``finished`` are continued by ``--resume``, and a plain run into the
folder is refused rather than replace them.

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
Status = Literal["running", "finished", "interrupted", "failed", "trials_failed"]


class NothingToResume(Exception):
    """``--resume`` found a search whose every trial finished: there is nothing left to run."""


class SearchStateError(ValueError):
    """An output folder's search state forbids what was asked (exit 2, before anything starts): a plain run into an
    unfinished search, a resume onto changed data or another tracking store, a state file that cannot be read."""


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
    cells: list[dict[str, Any]] = field(default_factory=list)  # compare: the rows of the cells done (mode,
    # workers, repeat: a cell saved without a repeat is repeat 1)
    current: dict[str, Any] | None = None  # compare: the cell under way: mode, workers, repeat, run_id, experiment
    # What a resume must find as it was (None: a state written before distmis recorded it):
    dataset: dict[str, list[int]] | None = None  # the data set's files: {path: [bytes, mtime_ns]}
    tracking_store: str | None = None  # the tracking URI the search logs to, any password redacted
    failed_trials: list[str] = field(default_factory=list)  # status trials_failed: the trials --resume runs again

    @classmethod
    def start(cls, kind: Kind, spec: Spec, run_id: str, *, dataset: dict[str, list[int]] | None = None,
              tracking_store: str | None = None) -> SearchState:
        return cls(kind=kind, run_id=run_id, spec_digest=spec_digest(spec), spec=_stored_spec(spec),
                   dataset=dataset, tracking_store=redact_uri(tracking_store) if tracking_store else None)

    def save(self, output_dir: str | Path) -> None:
        """Write the state atomically (a reader never sees half a file)."""
        output_dir = Path(output_dir)
        fd, tmp = tempfile.mkstemp(prefix=".search_state.", dir=output_dir)
        with os.fdopen(fd, "w") as handle:
            json.dump(asdict(self), handle, indent=2, default=str)
        os.replace(tmp, output_dir / STATE_FILE)

    @classmethod
    def load(cls, output_dir: str | Path) -> SearchState | None:
        """The state in ``output_dir`` (None: there is none). SearchStateError when the file cannot be read as one."""
        path = Path(output_dir) / STATE_FILE
        if not path.is_file():
            return None
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, UnicodeDecodeError, ValueError, TypeError) as exc:  # cut, edited, or not ours
            raise SearchStateError(
                f"{path} cannot be read as a distmis search state ({type(exc).__name__}: {exc}); nothing was "
                f"started. To start a new search, give another --output (or move {path} away); a search whose "
                "state is lost cannot be resumed") from None


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


def refuse_unfinished(output_dir: str | Path) -> None:
    """A plain run (no ``--resume``) into a folder whose search did not finish, or ended with failed trials, would
    replace its state and lose it: SearchStateError naming ``--resume`` and how to start afresh. The folder of a
    search whose every trial finished may be reused."""
    output_dir = Path(output_dir)
    state = SearchState.load(output_dir)
    if state is None or state.status == "finished":
        return
    if state.status == "trials_failed":
        failed = state.failed_trials
        named = f" ({', '.join(failed[:10])}{', ...' if len(failed) > 10 else ''})" if failed else ""
        raise SearchStateError(
            f"{output_dir} holds a {state.kind} that ended with {len(failed) or 'some'} failed trial(s){named} "
            f"({output_dir / STATE_FILE}); nothing was started. Run them again with the same command and --resume "
            "(the trials that finished are kept), or start afresh with another --output")
    how = {"running": "was stopped without a word (killed) or is still running",
           "interrupted": "was interrupted", "failed": "failed"}.get(state.status, f"is {state.status}")
    raise SearchStateError(
        f"{output_dir} holds a {state.kind} that {how} ({output_dir / STATE_FILE}); nothing was started. Continue it "
        f"with the same command and --resume, or start afresh with another --output")


def check_resume_matches(state: SearchState, *, dataset: dict[str, list[int]], tracking_store: str,
                         output_dir: str | Path) -> None:
    """SearchStateError when the data set's files or the tracking store differ from those the search started with:
    a resumed search would mix two data sets, or log to runs the store does not hold. States written before these
    were recorded are not checked."""
    from distmis.search.prepare import dataset_changes

    where = f"--resume {output_dir}"
    problems = []
    if state.dataset is not None:
        changes = dataset_changes(state.dataset, dataset)
        if changes:
            problems.append(f"dataset.path {state.spec.get('dataset', {}).get('path')!r} changed since the search "
                            f"started: {'; '.join(changes)}")
    store = redact_uri(tracking_store)
    if state.tracking_store is not None and state.tracking_store != store:
        problems.append(f"the tracking store is {store!r} (tracking.uri, else $MLFLOW_TRACKING_URI), but the search "
                        f"logs to {state.tracking_store!r}")
    if problems:
        raise SearchStateError(f"{where}: " + "; ".join(problems) + ". A resumed search keeps the data and the store "
                               "it started with: restore them, or start a new search with another --output")


@contextmanager
def recorded(state: SearchState, output_dir: str | Path) -> Iterator[SearchState]:
    """Keep ``search_state.json`` saying how the work inside went: running, then finished, interrupted or failed
    (raised), or what the work set on the state (failed, trials_failed)."""
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
    if state.status == "running":  # the work may have said otherwise (failed, trials_failed: --resume continues)
        state.status = "finished"
    state.save(output_dir)
