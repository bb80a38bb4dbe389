"""The memory format a torch trial trains in (``training.performance.memory_format``,
:mod:`distmis.train.step_settings`): chosen from measured step times (a fake clock here, never a real timing), cached
by what decides it, applied to the trainer's network and its inputs, kept by its checkpoints; and the same losses in
either format, per network family, to fp32 round-off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from distmis.models.registry import NetworkInput, model_entry
from distmis.networks import build_network
from distmis.search.prepare import prepare_data
from distmis.spec import validate_spec
from distmis.spec.load import SpecError
from distmis.train.step_settings import (
    ChoiceCache, MemoryFormatChoice, apply_memory_format, choice_key, choose_memory_format, in_memory_format,
    matmul_rate,
)
from distmis.train.torch_losses import make_loss
from tests.conftest import small_spec_tree
from tests.train.torch_trainers import local_trainer


class ScriptedClock:
    """A clock whose every timed step lasts the next of ``durations`` seconds (a start and an end reading each)."""

    def __init__(self, durations: list[float]) -> None:
        self.readings = []
        now = 0.0
        for duration in durations:
            self.readings += [now, now + duration]
            now += duration + 1.0
        self.readings.reverse()

    def __call__(self) -> float:
        return self.readings.pop()


def tiny_unet() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, object]:
    entry = model_entry("unet3d")
    torch.manual_seed(0)
    model = build_network(entry, entry.params(base_filters=4, levels=2), NetworkInput(2, 2, (8, 8, 8)))
    x = torch.rand(2, 2, 8, 8, 8)
    y = (torch.rand(2, 2, 8, 8, 8) > 0.5).float()
    return model, x, y, make_loss("dice", activation="sigmoid")


@pytest.mark.parametrize("contiguous, channels_last, chosen", [
    ([1.0, 1.1, 0.9], [0.5, 0.6, 0.55], "channels_last"),  # the medians: 1.0 against 0.55
    ([1.0, 1.0, 1.0], [0.97, 0.97, 0.97], "contiguous"),  # faster, but by less than the margin
    ([0.5, 0.5, 0.5], [1.0, 1.0, 1.0], "contiguous"),
])
def test_auto_takes_the_format_whose_measured_step_is_faster(contiguous, channels_last, chosen):
    model, x, y, loss = tiny_unet()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    choice = choose_memory_format(model, loss, x, y, timer=ScriptedClock(contiguous + channels_last))
    assert choice.memory_format == chosen and choice.source == "measured"
    assert choice.seconds == pytest.approx({"contiguous": sorted(contiguous)[1], "channels_last": sorted(channels_last)[1]})
    # measured on copies: the model itself is as it was, weights and layout
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]) and value.is_contiguous(), name


def test_the_cache_is_keyed_by_what_decides_the_choice(tmp_path: Path, monkeypatch):
    cache = ChoiceCache(tmp_path / "cache" / "step_settings.json")
    decides = {"network": "unet3d", "tile": [32, 32, 32], "batch": 2, "precision": "fp32", "device": "cpu x"}
    key = choice_key(**decides)
    assert cache.get(key) is None
    cache.put(key, MemoryFormatChoice("channels_last", "measured", {"contiguous": 2.0, "channels_last": 1.0}))
    assert cache.get(key) == MemoryFormatChoice("channels_last", "cached", {"contiguous": 2.0, "channels_last": 1.0})
    assert ChoiceCache(cache.path).get(key) is not None  # on disk: another process reads it
    for change in ({"tile": [64, 64, 64]}, {"batch": 4}, {"precision": "bf16"}, {"device": "cpu y"},
                   {"network": "segresnet"}):
        assert cache.get(choice_key(**{**decides, **change})) is None, change
    monkeypatch.setattr(torch, "__version__", "0.0.0")  # another torch: measured again
    assert choice_key(**decides) != key
    cache.path.write_text("{not json")  # a damaged cache is an empty one, and is written anew
    assert cache.get(key) is None
    cache.put(key, MemoryFormatChoice("contiguous", "measured", {}))
    assert json.loads(cache.path.read_text())[key]["memory_format"] == "contiguous"


FAMILIES = [
    ("unet3d", {"base_filters": 4, "levels": 3}, (16, 16, 16)),  # distmis's U-Net, group norm
    ("segresnet", {"init_filters": 8}, (16, 16, 16)),  # MONAI's residual encoder-decoder
    ("dynunet", {}, (16, 16, 16)),  # MONAI's nnU-Net network, instance norm
    ("vit-seg", {"patch": 4, "embed_dim": 32, "layers": 2, "heads": 2, "decoder_features": 8},
     (16, 16, 16)),  # the ViT: a convolution to patches, then attention
]


@pytest.mark.parametrize("name, params, tile", FAMILIES, ids=[family[0] for family in FAMILIES])
def test_the_same_losses_in_either_format(name: str, params: dict, tile: tuple[int, int, int]):
    """Three SGD steps from the same weights and batches, contiguous and channels-last: the same losses and weights
    to fp32 round-off (plain SGD: Adam divides each gradient by its own size, which turns round-off in a gradient
    near zero into a whole step)."""
    entry = model_entry(name)
    network = NetworkInput(2, 2, tile)
    loss_fn = make_loss("dice", from_logits=entry.output == "logits", activation="sigmoid")
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.rand(2, 2, *tile, generator=generator),
                (torch.rand(2, 2, *tile, generator=generator) > 0.5).float()) for _ in range(3)]
    runs = {}
    for memory_format in ("contiguous", "channels_last"):
        torch.manual_seed(0)
        model = apply_memory_format(build_network(entry, entry.params(**params), network), memory_format)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for x, y in batches:
            optimizer.zero_grad()
            loss = loss_fn(model(in_memory_format(x, memory_format)), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        runs[memory_format] = (losses, [p.detach().clone() for p in model.parameters()])
        if memory_format == "channels_last":  # the layout is in place: the convolutions' weights channels-last
            weights = [p for p in model.parameters() if p.dim() == 5]
            assert weights and all(p.is_contiguous(memory_format=torch.channels_last_3d) for p in weights)
    (contiguous, weights), (channels_last, weights_cl) = runs["contiguous"], runs["channels_last"]
    assert channels_last == pytest.approx(contiguous, rel=1e-5, abs=1e-6)
    for a, b in zip(weights, weights_cl):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4)


def test_the_matmul_rate_is_a_positive_rate_per_dtype():
    fp32 = matmul_rate("cpu", torch.float32, size=256, repeats=1)
    assert fp32 > 0 and matmul_rate("cpu", torch.float32, size=256, repeats=1) == fp32  # measured once


# --------------------------------------------------------------------------- in the trainer
@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("step_settings")
    tree = small_spec_tree(tmp / "data")
    tree["model"]["framework"] = "torch"
    spec = validate_spec(tree)
    return tree, prepare_data(spec, tmp / "out", progress=False)


def trainer_with(tree: dict, prepared_data, memory_format: str):
    tree = json.loads(json.dumps(tree))
    tree["training"]["performance"] = {"memory_format": memory_format}
    return local_trainer(validate_spec(tree), prepared_data.tfrecord_dir)


def test_the_trainer_trains_and_predicts_in_the_format_set_and_its_checkpoint_keeps_it(prepared, tmp_path: Path,
                                                                                       monkeypatch):
    tree, data = prepared
    monkeypatch.setenv("DISTMIS_CACHE", str(tmp_path / "cache"))
    trainer = trainer_with(tree, data, "channels_last")
    assert trainer.memory_format == MemoryFormatChoice("channels_last", "set")
    convolutions = [p for p in trainer.model.parameters() if p.dim() == 5]
    assert convolutions and all(p.is_contiguous(memory_format=torch.channels_last_3d) for p in convolutions)
    seen = []
    trainer.model.register_forward_pre_hook(lambda module, args: None if isinstance(args[0], FakeTensor) else seen.append(
        (tuple(args[0].shape), args[0].stride())))  # fake: the memory model's trace of the step
    metrics = trainer.run_epoch(1)
    # training's and validation's inputs, channels-last (validation's windows are views of a channels-last volume)
    assert len(seen) > 2 and all(stride[1] == 1 for _, stride in seen), seen
    assert metrics.channels_last == 1.0 and metrics.step_flop_rate > 0 and 0 < metrics.matmul_fraction
    trainer.save_state(tmp_path / "state")

    # an auto trial measured contiguous goes on channels-last from that checkpoint, as the trial began
    resumed = trainer_with(tree, data, "auto")
    resumed.memory_format = MemoryFormatChoice("contiguous", "measured")
    apply_memory_format(resumed.model, "contiguous")
    resumed.load_state(tmp_path / "state", epoch=1)
    assert resumed.memory_format.memory_format == "channels_last"
    assert all(p.is_contiguous(memory_format=torch.channels_last_3d)
               for p in resumed.model.parameters() if p.dim() == 5)
    for mine, theirs in zip(resumed.model.parameters(), trainer.model.parameters()):
        assert torch.equal(mine, theirs)


def test_auto_measures_once_and_reads_the_cache_after(prepared, tmp_path: Path, monkeypatch):
    tree, data = prepared
    monkeypatch.setenv("DISTMIS_CACHE", str(tmp_path / "cache"))
    first = trainer_with(tree, data, "auto")
    assert first.memory_format.source == "measured" and set(first.memory_format.seconds) == {"contiguous",
                                                                                              "channels_last"}
    second = trainer_with(tree, data, "auto")
    assert second.memory_format == MemoryFormatChoice(first.memory_format.memory_format, "cached",
                                                      first.memory_format.seconds)
    # the measurement used none of the trial's random numbers: both start alike
    for a, b in zip(first.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(first._tile_rng.get_state(), second._tile_rng.get_state())


def test_a_set_format_is_refused_where_it_does_not_apply(tmp_path: Path):
    tree = small_spec_tree(tmp_path / "data")
    tree["training"]["performance"] = {"memory_format": "channels_last"}  # the TensorFlow U-Net: channels-last
    with pytest.raises(SpecError, match="training.performance.memory_format: 'channels_last' lays out a torch"):
        validate_spec(tree)
    tree["model"] = {"name": "vit-seg", "framework": "torch",
                     "params": {"patch": 4, "embed_dim": 32, "layers": 2, "heads": 2, "decoder_features": 8}}
    tree["parallelism"] = {"mode": "experiment", "sequence_parallel": {"degree": 2}}
    with pytest.raises(SpecError, match="parallelism.sequence_parallel.degree is 2"):
        validate_spec(tree)
    tree["training"]["performance"] = {"memory_format": "auto"}
    validate_spec(tree)
