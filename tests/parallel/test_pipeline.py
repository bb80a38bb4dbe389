"""The U-Net as LAMP's sequence of cells, the cost of each and their cut into stages: on one process.

The pipeline itself, over real gloo groups, is in ``test_pipeline_parallel.py``; here only the error a failing
stage raises, in a gloo group of one.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from distmis.models.unet3d_torch import UNet3D
from distmis.models.vit_seg import ViTSeg
from distmis.parallel.pipeline import (
    BatchPlan,
    StageCells,
    balanced_partition,
    batch_plan,
    cell_macs,
    max_pipeline_stages,
    unet_cells,
)
from tests.parallel.gloo_cases import Cases, case, spawn_cases


def small_unet(levels: int = 3, norm: str = "group") -> UNet3D:
    torch.manual_seed(0)
    return UNet3D(in_channels=2, num_classes=3, base_filters=4, levels=levels, norm=norm, norm_groups=2)


@pytest.mark.parametrize("levels", [2, 3, 4])
def test_the_cells_in_turn_are_the_model(levels):
    model = small_unet(levels).eval()
    cells = unet_cells(model)
    assert len(cells) == max_pipeline_stages(levels) == 2 * levels - 1
    x = torch.randn(2, 2, 16, 16, 8)
    out = (x,)
    for cell in cells:
        out = cell(*out)
    torch.testing.assert_close(out, model(x), atol=0, rtol=0)


def test_the_last_cell_applies_the_models_softmax():
    model = UNet3D(in_channels=2, num_classes=3, base_filters=4, levels=3, norm="group", norm_groups=2,
                   activation="softmax").eval()
    x = torch.randn(2, 2, 16, 16, 8)
    out = (x,)
    for cell in unet_cells(model):
        out = cell(*out)
    torch.testing.assert_close(out, model(x), atol=0, rtol=0)
    torch.testing.assert_close(out.sum(dim=1), torch.ones(2, 16, 16, 8))


def test_the_cells_hold_the_models_own_parameters():
    model = small_unet()
    in_cells = {id(p) for cell in unet_cells(model) for p in cell.parameters()}
    assert in_cells == {id(p) for p in model.parameters()}


@pytest.mark.parametrize("cut", [[(0, 2), (2, 5)], [(0, 1), (1, 2), (2, 4), (4, 5)]])
def test_stages_of_cells_carry_the_skips_to_their_decoder_levels(cut):
    model = small_unet().eval()
    cells = unet_cells(model)
    x = torch.randn(1, 2, 16, 16, 16)
    out = (x,)
    for start, stop in cut:
        out = StageCells(cells[start:stop])(*out)
        if stop < len(cells):  # between stages: the activation and every skip not yet used, all contiguous
            assert isinstance(out, tuple) and all(t.is_contiguous() for t in out)
    torch.testing.assert_close(out, model(x), atol=0, rtol=0)


def test_a_decoder_cell_without_its_skip_says_so():
    cells = unet_cells(small_unet())
    with pytest.raises(ValueError, match="skip"):
        cells[-1](torch.randn(1, 8, 8, 8, 8))


@pytest.mark.parametrize("levels,tile", [(3, (16, 16, 16)), (4, (32, 16, 24))])
def test_cell_costs_add_up_to_the_models_convolution_flops(levels, tile):
    model = small_unet(levels)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.randn(1, 2, *tile))
    assert 2 * sum(cell_macs(model, tile)) == counter.get_total_flops()


def brute_force(costs, stages):
    """The smallest largest stage over every cut of ``costs`` into ``stages`` non-empty ranges."""
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        edges = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(edges, edges[1:])))
    return best


@pytest.mark.parametrize("costs", [[5, 1, 1, 1, 5], [96, 48, 24, 12, 52, 104, 216], [1] * 7, [9, 2, 7, 3, 3, 8]])
def test_balanced_partition_finds_the_smallest_largest_stage(costs):
    for stages in range(1, len(costs) + 1):
        bounds = balanced_partition(costs, stages)
        assert len(bounds) == stages and bounds[0][0] == 0 and bounds[-1][1] == len(costs)
        assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
        assert max(sum(costs[a:b]) for a, b in bounds) == brute_force(costs, stages)


def test_balanced_partition_leaves_the_later_stages_lighter_on_ties():
    assert balanced_partition([1, 1, 1], 2) == [(0, 2), (2, 3)]
    assert balanced_partition([1, 1, 1, 1, 1], 3) == [(0, 2), (2, 4), (4, 5)]


def test_balanced_partition_refuses_more_stages_than_cells():
    with pytest.raises(ValueError, match="stages must be an int from 1 to the 5 cells, got 6"):
        balanced_partition([1] * 5, 6)


@pytest.mark.parametrize("samples,expected", [
    (8, BatchPlan(8, 2, "gpipe")),  # a full batch: as configured, micro-batches of 4
    (7, BatchPlan(7, 7, "gpipe")),  # 7 is prime: micro-batches of 1
    (6, BatchPlan(6, 2, "gpipe")),  # of 3, the largest divisor of 6 no larger than 4
    (4, BatchPlan(4, 1, "gpipe")),
    (2, BatchPlan(2, 1, "gpipe")),
    (1, BatchPlan(1, 1, "gpipe")),
])
def test_a_short_batch_is_cut_into_equal_micro_batches_no_larger_than_configured(samples, expected):
    plan = batch_plan(samples, batch_size=8, microbatches=2, schedule="gpipe", stages=2)
    assert plan == expected
    assert plan.micro_batch * plan.microbatches == samples and plan.micro_batch <= 8 // 2


@pytest.mark.parametrize("samples,stages,expected", [
    (8, 4, BatchPlan(8, 4, "1f1b")),  # a full batch: as configured
    (6, 2, BatchPlan(6, 3, "1f1b")),  # 3 micro-batches of 2: enough for 2 stages
    (6, 4, BatchPlan(6, 3, "gpipe")),  # 3 are fewer than 1F1B's one per stage: GPipe
    (5, 4, BatchPlan(5, 5, "1f1b")),
    (1, 2, BatchPlan(1, 1, "gpipe")),
])
def test_1f1b_falls_back_to_gpipe_where_a_short_batch_has_fewer_micro_batches_than_stages(samples, stages, expected):
    assert batch_plan(samples, batch_size=8, microbatches=4, schedule="1f1b", stages=stages) == expected


def test_a_batch_plan_refuses_what_no_batch_is():
    with pytest.raises(ValueError, match="a batch holds from 1 to training.batch_size = 4 samples, got 5"):
        batch_plan(5, batch_size=4, microbatches=2, schedule="gpipe", stages=2)
    with pytest.raises(ValueError, match="got 0"):
        batch_plan(0, batch_size=4, microbatches=2, schedule="gpipe", stages=2)
    with pytest.raises(ValueError, match="batch of 3 samples must divide into 2 micro-batches"):
        batch_plan(1, batch_size=3, microbatches=2, schedule="gpipe", stages=2)
    with pytest.raises(ValueError, match="schedule must be one of"):
        batch_plan(1, batch_size=4, microbatches=2, schedule="zero-bubble", stages=2)  # type: ignore[arg-type]


def test_only_the_unet_is_cut_into_cells():
    vit = ViTSeg(in_channels=1, num_classes=1, tile=(8, 8, 8), patch=4, layers=1, embed_dim=8, heads=2)
    with pytest.raises(ValueError, match="splits the torch UNet3D, got ViTSeg"):
        unet_cells(vit)  # type: ignore[arg-type]


class FailingBackward(torch.autograd.Function):
    """Forward: a copy. Backward: the allocator's out-of-memory error, as a too-small rank meets it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 33554432 bytes")


