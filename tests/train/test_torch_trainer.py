"""The one torch trainer on real TFRecords made from a tiny synthetic dataset: the U-Net, the ViT (logits) and any
registered network through it, alone or as one data-parallel replica; a pipelined U-Net in a real gloo group."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
import threading
import time
import traceback
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from distmis.data.cases import SplitCases
from distmis.data.errors import DataError
from distmis.search.prepare import prepare_data
from distmis.spec import validate_spec
from distmis.train.tf_unet import NonFiniteLossError
from distmis.train.prefetch import PREFETCH_BATCHES, prefetched, shard_batches
from distmis.train.torch_losses import make_loss, soft_dice_loss, soft_dice_per_sample
from distmis.train.torch_trainer import TorchTrainer
from tests.conftest import small_spec_tree
from tests.train.torch_trainers import gloo_trainer, local_trainer, replica_trainer


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch_trainer")
    spec = validate_spec(small_spec_tree(tmp / "data"))
    return spec, prepare_data(spec, tmp / "out", progress=False)


def with_changes(spec, **training):
    tree = spec.model_dump(mode="json")
    tree["training"].update(training)
    return validate_spec(tree)


def reading_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "distmis-prefetch"]


# --------------------------------------------------------------------------- losses
def test_soft_dice_per_sample_hand_computed():
    y = torch.zeros(2, 1, 2, 2, 2)  # channels-first
    p = torch.zeros_like(y)
    y[0, 0, 0, 0, 0] = 1
    p[0, 0, 0, 0, 0] = 0.5
    p[0, 0, 1, 1, 1] = 0.5  # sample 0: (2*0.5 + s) / (1 + 1 + s)
    y[1, 0, 0, 0, :2] = 1  # sample 1: prediction empty: s / (2 + s)
    dice = soft_dice_per_sample(p, y, smooth=1.0)
    torch.testing.assert_close(dice[:, 0], torch.tensor([2 / 3, 1 / 3]))


def test_dice_is_averaged_per_sample_and_channel():
    y = torch.zeros(2, 2, 8, 8, 8)
    y[0, :, :6, :6, :6] = 1
    y[1, 0, 0, 0, 0] = 1
    p = y.clone()
    p[1, 0] = 0  # sample 1 channel 0 missed; sample 1 channel 1 empty & empty: dice 1
    assert float(soft_dice_loss(p, y, smooth=1e-6)) == pytest.approx(0.25, abs=1e-4)


def test_losses_match_the_tensorflow_ones():
    from distmis.train import losses as tf_losses

    rng = np.random.default_rng(0)
    y = (rng.random((2, 4, 4, 4, 3)) > 0.7).astype(np.float32)  # channels-last for TF
    p = rng.random((2, 4, 4, 4, 3)).astype(np.float32)
    to_torch = lambda a: torch.from_numpy(np.moveaxis(a, -1, 1).copy())  # noqa: E731
    for name in ("dice", "dice-bce"):
        expected = float(tf_losses.make_loss(name, smooth=0.5)(y, p))
        assert float(make_loss(name, 0.5)(to_torch(p), to_torch(y))) == pytest.approx(expected, rel=1e-5)


def test_dice_bce_hand_computed_and_clamped():
    y = torch.ones(1, 1, 1, 1, 2)
    p = torch.tensor([0.5, 0.0]).reshape(1, 1, 1, 1, 2)  # 0 is clamped to 1e-7 before the log
    dice = (2 * 0.5 + 1) / (0.5 + 2 + 1)
    bce = -(np.log(0.5) + np.log(1e-7)) / 2
    assert float(make_loss("dice-bce", 1.0)(p, y)) == pytest.approx(1 - dice + bce, rel=1e-5)
    assert float(make_loss("dice", 1.0)(p, y)) == pytest.approx(1 - dice, rel=1e-6)
    with pytest.raises(ValueError, match="loss must be one of .* got 'focal'"):
        make_loss("focal")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- sharding
def test_shard_batches_cycle_to_the_same_number_of_steps():
    order = [4, 0, 3, 1, 2]
    rank0 = shard_batches(order, rank=0, world_size=2, batch_size=2)
    rank1 = shard_batches(order, rank=1, world_size=2, batch_size=2)
    assert rank0 == [[4, 3], [2]]
    assert rank1 == [[0, 1], [0, 1]]  # ran out: starts its shard again
    assert shard_batches(order, rank=0, world_size=1, batch_size=2) == [[4, 0], [3, 1], [2]]
    assert shard_batches([7], rank=1, world_size=2, batch_size=1) == [[7]]  # fewer cases than ranks
    with pytest.raises(ValueError, match="no training cases"):
        shard_batches([], rank=0, world_size=1, batch_size=1)


def test_two_ranks_share_one_permutation_disjointly(prepared):
    spec, data = prepared
    spec = with_changes(spec, batch_size=1)
    ranks = [replica_trainer(spec, data.tfrecord_dir, rank=r, world_size=2) for r in (0, 1)]
    n = len(ranks[0].train_cases)
    assert n >= 3
    for epoch in (0, 1):
        order = ranks[0].epoch_order(epoch)
        assert order == ranks[1].epoch_order(epoch) and sorted(order) == list(range(n))
        batches = [trainer.epoch_batches(epoch) for trainer in ranks]
        assert len(batches[0]) == len(batches[1]) == ranks[0].steps_per_epoch == -(-n // 2)
        seen = [{i for batch in b for i in batch} for b in batches]
        assert seen[0] == set(order[0::2]) and seen[1] == set(order[1::2])
        assert not seen[0] & seen[1] and seen[0] | seen[1] == set(range(n))
    assert ranks[0].epoch_order(0) != ranks[0].epoch_order(1)  # reshuffled every epoch
    # Both ranks really run that many steps (no wrapper: each trains its own copy).
    for trainer in ranks:
        assert np.isfinite(trainer.train_epoch(0))


# --------------------------------------------------------------------------- trainer
def test_epoch_metrics_and_checkpoint(prepared, tmp_path: Path):
    spec, data = prepared
    trainer = local_trainer(spec, data.tfrecord_dir)
    assert trainer.train_model is trainer.model
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.run_epoch(1)
    assert metrics.epoch == 1 and 0 <= metrics.val_dice <= 1 and 0 <= metrics.train_loss <= 1
    assert 0 <= metrics.val_loss <= 1 and metrics.epoch_seconds > 0
    assert trainer.num_parameters == sum(p.numel() for p in trainer.model.parameters())
    path = trainer.save(tmp_path)
    assert path.name == "model.pt" and path.stat().st_size > 0
    saved = torch.load(path, weights_only=True)
    assert saved.keys() == before.keys()
    assert any(not torch.equal(saved[k], before[k]) for k in before)  # the epoch trained the weights
    # the traced memory model's prediction of the same step, beside what the step measured
    assert metrics.predicted_peak_memory_mb > metrics.predicted_step_memory_mb > 0
    assert metrics.predicted_flops_per_step > 0 and metrics.peak_memory_mb is not None


def test_alone_the_model_itself_trains(prepared):
    from distmis.train.parallelism import Replicas

    spec, data = prepared
    trainer = local_trainer(spec, data.tfrecord_dir)
    assert isinstance(trainer.parallelism, Replicas) and trainer.train_model is trainer.model  # no DDP alone
    assert np.isfinite(trainer.train_epoch())


def test_the_schedule_sets_the_optimizers_rate_at_each_epoch_and_step(prepared):
    spec, data = prepared
    trainer = local_trainer(with_changes(spec, epochs=2, lr_schedule={"name": "poly", "power": 1.0}),
                            data.tfrecord_dir)
    for epoch, rate in ((1, 1.0e-3), (2, 0.5e-3)):
        assert trainer.run_epoch(epoch).learning_rate == pytest.approx(rate)
        assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(rate)
    stepped = local_trainer(with_changes(spec, epochs=2, lr_schedule={"name": "cosine", "interval": "step"}),
                            data.tfrecord_dir)
    seen = []
    step = stepped.optimizer.step
    stepped.optimizer.step = lambda *a, **k: (seen.append(stepped.optimizer.param_groups[0]["lr"]), step(*a, **k))[1]
    stepped.train_epoch(1)
    stepped.train_epoch(2)  # 3 cases in batches of 2: steps at 0, 1/4, 1/2 and 3/4 of the 2 epochs
    assert seen == pytest.approx([1.0e-3 * 0.5 * (1 + math.cos(math.pi * q / 4)) for q in range(4)])


def test_same_seed_same_start_whatever_the_learning_rate(prepared):
    spec, data = prepared
    a = local_trainer(with_changes(spec, optimizer={"lr": 1.0e-3}), data.tfrecord_dir)
    b = local_trainer(with_changes(spec, optimizer={"lr": 5.0e-3}), data.tfrecord_dir)
    for (name, wa), wb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(wa, wb), name
    assert a.epoch_batches(0) == b.epoch_batches(0)  # same data order
    c = local_trainer(with_changes(spec, seed=1), data.tfrecord_dir)
    assert any(not torch.equal(wa, wc) for wa, wc in zip(a.model.parameters(), c.model.parameters()))


def test_tiled_training_and_validation_cover_the_volume(prepared):
    spec, data = prepared
    trainer = local_trainer(with_changes(spec, tile=[8, 8, 8]), data.tfrecord_dir)
    x, y = trainer._batch([0, 1])
    assert x.shape[2:] == y.shape[2:] == (8, 8, 8)
    _, image, label = trainer.val_cases[0]
    prob = trainer.predict_volume(image)
    assert prob.shape == label.shape and np.isfinite(prob).all()
    assert 0 <= prob.min() and prob.max() <= 1
    scores = trainer.validate()
    assert np.isfinite(scores.loss) and 0 <= scores.dice <= 1
    assert scores.class_dice == {"WT": scores.dice}  # whole-tumour: one scored channel
    with pytest.raises(ValueError, match="training.tile \\[32, 8, 8\\]"):
        local_trainer(with_changes(spec, tile=[32, 8, 8]), data.tfrecord_dir)


def test_foreground_tile_sampling_centres_tiles_on_the_label(prepared):
    spec, data = prepared

    def label_tiles(fraction: float) -> list[torch.Tensor]:
        trainer = local_trainer(with_changes(spec, tile=[4, 4, 4], tile_sampling=fraction), data.tfrecord_dir)
        return [y for epoch in range(8) for batch in trainer.epoch_batches(epoch) for y in trainer._batch(batch)[1]]

    assert all(label.any() for _, _, label in local_trainer(spec, data.tfrecord_dir).train_cases)
    uniform, centred, half = label_tiles(0.0), label_tiles(1.0), label_tiles(0.5)
    assert any(not y.any() for y in uniform)  # a uniform offset misses the foreground at times
    assert all(y.any() for y in centred)  # a centred tile never does
    # the coin's and the centre's draws come from a generator of their own: a tile not centred is a uniform one
    assert any(torch.equal(h, u) for h, u in zip(half, uniform))
    assert not all(torch.equal(h, u) for h, u in zip(half, uniform))


def test_random_tiles_crop_image_and_label_alike(prepared):
    spec, data = prepared
    tiled = with_changes(spec, tile=[8, 8, 8])
    trainer = local_trainer(tiled, data.tfrecord_dir)
    # Number every voxel, in image and label alike, so a crop shows where it was taken: the trainer reads
    # its cases from train_cases, here a list whose one case is the numbered volume.
    case_id, image, _ = trainer.train_cases[0]
    spatial = image.shape[:3]
    numbered = np.arange(np.prod(spatial), dtype=np.float32).reshape(spatial)
    trainer.train_cases = [(case_id, np.repeat(numbered[..., None], image.shape[-1], axis=-1), numbered[..., None])]
    corners = []
    for _ in range(10):
        x, y = trainer._batch([0])
        torch.testing.assert_close(x[0, 0], y[0, 0])  # same offset for image and label
        corners.append(int(x[0, 0, 0, 0, 0]))
    assert len(set(corners)) > 1  # the offsets are random...
    again = local_trainer(tiled, data.tfrecord_dir)
    again_crops = [again._random_crop(spatial, torch.from_numpy(numbered)[None]) for _ in range(10)]
    assert [int(numbered[c[1:]][0, 0, 0]) for c in again_crops] == corners  # ...and seeded


def test_nan_loss_raises(prepared):
    spec, data = prepared
    trainer = local_trainer(spec, data.tfrecord_dir)
    with torch.no_grad():
        trainer.model.down[0][0].weight.fill_(float("nan"))
    with pytest.raises(NonFiniteLossError, match="epoch 3"):
        trainer.run_epoch(3)
    assert not reading_threads()  # the step's error stopped the thread reading the epoch's cases


def test_the_layout_is_required_and_the_mesh_refuses_a_rank_outside_it():
    from distmis.parallel.mesh import TrialMesh
    from distmis.spec.layout import resolve_layout

    spec = validate_spec(small_spec_tree("/nonexistent"))
    with pytest.raises(TypeError, match="layout"):
        TorchTrainer(spec, "/nonexistent", mesh=TrialMesh.local(resolve_layout(spec)))  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="dp_rank must lie in \\[0, 2\\), got 2"):
        TrialMesh(resolve_layout(spec), dp_rank=2, dp_size=2)


# --------------------------------------------------------------------------- streaming input
def test_prefetched_keeps_order_and_runs_at_most_depth_ahead():
    made: list[int] = []

    def items():
        for i in range(12):
            made.append(i)
            yield i

    got = []
    for item in prefetched(items(), depth=2):
        time.sleep(0.02)  # a slow consumer: the thread fills the queue and waits
        got.append(item)
        assert len(made) <= len(got) + 2 + 1  # the queue's 2, and 1 the thread holds while it waits
    assert got == list(range(12))
    assert not reading_threads()
    with pytest.raises(ValueError, match="depth must be >= 1, got 0"):
        next(prefetched([1], depth=0))


def test_prefetched_raises_the_threads_error_as_itself():
    def broken_read():
        raise DataError("shard 'x.tfrecord': the file ends inside a record (truncated?)")

    def items():
        yield 1
        broken_read()

    stream = prefetched(items())
    assert next(stream) == 1
    with pytest.raises(DataError, match="x.tfrecord") as caught:
        next(stream)
    assert "broken_read" in "".join(traceback.format_tb(caught.value.__traceback__))  # the thread's frames
    assert not reading_threads()


def test_closing_prefetched_early_stops_the_thread():
    made = []

    def endless():
        while True:
            made.append(1)
            yield len(made)

    stream = prefetched(endless(), depth=1)
    assert next(stream) == 1
    stream.close()
    assert not reading_threads()
    count = len(made)
    time.sleep(0.3)
    assert len(made) == count  # stopped, not still making items


def test_streaming_training_is_deterministic(prepared):
    """Read in a background thread or not, the epoch is a function of the seed: same losses, same weights."""
    spec, data = prepared
    tiled = with_changes(spec, tile=[8, 8, 8], tile_sampling=0.5)
    a, b = (local_trainer(tiled, data.tfrecord_dir) for _ in range(2))
    assert [a.train_epoch(e) for e in (0, 1)] == [b.train_epoch(e) for e in (0, 1)]
    for (name, wa), wb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(wa, wb), name
    assert torch.equal(a._tile_rng.get_state(), b._tile_rng.get_state())  # no tile drawn beyond the epoch
    assert a.validate() == b.validate()
    assert not reading_threads()


class CountingCases(SplitCases):
    """Counts the reads and the volumes still alive (a volume the trainer kept would stay alive)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reads, self.alive, self.most_alive = 0, 0, 0
        self.lock = threading.Lock()

    def __getitem__(self, item):
        case = super().__getitem__(item)
        if isinstance(item, int):
            with self.lock:
                self.reads += 1
                self.alive += 1
                self.most_alive = max(self.most_alive, self.alive)
            weakref.finalize(case[1], self._freed)
        return case

    def _freed(self) -> None:
        with self.lock:
            self.alive -= 1


