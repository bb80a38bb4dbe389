"""A trial's checkpoint (distmis.train.checkpoint) through the real trainers and the real epoch loop: a trial cut
after an epoch and resumed from its checkpoint ends where an uninterrupted one does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from distmis.search.prepare import prepare_data
from distmis.trial.trainables import train_and_report
from distmis.spec import validate_spec
from distmis.train.checkpoint import RESUME_DIR, STATE_FILE, read_state
from distmis.trial.record import HISTORY_KEY
from tests.conftest import small_spec_tree


class Saved:
    """What ``Checkpoint.from_directory`` gives the loop: here, a copy kept on disk as the storage would."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def as_directory(self) -> Any:
        from contextlib import nullcontext

        return nullcontext(self.path)


class Recorder:
    """``report``: keeps every report's metrics and a copy of its checkpoint folder."""

    def __init__(self, root: Path, stop_after: int | None = None) -> None:
        self.root, self.stop_after = root, stop_after
        self.metrics: list[dict[str, Any]] = []
        self.checkpoints: list[Saved] = []

    def __call__(self, metrics: dict[str, Any], checkpoint: Any = None) -> None:
        import shutil

        self.metrics.append(dict(metrics))
        if checkpoint is not None:
            target = self.root / f"checkpoint_{len(self.metrics):06d}"
            shutil.copytree(checkpoint.path, target)
            self.checkpoints.append(Saved(target))
        if self.stop_after is not None and len(self.metrics) >= self.stop_after:
            raise KeyboardInterrupt("the process dies here")

    @staticmethod
    def from_directory(path: str) -> Saved:
        return Saved(Path(path))


def prepared_spec(tmp: Path, framework: str, **training: Any):
    tree = small_spec_tree(tmp / "data")
    tree["model"]["framework"] = framework
    tree["training"].update({"epochs": 3, "tile": [8, 8, 8], **training})
    spec = validate_spec(tree)
    return spec, prepare_data(spec, tmp / "out", progress=False)


def torch_trainer(spec: Any, data: Any) -> Any:
    from tests.train.torch_trainers import local_trainer

    return local_trainer(spec, data.tfrecord_dir)


def test_a_resumed_torch_trial_ends_where_an_uninterrupted_one_does(tmp_path: Path):
    spec, data = prepared_spec(tmp_path, "torch")
    whole = Recorder(tmp_path / "whole")
    straight = torch_trainer(spec, data)
    train_and_report(straight, spec, whole, Recorder)

    cut = Recorder(tmp_path / "cut", stop_after=1)
    with pytest.raises(KeyboardInterrupt):
        train_and_report(torch_trainer(spec, data), spec, cut, Recorder)
    [checkpoint] = cut.checkpoints
    state = read_state(checkpoint.path)
    assert state is not None and state.epoch == 1 and len(state.history) == 1
    assert (Path(checkpoint.path) / "model.pt").is_file()  # the best weights so far, at the root
    assert {p.name for p in (Path(checkpoint.path) / RESUME_DIR).iterdir()} == {"trainer.pt", "rng.rank0.pt", STATE_FILE}

    rest = Recorder(tmp_path / "rest")
    resumed = torch_trainer(spec, data)  # a new process: fresh weights, fresh random state
    train_and_report(resumed, spec, rest, Recorder, checkpoints=[checkpoint])
    assert [m["epoch"] for m in rest.metrics] == [2, 3]
    assert [e["epoch"] for e in json.loads(rest.metrics[0][HISTORY_KEY])] == [1]  # the epoch it had trained
    assert HISTORY_KEY not in rest.metrics[1]
    assert rest.metrics[0]["attempt"] != cut.metrics[0]["attempt"]
    for key, value in straight.model.state_dict().items():  # the same weights, bit for bit
        assert torch.equal(value, resumed.model.state_dict()[key]), key
    assert [m["train_loss"] for m in rest.metrics] == [m["train_loss"] for m in whole.metrics[1:]]
    final = read_state(rest.checkpoints[-1].path)
    assert final.epoch == 3 and [e["epoch"] for e in final.history] == [1, 2, 3]
    assert (final.best_value, final.best_epoch) == max((m["val_dice"], m["epoch"]) for m in whole.metrics)


def test_a_trial_that_had_trained_every_epoch_only_replays_them(tmp_path: Path):
    spec, data = prepared_spec(tmp_path, "torch", epochs=1)
    first = Recorder(tmp_path / "first")
    train_and_report(torch_trainer(spec, data), spec, first, Recorder)
    again = Recorder(tmp_path / "again")
    train_and_report(torch_trainer(spec, data), spec, again, Recorder, checkpoints=first.checkpoints)
    [replay] = again.metrics
    assert replay["epoch"] == 1 and replay["val_dice"] == first.metrics[0]["val_dice"]
    assert [e["epoch"] for e in json.loads(replay[HISTORY_KEY])] == [1]


def test_a_truncated_newest_checkpoint_falls_back_to_the_one_before(tmp_path: Path):
    spec, data = prepared_spec(tmp_path, "torch")
    cut = Recorder(tmp_path / "cut", stop_after=2)
    with pytest.raises(KeyboardInterrupt):
        train_and_report(torch_trainer(spec, data), spec, cut, Recorder)
    older, newest = cut.checkpoints
    trainer_file = Path(newest.path) / RESUME_DIR / "trainer.pt"
    trainer_file.write_bytes(trainer_file.read_bytes()[:100])  # the process died while saving it
    rest = Recorder(tmp_path / "rest")
    train_and_report(torch_trainer(spec, data), spec, rest, Recorder, checkpoints=[newest, older])
    assert [m["epoch"] for m in rest.metrics] == [2, 3]


def test_a_resumed_tensorflow_trial_gets_its_weights_and_optimizer_back(tmp_path: Path):
    from distmis.spec.layout import resolve_layout
    from distmis.train.tf_unet import UNetTrainer

    spec, data = prepared_spec(tmp_path, "tensorflow")
    cut = Recorder(tmp_path / "cut", stop_after=2)
    trained = UNetTrainer(spec, data.tfrecord_dir, layout=resolve_layout(spec))
    with pytest.raises(KeyboardInterrupt):
        train_and_report(trained, spec, cut, Recorder)
    assert {p.name for p in (Path(cut.checkpoints[-1].path) / RESUME_DIR).iterdir()} == {
        "model.weights.h5", "optimizer.npz", STATE_FILE}
    resumed = UNetTrainer(spec, data.tfrecord_dir, layout=resolve_layout(spec))
    resumed.load_state(Path(cut.checkpoints[-1].path) / RESUME_DIR, epoch=2)
    for a, b in zip(trained.model.get_weights(), resumed.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(resumed.optimizer.iterations.numpy()) == int(trained.optimizer.iterations.numpy()) > 0
    for a, b in zip(trained.optimizer.variables, resumed.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a.numpy()), np.asarray(b.numpy()))
    rest = Recorder(tmp_path / "rest")
    train_and_report(UNetTrainer(spec, data.tfrecord_dir, layout=resolve_layout(spec)), spec, rest, Recorder,
                     checkpoints=cut.checkpoints[::-1])
    assert [m["epoch"] for m in rest.metrics] == [3]
