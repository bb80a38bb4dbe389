"""Splitting a tile's tokens between SP ranks, validating SP configurations, the DP x SP layout: no processes."""

from __future__ import annotations

import pytest
import torch

from distmis.models.vit_seg import ViTSeg
from distmis.parallel.sequence import box_indices, sequence_chunks, token_chunk
from distmis.perf.partition import partition_tokens, range_box


def split_tokens(grid, sp_size, split):
    return [token_chunk(share, grid) for share in partition_tokens(grid, sp_size, split)]


def chunk_box(indices: torch.Tensor, grid) -> tuple[slice, slice, slice] | None:
    """The box a chunk of indices fills when they are listed row-major inside it (else None), the slow way."""
    low = [min(int(i) // d % g for i in indices) for d, g in zip((grid[1] * grid[2], grid[2], 1), grid)]
    high = [max(int(i) // d % g for i in indices) + 1 for d, g in zip((grid[1] * grid[2], grid[2], 1), grid)]
    box = tuple(slice(a, b) for a, b in zip(low, high))
    return box if torch.equal(box_indices(box, grid), indices) else None


def covers_every_token_once(chunks, n):
    return torch.equal(torch.sort(torch.cat([c.indices for c in chunks])).values, torch.arange(n))


def test_ordered_split_is_contiguous_chunks():
    chunks = split_tokens((6, 2, 2), 4, "ordered")
    assert [c.indices.tolist() for c in chunks] == [list(range(r * 6, r * 6 + 6)) for r in range(4)]
    # 6 tokens = one and a half Width slabs of 2 x 2: not boxes
    assert [c.box for c in chunks] == [None] * 4
    halves = split_tokens((6, 2, 2), 2, "ordered")
    assert [c.box for c in halves] == [(slice(0, 3), slice(0, 2), slice(0, 2)), (slice(3, 6), slice(0, 2), slice(0, 2))]


@pytest.mark.parametrize(
    "sp, boxes",
    [
        (1, [((0, 4), (0, 4), (0, 4))]),
        (2, [((0, 2), (0, 4), (0, 4)), ((2, 4), (0, 4), (0, 4))]),
        (4, [((0, 2), (0, 2), (0, 4)), ((0, 2), (2, 4), (0, 4)), ((2, 4), (0, 2), (0, 4)), ((2, 4), (2, 4), (0, 4))]),
        (8, [((w, w + 2), (d, d + 2), (h, h + 2)) for w in (0, 2) for d in (0, 2) for h in (0, 2)]),
    ],
)
def test_spatial_split_follows_figure_4(sp, boxes):
    grid = (4, 4, 4)
    chunks = split_tokens(grid, sp, "spatial")
    assert [tuple((s.start, s.stop) for s in c.box) for c in chunks] == boxes
    assert covers_every_token_once(chunks, 64)
    for chunk in chunks:
        assert len(chunk.indices) == 64 // sp
        assert chunk_box(chunk.indices, grid) == chunk.box  # listed row-major inside the box
        assert chunk.voxel_box(4) == tuple(slice(s.start * 4, s.stop * 4) for s in chunk.box)


def test_ordered_and_spatial_agree_at_two_ranks():
    for grid in [(4, 4, 4), (6, 2, 2)]:
        ordered, spatial = split_tokens(grid, 2, "ordered"), split_tokens(grid, 2, "spatial")
        assert all(torch.equal(a.indices, b.indices) and a.box == b.box for a, b in zip(ordered, spatial))


def test_box_helpers():
    assert box_indices((slice(1, 2), slice(0, 2), slice(1, 3)), (2, 2, 3)).tolist() == [7, 8, 10, 11]
    assert chunk_box(torch.tensor([7, 8, 10, 11]), (2, 2, 3)) == (slice(1, 2), slice(0, 2), slice(1, 3))
    assert chunk_box(torch.tensor([8, 7, 10, 11]), (2, 2, 3)) is None  # a box, but not in row-major order
    assert chunk_box(torch.tensor([2, 3]), (2, 2, 3)) is None  # crosses a row of the last axis


@pytest.mark.parametrize("grid", [(2, 2, 3), (3, 4, 5), (4, 1, 6), (2, 6, 1)])
def test_range_box_agrees_with_the_tokens_it_lists(grid):
    """Every contiguous range of the token order: a box exactly when its indices fill one row-major."""
    n = grid[0] * grid[1] * grid[2]
    for start in range(n):
        for stop in range(start + 1, n + 1):
            expected = chunk_box(torch.arange(start, stop), grid)
            box = range_box(start, stop, grid)
            assert (None if box is None else tuple(slice(a, b) for a, b in box)) == expected, (start, stop)


def test_embedding_a_cropped_box_equals_the_tile_tokens_at_its_indices():
    torch.manual_seed(0)
    model = ViTSeg(2, 3, (24, 8, 8), patch=4, layers=1, embed_dim=16, heads=2, decoder_features=8)
    x = torch.randn(1, 2, 24, 8, 8)
    tokens = model.embed(x)
    for chunk in split_tokens(model.grid, 4, "spatial"):
        crop = x[(Ellipsis,) + chunk.voxel_box(4)]
        torch.testing.assert_close(model.embed(crop), tokens[:, chunk.indices], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"attention": "ring"}, r"attention must be one of \('allgather-kv', 'ulysses', 'dsp'\), got 'ring'"),
        ({"decoder": "scatter"}, r"decoder must be one of \('gather', 'no-gather'\), got 'scatter'"),
        ({"split": "random"}, r"split must be one of \('ordered', 'spatial'\), got 'random'"),
        ({"sp_size": 5},
         r"split 'ordered': the tile's 24 tokens \(patch grid \(6, 2, 2\)\) must be divisible by the sequence-parallel "
         r"degree 5"),
        ({"sp_size": 3, "split": "spatial"}, r"split 'spatial' supports sequence-parallel degrees \(1, 2, 4, 8\)"),
        ({"sp_size": 8, "split": "spatial", "grid": (6, 2, 3)}, "not divisible along D=3"),
        ({"sp_size": 8, "attention": "ulysses"},
         r"attention 'ulysses' needs heads \(4\) divisible by the sequence-parallel degree \(8\)"),
        ({"sp_size": 4, "decoder": "no-gather"},
         "decoder 'no-gather' needs every rank's tokens to form a box .* rank 0 .* use split 'spatial'"),
        ({"sp_size": 0}, "the sequence-parallel degree must be a positive int"),
    ],
)
def test_configuration_errors(kwargs, match):
    args = {"grid": (6, 2, 2), "heads": 4, "sp_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        sequence_chunks(args.pop("grid"), args.pop("heads"), args.pop("sp_size"), **args)


def test_valid_configurations():
    assert len(sequence_chunks((6, 2, 2), 4, 4, attention="ulysses", split="spatial", decoder="no-gather")) == 4
    assert len(sequence_chunks((6, 2, 2), 4, 2, decoder="no-gather", split="ordered")) == 2  # boxes at 2


# --------------------------------------------------------------------------- DSP on axial attention
def fewest_switches(stages: list[int], allowed: tuple[int, ...]) -> int:
    """The fewest split changes over ``stages`` (attended axes) with splits from ``allowed``: dynamic programming."""
    cost = {a: 0 for a in allowed if a != stages[0]}
    for attended in stages[1:]:
        cost = {a: min(c + (a != b) for b, c in cost.items()) for a in allowed if a != attended}
    return min(cost.values())


@pytest.mark.parametrize("grid, degree", [((4, 2, 8), 2), ((4, 2, 8), 4), ((8, 8, 8), 4), ((6, 4, 4), 4),
                                          ((4, 6, 4), 2), ((3, 4, 4), 4)])
@pytest.mark.parametrize("layers", [1, 2, 3, 5, 12])
def test_dsp_schedule_splits_away_from_the_attended_axis_with_the_fewest_switches(grid, degree, layers):
    from distmis.perf.partition import AXIAL_ORDER, dsp_schedule, dsp_splittable_axes

    schedule = dsp_schedule(grid, degree, layers)
    stages = [AXIAL_ORDER[i % 3] for i in range(3 * layers)]
    assert len(schedule.splits) == len(stages)
    allowed = dsp_splittable_axes(grid, degree)
    for split, attended in zip(schedule.splits, stages):
        assert split != attended and grid[split] % degree == 0
    assert schedule.switches == fewest_switches(stages, allowed)
    assert schedule.switch_stages == tuple(i for i in range(1, len(stages))
                                           if schedule.splits[i] != schedule.splits[i - 1])
    if len(allowed) == 3:
        assert schedule.switches == -(-3 * layers // 2) - 1  # one switch per two stages
    assert schedule.first == dsp_schedule(grid, degree, 1).first  # what the spec checks with
    for axis in (schedule.first, schedule.last):
        slabs = schedule.shares(axis)
        assert [s.box[axis] for s in slabs] == [(r * grid[axis] // degree, (r + 1) * grid[axis] // degree)
                                                for r in range(degree)]
        assert all(s.box[a] == (0, grid[a]) for s in slabs for a in range(3) if a != axis)


def test_dsp_configuration_errors():
    with pytest.raises(ValueError, match="attention 'dsp' needs model.params.attention 'axial'"):
        sequence_chunks((4, 4, 4), 4, 2, attention="dsp")
    with pytest.raises(ValueError, match=r"at least two of its axes must divide by the sequence-parallel degree 4 "
                                         r"\(H=6, W=2, D=2\)"):
        sequence_chunks((6, 2, 2), 4, 4, attention="dsp", model_attention="axial")
    with pytest.raises(ValueError, match="axial attention .* every rank's tokens must form a box.* rank 0"):
        sequence_chunks((6, 2, 2), 4, 4, attention="ulysses", model_attention="axial")
    with pytest.raises(ValueError, match=r"the model's attention must be one of \('full', 'axial'\)"):
        sequence_chunks((4, 4, 4), 4, 2, model_attention="ring")


def test_valid_axial_configurations():
    # DSP: the slabs of the schedule's first axis (D, the axis attended along last in a block), split ignored
    slabs = sequence_chunks((4, 2, 8), 4, 2, attention="dsp", model_attention="axial", split="spatial")
    assert [tuple((b.start, b.stop) for b in s.box) for s in slabs] == [((0, 4), (0, 2), (0, 4)),
                                                                        ((0, 4), (0, 2), (4, 8))]
    assert len(sequence_chunks((4, 2, 8), 4, 4, attention="dsp", model_attention="axial",
                                       decoder="no-gather")) == 4
    # the baselines on boxes: an ordered split that cuts whole H planes, or a spatial one
    assert len(sequence_chunks((4, 2, 8), 4, 4, attention="ulysses", model_attention="axial")) == 4
    assert len(sequence_chunks((6, 2, 2), 4, 4, split="spatial", model_attention="axial")) == 4