def failing_stage_case() -> dict[str, Any]:
    """What a stage raises when its backward, then its forward, fails."""
    from distmis.parallel.pipeline import pipeline_unet
    from distmis.train.torch_losses import make_loss

    loss = make_loss("dice-bce")
    pipe = pipeline_unet(small_unet(), tile=(16, 16, 16), microbatches=2, batch_size=4,
                         loss_fn=lambda p, y: loss(FailingBackward.apply(p), y))
    x, y = torch.randn(4, 2, 16, 16, 16), (torch.rand(4, 3, 16, 16, 16) > 0.5).float()
    with pytest.raises(RuntimeError, match=r"pipeline stage 0 of 1 \(cells \(0, 5\)\) failed in its backward: "
                                           r"RuntimeError: DefaultCPUAllocator: can't allocate memory") as raised:
        pipe.train_step(x, y)
    assert "Failed to run stage backward" in str(raised.value.__cause__)  # the library's wrapper, kept as the cause
    with pytest.raises(RuntimeError, match=r"pipeline stage 0 of 1 \(cells \(0, 5\)\) failed in its forward: "
                                           r"RuntimeError: .*expected input.*to have 2 channels, but got 1"):
        pipe.train_step(x[:, :1], y)
    return {}


def failing_cases(world_size: int) -> Cases:
    return {"failing-stage": failing_stage_case}


def test_a_failing_stage_says_which_stage_and_why(tmp_path):
    case(spawn_cases(failing_cases, 1, tmp_path), "failing-stage")
