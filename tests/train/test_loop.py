"""The epoch loop's scratch files (issue 46, finding 14): a trial's best weights so far and each epoch's checkpoint
live in the trial's own working folder, not the system's temporary folder, where every SIGKILLed trial used to
leave a ``distmis-best-*`` folder for good (114 had piled up). What a killed run of the same trial left there is
reused, and the scratch goes when the run ends. The trainables' folders, with real Ray processes killed:
``tests/search/test_retries.py``; the TensorFlow worker group's: ``tests/search/test_worker_group.py``."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from distmis.search.prepare import prepare_data
from distmis.spec import validate_spec
from distmis.train.loop import BEST_DIR, SCRATCH_PREFIX, epoch_reports
from tests.conftest import small_spec_tree
from tests.train.torch_trainers import local_trainer


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("loop")
    tree = small_spec_tree(tmp / "data")
    tree["model"]["framework"] = "torch"
    tree["training"].update({"epochs": 2, "tile": [8, 8, 8]})
    spec = validate_spec(tree)
    return spec, prepare_data(spec, tmp / "out", progress=False).tfrecord_dir


def test_the_best_weights_live_in_the_trials_folder_reuse_a_killed_runs_and_go_at_the_end(
        prepared, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    spec, tfrecords = prepared
    system_temp = tmp_path / "system-temp"
    system_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_temp))  # what the loop would leave there, seen
    trial = tmp_path / "trial"
    # What a run of this trial SIGKILLed mid-epoch left: its best weights and an epoch's checkpoint half-written.
    leftover = trial / f"{SCRATCH_PREFIX}0"
    (leftover / BEST_DIR).mkdir(parents=True)
    (leftover / BEST_DIR / "model.pt").write_bytes(b"the weights of a killed run")
    (leftover / "checkpoint-halfway").mkdir()

    epochs = epoch_reports(local_trainer(spec, tfrecords), spec, scratch=trial)
    metrics, checkpoint = next(epochs)
    assert metrics["epoch"] == 1 and checkpoint is not None
    assert checkpoint.parent == leftover  # this epoch's checkpoint, in the trial's folder until it is reported
    best = leftover / BEST_DIR / "model.pt"
    assert best.is_file() and best.read_bytes() != b"the weights of a killed run"  # the first epoch is the best yet
    assert (checkpoint / "model.pt").read_bytes() == best.read_bytes()
    assert not (leftover / "checkpoint-halfway").exists()  # the killed run's folder was emptied, then reused
    assert sorted(p.name for p in trial.iterdir()) == [leftover.name]

    assert [m["epoch"] for m, _ in epochs] == [2]
    assert not leftover.exists() and not checkpoint.exists()  # the run's end removes its scratch
    assert [p.name for p in system_temp.iterdir() if "distmis" in p.name] == []  # nor the system's temporary folder


def test_outside_a_trial_the_scratch_is_a_fresh_temporary_folder(prepared, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch):
    spec, tfrecords = prepared
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    epochs = epoch_reports(local_trainer(spec, tfrecords), spec)
    _, checkpoint = next(epochs)
    assert checkpoint is not None and checkpoint.parent.parent == tmp_path
    assert checkpoint.parent.name.startswith(f"{SCRATCH_PREFIX}0-")
    assert (checkpoint.parent / BEST_DIR / "model.pt").is_file()
    epochs.close()  # a trial stopped between two epochs
    assert not checkpoint.parent.exists()


def test_a_restarted_rank_reads_a_checkpoint_on_the_searchs_disk_in_place(tmp_path):
    """Ray's ``as_directory`` gives the ranks of a node one shared copy, which a late rank copies again over the
    files another rank is reading; a checkpoint on the search's own (local) storage is read where it is."""
    from contextlib import contextmanager

    from ray.train import Checkpoint

    from distmis.train.loop import read_in_place
    from distmis.trial.storage import atomic_local_filesystem

    folder = tmp_path / "checkpoint_000002"
    folder.mkdir()
    (folder / "model.pt").write_bytes(b"weights")
    stored = Checkpoint(str(folder), filesystem=atomic_local_filesystem())
    with read_in_place(stored) as directory:
        assert directory == str(folder)
    with stored.as_directory() as copied:  # what Ray would have given: a copy elsewhere
        assert copied != str(folder) and (Path(copied) / "model.pt").read_bytes() == b"weights"

    class Remote:  # a checkpoint on another machine's storage (an s3 bucket): only Ray's copy can be read
        path = "bucket/trial/checkpoint_000002"
        filesystem = type("S3", (), {"type_name": "s3"})()

        @contextmanager
        def as_directory(self):
            yield str(folder)

    with read_in_place(Remote()) as directory:
        assert directory == str(folder)


def test_an_auto_trials_epochs_say_their_workers_and_a_restart_replays_them(prepared, tmp_path: Path):
    """Mode auto's epochs carry the workers they ran on, in the report and in the history a restarted trial replays:
    the driver logs a replayed epoch it missed (killed after the epoch's checkpoint, before its record) from that
    history alone, and an auto trial's ``workers`` curve had a hole there (CI, tests/faults/test_auto_resize_resume)."""
    import json
    import shutil

    from ray.train import Checkpoint

    from distmis.trial.record import HISTORY_KEY

    spec, tfrecords = prepared
    tree = spec.model_dump(mode="json", exclude_unset=True)
    tree["parallelism"] = {"mode": "auto", "workers": 2, "resources_per_worker": {"cpu": 1}}
    auto = validate_spec(tree)
    epochs = epoch_reports(local_trainer(auto, tfrecords), auto, scratch=tmp_path / "first")
    metrics, checkpoint = next(epochs)
    assert checkpoint is not None and metrics["workers"] == 1
    kept = shutil.copytree(checkpoint, tmp_path / "epoch1")
    epochs.close()  # killed after its first epoch

    restarted = epoch_reports(local_trainer(auto, tfrecords), auto, scratch=tmp_path / "second",
                              checkpoints=[Checkpoint.from_directory(str(kept))])
    metrics, _ = next(restarted)
    assert metrics["epoch"] == 2 and metrics["workers"] == 1
    assert [(entry["epoch"], entry["workers"]) for entry in json.loads(metrics[HISTORY_KEY])] == [(1, 1)]
    restarted.close()

    plain, _ = next(epoch_reports(local_trainer(spec, tfrecords), spec, scratch=tmp_path / "plain"))
    assert "workers" not in plain  # the other modes' trials hold what their layout says, not a pool's share
