"""``training.augment`` for the TensorFlow trainer: graph ops inside the ``tf.data`` pipeline.

The transforms, probabilities and ranges are those of the torch trainers (MONAI's, :mod:`distmis.data.augment_torch`)
and run in the same order on one channels-last training input at a time, in the pipeline's parallel ``map``:

- flips along each spatial axis and 90-degree rotations in the planes of equal extents are ``tf.reverse`` and
  ``tf.transpose``: the voxels are moved, never interpolated, in image and label alike;
- the small rotation and zoom (affine) and the elastic deformation share one map from output voxels to input
  coordinates (elastic displacements first, then the affine about the centre, as MONAI's two transforms compose),
  and one resampling: trilinear for the image, nearest neighbour for the label, zeros outside the input;
- intensity scale, shift and Gaussian noise change the image only.

Every draw is stateless, from ``(seed + k, draw)`` where ``draw`` is the element's own random integer from the
pipeline's seeded stream (``tf.data.Dataset.random``, re-randomized each epoch): the augmented inputs are a
function of ``training.seed`` and the epoch, as the tiles are.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Literal

from distmis.data.augment import rotate90_planes

if TYPE_CHECKING:  # pragma: no cover
    from distmis.spec.schema import AugmentSpec

__all__ = ["ImageMode", "augmenter"]

#: The image's resampling in the affine and elastic transforms; ``nearest`` keeps its values (the alignment tests).
ImageMode = Literal["linear", "nearest"]
# Offsets from the pipeline's seed of the stateless streams used here (the tiler uses seed and seed + 1).
_COINS, _ELASTIC, _NOISE = 2, 3, 4
# One coin or parameter per slot of the uniform draw: flips (3), rot90 (3 planes x coin, k), affine (coin, 3 angles,
# 3 zooms), elastic (coin, sigma, magnitude), intensity scale (coin, factor), shift (coin, offset), noise (coin, std).
_SLOTS = 3 + 6 + 7 + 3 + 2 + 2 + 2


def augmenter(
    tf: Any, augment: AugmentSpec, spatial: tuple[int, int, int], seed: int, *, image_mode: ImageMode = "linear",
) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
    """``augment(image, label, draw) -> (image, label)`` for channels-last float inputs of ``spatial`` size.

    Args:
        tf: the ``tensorflow`` module (imported by the caller, so this module stays import-free).
        augment: ``training.augment`` (``enabled`` with a probability above 0).
        spatial: the inputs' (h, w, d): the tile, or the volume.
        seed: the pipeline's seed (``training.seed``).
        image_mode: see :data:`ImageMode`.
    """
    if not augment.active:
        raise ValueError("training.augment is off (enabled false, or every probability 0): nothing to build")
    if image_mode not in ("linear", "nearest"):
        raise ValueError(f"image_mode must be 'linear' or 'nearest', got {image_mode!r}")
    spatial = tuple(int(s) for s in spatial)  # type: ignore[assignment]
    planes = rotate90_planes(spatial)
    angle = math.radians(augment.rotate_degrees)
    sigma_max = max(augment.elastic_sigma)
    grid = _voxel_grid(tf, spatial)  # (h, w, d, 3) float32 output coordinates

    def stream(offset: int, draw: Any) -> Any:
        return tf.stack([tf.constant(seed + offset, tf.int64), tf.cast(draw, tf.int64)])

    def apply(image: Any, label: Any, draw: Any) -> tuple[Any, Any]:
        u = tf.unstack(tf.random.stateless_uniform([_SLOTS], seed=stream(_COINS, draw)))
        slot = iter(u)
        # ---- flips, rotations by 90 degrees: voxels moved, not interpolated
        for axis in range(3):
            coin = next(slot)
            if augment.flip:
                image, label = _maybe(tf, coin < augment.flip, lambda i, l, a=axis: (tf.reverse(i, [a]), tf.reverse(l, [a])),
                                      image, label)
        for index in range(3):
            coin, pick = next(slot), next(slot)
            if augment.rotate90 and index < len(planes):
                k = tf.minimum(tf.cast(pick * 3.0, tf.int32), 2) + 1  # 1, 2 or 3 quarter turns

                def turn(i: Any, l: Any, plane: tuple[int, int] = planes[index], k: Any = k) -> tuple[Any, Any]:
                    return _rot90(tf, i, k, plane), _rot90(tf, l, k, plane)

                image, label = _maybe(tf, coin < augment.rotate90, turn, image, label)
        # ---- affine and elastic: one coordinate map, one resampling
        affine_coin, angles, zooms = next(slot), [next(slot) for _ in range(3)], [next(slot) for _ in range(3)]
        elastic_coin, sigma_u, magnitude_u = next(slot), next(slot), next(slot)
        affine_on = tf.constant(bool(augment.affine)) & (affine_coin < augment.affine)
        elastic_on = tf.constant(bool(augment.elastic)) & (elastic_coin < augment.elastic)
        if augment.affine or augment.elastic:
            def resample(i: Any, l: Any) -> tuple[Any, Any]:
                coords = grid
                if augment.elastic:
                    low, high = augment.elastic_sigma
                    sigma = low + (high - low) * sigma_u
                    low_m, high_m = augment.elastic_magnitude
                    magnitude = low_m + (high_m - low_m) * magnitude_u
                    field = tf.random.stateless_uniform([3, *spatial], seed=stream(_ELASTIC, draw), minval=-1.0, maxval=1.0)
                    displacement = _smooth(tf, field, sigma, sigma_max) * magnitude  # (3, h, w, d)
                    coords = coords + tf.where(elastic_on, 1.0, 0.0) * tf.transpose(displacement, [1, 2, 3, 0])
                if augment.affine:
                    rotation = _rotation(tf, [(2.0 * a - 1.0) * angle for a in angles])
                    zoom = tf.stack([1.0 + (2.0 * z - 1.0) * augment.scale_range for z in zooms])
                    matrix = tf.where(affine_on, rotation * zoom[None, :], tf.eye(3))  # R @ diag(zoom)
                    centre = tf.constant([(s - 1) / 2.0 for s in spatial], tf.float32)
                    coords = tf.einsum("ij,hwdj->hwdi", matrix, coords - centre) + centre
                resample_image = _nearest if image_mode == "nearest" else _trilinear
                return resample_image(tf, i, coords, spatial), _nearest(tf, l, coords, spatial)

            image, label = _maybe(tf, affine_on | elastic_on, resample, image, label)
        # ---- intensity: the image only
        scale_coin, factor = next(slot), next(slot)
        if augment.intensity_scale:
            r = augment.intensity_scale_range
            image = tf.where(scale_coin < augment.intensity_scale, image * (1.0 + (2.0 * factor - 1.0) * r), image)
        shift_coin, offset = next(slot), next(slot)
        if augment.intensity_shift:
            r = augment.intensity_shift_range
            image = tf.where(shift_coin < augment.intensity_shift, image + (2.0 * offset - 1.0) * r, image)
        noise_coin, std_u = next(slot), next(slot)
        if augment.noise:
            noise = tf.random.stateless_normal(tf.shape(image), seed=stream(_NOISE, draw)) * (std_u * augment.noise_std)
            image = tf.where(noise_coin < augment.noise, image + noise, image)
        return tf.ensure_shape(image, image.shape), tf.ensure_shape(label, label.shape)

    return apply


def _maybe(tf: Any, condition: Any, fn: Callable[[Any, Any], tuple[Any, Any]], image: Any, label: Any) -> tuple[Any, Any]:
    """``fn(image, label)`` where ``condition`` holds, else the inputs (a ``tf.cond``: the work runs only when drawn)."""
    return tf.cond(condition, lambda: fn(image, label), lambda: (image, label))


def _rot90(tf: Any, x: Any, k: Any, plane: tuple[int, int]) -> Any:
    """``numpy.rot90(x, k, axes=plane)`` for k in 1..3 (a plane of equal extents: the shape is kept)."""
    a, b = plane
    perm = list(range(len(x.shape)))
    perm[a], perm[b] = perm[b], perm[a]
    return tf.switch_case(k - 1, [
        lambda: tf.transpose(tf.reverse(x, [b]), perm),
        lambda: tf.reverse(x, [a, b]),
        lambda: tf.reverse(tf.transpose(x, perm), [b]),
    ])


def _voxel_grid(tf: Any, spatial: tuple[int, ...]) -> Any:
    axes = [tf.range(s, dtype=tf.float32) for s in spatial]
    return tf.stack(tf.meshgrid(*axes, indexing="ij"), axis=-1)


def _rotation(tf: Any, angles: list[Any]) -> Any:
    """The rotation about axes 0, 1 and 2 in turn by ``angles`` (radians), as a (3, 3) matrix."""
    def about(axis: int, theta: Any) -> Any:
        c, s = tf.cos(theta), tf.sin(theta)
        i, j = [k for k in range(3) if k != axis]
        rows = [[1.0 if r == col else 0.0 for col in range(3)] for r in range(3)]
        m = [[tf.constant(v) for v in row] for row in rows]
        m[i][i], m[i][j], m[j][i], m[j][j] = c, -s, s, c
        return tf.stack([tf.stack(row) for row in m])

    x, y, z = (about(axis, theta) for axis, theta in enumerate(angles))
    return z @ y @ x


def _smooth(tf: Any, field: Any, sigma: Any, sigma_max: float) -> Any:
    """A Gaussian of ``sigma`` voxels along each spatial axis of ``field`` (3, h, w, d), zeros beyond the edges,
    truncated at 3 x ``sigma_max`` (MONAI's elastic transform truncates at 3 sigma).

    Each axis is one product with a banded (n, n) matrix of the kernel's weights: the same sums as a convolution
    with zero padding, as BLAS products (with 49-tap ``conv3d``s in their place the affine and elastic transforms
    of a 64^3 tile took 1.5 s on one core, against 0.12 s).
    """
    radius = max(1, int(math.ceil(3.0 * sigma_max)))
    taps = tf.range(-radius, radius + 1, dtype=tf.float32)
    total = tf.reduce_sum(tf.exp(-0.5 * tf.square(taps / sigma)))
    x = field
    for axis, n in enumerate(field.shape[1:], start=1):
        offset = tf.range(n, dtype=tf.float32)
        distance = offset[:, None] - offset[None, :]
        band = tf.where(tf.abs(distance) <= radius, tf.exp(-0.5 * tf.square(distance / sigma)), 0.0) / total
        x = tf.experimental.numpy.moveaxis(tf.tensordot(x, band, axes=[[axis], [0]]), -1, axis)
    return x


def _inside(tf: Any, index: Any, spatial: tuple[int, ...]) -> tuple[Any, Any]:
    """``index`` (..., 3) int32 clipped into the volume, and whether it was inside (float 1/0)."""
    upper = tf.constant([s - 1 for s in spatial], tf.int32)
    inside = tf.reduce_all((index >= 0) & (index <= upper), axis=-1)
    return tf.clip_by_value(index, 0, upper), tf.cast(inside, tf.float32)[..., None]


def _nearest(tf: Any, volume: Any, coords: Any, spatial: tuple[int, ...]) -> Any:
    """``volume`` (h, w, d, C) at the nearest voxel of each of ``coords`` (h, w, d, 3); zeros outside."""
    index, inside = _inside(tf, tf.cast(tf.round(coords), tf.int32), spatial)
    return tf.gather_nd(volume, index) * tf.cast(inside, volume.dtype)


def _trilinear(tf: Any, volume: Any, coords: Any, spatial: tuple[int, ...]) -> Any:
    """``volume`` (h, w, d, C) interpolated trilinearly at ``coords`` (h, w, d, 3); zeros outside."""
    base = tf.floor(coords)
    frac = coords - base
    base = tf.cast(base, tf.int32)
    out = tf.zeros(tf.concat([tf.shape(coords)[:-1], tf.shape(volume)[-1:]], 0), volume.dtype)
    for corner in range(8):
        step = [(corner >> axis) & 1 for axis in range(3)]
        index, inside = _inside(tf, base + tf.constant(step, tf.int32), spatial)
        weight = tf.reduce_prod(tf.where(tf.constant([s == 1 for s in step]), frac, 1.0 - frac), axis=-1, keepdims=True)
        out += tf.gather_nd(volume, index) * weight * inside
    return out