def test_the_trainer_holds_no_volumes(prepared):
    spec, data = prepared
    trainer = local_trainer(with_changes(spec, tile=[8, 8, 8], batch_size=1), data.tfrecord_dir)
    volume = int(np.prod(trainer.volume_shape))
    kept = [name for name, value in vars(trainer).items()
            if isinstance(value, (np.ndarray, torch.Tensor)) and value.numel() >= volume]
    assert not kept
    counting = trainer.train_cases = CountingCases(data.tfrecord_dir, "train")
    assert len(counting) >= 3  # a trainer that kept its cases would have 3 alive
    trainer.train_epoch(0)
    assert counting.reads == len(counting)  # each case read once an epoch
    assert counting.most_alive == 1  # one volume at a time, whatever the prefetch depth: only tiles wait
    assert counting.alive == 0


def test_a_shard_cut_short_during_training_raises_its_data_error(prepared, tmp_path):
    """A read error in the reading thread reaches the training loop as the DataError naming the file."""
    spec, data = prepared
    copied = tmp_path / "tfrecords"
    shutil.copytree(data.tfrecord_dir, copied)
    trainer = local_trainer(spec, copied)
    shards = sorted(copied.glob("train-*.tfrecord"))
    for shard in shards:  # cut after the trainer indexed them
        shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(DataError, match=r"train-0000\d-of-0000\d\.tfrecord.*truncated") as caught:
        trainer.train_epoch(0)
    assert "read_record_at" in "".join(traceback.format_tb(caught.value.__traceback__))
    assert not reading_threads()


