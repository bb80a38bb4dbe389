"""The torch worker group of a data-mode search, for real: Ray actors joined once into one gloo process group,
serving trials one after another, each over its layout's mesh; every rank's part of a checkpoint merged."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from distmis.search.prepare import prepare_data
from distmis.spec import validate_spec
from distmis.spec.layout import resolve_trial
from distmis.trial.record import RESUME_DIR, STATE_FILE, TrainingState
from distmis.trial.worker_group import WorkerGroup, merged_files, release_groups
from tests.conftest import small_spec_tree

UNET = {"name": "unet3d", "framework": "torch", "params": {"base_filters": 4, "levels": 3, "norm": "group",
                                                           "norm_groups": 2}}


def probe(worker: Any) -> dict[str, Any]:
    """What a worker actor holds after its trial (run inside it by ``__ray_call__``)."""
    import os

    import torch.distributed as dist

    trainer = worker.trainer
    mesh = trainer.mesh
    return {"rank": worker.rank, "pid": os.getpid(), "world": dist.get_world_size(), "backend": dist.get_backend(),
            "lr": float(trainer.optimizer.param_groups[0]["lr"]), "meshes": len(worker.meshes),
            "mesh": (mesh.dp_size, mesh.pp_size, mesh.pp_rank), "layout_lr": mesh.layout.lr,
            "train_model": type(trainer.train_model).__name__}


def test_merged_files_take_every_rank_and_rank_0_first():
    assert merged_files([({}, None), ({}, None)]) is None
    assert merged_files([({}, {"a": b"0", "r0": b"0"}), ({}, None), ({}, {"a": b"2", "r2": b"2"})]) == {
        "a": b"0", "r0": b"0", "r2": b"2"}


def test_one_torch_group_serves_trials_of_either_layout_and_resumes_them(ray_local, tmp_path: Path):
    import ray

    tree = small_spec_tree(tmp_path / "data", model=UNET, parallelism={"mode": "data", "workers": 1,
                                                                       "resources_per_worker": {"cpu": 1}})
    tree["dataset"]["synthetic"]["cases"] = 8  # 4 training cases: full batches of 2
    tree["training"].update(batch_size=2, epochs=2)
    tree["parallelism"]["pipeline"] = {"microbatches": 2}
    spec = validate_spec(tree)
    tfrecords = str(prepare_data(spec, tmp_path / "out", progress=False).tfrecord_dir)
    replicas, layout = resolve_trial(spec, {"parallelism.workers": 2, "training.optimizer.lr": 1.0e-3})
    assert (layout.dp, layout.pp, layout.world_size) == (2, 1, 2)
    group = WorkerGroup(layout, "distmis-workers-test-torch-1", "torch")
    try:
        reports = list(group.epochs(replicas, layout, tfrecords, [], time.time()))
        assert [m["epoch"] for m, _ in reports] == [1, 2]
        assert reports[0][0]["startup_workers_s"] > 0 and reports[0][0]["startup_graphs_reused"] == 0.0
        first_losses = [m["train_loss"] for m, _ in reports]
        files = reports[-1][1]
        # rank 0's weights and state, and each rank's own random-number state, in one checkpoint
        assert {"model.pt", f"{RESUME_DIR}/trainer.pt", f"{RESUME_DIR}/{STATE_FILE}",
                f"{RESUME_DIR}/rng.rank0.pt", f"{RESUME_DIR}/rng.rank1.pt"} <= set(files)
        first = sorted(ray.get([w.__ray_call__.remote(probe) for w in group.workers]), key=lambda f: f["rank"])
        assert all(f["world"] == 2 and f["backend"] == "gloo" for f in first)
        assert all(f["train_model"] == "DistributedDataParallel" and f["mesh"][0] == 2 for f in first)
        assert all(f["lr"] == pytest.approx(2e-3) for f in first)  # linear scaling over the 2 replicas

        # Two pipeline stages on the same two ranks: the same processes and process group, a mesh of its own,
        # the stage's optimizer state from each rank in the checkpoint.
        pipelined, pp_layout = resolve_trial(spec, {"parallelism.workers": 1, "parallelism.pipeline.stages": 2,
                                                    "training.optimizer.lr": 5.0e-3})
        assert (pp_layout.dp, pp_layout.pp) == (1, 2) and group.fits(pp_layout, "torch")
        assert not group.fits(pp_layout, "tensorflow")
        reports = list(group.epochs(pipelined, pp_layout, tfrecords, [], time.time()))
        assert [m["epoch"] for m, _ in reports] == [1, 2]
        staged = reports[-1][1]
        assert {f"{RESUME_DIR}/optimizer.stage0.pt", f"{RESUME_DIR}/optimizer.stage1.pt"} <= set(staged)
        second = sorted(ray.get([w.__ray_call__.remote(probe) for w in group.workers]), key=lambda f: f["rank"])
        assert [f["pid"] for f in second] == [f["pid"] for f in first]
        assert all(f["meshes"] == 2 and f["train_model"] == "StageCells" for f in second)
        assert [f["mesh"] for f in second] == [(1, 2, 0), (1, 2, 1)]
        assert all(f["lr"] == pytest.approx(5e-3) and f["layout_lr"] == 5e-3 for f in second)  # dp 1: unscaled

        # A restarted trial hands its checkpoint to the workers, which go on after its last epoch: every stage
        # from its own optimizer state.
        longer = pipelined.model_copy(update={"training": pipelined.training.model_copy(update={"epochs": 3})})
        resumed = list(group.epochs(longer, pp_layout, tfrecords, [staged], time.time()))
        assert [m["epoch"] for m, _ in resumed] == [3]
        state = TrainingState.from_json(resumed[-1][1][f"{RESUME_DIR}/{STATE_FILE}"].decode())
        assert state.epoch == 3 and len(state.history) == 3
        # The replicas' trial again, on its kept mesh: it trains as it did the first time (a trial leaves nothing
        # behind in the workers that changes the next one).
        again = list(group.epochs(replicas, layout, tfrecords, [], time.time()))
        assert [m["train_loss"] for m, _ in again] == pytest.approx(first_losses, rel=1e-5)
        third = ray.get([w.__ray_call__.remote(probe) for w in group.workers])
        assert all(f["meshes"] == 2 and f["lr"] == pytest.approx(2e-3) for f in third)
    finally:
        group.shutdown()
    assert release_groups("test-torch") == []
