"""Mixed precision across ranks, for real: a gloo group of 2 processes (issue 37).

Under bf16 the sequence-parallel collectives carry the activations' dtype both ways (the gathered K and V, the
all-to-alls of Ulysses and of DSP's switches, and their backwards), the pipeline's stages send bf16 activations into
buffers made bf16 (checked by ``torch.distributed.pipelining``'s own per-chunk validation, on with
``TORCH_DISTRIBUTED_DEBUG=DETAIL``), data parallelism all-reduces fp32 gradients, and every strategy leaves fp32
gradients on fp32 parameters. Each parallel step is compared with the same step on one device under the same
autocast: bf16 rounds differently in a different summation order, so the tolerance is bf16's, a few 1e-2 of the
largest value. fp16's overflow is agreed over the ranks: one rank's overflow skips every rank's step.
"""

from __future__ import annotations

import copy
import types
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from distmis.models.unet3d_torch import UNet3D
from distmis.models.vit_seg import ViTSeg
from distmis.train.precision import TorchPrecision, cpu_float16_supported
from distmis.train.torch_losses import make_loss
from tests.parallel.gloo_cases import Cases, case, mesh_layout, spawn_cases

pytestmark = pytest.mark.slow  # a real gloo process group of 2 ranks

VIT = dict(in_channels=2, num_classes=3, tile=(16, 8, 8), patch=4, layers=1, embed_dim=32, heads=4, mlp_ratio=2.0,
           decoder_features=8)
AXIAL = {**VIT, "tile": (16, 8, 16), "attention": "axial"}


def close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = 0.05) -> float:
    """The largest difference relative to the largest expected value; asserted within ``tolerance``."""
    error = ((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-12)).item()
    assert error <= tolerance, f"relative error {error:.3g} > {tolerance}"
    return error


def vit_batch(tile) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, 2, *tile, generator=g), torch.randint(0, 3, (2, *tile), generator=g)


def sp_case(attention: str) -> dict[str, Any]:
    """SP=2 under bf16: the tensors the collectives deliver are bf16 (forward, and the gradients their backward
    hands back), the loss and fp32 gradients those of one device under the same autocast."""
    import torch.distributed as dist

    from distmis.parallel.sequence import parallelize_vit_seg, sync_sp_gradients

    config = AXIAL if attention == "dsp" else VIT
    torch.manual_seed(0)
    base = ViTSeg(**config)
    x, y = vit_batch(config["tile"])
    precision = TorchPrecision("bf16", "cpu")
    reference = copy.deepcopy(base)
    with precision.autocast():
        logits = reference(x)
    expected = F.cross_entropy(logits.float(), y)
    expected.backward()

    net = parallelize_vit_seg(copy.deepcopy(base), dist.group.WORLD, attention=attention)
    delivered: list[torch.dtype] = []
    returned: list[torch.dtype] = []
    if attention == "dsp":  # the stream each stage receives: after its switch's all-to-all
        watched = [stage for block in net.model.blocks for stage in block.axial]
        hooks = [m.register_forward_pre_hook(lambda _m, args: delivered.append(args[0].dtype)) for m in watched]
        hooks += [m.register_full_backward_pre_hook(lambda _m, grads: returned.append(grads[0].dtype))
                  for m in watched]
    else:  # what the local core gets from the collective, and the gradients the collective's backward returns
        cores = [block.attn.core for block in net.model.blocks]
        hooks = [core.local.register_forward_pre_hook(lambda _m, args: delivered.extend(a.dtype for a in args))
                 for core in cores]
        hooks += [core.register_full_backward_hook(
            lambda _m, grads_in, _out: returned.extend(g.dtype for g in grads_in if g is not None)) for core in cores]
    with precision.autocast():
        out = net(x)
    loss = F.cross_entropy(out.float(), net.local_target(y))
    loss.backward()
    sync_sp_gradients(net)
    for hook in hooks:
        hook.remove()
    assert delivered and set(delivered) == {torch.bfloat16}, delivered
    assert returned and set(returned) == {torch.bfloat16}, returned
    assert out.dtype == torch.bfloat16 and loss.dtype == torch.float32
    close(loss.detach(), expected.detach(), 0.02)
    grads = {n.removeprefix("model."): p.grad for n, p in net.named_parameters()}
    assert {g.dtype for g in grads.values()} == {torch.float32}
    errors = [close(grads[n], p.grad, 0.1) for n, p in reference.named_parameters()]
    return {"loss": float(loss), "worst": max(errors)}


