from __future__ import annotations

import pytest

from distmis.train.tiling import iter_tiles, predict_tiled, tile_starts


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


def test_predict_tiled_stitches_and_averages_overlaps():
    import numpy as np

    image = np.arange(20 * 8 * 8, dtype=np.float32).reshape(20, 8, 8, 1)
    calls = []

    def identity(batch):
        calls.append(len(batch))
        return batch  # the "probability" of a voxel is its own value

    out = predict_tiled(identity, image, (8, 8, 8), num_classes=1, batch_size=2)
    np.testing.assert_allclose(out, image)  # overlapping tiles (the last one) average to the same value
    assert calls == [2, 1]
