"""A single-process trial's checkpoint folders on storage: older ones emptied, the newest complete one found."""

from __future__ import annotations

from pathlib import Path

from ray import tune

from distmis.trial.checkpoints import PRUNED_MARKER, newest_complete, prune_older, resume_candidates
from distmis.trial.record import RESUME_DIR, STATE_FILE, held_epoch


def make_checkpoint(trial_dir: Path, index: int, complete: bool = True, epoch: int | None = None) -> tune.Checkpoint:
    """A checkpoint folder ``checkpoint_<index>`` holding ``epoch`` (default: index + 1, as Tune numbers a trial
    that was never restored)."""
    folder = trial_dir / f"checkpoint_{index:06d}"
    (folder / RESUME_DIR).mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(PRUNED_MARKER):
        stale.unlink()
    epoch = index + 1 if epoch is None else epoch
    (folder / "model.pt").write_bytes(f"weights of epoch {epoch}".encode())
    if complete:
        (folder / RESUME_DIR / STATE_FILE).write_text(f'{{"epoch": {epoch}}}')
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


def test_folders_are_ranked_by_the_epoch_they_hold_not_by_their_names(tmp_path: Path):
    """After a driver SIGKILL, Tune restores an older checkpoint index: a resumed trial's next epochs land in folders
    whose names sort before the ones it went on from. None of the newest epochs may be emptied."""
    from pyarrow.fs import LocalFileSystem

    checkpoints = [make_checkpoint(tmp_path, i) for i in range(7)]  # epochs 1..7 in checkpoint_000000..6
    prune_older(checkpoints[-1], keep=2)  # 5 and 6 (epochs 6 and 7) stay
    # Resumed from epoch 7; Tune's restored index says the next folder is checkpoint_000004.
    written = make_checkpoint(tmp_path, 4, epoch=8)
    prune_older(written, keep=2)
    assert (tmp_path / "checkpoint_000004" / "model.pt").read_text() == "weights of epoch 8"
    assert (tmp_path / "checkpoint_000006" / "model.pt").read_text() == "weights of epoch 7"
    assert [p.name for p in (tmp_path / "checkpoint_000005").iterdir()] == [PRUNED_MARKER]
    assert held_epoch(LocalFileSystem(), str(tmp_path / "checkpoint_000004")) == 8
    assert held_epoch(LocalFileSystem(), str(tmp_path / "checkpoint_000005")) is None
    # The search evaluates the newest epoch's folder, even when Tune still names an emptied one.
    assert Path(newest_complete(checkpoints[0]).path).name == "checkpoint_000004"
    assert [Path(c.path).name for c in resume_candidates(checkpoints[2])] == ["checkpoint_000004", "checkpoint_000006"]


def test_the_checkpoint_just_reported_is_never_emptied(tmp_path: Path):
    for i in range(3):
        make_checkpoint(tmp_path, i, epoch=10 + i)  # newer epochs in other folders (an abandoned attempt)
    reported = make_checkpoint(tmp_path, 5, epoch=4)
    prune_older(reported, keep=1)
    assert (Path(reported.path) / "model.pt").read_text() == "weights of epoch 4"