def collective_backwards_case() -> dict[str, Any]:
    """Each collective's backward, called as autograd calls it, returns its gradient in the dtype it was given
    (autograd would cast a mismatched one back silently)."""
    import torch.distributed as dist

    from distmis.parallel import collectives as c

    rank = dist.get_rank()
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.full((4, 2), rank + 1.0, dtype=dtype)
        gathered = c.AllGatherForwardReduceScatterBackward.apply(x, 0, None)
        assert gathered.dtype == dtype and gathered.shape == (8, 2)
        ctx = types.SimpleNamespace(dim=0, group=None, scatter_dim=0, gather_dim=1)
        grad = torch.ones(8, 2, dtype=dtype)
        for function in (c.AllGatherForwardReduceScatterBackward, c.AllGatherForwardSplitBackward):
            back = function.backward(ctx, grad)[0]
            assert back.dtype == dtype and back.shape == (4, 2)
        moved = c.AllToAll.apply(x, 0, 1, None)
        assert moved.dtype == dtype and moved.shape == (2, 4)
        assert c.AllToAll.backward(ctx, torch.ones(2, 4, dtype=dtype))[0].dtype == dtype
        assert c.SwitchSplitForwardSwitchBackBackward.apply(x, 1, 0, None).dtype == dtype
    return {}


PIPE_TILE, PIPE_BATCH = (16, 16, 16), 4


def unet() -> UNet3D:
    torch.manual_seed(0)
    return UNet3D(in_channels=2, num_classes=2, base_filters=4, levels=3, norm="group", norm_groups=2)


def unet_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(PIPE_BATCH, 2, *PIPE_TILE, generator=g)
    return x, (torch.rand(PIPE_BATCH, 2, *PIPE_TILE, generator=g) > 0.7).float()


def pipeline_case(schedule: str) -> dict[str, Any]:
    """Two stages under bf16 through the trainer's strategy (``PipelineParallel``): stage 0 sends bf16 activations
    into stage 1's bf16 buffers (the pipelining library validates every chunk's metadata), the loss and the fp32
    gradients are one device's under the same autocast."""
    import torch.distributed as dist

    from distmis.parallel.mesh import TrialMesh
    from distmis.parallel.pipeline import pipeline_unet
    from distmis.train.parallelism import InputShape, PipelineParallel

    dist.set_debug_level(dist.DebugLevel.DETAIL)  # per-chunk shape and dtype validation of what stages exchange
    try:
        precision = TorchPrecision("bf16", "cpu")
        loss_fn = precision.fp32_loss(make_loss("dice-bce"))
        base = unet()
        x, y = unet_batch()
        reference = copy.deepcopy(base)
        with precision.autocast():
            probabilities = reference(x)
        assert probabilities.dtype == torch.float32  # the activation is computed in fp32
        expected = loss_fn(probabilities, y)
        expected.backward()

        mesh = TrialMesh.build(mesh_layout(pp=2))
        strategy = PipelineParallel(mesh, torch.device("cpu"), precision=precision, pipeline_function=pipeline_unet,
                                    microbatches=2, schedule=schedule, loss_fn=loss_fn)
        stage = strategy.apply(copy.deepcopy(base), InputShape(PIPE_TILE, PIPE_BATCH))
        sent: list[torch.dtype] = []
        hook = stage.register_forward_hook(
            lambda _m, _i, out: sent.extend(t.dtype for t in (out if isinstance(out, tuple) else ())))
        stage.train()
        loss = strategy.forward_backward(stage, loss_fn, x, y)
        hook.remove()
        if strategy.pipeline.is_first:
            assert sent and set(sent) == {torch.bfloat16}, sent
        else:
            assert not sent  # the last stage returns the probabilities, which it does not send
        close(loss, expected.detach(), 0.02)
        names = {id(p): n for n, p in strategy.pipeline.model.named_parameters()}
        expected_grads = dict(reference.named_parameters())
        params = strategy.pipeline.parameters()
        assert params and {p.grad.dtype for p in params} == {torch.float32}
        worst = max(close(p.grad, expected_grads[names[id(p)]].grad, 0.1) for p in params)
        return {"loss": float(loss), "worst": worst}
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)


def ddp_case() -> dict[str, Any]:
    """DP=2 (``Replicas``: DDP) under bf16: the gradients DDP all-reduces are fp32 and the same on both ranks."""
    import torch.distributed as dist

    from distmis.parallel.mesh import TrialMesh
    from distmis.train.parallelism import InputShape, Replicas

    precision = TorchPrecision("bf16", "cpu")
    mesh = TrialMesh.build(mesh_layout(dp=2))
    strategy = Replicas(mesh, torch.device("cpu"), precision=precision)
    model = strategy.apply(unet(), InputShape(PIPE_TILE, 2))
    x, y = unet_batch()
    shard = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
    loss = strategy.forward_backward(model, precision.fp32_loss(make_loss("dice")), x[shard], y[shard])
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert grads.dtype == torch.float32 and loss.dtype == torch.float32
    others = [torch.empty_like(grads) for _ in range(2)]
    dist.all_gather(others, grads)
    torch.testing.assert_close(others[0], others[1], rtol=0, atol=0)
    return {}


