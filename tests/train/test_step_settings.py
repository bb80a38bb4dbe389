"""The memory format a torch trial trains in and whether its step is compiled (``training.performance``,
:mod:`distmis.train.step_settings`): chosen from measured step times (a fake clock here, never a real timing), cached
by what decides it, applied to the trainer's network and its inputs, kept by its checkpoints; a network that does not
compile falls back to eager and says so; and the same losses in either format, compiled or not, per network family,
to fp32 round-off."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from distmis.models.registry import NetworkInput, model_entry
from distmis.networks import build_network
from distmis.search.prepare import prepare_data
from distmis.spec import validate_spec
from distmis.spec.load import SpecError
from distmis.train import step_settings
from distmis.train.choice_cache import ChoiceCache
from distmis.train.step_settings import (
    CompileChoice, MemoryFormatChoice, apply_memory_format, choice_key, choose_compile,
    choose_memory_format, compile_model, decide_compile, in_memory_format, matmul_rate, matmul_side,
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


def test_the_key_imports_no_monai():
    """A trial of distmis's own U-Net never imports MONAI (seconds at each trial process's start): the key reads
    MONAI's version from its installed distribution."""
    code = ("import sys; from distmis.train.step_settings import choice_key; choice_key(network='unet3d'); "
            "assert 'monai' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_cache_is_keyed_by_what_decides_the_choice(tmp_path: Path, monkeypatch):
    cache = ChoiceCache(tmp_path / "cache" / "step_settings.json")
    decides = {"network": "unet3d", "tile": [32, 32, 32], "batch": 2, "precision": "fp32", "device": "cpu x"}
    key = choice_key(**decides)

    def cached(key: str) -> MemoryFormatChoice | None:
        return MemoryFormatChoice.from_cache(cache.entry(key))

    assert cached(key) is None
    cache.put_entry(key, MemoryFormatChoice("channels_last", "measured",
                                            {"contiguous": 2.0, "channels_last": 1.0}).cache_entry())
    assert cached(key) == MemoryFormatChoice("channels_last", "cached", {"contiguous": 2.0, "channels_last": 1.0})
    assert MemoryFormatChoice.from_cache(ChoiceCache(cache.path).entry(key)) is not None  # on disk: another process
    for change in ({"tile": [64, 64, 64]}, {"batch": 4}, {"precision": "bf16"}, {"device": "cpu y"},
                   {"network": "segresnet"}):
        assert cached(choice_key(**{**decides, **change})) is None, change
    monkeypatch.setattr(torch, "__version__", "0.0.0")  # another torch: measured again
    assert choice_key(**decides) != key
    monkeypatch.undo()
    assert choice_key(**decides) == key
    installed = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.0.0" if name == "monai" else installed(name))
    assert choice_key(**decides) != key  # another MONAI too
    monkeypatch.undo()
    cache.path.write_text("{not json")  # a damaged cache is an empty one, and is written anew
    assert cached(key) is None
    cache.put_entry(key, {"memory_format": "channels_first"})  # an entry of no known format is none
    assert cached(key) is None
    cache.put_entry(key, MemoryFormatChoice("contiguous", "measured", {}).cache_entry())
    assert json.loads(cache.path.read_text())[key]["memory_format"] == "contiguous"


FAMILIES = [
    ("unet3d", {"base_filters": 4, "levels": 3}, (16, 16, 16)),  # distmis's U-Net, group norm
    ("segresnet", {"init_filters": 8}, (16, 16, 16)),  # MONAI's residual encoder-decoder
    ("dynunet", {}, (16, 16, 16)),  # MONAI's nnU-Net network, instance norm
    ("vit-seg", {"patch": 4, "embed_dim": 32, "layers": 2, "heads": 2, "decoder_features": 8},
     (16, 16, 16)),  # the ViT: a convolution to patches, then attention
]


def three_sgd_steps(name: str, params: dict, tile: tuple[int, int, int], memory_format: str, *,
                    compiled: bool = False) -> tuple[list[float], list[torch.Tensor], torch.nn.Module]:
    """Three SGD steps of ``name``'s network from the same seeded weights on the same seeded batches, in
    ``memory_format``, eager or ``compiled``: the losses, the weights after, and the model (plain SGD: Adam divides
    each gradient by its own size, which turns round-off in a gradient near zero into a whole step)."""
    entry = model_entry(name)
    loss_fn = make_loss("dice", from_logits=entry.output == "logits", activation="sigmoid")
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.rand(2, 2, *tile, generator=generator),
                (torch.rand(2, 2, *tile, generator=generator) > 0.5).float()) for _ in range(3)]
    torch.manual_seed(0)
    model = apply_memory_format(build_network(entry, entry.params(**params), NetworkInput(2, 2, tile)), memory_format)
    forward = compile_model(model) if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = loss_fn(forward(in_memory_format(x, memory_format)), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()], model


