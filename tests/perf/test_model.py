"""The performance model's counts against the real ViT-seg: parameters exactly, FLOPs against FlopCounterMode."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from distmis.models.vit_seg import ViTSeg
from distmis.perf.model import SequenceLayout, ViTShape, seed_block_macs, vit_flops, vit_parameters

SHAPES = [  # (tile, patch, layers, embed_dim, heads, mlp_ratio, decoder_features)
    ((32, 32, 32), 8, 2, 48, 4, 4.0, 16),
    ((32, 16, 16), 4, 1, 32, 2, 2.0, 8),
    ((16, 16, 16), 2, 3, 24, 3, 4.0, 4),
]


def build(tile, patch, layers, embed_dim, heads, mlp_ratio, decoder_features,
          attention: str = "full") -> tuple[ViTSeg, ViTShape]:
    torch.manual_seed(0)
    model = ViTSeg(4, 3, tile, patch=patch, layers=layers, embed_dim=embed_dim, heads=heads, mlp_ratio=mlp_ratio,
                   decoder_features=decoder_features, attention=attention)
    return model, ViTShape(tile, patch, layers, embed_dim, heads, mlp_ratio, decoder_features, 4, 3, attention)


@pytest.mark.parametrize("attention", ["full", "axial"])
@pytest.mark.parametrize("config", SHAPES)
def test_parameters_are_the_models(config, attention):
    model, shape = build(*config, attention)
    assert vit_parameters(shape) == sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("attention", ["full", "axial"])
@pytest.mark.parametrize("config", SHAPES)
@pytest.mark.parametrize("batch", [1, 2])
def test_flops_are_what_flop_counter_mode_counts(config, batch, attention):
    """Forward, and forward plus backward, equal the counter's (the math attention kernel, which it counts)."""
    model, shape = build(*config, attention)
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

    from distmis.perf.model import communication_bytes

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
    from distmis.perf.model import communication_bytes

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
    from distmis.perf.model import PROCESS_OVERHEAD, process_overhead, vit_memory

    shape = ViTShape((96, 96, 96), 4, 2, 96, 4, 4.0, 16, 4, 1)
    one = vit_memory(shape)
    probabilities = 4 * shape.tokens**2 * 4  # one layer's, 4 heads, fp32
    assert one.moment == "backward: softmax of layer 2"
    assert one.scores == pytest.approx(2 * probabilities)  # every layer's probabilities
    # their gradient and the softmax's, on top of the gradient flowing back and the one being formed
    assert one.transient == pytest.approx(2 * probabilities + 2 * shape.tokens * 96 * 4)
    assert one.parameters == one.gradients == one.optimizer / 2 == 4 * vit_parameters(shape)
    assert one.peak == pytest.approx(one.tensors + PROCESS_OVERHEAD) and one.step == one.peak - one.parameters
    assert vit_memory(shape, overhead=0).peak == one.tensors
    # a small step's heap keeps no more than its tensors: code pages and buffers, then the tensors' peak again
    small = vit_memory(ViTShape((16, 16, 16), 4, 1, 16, 2, 4.0, 8, 4, 1))
    assert small.overhead == pytest.approx(process_overhead(0) + small.tensors - small.parameters)
    assert process_overhead(0) < process_overhead(10 * 2**20) < process_overhead(2**30) == PROCESS_OVERHEAD
    for sp in (2, 4):
        split = vit_memory(shape, SequenceLayout(sp=sp))
        assert split.scores == pytest.approx(one.scores / sp) and split.activations < one.activations
        assert split.parameters == one.parameters  # replicated
    fused = vit_memory(shape, kernel="fused")
    assert fused.scores == 0 and fused.peak < one.peak / 10
    assert fused.moment == "backward: decoder head"  # the decoder's full-resolution maps, not attention
    gather = vit_memory(shape, SequenceLayout(sp=4), kernel="fused")
    local = vit_memory(shape, SequenceLayout(sp=4, decoder="no-gather"), kernel="fused")
    assert local.saved < gather.saved and local.step < gather.step
    assert vit_memory(shape, batch=2).saved == pytest.approx(2 * one.saved)
    # one thread: the 1x1x1 head runs slow_conv3d, whose buffers are smaller than oneDNN's padded reorders
    assert vit_memory(shape, SequenceLayout(sp=4), kernel="fused", threads=1).workspace < gather.workspace
    with pytest.raises(ValueError, match="threads"):
        vit_memory(shape, threads=0)