def test_an_error_in_a_step_stops_the_reading_thread(prepared):
    spec, data = prepared
    trainer = local_trainer(with_changes(spec, batch_size=1), data.tfrecord_dir)
    counting = trainer.train_cases = CountingCases(data.tfrecord_dir, "train")

    def failing_loss(x, y):
        raise RuntimeError("step failed")

    trainer._forward_backward = failing_loss
    with pytest.raises(RuntimeError, match="step failed"):
        trainer.train_epoch(0)
    assert not reading_threads()
    assert counting.reads <= 1 + PREFETCH_BATCHES + 1  # stopped, not read to the epoch's end


def test_transform_case_sees_every_cropped_sample(prepared):
    """The augmentation hook: channels-first float32 tiles of their own, with the data order's epoch."""
    spec, data = prepared
    trainer = local_trainer(with_changes(spec, tile=[8, 8, 8]), data.tfrecord_dir)
    seen = []

    def transform(image, label, epoch):
        seen.append((tuple(image.shape), tuple(label.shape), image.dtype, label.dtype, epoch,
                     image.is_contiguous() and label.is_contiguous()))
        return image + 1, label

    trainer._transform_case = transform
    x, _ = trainer._batch([0], epoch=4)
    assert seen == [((4, 8, 8, 8), (trainer.num_classes, 8, 8, 8), torch.float32, torch.float32, 4, True)]
    trainer.train_epoch(2)
    assert [s[4] for s in seen[1:]] == [2] * len(trainer.train_cases)