def assert_the_same_run(run: tuple, other: tuple) -> None:
    """The same losses and weights to fp32 round-off."""
    assert other[0] == pytest.approx(run[0], rel=1e-5, abs=1e-6)
    for a, b in zip(run[1], other[1]):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("name, params, tile", FAMILIES, ids=[family[0] for family in FAMILIES])
def test_the_same_losses_in_either_format(name: str, params: dict, tile: tuple[int, int, int]):
    """Contiguous and channels-last: the same three steps."""
    contiguous = three_sgd_steps(name, params, tile, "contiguous")
    channels_last = three_sgd_steps(name, params, tile, "channels_last")
    weights = [p for p in channels_last[2].parameters() if p.dim() == 5]  # the layout in place
    assert weights and all(p.is_contiguous(memory_format=torch.channels_last_3d) for p in weights)
    assert_the_same_run(contiguous, channels_last)


def broken_backend(graph_module, example_inputs):
    """A torch.compile backend that cannot compile anything, as a network with an operation the backend lacks."""
    raise RuntimeError("no kernel for this operation")


@pytest.mark.parametrize("planned_steps, durations, compiled, source", [
    (100, [20.5, 0.5, 0.6, 0.4], True, "measured"),  # saves 0.5 s a step: 50 s over 100 steps, against 20 s
    (30, [20.5, 0.5, 0.6, 0.4], False, "measured"),  # 15 s saved do not repay 20 s of compilation
    (10_000, [20.98, 0.98, 0.98, 0.98], False, "measured"),  # faster, but by less than the margin
    (100, [], False, "not measured"),  # 100 steps of 1 s are under COMPILE_MIN_TRAINING_SECONDS: not compiled
])
def test_auto_compiles_where_the_measured_saving_repays_the_compilation(monkeypatch, planned_steps, durations,
                                                                        compiled, source):
    monkeypatch.setattr(step_settings, "COMPILE_BACKEND", "eager")  # TorchDynamo's capture, no code generation
    model, x, y, loss = tiny_unet()
    minimum = 600.0 if source == "not measured" else 20.0
    choice = choose_compile(model, loss, x, y, eager_seconds=1.0, planned_steps=planned_steps,
                            timer=ScriptedClock(durations), min_training_seconds=minimum)
    assert (choice.compiled, choice.source) == (compiled, source), choice
    if source == "measured":
        assert choice.seconds == pytest.approx({"eager": 1.0, "compiled": sorted(durations[1:])[1],
                                                "compiling": durations[0] - sorted(durations[1:])[1]})
        assert compiled or choice.reason
        # the verdict is the measurement's: the same seconds read from the cache decide alike
        assert decide_compile(choice.seconds, planned_steps, "cached").compiled == compiled
    else:
        assert "shorter than 600 s" in choice.reason


