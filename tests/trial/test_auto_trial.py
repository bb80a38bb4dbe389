"""An ``auto`` search's trial grown from one worker to two, for real (TensorFlow's and torch's worker groups): it goes
on from its checkpoint's weights and optimizer state, and trains after the growth as a two-worker trial restarted
from the same checkpoint does; its process keeps the grown group, warm, for its next trial."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distmis.search.prepare import prepare_data
from distmis.spec import validate_spec
from distmis.spec.layout import resolve_trial
from distmis.perf.pool import Grant
from distmis.trial.auto_trial import GroupSlot, group_prefix, resized_epochs
from distmis.trial.record import RESUME_DIR, STATE_FILE, TrainingState
from distmis.trial.worker_group import GROUP_NAME_PREFIX
from tests.conftest import small_spec_tree


def trainer_state(worker: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """A group worker's trainer's weights and optimizer state, as arrays (run inside the worker)."""
    trainer = worker.trainer
    if worker.framework == "tensorflow":
        return ([np.asarray(w) for w in trainer.model.get_weights()],
                [np.asarray(v.numpy()) for v in trainer.optimizer.variables])
    weights = [v.detach().cpu().numpy() for v in trainer.model.state_dict().values()]
    optimizer = []
    for _, state in sorted(trainer.optimizer.state_dict()["state"].items()):
        optimizer += [np.asarray(v.cpu()) for _, v in sorted(state.items())]
    return weights, optimizer


def loaded_state(worker: Any, files: dict[str, bytes]) -> tuple[int, int, tuple[list[np.ndarray], list[np.ndarray]]]:
    """Load a checkpoint into the worker's trainer as a restarted trial does; its rank, the epoch and the state."""
    from distmis.train.checkpoint import resume_from
    from distmis.trial.worker_group import write_files

    with tempfile.TemporaryDirectory() as tmp:
        best = Path(tmp) / "best"
        best.mkdir()
        state = resume_from(worker.trainer, write_files(files, Path(tmp) / "checkpoint"), best, rank=worker.rank)
    return worker.rank, state.epoch, trainer_state(worker)


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


