from __future__ import annotations

import pytest

from distmis.train.tf_unet import iter_tiles, tile_starts


def test_tile_starts_cover_the_volume():
    assert tile_starts(16, 8) == [0, 8]
    assert tile_starts(20, 8) == [0, 8, 12]  # the last tile is flush with the end
    assert tile_starts(8, 8) == [0]
    with pytest.raises(ValueError, match="larger"):
        tile_starts(4, 8)


def test_tiles_cover_every_voxel():
    import numpy as np

    covered = np.zeros((20, 16, 12), int)
    for s in iter_tiles((20, 16, 12), (8, 8, 8)):
        covered[s] += 1
    assert covered.min() >= 1