def test_an_unmeasured_eager_step_is_timed_once_where_that_step_shows_the_trial_short(monkeypatch):
    """A format set by hand leaves the eager step unmeasured: its first step (the slowest: kernels set up) bounds
    it, and a trial short even at that bound costs that one step; a longer one measures the eager step and the
    compiled one as before."""
    monkeypatch.setattr(step_settings, "COMPILE_BACKEND", "eager")
    model, x, y, loss = tiny_unet()
    clock = ScriptedClock([2.0])  # 100 steps of at most 2 s: under 600 s
    choice = choose_compile(model, loss, x, y, eager_seconds=None, planned_steps=100, timer=clock)
    assert choice == CompileChoice(False, "not measured", {"eager": 2.0}, choice.reason)
    assert "100 steps of at most 2 s" in choice.reason and clock.readings == []  # one step timed
    clock = ScriptedClock([2.0, 1.0, 1.2, 0.9, 20.5, 0.5, 0.5, 0.5])  # then a warm-up and 3 eager, the compiled
    choice = choose_compile(model, loss, x, y, eager_seconds=None, planned_steps=1000, timer=clock)
    assert choice.source == "measured" and choice.compiled and clock.readings == []
    assert choice.seconds == pytest.approx({"eager": 1.0, "compiled": 0.5, "compiling": 20.0})


def test_a_network_that_does_not_compile_falls_back_and_says_so(monkeypatch):
    monkeypatch.setattr(step_settings, "COMPILE_BACKEND", broken_backend)
    model, x, y, loss = tiny_unet()
    choice = choose_compile(model, loss, x, y, eager_seconds=10.0, planned_steps=1_000)
    assert (choice.compiled, choice.source) == (False, "fell back")
    assert "no kernel for this operation" in choice.reason and choice.metrics()["compiled"] == 0.0


