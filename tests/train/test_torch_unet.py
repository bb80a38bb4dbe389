"""The PyTorch U-Net trainer on real TFRecords made from a tiny synthetic dataset."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from distmis.search.prepare import prepare_data
from distmis.spec import validate_spec
from distmis.train.tf_unet import NonFiniteLossError
from distmis.train.torch_unet import (
    TorchUNetTrainer,
    make_loss,
    shard_batches,
    soft_dice_loss,
    soft_dice_per_sample,
)
from tests.conftest import small_spec_tree


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch_trainer")
    spec = validate_spec(small_spec_tree(tmp / "data"))
    return spec, prepare_data(spec, tmp / "out", progress=False)


def with_changes(spec, **training):
    tree = spec.model_dump(mode="json")
    tree["training"].update(training)
    return validate_spec(tree)


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
    ranks = [TorchUNetTrainer(spec, data.tfrecord_dir, rank=r, world_size=2) for r in (0, 1)]
    n = len(ranks[0].train_images)
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
    trainer = TorchUNetTrainer(spec, data.tfrecord_dir)
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


def test_wrap_model_is_trained(prepared):
    spec, data = prepared
    wrapped = []

    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        wrapped.append(model)
        return torch.nn.Sequential(model)

    trainer = TorchUNetTrainer(spec, data.tfrecord_dir, wrap_model=wrap)
    assert wrapped == [trainer.model] and trainer.train_model[0] is trainer.model
    assert np.isfinite(trainer.train_epoch())


def test_the_schedule_sets_the_optimizers_rate_at_each_epoch_and_step(prepared):
    spec, data = prepared
    trainer = TorchUNetTrainer(with_changes(spec, epochs=2, lr_schedule={"name": "poly", "power": 1.0}),
                               data.tfrecord_dir)
    for epoch, rate in ((1, 1.0e-3), (2, 0.5e-3)):
        assert trainer.run_epoch(epoch).learning_rate == pytest.approx(rate)
        assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(rate)
    stepped = TorchUNetTrainer(with_changes(spec, epochs=2, lr_schedule={"name": "cosine", "interval": "step"}),
                               data.tfrecord_dir)
    seen = []
    step = stepped.optimizer.step
    stepped.optimizer.step = lambda *a, **k: (seen.append(stepped.optimizer.param_groups[0]["lr"]), step(*a, **k))[1]
    stepped.train_epoch(1)
    stepped.train_epoch(2)  # 3 cases in batches of 2: steps at 0, 1/4, 1/2 and 3/4 of the 2 epochs
    assert seen == pytest.approx([1.0e-3 * 0.5 * (1 + math.cos(math.pi * q / 4)) for q in range(4)])


def test_same_seed_same_start_whatever_the_learning_rate(prepared):
    spec, data = prepared
    a = TorchUNetTrainer(with_changes(spec, optimizer={"lr": 1.0e-3}), data.tfrecord_dir)
    b = TorchUNetTrainer(with_changes(spec, optimizer={"lr": 5.0e-3}), data.tfrecord_dir)
    for (name, wa), wb in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(wa, wb), name
    assert a.epoch_batches(0) == b.epoch_batches(0)  # same data order
    c = TorchUNetTrainer(with_changes(spec, seed=1), data.tfrecord_dir)
    assert any(not torch.equal(wa, wc) for wa, wc in zip(a.model.parameters(), c.model.parameters()))


def test_tiled_training_and_validation_cover_the_volume(prepared):
    spec, data = prepared
    trainer = TorchUNetTrainer(with_changes(spec, tile=[8, 8, 8]), data.tfrecord_dir)
    x, y = trainer._batch([0, 1])
    assert x.shape[2:] == y.shape[2:] == (8, 8, 8)
    _, image, label = trainer.val_cases[0]
    prob = trainer.predict_volume(image)
    assert prob.shape == label.shape and np.isfinite(prob).all()
    assert 0 <= prob.min() and prob.max() <= 1
    val_loss, val_dice = trainer.validate()
    assert np.isfinite(val_loss) and 0 <= val_dice <= 1
    with pytest.raises(ValueError, match="training.tile \\[32, 8, 8\\]"):
        TorchUNetTrainer(with_changes(spec, tile=[32, 8, 8]), data.tfrecord_dir)


def test_foreground_tile_sampling_centres_tiles_on_the_label(prepared):
    spec, data = prepared

    def label_tiles(fraction: float) -> list[torch.Tensor]:
        trainer = TorchUNetTrainer(with_changes(spec, tile=[4, 4, 4], tile_sampling=fraction), data.tfrecord_dir)
        return [y for epoch in range(8) for batch in trainer.epoch_batches(epoch) for y in trainer._batch(batch)[1]]

    assert all(label.any() for label in TorchUNetTrainer(spec, data.tfrecord_dir).train_labels)
    uniform, centred, half = label_tiles(0.0), label_tiles(1.0), label_tiles(0.5)
    assert any(not y.any() for y in uniform)  # a uniform offset misses the foreground at times
    assert all(y.any() for y in centred)  # a centred tile never does
    # the coin's and the centre's draws come from a generator of their own: a tile not centred is a uniform one
    assert any(torch.equal(h, u) for h, u in zip(half, uniform))
    assert not all(torch.equal(h, u) for h, u in zip(half, uniform))


def test_random_tiles_crop_image_and_label_alike(prepared):
    spec, data = prepared
    tiled = with_changes(spec, tile=[8, 8, 8])
    trainer = TorchUNetTrainer(tiled, data.tfrecord_dir)
    # Number every voxel, in image and label alike, so a crop shows where it was taken.
    shape = trainer.train_images[0].shape
    numbered = torch.arange(np.prod(shape[1:]), dtype=torch.float32).reshape(shape[1:])
    trainer.train_images[0] = numbered.expand(shape).clone()
    trainer.train_labels[0] = numbered[None].clone()
    corners = []
    for _ in range(10):
        x, y = trainer._batch([0])
        torch.testing.assert_close(x[0, 0], y[0, 0])  # same offset for image and label
        corners.append(int(x[0, 0, 0, 0, 0]))
    assert len(set(corners)) > 1  # the offsets are random...
    again = TorchUNetTrainer(tiled, data.tfrecord_dir)
    again_crops = [again._random_crop(tuple(shape[1:]), trainer.train_labels[0]) for _ in range(10)]
    assert [int(numbered[c[1:]][0, 0, 0]) for c in again_crops] == corners  # ...and seeded


def test_nan_loss_raises(prepared):
    spec, data = prepared
    trainer = TorchUNetTrainer(spec, data.tfrecord_dir)
    with torch.no_grad():
        trainer.model.down[0][0].weight.fill_(float("nan"))
    with pytest.raises(NonFiniteLossError, match="epoch 3"):
        trainer.run_epoch(3)


def test_bad_rank():
    with pytest.raises(ValueError, match="rank must lie in \\[0, 2\\), got 2"):
        TorchUNetTrainer(validate_spec(small_spec_tree("/nonexistent")), "/nonexistent", rank=2, world_size=2)


# --------------------------------------------------------------------------- validation over a process group
def _validate_on_rank(rank: int, world_size: int, spec_tree: dict, tfrecord_dir: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world_size)
    try:
        trainer = TorchUNetTrainer(validate_spec(spec_tree), tfrecord_dir, rank=rank, world_size=world_size)
        if rank == 1:  # drifted batch-norm statistics that rank 0's must replace before predicting
            for module in trainer.model.modules():
                if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                    module.running_mean.add_(3.0)
        torch.save({"metrics": trainer.validate(), "cases": len(trainer.val_cases[rank::world_size])},
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
    whole = TorchUNetTrainer(spec, data.tfrecord_dir)
    assert len(whole.val_cases) == 3  # 2 + 1: the ranks hold unequal shares
    expected = whole.validate()

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
        "from distmis.search.trainable import trial_frameworks\n"
        "from distmis.spec import load_spec\n"
        "from distmis.train.threads import pin_threads\n"
        "from distmis.train.torch_unet import TorchUNetTrainer\n"
        f"spec = load_spec({str(spec_file)!r})\n"
        "pin_threads(1, **trial_frameworks(spec))\n"
        f"trainer = TorchUNetTrainer(spec, {str(data.tfrecord_dir)!r})\n"
        "print(trainer.run_epoch(1).train_loss > 0, 'tensorflow' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["True", "False"], out.stdout + out.stderr[-2000:]
