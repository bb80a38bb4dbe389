"""A single-process trial's checkpoint folders on storage: older ones emptied, the newest complete one found."""

from __future__ import annotations

from pathlib import Path

from ray import tune

from distmis.search.trial_checkpoints import PRUNED_MARKER, prune_older, resume_candidates
from distmis.train.checkpoint import RESUME_DIR, STATE_FILE


def make_checkpoint(trial_dir: Path, index: int, complete: bool = True) -> tune.Checkpoint:
    folder = trial_dir / f"checkpoint_{index:06d}"
    (folder / RESUME_DIR).mkdir(parents=True)
    (folder / "model.pt").write_bytes(b"weights")
    if complete:
        (folder / RESUME_DIR / STATE_FILE).write_text(f'{{"epoch": {index + 1}}}')
    return tune.Checkpoint(str(folder))


def test_older_folders_are_emptied_but_stay(tmp_path: Path):
    checkpoints = [make_checkpoint(tmp_path, i) for i in range(5)]
    (tmp_path / "result.json").write_text("{}")  # not a checkpoint: left alone
    prune_older(checkpoints[-1], keep=2)
    for i in range(3):
        folder = tmp_path / f"checkpoint_{i:06d}"
        assert folder.is_dir() and [p.name for p in folder.iterdir()] == [PRUNED_MARKER]
    for i in (3, 4):
        assert (tmp_path / f"checkpoint_{i:06d}" / "model.pt").is_file()
    assert (tmp_path / "result.json").is_file()


def test_a_restart_goes_on_from_the_newest_complete_folder_whichever_tune_names(tmp_path: Path):
    checkpoints = [make_checkpoint(tmp_path, i) for i in range(4)]
    make_checkpoint(tmp_path, 4, complete=False)  # the process died while saving it
    prune_older(checkpoints[3], keep=2)
    named_by_tune = checkpoints[0]  # Tune's saved state was older: it names an emptied folder
    found = [Path(c.path).name for c in resume_candidates(named_by_tune)]
    assert found == ["checkpoint_000003", "checkpoint_000002"]
    assert resume_candidates(None) == []
    # Tune's saved state predates the trial's first checkpoint: the trial's folder is looked in.
    from pyarrow.fs import LocalFileSystem

    found = [Path(c.path).name for c in resume_candidates(None, (LocalFileSystem(), str(tmp_path)))]
    assert found == ["checkpoint_000003", "checkpoint_000002"]
    assert resume_candidates(None, (LocalFileSystem(), str(tmp_path / "nothing-here"))) == []
