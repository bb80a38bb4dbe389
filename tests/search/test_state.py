"""search_state.json: what --resume continues, and what it refuses (before anything starts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distmis.cli.main import main
from distmis.search.state import (
    STATE_FILE, NothingToResume, SearchState, SearchStateError, recorded, refuse_unfinished, state_to_resume,
)
from distmis.spec import SpecError, validate_spec
from tests.conftest import small_spec_tree


def test_a_saved_state_comes_back(tmp_path: Path):
    spec = validate_spec(small_spec_tree(tmp_path / "data"))
    state = SearchState.start("compare", spec, "run123")
    state.cells.append({"mode": "experiment", "workers": 1, "elapsed_s": float("nan"), "status": "FINISHED"})
    state.current = {"mode": "data", "workers": 1, "run_id": "cell1", "experiment": "tiny-data-1w-cell1"}
    state.save(tmp_path)
    loaded = state_to_resume(spec, tmp_path, "compare")
    assert loaded.run_id == "run123" and loaded.current == state.current and loaded.cells[0]["workers"] == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".search_state")] == []  # no temporary left


def test_a_changed_spec_is_refused_naming_the_fields(tmp_path: Path):
    tree = small_spec_tree(tmp_path / "data")
    SearchState.start("search", validate_spec(tree), "run123").save(tmp_path)
    tree["training"]["epochs"] = 7
    with pytest.raises(SpecError) as err:
        state_to_resume(validate_spec(tree), tmp_path, "search")
    assert "training.epochs" in str(err.value) and "was 2" in str(err.value) and "now 7" in str(err.value)


def test_nothing_to_resume(tmp_path: Path):
    spec = validate_spec(small_spec_tree(tmp_path / "data"))
    with pytest.raises(SpecError, match="does not exist"):
        state_to_resume(spec, tmp_path, "search")
    state = SearchState.start("search", spec, "run123")
    state.save(tmp_path)
    with pytest.raises(SpecError, match="is a search, this spec runs a compare"):
        state_to_resume(spec, tmp_path, "compare")
    state.status = "finished"
    state.save(tmp_path)
    with pytest.raises(NothingToResume):
        state_to_resume(spec, tmp_path, "search")


def test_the_state_holds_no_password(tmp_path: Path):
    tree = small_spec_tree(tmp_path / "data")
    tree["tracking"] = {"uri": "postgresql://alice:s3cr3t@db.example/mlflow"}
    SearchState.start("search", validate_spec(tree), "run123").save(tmp_path)
    text = (tmp_path / STATE_FILE).read_text()
    assert "s3cr3t" not in text and "alice" in text


def test_cli_resume_without_a_search_exits_2_and_starts_nothing(tmp_path: Path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps(small_spec_tree(tmp_path / "data")))
    out = tmp_path / "out"
    out.mkdir()
    assert main(["run", str(spec), "--output", str(out), "--resume"]) == 2
    assert "no search to resume" in capsys.readouterr().err
    assert list(out.iterdir()) == [] and not (tmp_path / "data").exists()


def spec_file_and_output(tmp_path: Path) -> tuple[dict, Path, Path]:
    """A small spec's tree, written as ``spec.yaml``, and an empty output folder: (tree, spec file, output)."""
    tree = small_spec_tree(tmp_path / "data")
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps(tree))
    out = tmp_path / "out"
    out.mkdir()
    return tree, spec, out


def test_cli_resume_of_a_finished_search_says_so_and_exits_0(tmp_path: Path, capsys):
    tree, spec, out = spec_file_and_output(tmp_path)
    state = SearchState.start("search", validate_spec(tree), "run123")
    state.status = "finished"
    state.save(out)
    assert main(["run", str(spec), "--output", str(out), "--resume"]) == 0
    assert "finished: nothing to resume" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == [STATE_FILE]  # nothing started


def test_a_search_that_ended_with_failed_trials_is_resumed_not_finished(tmp_path: Path):
    """Issue 46, 2: its state says so (not "finished"), --resume continues it, a plain run is told what to do."""
    spec = validate_spec(small_spec_tree(tmp_path / "data"))
    state = SearchState.start("search", spec, "run123")
    with recorded(state, tmp_path):
        state.status, state.failed_trials = "trials_failed", ["a1b2c_00001"]  # what run_search sets
    assert SearchState.load(tmp_path).status == "trials_failed"
    assert state_to_resume(spec, tmp_path, "search").failed_trials == ["a1b2c_00001"]
    with pytest.raises(SearchStateError) as refused:
        refuse_unfinished(tmp_path)
    message = str(refused.value)
    assert "ended with 1 failed trial(s) (a1b2c_00001)" in message and "--resume" in message
    assert "another --output" in message
    resumed = state_to_resume(spec, tmp_path, "search")
    with recorded(resumed, tmp_path):  # the failed trial finished this time
        resumed.failed_trials = []
    assert SearchState.load(tmp_path).status == "finished"
    with pytest.raises(NothingToResume):
        state_to_resume(spec, tmp_path, "search")
    refuse_unfinished(tmp_path)  # a finished search's folder may be reused


def test_cli_plain_run_into_a_search_with_failed_trials_exits_2_and_starts_nothing(tmp_path: Path, capsys):
    tree, spec, out = spec_file_and_output(tmp_path)
    state = SearchState.start("search", validate_spec(tree), "run123")
    state.status, state.failed_trials = "trials_failed", ["t1", "t2"]
    state.save(out)
    assert main(["run", str(spec), "--output", str(out)]) == 2
    assert "ended with 2 failed trial(s) (t1, t2)" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == [STATE_FILE] and not (tmp_path / "data").exists()