def test_augmented_training_inputs_are_a_function_of_seed_epoch_and_rank(prepared):
    """training.augment in the trainer: the same (seed, epoch) gives the same augmented batches in a new trainer;
    another epoch or rank draws again; labels stay binary; off by default."""
    spec, data = prepared
    recipe = {"enabled": True, "flip": 0.5, "rotate90": 0.5, "affine": 0.5, "noise": 0.5}

    def batches(augment, epoch, *, rank=0):
        trainer = replica_trainer(with_changes(spec, tile=[8, 8, 8], augment=augment), data.tfrecord_dir,
                                  rank=rank, world_size=2)
        seen = []
        trainer._forward_backward = lambda x, y: (seen.append((x.clone(), y.clone())),
                                                  TorchTrainer._forward_backward(trainer, x, y))[1]
        trainer.train_epoch(epoch)
        return trainer, seen

    def same(a, b) -> bool:
        return all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(a, b))

    assert local_trainer(spec, data.tfrecord_dir).augmenter is None
    trainer, first = batches(recipe, 1)
    assert trainer.augmenter is not None
    assert same(first, batches(recipe, 1)[1])  # a new trainer of the same seed
    assert not same(first, batches(recipe, 2)[1]) and not same(first, batches(recipe, 1, rank=1)[1])
    assert not same(first, batches({"enabled": False}, 1)[1])
    assert all(set(y.unique().tolist()) <= {0.0, 1.0} and x.shape[2:] == (8, 8, 8) for x, y in first)


