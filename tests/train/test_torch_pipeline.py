"""The pipelined U-Net trainer in a real gloo group of 2 ranks (one stage each), on real TFRecords.

Each rank writes what it found; the tests compare the ranks with each other, a resumed run with one trained
straight on, and the saved model (the whole U-Net, loadable without a pipeline) with the ranks' weights. That a
pipelined trial trains as an unpipelined one does is ``tests/search/test_pipeline_search.py``'s, and with a short
last batch ``tests/faults/test_pipeline_short_batch.py``'s.
"""

from __future__ import annotations

import copy
import dataclasses
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from distmis.search.prepare import prepare_data
from distmis.spec import validate_spec
from distmis.train.torch_unet import TorchUNetTrainer
from tests.conftest import small_spec_tree

pytestmark = pytest.mark.slow  # a real gloo group of 2 processes


def pipeline_tree(data: Path) -> dict[str, Any]:
    tree = small_spec_tree(data, model={"name": "unet3d", "framework": "torch",
                                        "params": {"base_filters": 4, "levels": 3, "norm": "group", "norm_groups": 2}})
    tree["dataset"]["synthetic"]["cases"] = 10  # 5 training cases: the last batch of 2 is short
    tree["training"].update(batch_size=2, epochs=2)
    tree["parallelism"] = {"mode": "data", "workers": 1, "pipeline": {"stages": 2, "microbatches": 2}}
    return tree


