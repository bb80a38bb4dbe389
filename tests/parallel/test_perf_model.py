"""The performance model's counts against the real ViT-seg: parameters exactly, FLOPs against FlopCounterMode."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from distmis.models.vit_seg import ViTSeg
from distmis.parallel.perf_model import SequenceLayout, ViTShape, seed_block_macs, vit_flops, vit_parameters

SHAPES = [  # (tile, patch, layers, embed_dim, heads, mlp_ratio, decoder_features)
    ((32, 32, 32), 8, 2, 48, 4, 4.0, 16),
    ((32, 16, 16), 4, 1, 32, 2, 2.0, 8),
    ((16, 16, 16), 2, 3, 24, 3, 4.0, 4),
]


def build(tile, patch, layers, embed_dim, heads, mlp_ratio, decoder_features) -> tuple[ViTSeg, ViTShape]:
    torch.manual_seed(0)
    model = ViTSeg(4, 3, tile, patch=patch, layers=layers, embed_dim=embed_dim, heads=heads, mlp_ratio=mlp_ratio,
                   decoder_features=decoder_features)
    return model, ViTShape(tile, patch, layers, embed_dim, heads, mlp_ratio, decoder_features, 4, 3)


@pytest.mark.parametrize("config", SHAPES)
def test_parameters_are_the_models(config):
    model, shape = build(*config)
    assert vit_parameters(shape) == sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("config", SHAPES)
@pytest.mark.parametrize("batch", [1, 2])
def test_flops_are_what_flop_counter_mode_counts(config, batch):
    """Forward, and forward plus backward, equal the counter's (the math attention kernel, which it counts)."""
    model, shape = build(*config)
    x = torch.randn(batch, 4, *shape.tile)
    predicted = vit_flops(shape, batch=batch)
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as forward:
            y = model(x)
        with FlopCounterMode(display=False) as step:
            model(x).sum().backward()
    assert predicted.forward == pytest.approx(forward.get_total_flops(), rel=1e-9)
    assert predicted.matmul == pytest.approx(step.get_total_flops(), rel=1e-9)
    assert y.shape == (batch, 3, *shape.tile)


def test_sequence_parallel_shares_the_encoder_and_no_gather_the_decoder():
    shape = ViTShape((32, 32, 32), 4, 2, 48, 4, 4.0, 16)
    one, two = vit_flops(shape), vit_flops(shape, SequenceLayout(sp=2, attention="ulysses"))
    assert two.encoder_forward == pytest.approx(one.encoder_forward / 2)
    assert two.embed_forward == pytest.approx(one.embed_forward / 2)
    assert two.decoder_forward == one.decoder_forward  # gather: every rank decodes the whole tile
    split = vit_flops(shape, SequenceLayout(sp=2, decoder="no-gather"))
    assert split.decoder_forward == pytest.approx(one.decoder_forward / 2)
    with pytest.raises(ValueError, match="do not divide by SP=3"):
        vit_flops(shape, SequenceLayout(sp=3))


def test_the_seeds_block_count_is_half_the_models_flops_at_mlp_ratio_4():
    """Equation 20 counts multiply-accumulates; the model's blocks, in FLOPs, are twice that (bias-free)."""
    shape = ViTShape((96, 96, 96), 16, 1, 768, 12)
    s, d = shape.tokens, shape.embed_dim
    for sp in (1, 2, 4):
        assert vit_flops(shape, SequenceLayout(sp=sp)).encoder_forward == pytest.approx(2 * seed_block_macs(s, d, sp))


def test_ring_bytes_equal_the_sp_benchmarks_analytic_volume():
    """benchmarks/sp_scaling.py's own count (whose Ulysses rows its measurement matched to 1%)."""
    import importlib.util
    from pathlib import Path

    from distmis.parallel.perf_model import communication_bytes

    path = Path(__file__).parents[2] / "benchmarks" / "sp_scaling.py"
    module_spec = importlib.util.spec_from_file_location("sp_scaling", path)
    sp_scaling = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(sp_scaling)
    for patch in (4, 8, 16):
        shape = ViTShape((96, 96, 96), patch, 2, 96, 4, 4.0, 16, 4, 1)
        for sp in (1, 2, 4):
            for attention in ("allgather-kv", "ulysses"):
                predicted = communication_bytes(shape, SequenceLayout(sp=sp, attention=attention)).total
                expected = sp_scaling.analytic_bytes(sp, shape.tokens, 96, 2, vit_parameters(shape), attention)
                assert predicted == pytest.approx(expected, rel=1e-9)