# --------------------------------------------------------------------------- validation over a process group
def _validate_on_rank(rank: int, world_size: int, spec_tree: dict, tfrecord_dir: str, out: str) -> None:
    import torch.distributed as dist

    from distmis.parallel.mesh import TrialMesh
    from distmis.spec.layout import resolve_layout

    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world_size)
    try:
        spec = validate_spec(spec_tree)
        layout = dataclasses.replace(resolve_layout(spec), dp=world_size, distributed=True)  # DP replicas
        trainer = TorchTrainer(spec, tfrecord_dir, layout=layout, mesh=TrialMesh.build(layout))
        if rank == 1:  # drifted batch-norm statistics that rank 0's must replace before predicting
            for module in trainer.model.modules():
                if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                    module.running_mean.add_(3.0)
        scores = trainer.validate()
        torch.save({"metrics": [scores.loss, scores.dice, *scores.class_dice.values()],
                    "cases": len(trainer.val_cases[rank::world_size])},
                   f"{out}/rank{rank}.pt")
        dist.barrier()  # both ranks done before either tears gloo down
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # a real gloo group of 2 processes
def test_validation_is_sharded_over_ranks_and_all_reduced(tmp_path: Path):
    import torch.multiprocessing as mp

    tree = small_spec_tree(tmp_path / "data")
    tree["dataset"]["split"] = {"train": 0.5, "val": 0.5, "test": 0.0, "seed": 0}
    spec = validate_spec(tree)
    data = prepare_data(spec, tmp_path / "out", progress=False)
    whole = local_trainer(spec, data.tfrecord_dir)
    assert len(whole.val_cases) == 3  # 2 + 1: the ranks hold unequal shares
    scores = whole.validate()
    expected = [scores.loss, scores.dice, *scores.class_dice.values()]

    mp.spawn(_validate_on_rank, args=(2, spec.model_dump(mode="json"), str(data.tfrecord_dir), str(tmp_path)),
             nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [r["cases"] for r in results] == [2, 1]
    for r in results:
        np.testing.assert_allclose(r["metrics"], expected, rtol=1e-6, atol=1e-7)


def test_a_torch_trial_never_imports_tensorflow(prepared, tmp_path):
    """A torch trial's process pins only torch and reads its cases without TensorFlow (seconds of start-up
    and hundreds of MB saved per process): built and trained in a fresh interpreter, TensorFlow stays out."""
    import subprocess
    import sys

    from distmis.spec.load import spec_to_yaml

    spec, data = prepared
    tree = spec.model_dump(mode="json")
    tree["model"]["framework"] = "torch"
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(spec_to_yaml(validate_spec(tree)))
    code = (
        "import sys\n"
        "from distmis.trial.trainers import trial_frameworks\n"
        "from distmis.spec import load_spec\n"
        "from distmis.train.threads import pin_threads\n"
        "from tests.train.torch_trainers import local_trainer\n"
        f"spec = load_spec({str(spec_file)!r})\n"
        "pin_threads(1, **trial_frameworks(spec))\n"
        f"trainer = local_trainer(spec, {str(data.tfrecord_dir)!r})\n"
        "print(trainer.run_epoch(1).train_loss > 0, 'tensorflow' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["True", "False"], out.stdout + out.stderr[-2000:]


# --------------------------------------------------------------------------- any registered network: the ViT
VIT = {"name": "vit-seg", "framework": "torch",
       "params": {"layers": 2, "embed_dim": 32, "heads": 4, "patch": 4, "decoder_features": 16}}


@pytest.fixture(scope="module")
def vit_prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vit_trainer")
    tree = small_spec_tree(tmp / "data", model=VIT)
    tree["training"]["tile"] = [8, 8, 8]
    spec = validate_spec(tree)
    return spec, prepare_data(spec, tmp / "out", progress=False)


def test_the_vit_trains_validates_and_saves(vit_prepared, tmp_path: Path):
    from distmis.models.vit_seg import ViTSeg

    spec, data = vit_prepared
    trainer = local_trainer(spec, data.tfrecord_dir)
    assert isinstance(trainer.model, ViTSeg) and trainer.model.tile == (8, 8, 8) == trainer.window
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.run_epoch(1)
    assert 0 <= metrics.train_loss <= 1 and 0 <= metrics.val_dice <= 1 and np.isfinite(metrics.val_loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    # Validation predicts whole 16^3 volumes from 8^3 tiles.
    _, image, label = trainer.val_cases[0]
    prob = trainer.predict_volume(image)
    assert prob.shape == label.shape and 0 <= prob.min() and prob.max() <= 1
    trainer.save(tmp_path)
    other = local_trainer(spec, data.tfrecord_dir)
    other.load(tmp_path)
    np.testing.assert_array_equal(other.predict_volume(image), prob)
    np.testing.assert_array_equal(other.predict_with_window(image, (8, 8, 8)), prob)  # probabilities too


def test_a_fixed_input_network_is_built_for_the_whole_volume_when_no_tile_is_set(vit_prepared):
    spec, data = vit_prepared
    tree = spec.model_dump(mode="json")
    tree["training"]["tile"] = None
    trainer = local_trainer(validate_spec(tree), data.tfrecord_dir)
    assert trainer.model.tile == (16, 16, 16) == trainer.window


def test_a_logits_network_trains_on_its_logits_and_predicts_the_schemes_activation(vit_prepared):
    """What every MONAI network of the registry (``output: logits``) gets from the one trainer, with no code of
    its own: the loss from the logits, the target scheme's activation of them to predict."""
    from distmis.models.registry import MODELS
    from distmis.models.unet3d_torch import activate

    name = "segresnet" if "segresnet" in MODELS else "vit-seg"
    spec, data = vit_prepared
    if name != "vit-seg":
        tree = spec.model_dump(mode="json")
        tree["model"] = {"name": name, "framework": "torch", "params": {}}
        spec = validate_spec(tree)
    trainer = local_trainer(spec, data.tfrecord_dir)
    assert trainer.entry.output == "logits" and trainer.train_loss_fn is not trainer.loss_fn
    x, y = trainer._batch([0])
    logits = trainer.model(x)
    seen = []
    trainer._forward_backward = lambda a, b: (seen.append(TorchTrainer._forward_backward(trainer, a, b)), seen[-1])[1]
    trainer.train_epoch(0)
    assert seen and all(torch.isfinite(loss) for loss in seen)
    with torch.no_grad():
        expected = trainer.train_loss_fn(logits, y)
        trainer.model.eval()
        window = torch.zeros(1, trainer.in_channels, *trainer.network_input.tile)
        torch.testing.assert_close(trainer._probabilities(window), activate(trainer.model(window), trainer.activation))
    assert torch.isfinite(expected)


def test_a_mesh_asking_for_a_parallelism_the_model_lacks_is_refused(prepared, vit_prepared):
    from distmis.parallel.mesh import TrialMesh
    from distmis.spec.layout import resolve_layout

    for (spec, data), axis, model in ((prepared, "sp", "unet3d"), (vit_prepared, "pp", "vit-seg")):
        layout = resolve_layout(spec)
        mesh = dataclasses.replace(TrialMesh.local(layout), **{f"{axis}_size": 2})
        with pytest.raises(ValueError, match=f"model '{model}' does not support .*{axis}"):
            TorchTrainer(spec, data.tfrecord_dir, layout=layout, mesh=mesh)


def test_the_vits_figure_of_merit_comes_from_its_registry_shape(vit_prepared, prepared):
    spec, data = vit_prepared
    trainer = local_trainer(spec, data.tfrecord_dir)
    assert trainer.perf_shape.tokens == 8 and trainer.figure_of_merit(1.0) is not None
    unet = local_trainer(*[prepared[0], prepared[1].tfrecord_dir])
    assert unet.perf_shape is None and unet.figure_of_merit(1.0) is None
    # the driver logs the ViT's predictions (the performance model, which knows SP), the trainer nobody else's
    trainer.run_epoch(1)
    assert trainer.predicted_step() == {}
    measured = trainer.step_metrics().keys() - {  # its memory format's, its compilation's, its dtype's, its steps' share
        "channels_last", "format_step_seconds_contiguous", "format_step_seconds_channels_last", "compiled",
        "compile_step_seconds_eager", "compile_step_seconds_compiled", "compile_seconds", "compute_bits", "step_share"}
    assert measured == {"step_seconds", "peak_memory_mb", "fom"}


# --------------------------------------------------------------------------- a pipelined U-Net in a real gloo group
# Each rank writes what it found; the tests compare the ranks with each other, a resumed run with one trained
# straight on, and the saved model (the whole U-Net, loadable without a pipeline) with the ranks' weights. That a
# pipelined trial trains as an unpipelined one does is tests/search/test_layout_in_workers.py's (its pipelined
# search), and with a short last batch tests/faults/test_pipeline_short_batch.py's.
def pipeline_tree(data: Path) -> dict[str, Any]:
    tree = small_spec_tree(data, model={"name": "unet3d", "framework": "torch",
                                        "params": {"base_filters": 4, "levels": 3, "norm": "group", "norm_groups": 2}})
    tree["dataset"]["synthetic"]["cases"] = 10  # 5 training cases: the last batch of 2 is short
    tree["training"].update(batch_size=2, epochs=2)
    tree["parallelism"] = {"mode": "data", "workers": 1, "pipeline": {"stages": 2, "microbatches": 2}}
    return tree


def _pipeline_on_rank(rank: int, spec_tree: dict, tfrecord_dir: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    found: dict[str, Any] = {}
    try:
        spec = validate_spec(spec_tree)

        def trainer() -> TorchTrainer:
            return gloo_trainer(spec, tfrecord_dir)

        straight = trainer()
        found["batches"] = [straight.epoch_batches(e) for e in (1, 2)]
        found["plans"] = {size: dataclasses.asdict(straight.parallelism.pipeline_for(size).plan) for size in (1, 2)}
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
        growing = gloo_trainer(validate_spec(tree), tfrecord_dir)
        found["curriculum"] = []
        for epoch in (1, 2):
            metrics = growing.run_epoch(epoch).as_dict()
            found["curriculum"].append({"tile": growing.tile, "pipeline": id(growing.parallelism.pipeline),
                                        "optimizer_parameters": [id(p) for g in growing.optimizer.param_groups
                                                                 for p in g["params"]],
                                        "stage_parameters": [id(p) for p in
                                                             growing.parallelism.pipeline.parameters()],
                                        **metrics})
        found["ok"] = True
    except Exception:  # noqa: BLE001 - reported to the test, which fails with it
        found = {"ok": False, "error": traceback.format_exc()}
    finally:
        torch.save(found, f"{out}/rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory) -> tuple[Any, Any, list[dict[str, Any]], Path]:
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("pipeline_trainer")
    spec = validate_spec(pipeline_tree(tmp / "data"))
    data = prepare_data(spec, tmp / "out", progress=False)
    mp.spawn(_pipeline_on_rank, args=(spec.model_dump(mode="json"), str(data.tfrecord_dir), str(tmp)), nprocs=2,
             join=True)
    results = [torch.load(tmp / f"rank{r}.pt") for r in (0, 1)]
    failures = [r["error"] for r in results if not r["ok"]]
    assert not failures, "\n".join(failures)
    return spec, data, results, tmp


@pytest.mark.slow  # a real gloo group of 2 processes
def test_a_pipelined_trial_trains_the_unpipelined_batches_a_short_one_short(pipelined):
    spec, data, results, _ = pipelined
    plain = local_trainer(spec, data.tfrecord_dir)  # no pipeline, no process group
    for epoch, batches in zip((1, 2), results[0]["batches"]):
        assert batches == plain.epoch_batches(epoch)
        assert [len(b) for b in batches] == [2, 2, 1]  # 5 cases: every one once, the last batch short
        assert sorted(i for b in batches for i in b) == list(range(5))
    assert results[0]["batches"] == results[1]["batches"]  # both stages read the same batches


@pytest.mark.slow  # a real gloo group of 2 processes
def test_a_short_batch_gets_a_pipeline_of_its_own_shape(pipelined):
    for result in pipelined[2]:
        full, short = result["plans"][2], result["plans"][1]
        assert full == {"samples": 2, "microbatches": 2, "schedule": "gpipe"}  # as configured
        assert short == {"samples": 1, "microbatches": 1, "schedule": "gpipe"}  # one micro-batch of 1


@pytest.mark.slow  # a real gloo group of 2 processes
def test_the_pipelined_trainer_trains_and_validates_the_whole_model(pipelined):
    spec, data, results, _ = pipelined
    for result in results:  # every rank reports the same numbers, and holds every stage's weights
        for mine, first in zip(result["epochs"], results[0]["epochs"]):
            assert [mine[k] for k in ("train_loss", "val_loss", "val_dice")] == [
                first[k] for k in ("train_loss", "val_loss", "val_dice")]
        for name, value in result["weights"].items():
            torch.testing.assert_close(value, results[0]["weights"][name], atol=0, rtol=0)
    epochs = results[0]["epochs"]
    assert epochs[1]["train_loss"] < epochs[0]["train_loss"]
    assert all(e["step_seconds"] > 0 and e["peak_memory_mb"] >= 0 for e in epochs)


@pytest.mark.slow  # a real gloo group of 2 processes
def test_a_pipelined_trial_resumes_as_if_never_stopped(pipelined):
    _, _, results, _ = pipelined
    for result in results:
        resumed, straight = result["resumed_epoch"], result["epochs"][1]
        for key in ("train_loss", "val_loss", "val_dice"):
            assert resumed[key] == pytest.approx(straight[key], rel=1e-6, abs=1e-7), key
        for name, value in result["resumed_weights"].items():
            torch.testing.assert_close(value, result["weights"][name], atol=1e-6, rtol=1e-6)


@pytest.mark.slow  # a real gloo group of 2 processes
def test_the_saved_model_is_the_whole_unet(pipelined):
    spec, data, results, tmp = pipelined
    plain = local_trainer(spec, data.tfrecord_dir)  # no pipeline, no process group
    plain.load(tmp / "model")
    for name, value in plain.model.state_dict().items():
        torch.testing.assert_close(value, results[0]["weights"][name], atol=0, rtol=0)
    scores = plain.validate()
    np.testing.assert_allclose([scores.loss, scores.dice],
                               [results[0]["epochs"][1]["val_loss"], results[0]["epochs"][1]["val_dice"]], rtol=1e-6)


@pytest.mark.slow  # a real gloo group of 2 processes
def test_a_pipelined_curriculum_gets_a_pipeline_per_input(pipelined):
    for result in pipelined[2]:
        first, second = result["curriculum"]
        assert (first["tile"], second["tile"]) == ((8, 8, 8), None)
        assert (first["curriculum_stage"], second["curriculum_stage"]) == (1, 2)
        assert (second["tile_h"], second["tile_w"], second["tile_d"]) == (16, 16, 16)
        assert first["pipeline"] != second["pipeline"]  # rebuilt for the whole volume's shapes...
        for stage in (first, second):  # ...over the same parameters, which the one optimizer updates
            assert stage["stage_parameters"] == stage["optimizer_parameters"]
        assert all(np.isfinite(stage["train_loss"]) and np.isfinite(stage["val_dice"]) for stage in (first, second))


@pytest.mark.parametrize("name, params", [("dynunet", {"filters": [4, 8, 16]}),
                                          ("segresnet", {"init_filters": 8, "blocks_down": [1, 1, 1],
                                                         "blocks_up": [1, 1]})])
def test_a_monai_network_trains_a_curriculum_of_augmented_tiles(prepared, name: str, params: dict):
    """A curriculum (foreground-centred 8^3 tiles, then whole 16^3 volumes) with augmentation: one network serves
    both inputs (DynUNet's strides planned from what both divide by), and validation predicts whole volumes."""
    spec, data = prepared
    tree = spec.model_dump(mode="json")
    tree["model"] = {"name": name, "framework": "torch", "params": params}
    tree["training"].update(tile=None, epochs=2, augment={"enabled": True},
                            curriculum=[{"tile": [8, 8, 8], "epochs": 1, "tile_sampling": 1.0},
                                        {"tile": None, "epochs": 1}])
    trainer = local_trainer(validate_spec(tree), data.tfrecord_dir)
    assert trainer.network_input.tile == (8, 8, 8) and trainer.window is None  # whole volumes to validate
    inputs = []
    trainer._forward_backward = lambda x, y: (inputs.append(tuple(x.shape[2:])),
                                              TorchTrainer._forward_backward(trainer, x, y))[1]
    for epoch in (1, 2):
        metrics = trainer.run_epoch(epoch)
        assert np.isfinite(metrics.train_loss) and 0.0 <= metrics.val_dice <= 1.0
    assert set(inputs) == {(8, 8, 8), (16, 16, 16)}


#: The networks the data-mode architecture search (tests/search/test_architecture_search.py) does not train on two
#: workers: each in DDP over a real gloo group here.
REPLICATED_NETWORKS = {"segresnet": {"init_filters": 8, "blocks_down": [1, 1, 1], "blocks_up": [1, 1]},
                       "dynunet": {"filters": [4, 8, 16]}}  # kernels and strides planned from the 16^3 volume


def _train_replicas_on_rank(rank: int, world_size: int, spec_trees: dict[str, Any], tfrecord_dir: str,
                            out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world_size)
    try:
        found = {}
        for name, tree in spec_trees.items():
            spec = validate_spec(tree)
            trainer = gloo_trainer(spec, tfrecord_dir)
            before = [p.detach().clone() for p in trainer.model.parameters()]
            loss = trainer.train_epoch(1)
            found[name] = {"wrapper": type(trainer.train_model).__name__, "loss": loss,
                           "channels_last": [p.is_contiguous(memory_format=torch.channels_last_3d)
                                             for p in trainer.model.parameters() if p.dim() == 5],
                           "weights": [p.detach().clone() for p in trainer.model.parameters()],
                           "moved": any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))}
        torch.save(found, f"{out}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # a real gloo group of 2 processes, two networks trained an epoch each
def test_monai_networks_train_as_ddp_replicas_that_stay_equal(tmp_path: Path):
    """A data-parallel trial of SegResNet or DynUNet, or of the U-Net set channels-last: each rank's network in DDP
    over the DP group, its own share of the batches, the same weights on both ranks after the epoch's steps."""
    import torch.multiprocessing as mp

    trees = {}
    for name, params in REPLICATED_NETWORKS.items():
        tree = small_spec_tree(tmp_path / "data")
        tree["model"] = {"framework": "torch", "name": name, "params": params}
        tree["training"].update(tile=None, batch_size=1)
        tree["parallelism"] = {"mode": "data", "workers": 2}
        trees[name] = tree
    channels_last = json.loads(json.dumps(trees["segresnet"]))  # training.performance, set by hand
    channels_last["model"] = {"framework": "torch", "name": "unet3d", "params": {"base_filters": 4, "levels": 3}}
    channels_last["training"]["performance"] = {"memory_format": "channels_last"}
    trees["unet3d channels-last"] = channels_last
    data = prepare_data(validate_spec(trees["segresnet"]), tmp_path / "out", progress=False)
    mp.spawn(_train_replicas_on_rank, args=(2, trees, str(data.tfrecord_dir), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for name in trees:
        first, second = ranks[0][name], ranks[1][name]
        assert all(first["channels_last"]) == all(second["channels_last"]) == (name == "unet3d channels-last")
        assert first["wrapper"] == second["wrapper"] == "DistributedDataParallel", name
        assert first["moved"] and second["moved"], name
        assert first["loss"] != second["loss"], name  # each rank trained on its own share of the batches
        for a, b in zip(first["weights"], second["weights"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_prediction_that_cannot_be_made_never_stops_training(prepared, monkeypatch, caplog):
    import distmis.estimate.memory as memory

    def broken(*args, **kwargs):
        raise NotImplementedError("an operation fake tensors lack")

    monkeypatch.setattr(memory, "predict_step_memory", broken)
    spec, data = prepared
    trainer = local_trainer(spec, data.tfrecord_dir)
    metrics = trainer.run_epoch(1)
    assert metrics.predicted_step_memory_mb is None and metrics.peak_memory_mb is not None
    assert "no memory prediction for unet3d" in caplog.text and "an operation fake tensors lack" in caplog.text


def test_a_fixed_number_of_steps_per_epoch_walks_through_seeded_passes(tmp_path):
    """``training.steps_per_epoch``: every rank trains that many batches an epoch, and the epochs' cases, end to
    end, are one permutation of the training cases after another."""
    from distmis.search.prepare import prepare_data
    from distmis.spec import validate_spec
    from tests.conftest import small_spec_tree
    from tests.train.torch_trainers import local_trainer, replica_trainer

    tree = small_spec_tree(tmp_path / "data")
    tree["dataset"]["synthetic"]["cases"] = 8  # 4 training cases
    tree["model"]["framework"] = "torch"
    tree["training"].update({"steps_per_epoch": 3, "tile": [8, 8, 8]})
    spec = validate_spec(tree)
    tfrecords = prepare_data(spec, tmp_path / "out", progress=False).tfrecord_dir
    trainer = local_trainer(spec, tfrecords)
    n = len(trainer.train_cases)
    assert n == 4 and trainer.steps_per_epoch == 3
    stream = [i for epoch in range(4) for i in trainer.epoch_order(epoch)]  # 4 epochs x 6 cases = 6 passes
    assert len(stream) == 24
    passes = [stream[k:k + n] for k in range(0, len(stream), n)]
    assert all(sorted(p) == list(range(n)) for p in passes) and len({tuple(p) for p in passes}) > 1
    assert [len(b) for b in trainer.epoch_batches(1)] == [2, 2, 2]
    replicas = [replica_trainer(spec, tfrecords, rank=r, world_size=2) for r in (0, 1)]
    assert [len(r.epoch_batches(1)) for r in replicas] == [3, 3]  # 3 steps on every replica: 12 cases an epoch
    assert replicas[0].epoch_order(1) == replicas[1].epoch_order(1) and len(replicas[0].epoch_order(1)) == 12
