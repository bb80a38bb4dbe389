"""What the PyTorch trainers measure of their training steps each epoch (step_seconds, peak_memory_mb, fom), on
real TFRecords and real memory: the ViT-seg's figure of merit from its measured step, a peak that is the epoch's
and not the process's, and the largest over the ranks of a real gloo group."""

from __future__ import annotations

import gc
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from distmis.perf.model import figure_of_merit
from distmis.search.prepare import prepare_data
from distmis.spec import validate_spec
from distmis.train.metering import StepMeter
from tests.conftest import small_spec_tree
from tests.train.torch_trainers import gloo_trainer, local_trainer

VIT = {"name": "vit-seg", "framework": "torch",
       "params": {"layers": 2, "embed_dim": 32, "heads": 4, "patch": 4, "decoder_features": 16,
                  "attention_kernel": "math"}}
MIB = 2**20


def vit_tree(data: Path, sp: int = 1) -> dict[str, Any]:
    tree = small_spec_tree(data, model=VIT)
    tree["training"].update({"tile": [8, 8, 8], "batch_size": 1})
    if sp > 1:
        tree["parallelism"] = {"mode": "data", "workers": 1, "resources_per_worker": {"cpu": 1},
                               "sequence_parallel": {"degree": sp, "attention": "allgather-kv"}}
    return tree


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("step_metrics")
    spec = validate_spec(vit_tree(tmp / "data"))
    return spec, prepare_data(spec, tmp / "out", progress=False)


def test_a_vit_epoch_reports_its_steps_time_memory_and_figure_of_merit(prepared):
    spec, data = prepared
    trainer = local_trainer(spec, data.tfrecord_dir)
    metrics = trainer.run_epoch(1)
    assert {"step_seconds", "peak_memory_mb", "fom"} <= set(metrics.as_dict())
    assert 0 < metrics.step_seconds and metrics.step_seconds * trainer.steps_per_epoch < metrics.epoch_seconds
    assert metrics.peak_memory_mb >= 0
    # the seed's b L s^2 d / T: one sample per step, 2 layers, (8/4)^3 = 8 tokens of width 32
    assert trainer.perf_shape.tokens == 8
    assert metrics.fom == pytest.approx(1 * 2 * 8**2 * 32 / metrics.step_seconds)
    assert metrics.fom == figure_of_merit(trainer.perf_shape, batch=1, seconds=metrics.step_seconds)


def test_later_epochs_count_the_gradients_and_adam_moments_as_the_first_does(prepared):
    spec, data = prepared
    trainer = local_trainer(spec, data.tfrecord_dir)
    assert trainer._training_state_bytes() == 0  # before the first step: no gradients, no optimizer state
    with pytest.raises(ValueError, match="no epoch trained"):
        trainer.step_metrics()
    trainer.train_epoch(1)
    first = trainer.step_metrics()
    params = list(trainer.model.parameters())
    # a gradient and Adam's two moments per value, and Adam's step counter per tensor, all float32
    assert trainer._training_state_bytes() == 4 * (3 * trainer.num_parameters + len(params))
    trainer.train_epoch(2)
    second = trainer.step_metrics()  # measured afresh: its own steps, its own peak
    assert second["step_seconds"] > 0 and second["peak_memory_mb"] >= 0 and second != first
    assert second["fom"] == figure_of_merit(trainer.perf_shape, batch=1, seconds=second["step_seconds"])


def test_the_unet_reports_step_time_and_memory_but_no_figure_of_merit(tmp_path: Path):
    spec = validate_spec(small_spec_tree(tmp_path / "data"))
    data = prepare_data(spec, tmp_path / "out", progress=False)
    reported = local_trainer(spec, data.tfrecord_dir).run_epoch(1).as_dict()
    assert reported["step_seconds"] > 0 and reported["peak_memory_mb"] >= 0 and "fom" not in reported


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the resident-set peak is reset through /proc")
def test_the_memory_peak_is_the_epochs_not_the_processes():
    meter = StepMeter(torch.device("cpu"))
    big = torch.ones(64 * MIB)  # 256 MiB, touched: the process's peak, before the epoch
    del big
    gc.collect()
    meter.start_epoch()
    meter.start_step()
    step = torch.ones(16 * MIB) * 2  # the step holds 64 MiB (and a temporary as large) at its peak
    del step
    meter.end_step()
    assert meter.steps == 1 and meter.step_seconds > 0
    assert 60 * MIB < meter.peak_bytes < 200 * MIB  # the step's 64-128 MiB, not the 256 MiB before it
    meter.start_epoch()  # a quiet epoch: its peak starts afresh
    meter.start_step()
    meter.end_step()
    assert meter.peak_bytes < 32 * MIB


def test_held_training_state_counts_as_the_steps():
    held = 48.0 * MIB
    with_state = StepMeter(torch.device("cpu"), held=lambda: held)
    with_state.start_epoch()
    with_state.start_step()
    with_state.end_step()
    assert with_state.peak_bytes >= held  # what earlier steps left in place counts, as in the first epoch
    with pytest.raises(ValueError, match="no step measured"):
        StepMeter(torch.device("cpu")).step_seconds


# --------------------------------------------------------------------------- a real gloo group
def sp_worker(rank: int, world_size: int, tree: dict[str, Any], tfrecord_dir: str, out: str) -> None:
    import torch.distributed as dist


    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        spec = validate_spec(tree)
        trainer = gloo_trainer(spec, tfrecord_dir)
        reported = trainer.run_epoch(1).as_dict()
        torch.save({"measured": trainer._measured, "reported": reported}, Path(out) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # a real gloo process group of 2 ranks
def test_an_sp_group_reports_its_slowest_step_and_fullest_rank(prepared, tmp_path: Path):
    import torch.multiprocessing as mp

    spec, data = prepared
    tree = vit_tree(Path(spec.dataset.path), sp=2)
    mp.spawn(sp_worker, args=(2, tree, str(data.tfrecord_dir), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    seconds = max(r["measured"][0] for r in ranks)
    peak = max(r["measured"][1] for r in ranks)
    for r in ranks:  # every rank reports the largest, so rank 0's report (what Tune gets) is the group's
        assert r["reported"]["step_seconds"] == seconds
        assert r["reported"]["peak_memory_mb"] == peak / MIB
        assert r["reported"]["fom"] == pytest.approx(2 * 8**2 * 32 / seconds)
