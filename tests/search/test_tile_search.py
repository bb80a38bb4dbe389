"""The planner's search on any step peak: nnU-Net's sequence of tiles, bisected, then the batch."""

from __future__ import annotations

import math

import pytest

from distmis.search.tile_search import NothingFits, plan_inputs, tile_candidates


def linear_peak(calls: list):
    """A step whose memory is 1 MB plus 1 kB per voxel of the batch; ``calls`` records what was traced."""

    def peak(tile, batch):
        calls.append((tile, batch))
        return 1e6 + 1e3 * batch * math.prod(tile)

    return peak


def test_the_tiles_shrink_the_side_longest_against_the_volume_by_the_networks_multiple():
    tiles = tile_candidates((40, 52, 24), 8)
    assert tiles[0] == (40, 48, 24)  # each side rounded down to a multiple of 8
    assert tiles[1:3] == [(32, 48, 24), (32, 48, 16)]  # the side longest against its volume's goes first
    assert tile_candidates((48, 48, 24), 8)[1] == (40, 48, 24)  # a tie: the longer side, then the first
    assert all(t % 8 == 0 and 8 <= t <= v for tile in tiles for t, v in zip(tile, (40, 52, 24)))
    assert tiles[-1] == (8, 8, 8) and len(set(tiles)) == len(tiles)
    assert [math.prod(t) for t in tiles] == sorted((math.prod(t) for t in tiles), reverse=True)
    # a rotation by 90 degrees needs a plane of two equal sides: the volume's two longest stay equal
    assert all(tile[0] == tile[1] for tile in tile_candidates((48, 56, 24), 8, equal_pair=True))
    with pytest.raises(ValueError, match="shorter than 16"):
        tile_candidates((48, 8, 48), 16)


def test_the_plan_is_the_largest_tile_that_fits_and_the_next_larger_was_traced_and_does_not():
    calls: list = []
    usable = 1e6 + 1e3 * 2 * 40 * 40 * 24  # (40, 40, 24) at batch 2 fits exactly
    tile, batch, considered = plan_inputs((48, 48, 24), 8, linear_peak(calls), usable, batch=2)
    assert (tile, batch) == ((40, 40, 24), 2)
    by_tile = {c.tile: c for c in considered}
    assert by_tile[(40, 40, 24)].fits and not by_tile[(40, 48, 24)].fits  # the next larger in the sequence
    sequence = tile_candidates((48, 48, 24), 8)
    assert len(calls) <= math.ceil(math.log2(len(sequence))) + 2  # bisection, not every tile


def test_the_batch_grows_to_nnunets_share_of_the_data_and_drops_below_2_only_when_nothing_else_fits():
    calls: list = []
    volume = (32, 32, 32)
    # a roomy worker: the whole volume fits, and the batch stops at the cap (5% of the voxels: here 6)
    tile, batch, _ = plan_inputs(volume, 8, linear_peak(calls), 1e12, batch_cap=lambda tile: 6)
    assert (tile, batch) == (volume, 6)
    # room for the whole volume 3 times: batch 3, and batch 4 was traced and does not fit
    usable = 1e6 + 1e3 * 3 * 32**3
    tile, batch, considered = plan_inputs(volume, 8, linear_peak([]), usable, batch_cap=lambda tile: 6)
    assert (tile, batch) == (volume, 3)
    assert any(c.batch == 4 and c.tile == volume and not c.fits for c in considered)
    # a fixed batch is kept; a pipeline's micro-batches make the batch their multiple
    assert plan_inputs(volume, 8, linear_peak([]), 1e12, batch=5)[1] == 5
    assert plan_inputs(volume, 8, linear_peak([]), 1e12, batch_cap=lambda t: 7, batch_multiple=3)[1] == 6
    # batch 2 fits nowhere, batch 1 does at the smallest tile
    usable = 1e6 + 1e3 * 8**3
    assert plan_inputs(volume, 8, linear_peak([]), usable, batch_cap=lambda t: 6)[:2] == ((8, 8, 8), 1)
    with pytest.raises(NothingFits, match=r"tile \[8, 8, 8\] at batch 2, is predicted to need 2 MiB"):
        plan_inputs(volume, 8, linear_peak([]), 1e6, batch=2)


def test_a_networks_preferred_tiles_are_searched_first_and_the_others_only_when_none_is_valid():
    """A DynUNet planned from its tile (multiple 1: any tile is valid) prefers tiles it pools fully: stepping by one
    voxel, the plan lands on 40 (pooled 3 times a side), not on 45 or 41 (odd: not pooled at all)."""
    from distmis.models.registry import model_entry

    entry = model_entry("dynunet")
    params = entry.params()
    assert entry.input_multiple(params) == 1

    def prefers(tile):
        return entry.tile_preference(params, tile)

    usable = 1e6 + 1e3 * 2 * 45 * 45 * 45  # the whole volume fits: only the preference moves the tile
    tile, _, _ = plan_inputs((45, 45, 45), 1, linear_peak([]), usable, batch=2, preferred=prefers)
    assert tile == (40, 40, 40) and not prefers((45, 45, 45)) and not prefers((41, 40, 40))
    tile, _, _ = plan_inputs((45, 45, 45), 1, linear_peak([]), usable, batch=2)  # no preference: the volume
    assert tile == (45, 45, 45)
    # none preferred (a volume too thin to pool, 7 voxels): the valid ones as before
    tile, _, _ = plan_inputs((7, 7, 7), 1, linear_peak([]), 1e9, batch=2, preferred=lambda t: False)
    assert tile == (7, 7, 7)
    # explicit strides: no preference
    fixed = entry.params(kernel_size=[[3, 3, 3]] * 3, strides=[[1, 1, 1], [2, 2, 2], [2, 2, 2]])
    assert entry.tile_preference(fixed, (45, 45, 45))
