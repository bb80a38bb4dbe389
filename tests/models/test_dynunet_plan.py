"""DynUNet's kernels and strides as nnU-Net plans them (:mod:`distmis.models.dynunet_plan`): pure arithmetic."""

from __future__ import annotations

import itertools

import pytest

from distmis.models.dynunet_plan import MAX_DOWNSAMPLINGS, MIN_FEATURE_MAP, plan_dynunet


def test_an_isotropic_tile_pools_every_axis_down_to_feature_maps_of_four():
    plan = plan_dynunet((32, 32, 32))
    assert plan.strides == ((1, 1, 1), (2, 2, 2), (2, 2, 2), (2, 2, 2))  # 32 -> 16 -> 8 -> 4
    assert plan.kernel_size == ((3, 3, 3),) * 4
    assert plan.upsample_kernel_size == plan.strides[1:]
    assert plan.downsampling == (8, 8, 8) and plan.levels == 4


def test_an_anisotropic_spacing_pools_the_coarse_axis_later_with_flat_kernels_first():
    plan = plan_dynunet((64, 64, 16), (0.8, 0.8, 3.0))
    # 3.0 mm is more than twice 0.8: the third axis waits one level (kernel 1 there), then pools with the others
    # while its map stays >= 4 voxels
    assert plan.strides == ((1, 1, 1), (2, 2, 1), (2, 2, 2), (2, 2, 2), (2, 2, 1))
    assert plan.kernel_size == ((3, 3, 1), (3, 3, 3), (3, 3, 3), (3, 3, 3), (3, 3, 3))
    assert plan.downsampling == (16, 16, 4)


def test_isotropic_is_the_default_spacing_and_spacing_scale_does_not_matter():
    assert plan_dynunet((48, 32, 16)) == plan_dynunet((48, 32, 16), (1.0, 1.0, 1.0)) == plan_dynunet((48, 32, 16),
                                                                                                        (2.5,) * 3)


def test_the_depth_is_capped():
    plan = plan_dynunet((256, 256, 256))
    assert plan.levels == MAX_DOWNSAMPLINGS + 1 and plan.downsampling == (32, 32, 32)
    assert plan_dynunet((256, 256, 256), max_downsamplings=3).downsampling == (8, 8, 8)


def test_a_single_axis_left_to_pool_pools_only_from_twelve_voxels():
    # after one level (8, 4, 4) only the first axis could pool, and nnU-Net pools a lone axis only from 3 x 4 voxels
    plan = plan_dynunet((16, 8, 8))
    assert plan.strides[:2] == ((1, 1, 1), (2, 2, 2)) and plan.downsampling == (2, 2, 2)
    assert plan_dynunet((32, 8, 8)).downsampling == (4, 2, 2)  # 16 >= 12: it pools once more alone


def test_an_input_too_small_to_pool_twice_gets_stride_one_levels():
    # DynUNet needs three levels (input, a downsampling, bottleneck)
    assert plan_dynunet((8, 8, 8)).strides == ((1, 1, 1), (2, 2, 2), (1, 1, 1))
    assert plan_dynunet((4, 4, 4)).strides == ((1, 1, 1),) * 3


@pytest.mark.parametrize("spacing", [None, (0.8, 0.8, 3.0), (2.0, 0.5, 1.0), (1.0, 1.0, 1.9)])
def test_the_strides_always_divide_the_tile_and_keep_maps_of_four(spacing):
    for tile in itertools.product([4, 6, 8, 12, 20, 24, 36, 40, 48, 64, 72, 96, 160], repeat=3):
        plan = plan_dynunet(tile, spacing)
        assert plan.strides[0] == (1, 1, 1)
        assert 3 <= plan.levels <= MAX_DOWNSAMPLINGS + 1
        assert all(t % d == 0 for t, d in zip(tile, plan.downsampling)), (tile, plan)
        # an axis pooled at all keeps a map of at least 4 voxels
        assert all(t // d >= MIN_FEATURE_MAP for t, d in zip(tile, plan.downsampling) if d > 1), (tile, plan)
        assert len(plan.kernel_size) == plan.levels and plan.kernel_size[-1] == (3, 3, 3)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="three positive integers"):
        plan_dynunet((32, 0, 32))
    with pytest.raises(ValueError, match="three positive numbers"):
        plan_dynunet((32, 32, 32), (1.0, -1.0, 1.0))


def test_full_pooling_holds_where_the_tile_divides_by_what_nnunet_would_pool():
    from distmis.models.dynunet_plan import full_pooling

    assert full_pooling((40, 40, 40)) and full_pooling((96, 96, 96)) and full_pooling((48, 48, 32))
    assert plan_dynunet((45, 45, 45)).downsampling == (1, 1, 1)  # odd: never pooled here
    assert plan_dynunet((45, 45, 45), even=False).downsampling == (8, 8, 8)  # nnU-Net pads it and pools 3 times
    assert not full_pooling((45, 45, 45)) and not full_pooling((36, 36, 36))  # 36 -> 18 -> 9: one pooling short
    assert full_pooling((7, 7, 7))  # too small to pool either way