#: The compiled families, each at its smallest network that still holds every kind of block (a U-Net's way down, its
#: bottom and a way up joining its skip; a transformer layer): TorchInductor's compilation, most of these tests'
#: time, grows with the graph (the U-Net at 3 levels and the ViT at 2 layers each took 1.3-1.4x as long).
COMPILED_FAMILIES = [
    ("unet3d", {"base_filters": 4, "levels": 2}, (16, 16, 16)),
    ("vit-seg", {"patch": 4, "embed_dim": 32, "layers": 1, "heads": 2, "decoder_features": 8}, (16, 16, 16)),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, params, tile", COMPILED_FAMILIES, ids=[family[0] for family in COMPILED_FAMILIES])
def test_the_same_losses_compiled(name: str, params: dict, tile: tuple[int, int, int]):
    """Eager and through TorchInductor (channels-last: the layout a compiled U-Net trains in): the same three
    steps."""
    assert_the_same_run(three_sgd_steps(name, params, tile, "channels_last"),
                        three_sgd_steps(name, params, tile, "channels_last", compiled=True))


def test_the_matmul_rate_is_a_positive_rate_per_dtype():
    fp32 = matmul_rate("cpu", torch.float32, size=256, repeats=1)
    assert fp32 > 0 and matmul_rate("cpu", torch.float32, size=256, repeats=1) == fp32  # measured once


def test_the_matmul_side_doubles_while_the_next_product_fits_the_time_allowed():
    """A fake device that computes 1e9 FLOP/s: 256^3 in 0.034 s, 512^3 in 0.27 s, 1024^3 in 2.1 s."""
    timed: list[int] = []

    def seconds_at(side: int) -> float:
        timed.append(side)
        return 2 * side**3 / 1e9

    assert matmul_side(seconds_at, 2048, 0.5) == 512  # 1024^3 is predicted at 2.1 s
    assert timed == [256, 512]
    timed.clear()
    assert matmul_side(seconds_at, 2048, 60.0) == 2048 and timed == [256, 512, 1024, 2048]
    timed.clear()
    assert matmul_side(seconds_at, 300, 60.0) == 300 and timed == [256, 300]  # never past size
    assert matmul_side(seconds_at, 128, 60.0) == 128
    with pytest.raises(ValueError, match="at least 1"):
        matmul_side(seconds_at, 0, 1.0)


def test_a_product_that_would_take_too_long_is_timed_smaller(monkeypatch):
    """Allowed no time, only 256^3 products are timed, however large ``size``; allowed a minute, ``size``'s."""
    sides: list[int] = []
    mm = torch.mm

    def recorded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        sides.append(a.shape[0])
        return mm(a, b)

    monkeypatch.setattr(torch, "mm", recorded)
    quick = matmul_rate("cpu", torch.float64, size=2048, repeats=2, max_seconds=0.0)
    assert quick > 0 and set(sides) == {256} and len(sides) == 1 + 1 + 2  # the warm-up, the probe, the repeats
    sides.clear()
    assert matmul_rate("cpu", torch.float64, size=2048, repeats=2, max_seconds=0.0) == quick and sides == []
    matmul_rate("cpu", torch.float64, size=512, repeats=2, max_seconds=60.0)
    assert sides == [256, 256, 512, 512, 512]


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
    assert 0 < metrics.step_share <= 1  # the steps against the wait for batches
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


def trainer_compiled(tree: dict, prepared_data, compile: str):
    tree = json.loads(json.dumps(tree))
    tree["training"]["performance"] = {"memory_format": "contiguous", "compile": compile}
    return local_trainer(validate_spec(tree), prepared_data.tfrecord_dir)


def test_the_trainer_compiles_its_step_and_falls_back_where_it_cannot(prepared, tmp_path: Path, monkeypatch,
                                                                      caplog):
    tree, data = prepared
    monkeypatch.setattr(step_settings, "COMPILE_BACKEND", "eager")
    eager = trainer_compiled(tree, data, "off")
    compiled = trainer_compiled(tree, data, "on")
    assert compiled.compile == CompileChoice(True, "set") and eager.compile == CompileChoice(False, "set")
    wrapped = compiled.train_model
    assert isinstance(wrapped, torch._dynamo.eval_frame.OptimizedModule) and wrapped._orig_mod is compiled.model
    first, second = eager.run_epoch(1), compiled.run_epoch(1)
    assert compiled.train_model is wrapped and second.compiled == 1.0 and first.compiled == 0.0
    assert second.train_loss == pytest.approx(first.train_loss, rel=1e-6)  # the captured graph computes the same
    saved = torch.load(compiled.save(tmp_path / "compiled"), weights_only=True)
    assert saved.keys() == eager.model.state_dict().keys()  # the plain model's weights, loadable without compiling

    monkeypatch.setattr(step_settings, "COMPILE_BACKEND", broken_backend)
    failing = trainer_compiled(tree, data, "on")
    with caplog.at_level("WARNING", logger="distmis.train.torch_trainer"):
        metrics = failing.run_epoch(1)
    assert failing.compile.source == "fell back" and "no kernel for this operation" in failing.compile.reason
    assert failing.train_model is failing.model and metrics.compiled == 0.0
    assert metrics.train_loss == pytest.approx(first.train_loss, rel=1e-6)  # the eager step, from the same weights
    assert any("does not compile" in record.getMessage() for record in caplog.records)

    # auto: a trial this short is not worth a compilation, and is not measured (its set format's eager step is timed
    # once, the bound that shows it short)
    short = trainer_compiled(tree, data, "auto")
    assert short.compile.source == "not measured" and not short.compile.compiled
    assert "of at most" in short.compile.reason
    assert short.train_model is short.model


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
    tree["training"]["performance"] = {"memory_format": "auto", "compile": "on"}
    with pytest.raises(SpecError, match="training.performance.compile: 'on' is for trials whose ranks each hold"):
        validate_spec(tree)
    tree["training"]["performance"] = {"memory_format": "auto"}
    validate_spec(tree)
    tree = small_spec_tree(tmp_path / "data")
    tree["training"]["performance"] = {"compile": "on"}  # the TensorFlow U-Net: XLA, for trials of one replica
    tree["parallelism"] = {"mode": "data", "workers": 2}
    with pytest.raises(SpecError, match="training.performance.compile: 'on' compiles a TensorFlow trial's step "
                                        "with XLA"):
        validate_spec(tree)