class TrialProcess:
    """A Tune trial's process (a Ray actor, as in a search): its group slot, and the trial's epochs run in it."""

    def __init__(self) -> None:
        self.slot = GroupSlot()

    def grow(self, trial: Any, base: Any, tfrecords: str, name: str) -> tuple[list, list[str]]:
        """One worker for two epochs, then two from the second epoch's checkpoint, on the groups the grants name;
        the epochs, and after each the kind of group it ran on and the worker groups reserved."""
        kinds = []

        def decide(metrics: dict) -> Grant:
            kinds.append((type(self.slot.group).__name__, [info["name"] for info in _live_groups(name)]))
            return Grant(2, group=f"{name}-2") if metrics["epoch"] == 2 else Grant(metrics["workers"])

        return list(resized_epochs(trial, base, tfrecords, Grant(1, group=f"{name}-1"), [], decide,
                                   slot=self.slot)), kinds

    def held(self) -> tuple[str, int]:
        return self.slot.group.name, len(self.slot.group.workers)

    def offered(self, base: Any, framework: str) -> str:
        return self.slot.offered(base, framework)

    def take(self, grant: Grant, base: Any, framework: str, held: str) -> list:
        """The group ``grant`` names, which must be the one held: its workers."""
        group = self.slot.take(grant, base, framework)
        assert group.name == held
        return group.workers

    def restarted(self, trial: Any, layout: Any, tfrecords: str, files: dict[str, bytes]) -> list:
        return list(self.slot.group.epochs(trial, layout, tfrecords, [files], time.time()))

    def drop(self) -> None:
        self.slot.drop()


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_a_trial_grown_from_one_worker_to_two_goes_on_exactly(ray_local, tmp_path: Path, framework: str):
    import ray

    model = {"name": "unet3d", "framework": framework, "params": {"base_filters": 4, "levels": 3, "norm": "group",
                                                                  "norm_groups": 2}}
    tree = small_spec_tree(tmp_path / "data", model=model, parallelism={"mode": "auto", "workers": 2,
                                                                        "resources_per_worker": {"cpu": 1}})
    tree["dataset"]["synthetic"]["cases"] = 8  # 4 training cases: two replicas of 2
    tree["training"].update(batch_size=2, epochs=4)
    spec = validate_spec(tree)
    tfrecords = str(prepare_data(spec, tmp_path / "out", progress=False).tfrecord_dir)
    trial, base = resolve_trial(spec, {"training.optimizer.lr": 1.0e-3})
    assert (base.dp, base.distributed) == (1, True)
    name = f"{GROUP_NAME_PREFIX}{group_prefix('test-resize', framework)}"
    process = ray.remote(num_cpus=0)(TrialProcess).remote()

    try:
        grown, kinds = ray.get(process.grow.remote(trial, base, tfrecords, name))
        assert [(m["epoch"], m["workers"]) for m, _ in grown] == [(1, 1), (2, 1), (3, 2), (4, 2)]
        # one worker: the trial's own process (its worker reserved); two: a worker group of two processes
        assert kinds == [("LocalGroup", [f"{name}-1"])] * 2 + [("WorkerGroup", [f"{name}-2"])] * 2
        assert [m["learning_rate"] for m, _ in grown] == pytest.approx([1e-3, 1e-3, 2e-3, 2e-3])  # lr_scaling: linear
        files = grown[1][1]
        assert TrainingState.from_json(files[f"{RESUME_DIR}/{STATE_FILE}"].decode()).epoch == 2
        # the one-worker group is gone; the grown one stays in the slot, idle, for the process's next trial
        assert ray.get(process.held.remote()) == (f"{name}-2", 2)
        assert [info["name"] for info in _live_groups(name)] == [f"{name}-2"]

        # A two-worker trial restarted from the same checkpoint, on the kept group (warm): its ranks hold the
        # checkpoint's weights and optimizer state once loaded, and it trains epochs 3 and 4 as the grown trial did.
        two = dataclasses.replace(base, dp=2)
        assert ray.get(process.offered.remote(base, framework)) == f"{name}-2"
        workers = ray.get(process.take.remote(Grant(2, group=f"{name}-2", reuse=True), base, framework,
                                              f"{name}-2"))
        ray.get([w.start_trial.remote(trial, two, tfrecords, [files], time.time()) for w in workers])
        loaded = sorted(ray.get([w.__ray_call__.remote(loaded_state, files) for w in workers]))
        assert [(rank, epoch) for rank, epoch, _ in loaded] == [(0, 2), (1, 2)]
        (weights0, optimizer0), (weights1, optimizer1) = (state for _, _, state in loaded)
        assert optimizer0 and same(weights0, weights1) and same(optimizer0, optimizer1)
        if framework == "torch":  # the checkpoint's own arrays
            import torch

            saved = torch.load(_written(files, f"{RESUME_DIR}/trainer.pt", tmp_path), weights_only=True)
            assert same(weights0, [v.numpy() for v in saved["model"].values()])
        else:
            saved = np.load(_written(files, f"{RESUME_DIR}/optimizer.npz", tmp_path))
            assert same(optimizer0, [saved[f"arr_{i}"] for i in range(len(saved.files))])
        ray.get([w.finish_trial.remote() for w in workers])
        restarted = ray.get(process.restarted.remote(trial, two, tfrecords, files))
    finally:
        ray.get(process.drop.remote())
        ray.kill(process)
    assert _live_groups(name) == []
    assert [m["epoch"] for m, _ in restarted] == [3, 4]
    for key in ("train_loss", "val_loss", "val_dice"):
        assert [m[key] for m, _ in grown[2:]] == pytest.approx([m[key] for m, _ in restarted], rel=1e-4), key


def _written(files: dict[str, bytes], name: str, folder: Path) -> Path:
    path = folder / name.replace("/", "_")
    path.write_bytes(files[name])
    return path


def _live_groups(prefix: str) -> list[dict]:
    """The placement groups named ``prefix``... that are not removed."""
    from ray.util.placement_group import placement_group_table

    return sorted((info for info in placement_group_table().values()
                   if (info.get("name") or "").startswith(prefix) and info.get("state") != "REMOVED"),
                  key=lambda info: info["name"])