def fp16_overflow_case() -> dict[str, Any]:
    """Rank 0's gradients overflow, rank 1's do not: both skip the step and back off to the same scale (the
    overflow agreed over the group); the next step, finite on both, is taken. Without float16 on this CPU the
    precision is refused on every rank."""
    import torch.distributed as dist

    if not cpu_float16_supported():
        with pytest.raises(ValueError, match="float16"):
            TorchPrecision("fp16", "cpu")
        return {"skipped_step": None}
    precision = TorchPrecision("fp16", "cpu")
    torch.manual_seed(dist.get_rank())  # different parameters on each rank, as a pipeline's stages hold
    layer = torch.nn.Linear(3, 1)
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.1)
    before = [p.detach().clone() for p in layer.parameters()]

    def step(blow_up: bool) -> bool:
        optimizer.zero_grad(set_to_none=True)
        with precision.autocast():
            out = layer(torch.ones(1, 3))
        loss = out.float().sum() * (float("inf") if blow_up else 1.0)
        precision.backward(loss)
        return precision.step(optimizer, [dist.group.WORLD])

    took = step(blow_up=dist.get_rank() == 0)
    assert took is False and precision.scaler.get_scale() == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))
    assert step(blow_up=False) is True
    scales = [None, None]
    dist.all_gather_object(scales, precision.scaler.get_scale())
    assert scales[0] == scales[1] == 2.0**15
    return {"skipped_step": True}


def clipping_case() -> dict[str, Any]:
    """Two ranks hold the two halves of one model, as a pipeline's stages do: clipped over their group, each half is
    what clipping the whole model in one process gives (``training.clip_grad_norm``); clipped alone, it is not."""
    import torch.distributed as dist

    from distmis.train.clipping import clip_torch_gradients

    torch.manual_seed(0)
    whole = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3))]
    for p, grad in zip(whole, (torch.tensor([3.0, -4.0, 1.0, 2.0]), torch.tensor([5.0, 0.5, -2.0]))):
        p.grad = grad.clone()
    mine = torch.nn.Parameter(torch.zeros_like(whole[dist.get_rank()]))
    mine.grad = whole[dist.get_rank()].grad.clone()
    alone = mine.grad.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(whole, 2.0)
    norm = clip_torch_gradients([mine], 2.0, [dist.group.WORLD])
    torch.testing.assert_close(norm, expected_norm)
    torch.testing.assert_close(mine.grad, whole[dist.get_rank()].grad)
    clip_torch_gradients([torch.nn.Parameter(torch.zeros_like(alone))], 2.0)  # no gradient: nothing to clip
    own = torch.nn.Parameter(torch.zeros_like(alone))
    own.grad = alone.clone()
    clip_torch_gradients([own], 2.0)
    assert not torch.allclose(own.grad, mine.grad)  # its own norm only: not the model's
    return {"norm": float(norm)}


def make_cases(world_size: int) -> Cases:
    cases: dict[str, Callable[[], dict[str, Any]]] = {
        "collectives": collective_backwards_case,
        "sp/allgather-kv": lambda: sp_case("allgather-kv"),
        "sp/ulysses": lambda: sp_case("ulysses"),
        "sp/dsp": lambda: sp_case("dsp"),
        "pipeline/gpipe": lambda: pipeline_case("gpipe"),
        "pipeline/1f1b": lambda: pipeline_case("1f1b"),
        "ddp": ddp_case,
        "fp16-overflow": fp16_overflow_case,
        "clipping": clipping_case,
    }
    return cases


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    return spawn_cases(make_cases, 2, tmp_path_factory.mktemp("precision"))


def test_collectives_backwards_keep_the_dtype(ranks):
    case(ranks, "collectives")


@pytest.mark.parametrize("attention", ["allgather-kv", "ulysses", "dsp"])
def test_sequence_parallel_bf16_collectives_and_gradients(ranks, attention):
    results = case(ranks, f"sp/{attention}")
    assert results[0]["loss"] == pytest.approx(results[1]["loss"], rel=0.02)  # gather: the same loss on both


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_stages_send_bf16_into_bf16_buffers(ranks, schedule):
    results = case(ranks, f"pipeline/{schedule}")
    assert results[0]["loss"] == results[1]["loss"]  # the last stage's loss, broadcast


def test_data_parallel_bf16_all_reduces_fp32_gradients(ranks):
    case(ranks, "ddp")


def test_an_overflow_on_one_rank_skips_every_ranks_fp16_step(ranks):
    results = case(ranks, "fp16-overflow")
    assert results[0]["skipped_step"] == results[1]["skipped_step"] == (True if cpu_float16_supported() else None)


def test_a_pipelines_stages_clip_their_gradients_to_the_models_global_norm(ranks):
    results = case(ranks, "clipping")
    assert results[0]["norm"] == results[1]["norm"] > 2.0