@pytest.mark.parametrize("batch, channels, size, kernel", [
    (1, 8, 48, 3), (1, 16, 48, 3), (1, 96, 12, 3), (1, 96, 24, 3), (2, 4, 8, 3), (1, 4, 96, 1), (1, 4, 16, 4),
    (16, 2, 4, 1), (1, 1, 32, 2),
])
def test_the_convolution_kernel_is_the_one_torch_selects(batch, channels, size, kernel):
    """oneDNN or slow_conv3d (whose column buffers the decoder's peak holds): torch's own choice."""
    from distmis.perf.model import onednn_convolution

    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            x, w = torch.empty(batch, channels, size, size, size), torch.empty(2, channels, kernel, kernel, kernel)
            backend = torch._C._select_conv_backend(x, w, None, [1] * 3, [kernel // 2] * 3, [1] * 3, False,
                                                    [0] * 3, 1, None)
            expected = backend == torch._C._ConvBackend.Mkldnn
            assert onednn_convolution(batch, channels, size * size, kernel, n) == expected, (n, backend)
    finally:
        torch.set_num_threads(threads)


def allocations(run) -> list[int]:
    """The sizes of the CPU allocations ``run()`` makes (the profiler's allocation events)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    sizes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation and event.extra_fields.alloc_size > 0:
            sizes.append(event.extra_fields.alloc_size)
        stack.extend(event.children)
    return sizes


def test_slow_conv3d_unfolds_27_input_channels_per_voxel():
    """The decoder's workspace at patches 8 and 16: a 27 c_in x voxels column buffer, forward and backward."""
    from distmis.perf.model import onednn_convolution

    assert not onednn_convolution(1, 4, 16 * 16, 3, 2)
    conv = torch.nn.Conv3d(4, 2, 3, padding=1)
    x = torch.randn(1, 4, 16, 16, 16, requires_grad=True)
    forward = allocations(lambda: conv(x))
    y = conv(x)
    backward = allocations(lambda: y.sum().backward())
    assert max(forward) == max(backward) == 27 * 4 * 16**3 * 4


@pytest.mark.parametrize("attention", ["full", "axial"])
@pytest.mark.parametrize("kernel", ["math", "fused"])
@pytest.mark.parametrize("config", SHAPES)
def test_the_saved_activations_are_what_autograd_saves(config, kernel, attention):
    """At the forward's end: every tensor autograd saved (its storages, less the parameters, input and target),
    and, with the math kernel, every layer's (s x s) attention probabilities exactly (full attention)."""
    from distmis.perf.model import vit_memory

    model, shape = build(*config, attention)
    x, y = torch.randn(1, 4, *shape.tile), torch.rand(1, 3, *shape.tile)
    given = {t.untyped_storage().data_ptr() for t in [x, y, *model.parameters()]}
    storages, probabilities = {}, {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in given:
            storages[storage.data_ptr()] = storage.nbytes()
            if tensor.dim() == 4 and tensor.shape[-2:] == (shape.tokens, shape.tokens):
                probabilities[storage.data_ptr()] = storage.nbytes()
        return tensor

    backend = SDPBackend.MATH if kernel == "math" else SDPBackend.FLASH_ATTENTION
    with sdpa_kernel(backend), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
    predicted = vit_memory(shape, kernel=kernel)
    scores = shape.layers * shape.heads * shape.tokens**2 * 4
    if attention == "full":
        assert sum(probabilities.values()) == (scores if kernel == "math" else 0)
    else:  # s (gh + gw + gd) per head and block
        assert predicted.scores == (shape.layers * shape.heads * shape.tokens * sum(shape.grid) * 4
                                    if kernel == "math" else 0)
    # the norms' means and deviations (two values a token or a channel) are not counted
    assert predicted.saved == pytest.approx(sum(storages.values()), rel=0.02)


@pytest.mark.parametrize("attention", ["full", "axial"])
@pytest.mark.parametrize("kernel", ["math", "fused"])
@pytest.mark.parametrize("config", SHAPES + [((48, 48, 48), 8, 2, 32, 4, 4.0, 16)])
def test_the_tensor_peak_of_two_steps_is_the_profilers(config, kernel, attention):
    """The largest sum of live tensors over two Adam steps (what the profiler records), one thread: the peak's
    moment (a softmax's backward, a decoder convolution's columns) and its size."""
    from distmis.perf.model import vit_memory

    model, shape = build(*config, attention)
    optimizer = torch.optim.Adam(model.parameters())
    x, y = torch.randn(1, 4, *shape.tile), torch.rand(1, 3, *shape.tile)

    def steps() -> None:
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
            optimizer.step()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with sdpa_kernel(SDPBackend.MATH if kernel == "math" else SDPBackend.FLASH_ATTENTION):
            from torch._C._profiler import _EventType
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                steps()
    finally:
        torch.set_num_threads(threads)
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.alloc_size, event.extra_fields.ptr))
        stack.extend(event.children)
    live, current, peak = {}, 0, 0
    for _, size, ptr in sorted(events):
        current -= live.pop(ptr, 0)
        if size > 0:
            live[ptr] = size
            current += size
        peak = max(peak, current)
    predicted = vit_memory(shape, kernel=kernel, threads=1, overhead=0)
    assert predicted.step == pytest.approx(peak, rel=0.05)


def test_the_seeds_table_2_and_figure_of_merit():
    from distmis.perf.model import communication_bytes, figure_of_merit, seed_table2

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