def _on_rank(rank: int, spec_tree: dict, tfrecord_dir: str, out: str) -> None:
    import torch.distributed as dist

    from distmis.parallel.groups import build_pipeline_groups
    from distmis.train.torch_pipeline import TorchPipelineUNetTrainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    found: dict[str, Any] = {}
    try:
        spec = validate_spec(spec_tree)
        groups = build_pipeline_groups(2)

        def trainer() -> TorchPipelineUNetTrainer:
            return TorchPipelineUNetTrainer(spec, tfrecord_dir, groups=groups)

        straight = trainer()
        found["batches"] = [straight.epoch_batches(e) for e in (1, 2)]
        found["plans"] = {size: dataclasses.asdict(straight.pipeline_for(size).plan) for size in (1, 2)}
        found["epochs"] = [straight.run_epoch(e).as_dict() for e in (1, 2)]
        found["weights"] = {k: v.clone() for k, v in straight.model.state_dict().items()}
        if rank == 0:
            straight.save(Path(out) / "model")

        first = trainer()
        first.run_epoch(1)
        first.save_state(Path(out) / "state", rank=rank, primary=rank == 0)
        dist.barrier()  # every stage's files written before any loads
        resumed = trainer()
        resumed.load_state(Path(out) / "state", rank=rank, epoch=1)
        found["resumed_epoch"] = resumed.run_epoch(2).as_dict()
        found["resumed_weights"] = {k: v.clone() for k, v in resumed.model.state_dict().items()}

        # a curriculum: small tiles, then the whole volume, each stage with a pipeline for its shapes
        tree = copy.deepcopy(spec_tree)
        tree["training"].pop("epochs")
        tree["training"]["curriculum"] = [{"tile": [8, 8, 8], "epochs": 1, "tile_sampling": 1.0},
                                          {"tile": None, "epochs": 1}]
        growing = TorchPipelineUNetTrainer(validate_spec(tree), tfrecord_dir, groups=groups)
        found["curriculum"] = []
        for epoch in (1, 2):
            metrics = growing.run_epoch(epoch).as_dict()
            found["curriculum"].append({"tile": growing.tile, "pipeline": id(growing.pipeline),
                                        "optimizer_parameters": [id(p) for g in growing.optimizer.param_groups
                                                                 for p in g["params"]],
                                        "stage_parameters": [id(p) for p in growing.pipeline.parameters()],
                                        **metrics})
        found["ok"] = True
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        found = {"ok": False, "error": traceback.format_exc()}
    finally:
        torch.save(found, f"{out}/rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> tuple[Any, Any, list[dict[str, Any]], Path]:
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("pipeline_trainer")
    spec = validate_spec(pipeline_tree(tmp / "data"))
    data = prepare_data(spec, tmp / "out", progress=False)
    mp.spawn(_on_rank, args=(spec.model_dump(mode="json"), str(data.tfrecord_dir), str(tmp)), nprocs=2, join=True)
    results = [torch.load(tmp / f"rank{r}.pt") for r in (0, 1)]
    failures = [r["error"] for r in results if not r["ok"]]
    assert not failures, "\n".join(failures)
    return spec, data, results, tmp


def test_a_pipelined_trial_trains_the_unpipelined_batches_a_short_one_short(ran):
    spec, data, results, _ = ran
    plain = TorchUNetTrainer(spec, data.tfrecord_dir)  # no pipeline, no process group
    for epoch, batches in zip((1, 2), results[0]["batches"]):
        assert batches == plain.epoch_batches(epoch)
        assert [len(b) for b in batches] == [2, 2, 1]  # 5 cases: every one once, the last batch short
        assert sorted(i for b in batches for i in b) == list(range(5))
    assert results[0]["batches"] == results[1]["batches"]  # both stages read the same batches


def test_a_short_batch_gets_a_pipeline_of_its_own_shape(ran):
    for result in ran[2]:
        full, short = result["plans"][2], result["plans"][1]
        assert full == {"samples": 2, "microbatches": 2, "schedule": "gpipe"}  # as configured
        assert short == {"samples": 1, "microbatches": 1, "schedule": "gpipe"}  # one micro-batch of 1


def test_the_pipelined_trainer_trains_and_validates_the_whole_model(ran):
    spec, data, results, _ = ran
    for result in results:  # every rank reports the same numbers, and holds every stage's weights
        for mine, first in zip(result["epochs"], results[0]["epochs"]):
            assert [mine[k] for k in ("train_loss", "val_loss", "val_dice")] == [
                first[k] for k in ("train_loss", "val_loss", "val_dice")]
        for name, value in result["weights"].items():
            torch.testing.assert_close(value, results[0]["weights"][name], atol=0, rtol=0)
    epochs = results[0]["epochs"]
    assert epochs[1]["train_loss"] < epochs[0]["train_loss"]
    assert all(e["step_seconds"] > 0 and e["peak_memory_mb"] >= 0 for e in epochs)


def test_a_pipelined_trial_resumes_as_if_never_stopped(ran):
    _, _, results, _ = ran
    for result in results:
        resumed, straight = result["resumed_epoch"], result["epochs"][1]
        for key in ("train_loss", "val_loss", "val_dice"):
            assert resumed[key] == pytest.approx(straight[key], rel=1e-6, abs=1e-7), key
        for name, value in result["resumed_weights"].items():
            torch.testing.assert_close(value, result["weights"][name], atol=1e-6, rtol=1e-6)


def test_the_saved_model_is_the_whole_unet(ran):
    spec, data, results, tmp = ran
    plain = TorchUNetTrainer(spec, data.tfrecord_dir)  # no pipeline, no process group
    plain.load(tmp / "model")
    for name, value in plain.model.state_dict().items():
        torch.testing.assert_close(value, results[0]["weights"][name], atol=0, rtol=0)
    scores = plain.validate()
    np.testing.assert_allclose([scores.loss, scores.dice],
                               [results[0]["epochs"][1]["val_loss"], results[0]["epochs"][1]["val_dice"]], rtol=1e-6)


def test_a_pipelined_curriculum_gets_a_pipeline_per_input(ran):
    for result in ran[2]:
        first, second = result["curriculum"]
        assert (first["tile"], second["tile"]) == ((8, 8, 8), None)
        assert (first["curriculum_stage"], second["curriculum_stage"]) == (1, 2)
        assert (second["tile_h"], second["tile_w"], second["tile_d"]) == (16, 16, 16)
        assert first["pipeline"] != second["pipeline"]  # rebuilt for the whole volume's shapes...
        for stage in (first, second):  # ...over the same parameters, which the one optimizer updates
            assert stage["stage_parameters"] == stage["optimizer_parameters"]
        assert all(np.isfinite(stage["train_loss"]) and np.isfinite(stage["val_dice"]) for stage in (first, second))
