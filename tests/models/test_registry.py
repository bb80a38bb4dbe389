"""Every registered network (:mod:`distmis.models.registry`): built through its entry at a tiny input, the shape it
returns, MONAI's networks built exactly as MONAI's constructor builds them (same arguments, same defaults, no
wrapper), and each exported as distmis exports a registered model (``torch.export``, any number of windows)."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from typing import Any

import pytest
import torch

from distmis.models.dynunet_plan import plan_dynunet
from distmis.models.params import ACT_OPTIONS, NORM_OPTIONS
from distmis.models.registry import MODELS, NetworkInput, model_entry
from distmis.networks import build_network

IN_CHANNELS, OUT_CHANNELS = 2, 3

#: Small params and a tile each network takes (and trains on: instance normalization needs a deepest feature map
#: of more than one voxel, so SwinUNETR's is 64 along one axis).
TINY: dict[str, tuple[dict[str, Any], tuple[int, int, int]]] = {
    "unet3d": ({"base_filters": 4, "levels": 3}, (16, 16, 16)),
    "vit-seg": ({"layers": 1, "embed_dim": 16, "heads": 2, "patch": 4, "decoder_features": 8}, (16, 16, 16)),
    "segresnet": ({"init_filters": 8, "blocks_down": (1, 1, 1), "blocks_up": (1, 1)}, (16, 16, 16)),
    "unetr": ({"feature_size": 8, "hidden_size": 48, "mlp_dim": 96, "num_heads": 4}, (32, 32, 32)),
    "swinunetr": ({"feature_size": 12, "depths": (1, 1, 1, 1)}, (64, 32, 32)),
    "dynunet": ({"filters": (4, 8, 16, 32)}, (32, 32, 16)),
    "basicunet": ({"features": (4, 4, 8, 16, 32, 4)}, (32, 32, 32)),
}
MONAI = sorted(name for name, entry in MODELS.items() if entry.constructor is not None)


def test_every_entry_has_tiny_params_here_and_the_monai_ones_are_the_five():
    assert set(TINY) == set(MODELS)
    assert MONAI == ["basicunet", "dynunet", "segresnet", "swinunetr", "unetr"]
    for name in MONAI:
        entry = MODELS[name]
        assert entry.frameworks == ("torch",) and entry.output == "logits" and entry.parallelisms == {"dp"}
        assert entry.summary and entry.constructor.startswith("monai.networks.nets:")
    assert [name for name, entry in MODELS.items() if entry.fixed_input] == ["vit-seg", "unetr"]


def build(name: str, params: dict[str, Any], tile: tuple[int, int, int], **network: Any) -> torch.nn.Module:
    entry = model_entry(name)
    torch.manual_seed(0)
    return build_network(entry, entry.params.model_validate(params),
                         NetworkInput(IN_CHANNELS, OUT_CHANNELS, tile, **network))


@pytest.mark.parametrize("name", list(TINY))
def test_every_entry_builds_at_a_tiny_input_and_trains_on_it(name):
    params, tile = TINY[name]
    entry = model_entry(name)
    validated = entry.params.model_validate(params)
    assert all(t % entry.input_multiple(validated) == 0 for t in tile), entry.input_rule(validated)
    assert entry.input_check is None or entry.input_check(validated, tile, 2) is None
    network = build(name, params, tile).train()
    out = network(torch.randn(2, IN_CHANNELS, *tile))
    assert out.shape == (2, OUT_CHANNELS, *tile)
    out.float().mean().backward()  # a training step's backward runs
    if entry.output == "probabilities":
        assert float(out.detach().min()) >= 0 and float(out.detach().max()) <= 1


def constructor(name: str) -> type:
    module, _, attribute = model_entry(name).constructor.partition(":")
    return getattr(importlib.import_module(module), attribute)


def monai_arguments(name: str, params: dict[str, Any], tile: tuple[int, int, int]) -> dict[str, Any]:
    """What a researcher would pass MONAI's constructor for these params on this input (the kernels and strides
    DynUNet leaves to distmis: nnU-Net's plan for the tile)."""
    arguments = {"spatial_dims": 3, "in_channels": IN_CHANNELS, "out_channels": OUT_CHANNELS, **params}
    if name == "unetr":
        arguments["img_size"] = tile
    if name == "dynunet" and "strides" not in params:
        plan = plan_dynunet(tile, max_downsamplings=len(params["filters"]) - 1)
        arguments.update(kernel_size=plan.kernel_size, strides=plan.strides, upsample_kernel_size=plan.strides[1:])
    return arguments


@pytest.mark.parametrize("name", MONAI)
def test_a_monai_entry_builds_exactly_monai_s_network(name):
    params, tile = TINY[name]
    network = build(name, params, tile)
    cls = constructor(name)
    assert type(network) is cls  # no wrapper
    reference = cls(**monai_arguments(name, params, tile))
    assert sum(p.numel() for p in network.parameters()) == sum(p.numel() for p in reference.parameters())
    assert [n for n, _ in network.named_parameters()] == [n for n, _ in reference.named_parameters()]