def test_gloo_reduce_scatter_and_data_parallel_bytes():
    from distmis.parallel.perf_model import communication_bytes

    shape = ViTShape((32, 32, 32), 4, 2, 48, 4)
    ring = communication_bytes(shape, SequenceLayout(sp=4))
    gloo = communication_bytes(shape, SequenceLayout(sp=4), cost="gloo")
    assert gloo.attention == pytest.approx(1.5 * ring.attention)  # the backward's half sends twice as much
    ulysses = communication_bytes(shape, SequenceLayout(sp=4, attention="ulysses"), cost="gloo")
    assert ulysses.attention == pytest.approx(ring.attention / 2)  # 8 (k-1)/k against 4 (k-1): SP/2 = 2 times less
    alone = communication_bytes(shape, dp=4)
    assert alone.attention == alone.sp_gradients == alone.decoder_gather == 0
    assert alone.dp_gradients == pytest.approx(4 * 2 * 3 / 4 * vit_parameters(shape))


def test_memory_parts_follow_the_layout():
    from distmis.parallel.perf_model import vit_memory

    shape = ViTShape((96, 96, 96), 4, 2, 96, 4, 4.0, 16, 4, 1)
    one = vit_memory(shape)
    assert one.scores == pytest.approx(2 * 4 * shape.tokens**2 * 4)  # every layer's probabilities, fp32
    assert one.transient == pytest.approx(2 * 4 * shape.tokens**2 * 4)  # the backward's two more
    assert one.parameters == one.gradients == one.optimizer / 2 == 4 * vit_parameters(shape)
    for sp in (2, 4):
        split = vit_memory(shape, SequenceLayout(sp=sp))
        assert split.scores == pytest.approx(one.scores / sp) and split.activations < one.activations
        assert split.parameters == one.parameters  # replicated
    fused = vit_memory(shape, kernel="fused")
    assert fused.scores == 0 and fused.peak < one.peak / 10
    gather = vit_memory(shape, SequenceLayout(sp=4), kernel="fused")
    local = vit_memory(shape, SequenceLayout(sp=4, decoder="no-gather"), kernel="fused")
    assert local.activations < gather.activations and local.transient == pytest.approx(gather.transient / 4)
    assert vit_memory(shape, batch=2).activations == pytest.approx(2 * one.activations)


def test_the_seeds_table_2_and_figure_of_merit():
    from distmis.parallel.perf_model import communication_bytes, figure_of_merit, seed_table2

    shape = ViTShape((96, 96, 96), 16, 1, 768, 12)  # the SP-ViT paper's configuration, one block
    table = seed_table2(shape, n=4)
    assert table["ZeRO3"]["param_comm"] == pytest.approx(1.5 * table["DP"]["param_comm"])  # "around 1.5x"
    assert table["SP-Ulysses"]["activation_comm"] == pytest.approx(8 / 4 * shape.tokens * 768)
    assert table["ZeRO3"]["optimizer_memory"] == pytest.approx(table["DP"]["optimizer_memory"] / 4)
    # the model's Ulysses traffic of one layer is the seed's 8/N b s d with (N-1)/N of each all-to-all sent
    ulysses = communication_bytes(shape, SequenceLayout(sp=4, attention="ulysses"), bytes_per_value=1)
    assert ulysses.attention == pytest.approx(table["SP-Ulysses"]["activation_comm"] * 3 / 4)
    assert figure_of_merit(shape, batch=2, seconds=0.5) == pytest.approx(2 * 1 * 216**2 * 768 / 0.5)
    with pytest.raises(ValueError, match="positive"):
        figure_of_merit(shape, batch=1, seconds=0)
