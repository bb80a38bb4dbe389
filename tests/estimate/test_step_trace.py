"""A registered network's training step, traced on fake tensors: the real step's bytes and FLOPs, for every network,
with nothing written per architecture."""

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import distmis.networks as networks
from distmis.estimate.live_bytes import LiveBytes
from distmis.estimate.memory import RETAINED_SHARE, predict_step_memory
from distmis.estimate.step_trace import TrainingStep, trace_step
from distmis.estimate.workspace import workspace_rule
from distmis.models.params import NetworkParams
from distmis.models.registry import MODELS, ModelEntry, NetworkInput, model_entry
from distmis.train.torch_losses import make_loss

DICE = make_loss("dice", from_logits=True)  # on logits, through a sigmoid

MIB = 2**20


def test_the_trace_on_fake_tensors_is_the_real_steps():
    entry = model_entry("unet3d")
    params = entry.params(base_filters=4, levels=3)
    network = NetworkInput(2, 2, (16, 16, 32))
    traced = trace_step(entry, params, network, make_loss("dice"), batch=2, threads=2)

    torch.manual_seed(0)
    model = networks.build_network(entry, params, network)
    step = TrainingStep(model, network, make_loss("dice"), batch=2)  # the U-Net gives probabilities
    step()
    live = LiveBytes(workspace_rule("cpu", threads=2))
    live.hold(step.held())
    with FlopCounterMode(display=False) as counter, live:
        saved = step(live.mark)
    assert traced.peak_bytes == live.peak and traced.workspace_bytes == live.peak_workspace
    assert traced.saved_bytes == saved and traced.moment == live.moment
    assert traced.flops == counter.get_total_flops() > traced.forward_flops > 0
    assert traced.parameters == sum(p.numel() for p in model.parameters())
    assert traced.optimizer_bytes == 2 * traced.gradient_bytes + 4 * len(list(model.parameters()))  # Adam's steps
    assert traced.batch_bytes == 4 * 2 * (2 + 2) * 16 * 16 * 32
    assert not traced.stand_in_loss  # distmis's own losses run on fake tensors


def test_a_loss_that_reads_values_is_traced_through_its_stand_in():
    """MONAI's DiceCELoss turns a tensor into a list, which a fake tensor cannot: the trace takes a loss of the same
    tensors in its place and says so."""
    entry = model_entry("segresnet")
    network = NetworkInput(1, 3, (16, 16, 16), activation="softmax")
    monai = trace_step(entry, entry.params(), network, make_loss("dice-ce", from_logits=True, activation="softmax"),
                       batch=1)
    own = trace_step(entry, entry.params(), network, make_loss("dice", from_logits=True, activation="softmax"),
                     batch=1)
    assert monai.stand_in_loss and not own.stand_in_loss
    assert monai.saved_bytes == own.saved_bytes  # the network's, before any loss
    assert monai.peak_bytes == pytest.approx(own.peak_bytes, rel=0.1)


@pytest.fixture
def toy_network(monkeypatch):
    """A network added to the registry as any is: an entry and a builder, nothing for the estimate."""
    entry = ModelEntry(name="toy-conv", params=NetworkParams, frameworks=("torch",), output="logits",
                       input_multiple=lambda p: 1, input_rule=lambda p: "any")

    def build(params, network):
        return nn.Sequential(nn.Conv3d(network.in_channels, 8, 3, padding=1), nn.ReLU(),
                             nn.Conv3d(8, network.out_channels, 1))

    monkeypatch.setitem(MODELS, entry.name, entry)
    monkeypatch.setitem(networks.BINDINGS, entry.name, networks.Bindings({"torch": build}))
    return entry


def test_a_network_added_to_the_registry_is_traced_as_its_arithmetic_says(toy_network):
    batch, c_in, c_out, tile = 2, 3, 2, (8, 12, 16)
    voxels = batch * 8 * 12 * 16
    trace = trace_step(toy_network, NetworkParams(), NetworkInput(c_in, c_out, tile), DICE, batch=batch)
    first, second = 2 * c_in * 27 * 8 * voxels, 2 * 8 * c_out * voxels  # multiply-adds, twice
    assert trace.forward_flops == first + second
    # the backward: the first convolution's weights only (the input needs no gradient), the second's both
    assert trace.flops == 2 * first + 3 * second
    assert trace.parameters == c_in * 27 * 8 + 8 + 8 * c_out + c_out
    # at the forward's end: the ReLU's output (kept by it and the second convolution) and the network's output
    assert trace.saved_bytes == 4 * (8 + c_out) * voxels
    assert trace.gradient_bytes == 4 * trace.parameters


@pytest.mark.slow  # builds and traces every registered network (about 40 s)
def test_every_registered_torch_network_is_traced_and_its_memory_grows_with_the_tile():
    for name, entry in MODELS.items():
        if "torch" not in entry.frameworks:
            continue
        side = max(16, entry.input_multiple(entry.params()))
        # the smallest cube the network trains on (SwinUNETR's instance norm needs a deepest map of 2 voxels)
        while entry.input_check is not None and entry.input_check(entry.params(), (side,) * 3, 1) is not None:
            side *= 2
        loss_fn = DICE if entry.output == "logits" else make_loss("dice")
        trace = trace_step(entry, entry.params(), NetworkInput(1, 2, (side,) * 3), loss_fn, batch=1)
        assert trace.parameters > 0 and trace.flops > 2 * trace.forward_flops > 0, name
        # fp32 gradients of the fp32 weights that take part (UNETR's classification token does not)
        assert 0.99 * 4 * trace.parameters <= trace.gradient_bytes <= 4 * trace.parameters, name
        assert trace.peak_bytes >= trace.saved_bytes > 0, name
    entry = model_entry("segresnet")
    small, large = (predict_step_memory(entry, entry.params(), NetworkInput(1, 2, (t, t, t)), DICE, batch=1)
                    for t in (16, 32))
    assert large.trace.saved_bytes > 6 * small.trace.saved_bytes  # 8x the voxels, the same weights
    assert large.step > large.trace.optimizer_bytes + large.trace.peak_bytes  # the heap's retention on a CPU
    assert large.overhead == pytest.approx(RETAINED_SHARE * (large.step - large.overhead))


def test_mixed_precision_halves_a_unets_activations():
    entry = model_entry("unet3d")
    network = NetworkInput(2, 2, (32, 32, 32))
    fp32, bf16 = (trace_step(entry, entry.params(), network, make_loss("dice"), batch=2, precision=p)
                  for p in ("fp32", "bf16"))
    assert bf16.saved_bytes < 0.6 * fp32.saved_bytes
    assert bf16.gradient_bytes == fp32.gradient_bytes and bf16.optimizer_bytes == fp32.optimizer_bytes


def test_a_network_without_torch_and_a_bad_batch_are_refused():
    keras_only = ModelEntry(name="keras-only", params=NetworkParams, frameworks=("tensorflow",),
                            output="probabilities", input_multiple=lambda p: 1, input_rule=lambda p: "any")
    with pytest.raises(ValueError, match="'keras-only' has no torch network"):
        trace_step(keras_only, NetworkParams(), NetworkInput(1, 1, (8, 8, 8)), DICE, batch=1)
    entry = model_entry("unet3d")
    with pytest.raises(ValueError, match="batch must be at least 1, got 0"):
        trace_step(entry, entry.params(), NetworkInput(1, 1, (8, 8, 8)), DICE, batch=0)