def test_dynunet_with_given_strides_and_an_anisotropic_plan():
    params = {"kernel_size": [3, 3, [3, 3, 1]], "strides": [1, 2, [2, 2, 1]], "filters": [4, 8, 16]}
    network = build("dynunet", params, (16, 16, 8))
    reference = constructor("dynunet")(**monai_arguments("dynunet", params, (16, 16, 8)),
                                       upsample_kernel_size=[2, [2, 2, 1]])
    assert sum(p.numel() for p in network.parameters()) == sum(p.numel() for p in reference.parameters())
    assert network.train()(torch.randn(2, IN_CHANNELS, 16, 16, 8)).shape == (2, OUT_CHANNELS, 16, 16, 8)
    entry, validated = model_entry("dynunet"), model_entry("dynunet").params.model_validate(params)
    assert entry.input_multiple(validated) == 4 and "[4, 4, 2]" in entry.input_rule(validated)
    # planned: from the tile and the spacing given with the network input
    planned = build("dynunet", {"filters": [4, 8, 16, 32, 64]}, (64, 64, 16), spacing=(0.8, 0.8, 3.0))
    assert [tuple(s) for s in planned.strides] == list(plan_dynunet((64, 64, 16), (0.8, 0.8, 3.0)).strides)
    assert planned.eval()(torch.randn(1, IN_CHANNELS, 64, 64, 16)).shape == (1, OUT_CHANNELS, 64, 64, 16)
    assert model_entry("dynunet").input_multiple(model_entry("dynunet").params()) == 1


# MONAI's arguments that distmis plans rather than takes a default for.
PLANNED = {"dynunet": {"kernel_size", "strides", "upsample_kernel_size"}}


@pytest.mark.parametrize("name", MONAI)
def test_every_params_field_is_a_constructor_argument_with_monai_s_default(name):
    signature = inspect.signature(constructor(name)).parameters
    for field, info in model_entry(name).params.model_fields.items():
        assert field in signature, f"{name}: {field} is no argument of {constructor(name).__name__}"
        if field in PLANNED.get(name, ()):
            assert signature[field].default is inspect.Parameter.empty and info.default is None
        else:
            assert info.default == signature[field].default, (name, field)
    supplied = {"spatial_dims", "in_channels", "out_channels", "img_size"}
    assert not supplied & set(model_entry(name).params.model_fields)


def test_the_norm_and_activation_names_and_options_are_monai_s_and_torch_s():
    from monai.networks.layers.factories import Act, Norm

    for name, options in NORM_OPTIONS.items():
        parameters = inspect.signature(Norm[name, 3]).parameters
        assert set(options) <= set(parameters), name
    for name, options in ACT_OPTIONS.items():
        parameters = inspect.signature(Act[name]).parameters
        assert set(options) <= set(parameters), name


@pytest.mark.parametrize("name", list(TINY))
def test_every_entry_exports_as_a_registered_model_is_exported(name):
    """``distmis.predict.registry._write_network``: eval mode, no gradients, any number of windows."""
    params, tile = TINY[name]
    network = build(name, params, tile).eval()
    windows = torch.randn(2, IN_CHANNELS, *tile)
    with torch.no_grad():
        program = torch.export.export(network, (windows,), dynamic_shapes=({0: torch.export.Dim("windows", min=1)},))
        expected = network(windows[:1])
        out = program.module()(windows[:1])
    assert out.shape == (1, OUT_CHANNELS, *tile)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_the_input_check_says_what_torch_says():
    """A deepest feature map of one voxel cannot be instance-normalized: the spec refuses it before torch would."""
    entry = model_entry("basicunet")
    params = entry.params.model_validate(TINY["basicunet"][0])
    message = entry.input_check(params, (16, 16, 16), 2)
    assert "single voxel" in message and "instance normalization" in message
    with pytest.raises(ValueError, match="more than 1 spatial element"):
        build("basicunet", TINY["basicunet"][0], (16, 16, 16)).eval()(torch.randn(1, IN_CHANNELS, 16, 16, 16))
    assert entry.input_check(params, (32, 16, 16), 2) is None
    batch_norm = entry.params.model_validate({**TINY["basicunet"][0], "norm": "batch"})
    for batch in (1, 2):  # a batch of 2 still ends an epoch of 3 cases with a batch of one sample
        assert "batch normalization" in entry.input_check(batch_norm, (16, 16, 16), batch)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        build("basicunet", {**TINY["basicunet"][0], "norm": "batch"}, (16, 16, 16)).train()(
            torch.randn(1, IN_CHANNELS, 16, 16, 16))
    group_norm = entry.params.model_validate({**TINY["basicunet"][0], "norm": ["group", {"num_groups": 2}]})
    assert entry.input_check(group_norm, (16, 16, 16), 1) is None
    swin = model_entry("swinunetr")
    assert "single voxel" in swin.input_check(swin.params(feature_size=12), (32, 32, 32), 2)
    vit = model_entry("vit-seg")  # one token: the decoder's first map is a single voxel
    vit_params = {"layers": 1, "embed_dim": 32, "heads": 2, "patch": 8, "decoder_features": 8}
    assert "single voxel" in vit.input_check(vit.params(**vit_params), (8, 8, 8), 2)
    assert vit.input_check(vit.params(**vit_params), (16, 8, 8), 2) is None
    with pytest.raises(ValueError, match="more than 1 spatial element"):
        build("vit-seg", vit_params, (8, 8, 8)).train()(torch.randn(1, IN_CHANNELS, 8, 8, 8))


def test_the_registry_imports_no_torch():
    code = "import sys, distmis.models.registry, distmis.models.dynunet_plan; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
