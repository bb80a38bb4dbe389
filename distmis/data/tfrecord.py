"""Offline binarisation into sharded TFRecords, and reading them back with tf.data.

The training pipeline never touches NIfTI: :func:`convert_to_tfrecords` reads
and preprocesses every case once (in parallel worker processes that only use
numpy / nibabel / scipy) and the parent process writes them into sharded
TFRecord files, one set per split::

    out_dir/manifest.json
    out_dir/train-00000-of-00002.tfrecord
    out_dir/train-00001-of-00002.tfrecord
    out_dir/val-00000-of-00001.tfrecord
    ...

Each record is a ``tf.train.Example`` with the features

* ``case_id``: bytes (UTF-8);
* ``image``: raw little-endian float32 bytes of the ``(h, w, d, 4)`` image;
* ``label``: raw uint8 bytes of the ``(h, w, d, C)`` binary target;
* ``image_shape``, ``label_shape``: int64 lists.

``manifest.json`` records the format version, the preprocessing config, the
(common) shapes and dtypes, the split and, per split, the case ids and the
shards with their sha256 checksums (see :func:`verify_checksums`).

:func:`make_dataset` builds the training input pipeline (interleave -> parse
-> cache -> shuffle -> random tile crop -> batch -> prefetch), deterministic
for a seed; :func:`iter_cases` yields whole volumes for validation.

TensorFlow is imported inside the functions only, so that importing
:mod:`distmis.data` stays cheap and the worker processes never load it.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import shutil
import sys
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from distmis.data.errors import DataError
from distmis.data.layouts import MODALITIES, CaseFiles, read_case
from distmis.data.preprocess import PreprocessConfig, preprocess_case
from distmis.data.records import parse_example, read_records
from distmis.data.split import SPLIT_NAMES, validate_split

if TYPE_CHECKING:  # pragma: no cover
    import tensorflow as tf

    from distmis.spec.schema import AugmentSpec

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "CASES_PER_SHARD",
    "convert_to_tfrecords",
    "read_manifest",
    "verify_checksums",
    "make_dataset",
    "iter_cases",
]

#: Version of the on-disk format written by :func:`convert_to_tfrecords`.
FORMAT_VERSION = 1
#: Name of the manifest file inside a TFRecord folder.
MANIFEST_NAME = "manifest.json"
#: Default maximum number of cases per shard.
CASES_PER_SHARD = 8
#: Maximum number of shards read concurrently by :func:`make_dataset` (a
#: constant, not the CPU count, so the element order is the same on every machine).
INTERLEAVE_CYCLE = 4

T = TypeVar("T")
R = TypeVar("R")


def _tf() -> Any:
    """Import TensorFlow quietly (only when TFRecords are actually written or read)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    return tf


def shard_name(split: str, index: int, count: int) -> str:
    """``train-00000-of-00002.tfrecord``."""
    return f"{split}-{index:05d}-of-{count:05d}.tfrecord"


def _shard_sizes(num_cases: int, shards_per_split: int | None) -> list[int]:
    """Balanced number of cases per shard (earlier shards get the extra case)."""
    if num_cases == 0:
        return []
    count = math.ceil(num_cases / CASES_PER_SHARD) if shards_per_split is None else shards_per_split
    count = max(1, min(count, num_cases))
    base, extra = divmod(num_cases, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------- workers


def _load_case(case: CaseFiles, config: PreprocessConfig) -> tuple[str, np.ndarray, np.ndarray]:
    """Worker: read and preprocess one case (numpy / nibabel / scipy only)."""
    image, label, _ = read_case(case, config.layout)
    try:
        image, target = preprocess_case(image, label, config)
    except DataError:
        raise
    except ValueError as exc:
        raise DataError(f"case {case.case_id!r} ({str(case.images[0])!r}): preprocessing failed: {exc}") from exc
    return case.case_id, image, target


def _ordered_map(fn: Callable[..., R], items: Sequence[T], config: PreprocessConfig, workers: int) -> Iterator[R]:
    """``fn(item, config)`` for every item, in order, with at most ``2 * workers`` results in flight.

    Uses a *spawn* process pool, so that workers start clean even if the parent
    has already loaded TensorFlow (forking a multi-threaded process can deadlock).
    ``workers <= 1`` runs in the calling process.
    """
    if workers <= 1:
        for item in items:
            yield fn(item, config)
        return
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    pending: deque[Future[R]] = deque()
    queue = iter(items)
    try:
        for item in queue:
            pending.append(pool.submit(fn, item, config))
            if len(pending) >= 2 * workers:
                break
        while pending:
            result = pending.popleft().result()
            nxt = next(queue, None)
            if nxt is not None:
                pending.append(pool.submit(fn, nxt, config))
            yield result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------- writing


def _example(tf: Any, case_id: str, image: np.ndarray, target: np.ndarray) -> bytes:
    def _bytes(value: bytes) -> Any:
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))

    def _ints(values: Iterable[int]) -> Any:
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[int(v) for v in values]))

    features = {
        "case_id": _bytes(case_id.encode("utf-8")),
        "image": _bytes(np.ascontiguousarray(image, dtype="<f4").tobytes()),
        "label": _bytes(np.ascontiguousarray(target, dtype=np.uint8).tobytes()),
        "image_shape": _ints(image.shape),
        "label_shape": _ints(target.shape),
    }
    return tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString()


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    if not out_dir.exists():
        return
    if not overwrite:
        raise DataError(f"output folder {str(out_dir)!r} already exists; pass overwrite=True to replace it")
    if not out_dir.is_dir():
        raise DataError(f"output path {str(out_dir)!r} exists and is not a folder; refusing to replace it")
    if not any(out_dir.iterdir()):
        return
    try:
        manifest = read_manifest(out_dir)
    except DataError as exc:
        raise DataError(f"output folder {str(out_dir)!r} is not empty and is not a TFRecord folder distmis wrote "
                        f"({exc}), so overwrite will not replace it; choose another folder") from None
    listed = {MANIFEST_NAME} | {shard["file"] for info in manifest["splits"].values() for shard in info["shards"]}
    present = {path.relative_to(out_dir).as_posix() for path in out_dir.rglob("*") if not path.is_dir()}
    foreign = sorted(present - listed)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise DataError(f"output folder {str(out_dir)!r} holds files its {MANIFEST_NAME} does not list ({shown}): "
                        "distmis replaces only a folder it wrote, so overwrite will not delete them; move them or "
                        "choose another folder")


def _plan(cases: Sequence[CaseFiles], split: Mapping[str, Any]) -> dict[str, list[CaseFiles]]:
    """Cases of each split, in the split's order; DataError for unknown or duplicated ids."""
    validate_split(split)
    by_id: dict[str, CaseFiles] = {}
    for case in cases:
        if case.case_id in by_id:
            raise DataError(f"case id {case.case_id!r} appears twice in the list of cases")
        by_id[case.case_id] = case
    unknown = [c for name in SPLIT_NAMES for c in split[name] if c not in by_id]
    if unknown:
        raise DataError(
            f"the split names {len(unknown)} case(s) that are not in the data set, e.g. {unknown[:5]}; "
            f"was the split made for another data set?"
        )
    plan = {name: [by_id[c] for c in split[name]] for name in SPLIT_NAMES}
    if not any(plan.values()):
        raise DataError("the split has no cases in train, val or test; nothing to convert")
    return plan


def convert_to_tfrecords(
    cases: Sequence[CaseFiles],
    split: Mapping[str, Any],
    config: PreprocessConfig,
    out_dir: str | Path,
    *,
    shards_per_split: int | None = None,
    workers: int | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Read, preprocess and write the cases of ``split`` as sharded TFRecords.

    Args:
        cases: the data set's cases (from :func:`~distmis.data.layouts.discover_cases`).
        split: a split dict (:func:`~distmis.data.split.make_split`); cases in
            no split are skipped.
        config: preprocessing; after it, every case must have the same shape.
        out_dir: output folder, created atomically (see the module docstring).
        shards_per_split: shards per split; default: ~8 cases per shard.
            Always clamped to ``[1, number of cases in the split]``.
        workers: reader processes; default ``min(cpu count, 4)``; 1 = in-process.
        progress: show a tqdm progress bar on stderr.
        overwrite: replace an existing TFRecord folder (one that has a
            manifest, or is empty) at ``out_dir``.

    Returns:
        the manifest (also written to ``out_dir/manifest.json``).

    Raises:
        DataError: naming the file or case, for unreadable files, mismatched
            shapes, bad label values, cases with different shapes after
            preprocessing, or an existing ``out_dir``.  Nothing is left on
            disk when it fails.
    """
    from tqdm import tqdm

    out_dir = Path(out_dir)
    if shards_per_split is not None and int(shards_per_split) < 1:
        raise ValueError(f"shards_per_split must be >= 1, got {shards_per_split!r}")
    _check_out_dir(out_dir, overwrite)
    plan = _plan(cases, split)
    ordered = [case for name in SPLIT_NAMES for case in plan[name]]
    if workers is None:
        workers = min(os.cpu_count() or 1, 4)
    workers = max(1, min(int(workers), len(ordered)))

    tf = _tf()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    results = _ordered_map(_load_case, ordered, config, workers)
    bar = tqdm(total=len(ordered), desc="tfrecords", unit="case", disable=not progress, file=sys.stderr)
    try:
        image_shape: tuple[int, ...] | None = None
        label_shape: tuple[int, ...] | None = None
        first_case = ""
        splits_info: dict[str, Any] = {}
        for name in SPLIT_NAMES:
            sizes = _shard_sizes(len(plan[name]), shards_per_split)
            shards = []
            for index, size in enumerate(sizes):
                filename = shard_name(name, index, len(sizes))
                with tf.io.TFRecordWriter(str(tmp / filename)) as writer:
                    for _ in range(size):
                        case_id, image, target = next(results)
                        if image_shape is None:
                            image_shape, label_shape, first_case = image.shape, target.shape, case_id
                        elif image.shape != image_shape or target.shape != label_shape:
                            raise DataError(
                                f"case {case_id!r} has image shape {image.shape} / label shape {target.shape} "
                                f"after preprocessing, but case {first_case!r} has {image_shape} / {label_shape}; "
                                f"all cases must have one shape: set crop or resize in the PreprocessConfig "
                                f"(spec: dataset.crop / dataset.resize; CLI: --crop / --resize)"
                            )
                        writer.write(_example(tf, case_id, image, target))
                        bar.update(1)
                shards.append({"file": filename, "num_cases": size, "sha256": _sha256(tmp / filename)})
            splits_info[name] = {
                "num_cases": len(plan[name]),
                "case_ids": [c.case_id for c in plan[name]],
                "shards": shards,
            }
        assert image_shape is not None and label_shape is not None
        manifest = {
            "format_version": FORMAT_VERSION,
            "preprocess": config.to_dict(),
            "modalities": list(MODALITIES),
            "image_shape": list(image_shape),
            "label_shape": list(label_shape),
            "image_dtype": "float32",
            "label_dtype": "uint8",
            "num_classes": config.num_classes,
            "splits": splits_info,
            "split": json.loads(json.dumps(dict(split))),
        }
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    except BaseException:
        results.close()  # stops the worker pool
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    results.close()
    bar.close()
    _move_into_place(tmp, out_dir)
    return manifest


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished temporary folder to ``out_dir`` (replacing an old one)."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        if old is not None:
            os.replace(old, out_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- reading


def read_manifest(tfrecord_dir: str | Path) -> dict[str, Any]:
    """Load ``manifest.json`` of a TFRecord folder.

    Raises:
        DataError: if the folder or manifest is missing, not JSON, or of an
            unsupported format version.
    """
    path = Path(tfrecord_dir) / MANIFEST_NAME
    if not path.is_file():
        raise DataError(
            f"{str(path)!r} not found: {str(tfrecord_dir)!r} is not a TFRecord folder written by "
            f"convert_to_tfrecords (make one with `distmis data tfrecord`)"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{str(path)!r} is not valid JSON: {exc}") from exc
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise DataError(f"{str(path)!r} has format_version {version!r}; this version of distmis reads {FORMAT_VERSION}")
    missing = [k for k in ("preprocess", "image_shape", "label_shape", "splits") if k not in manifest]
    if missing:
        raise DataError(f"{str(path)!r} lacks the field(s) {missing}")
    return manifest


def _split_shards(tfrecord_dir: Path, manifest: Mapping[str, Any], split: str) -> tuple[list[Path], int]:
    """Shard paths and number of cases of ``split``; DataError if unknown, empty or missing."""
    splits = manifest["splits"]
    if split not in splits:
        raise DataError(f"split {split!r} is not in {str(tfrecord_dir)!r}; available: {sorted(splits)}")
    info = splits[split]
    if info["num_cases"] == 0:
        raise DataError(f"split {split!r} of {str(tfrecord_dir)!r} has no cases")
    paths = [tfrecord_dir / shard["file"] for shard in info["shards"]]
    for path in paths:
        if not path.is_file():
            raise DataError(f"shard {str(path)!r} listed in the manifest does not exist")
    return paths, int(info["num_cases"])


def verify_checksums(tfrecord_dir: str | Path) -> None:
    """Check every shard against the sha256 recorded in the manifest.

    Raises:
        DataError: naming the first shard that is missing or whose checksum differs.
    """
    tfrecord_dir = Path(tfrecord_dir)
    manifest = read_manifest(tfrecord_dir)
    for info in manifest["splits"].values():
        for shard in info["shards"]:
            path = tfrecord_dir / shard["file"]
            if not path.is_file():
                raise DataError(f"shard {str(path)!r} listed in the manifest does not exist")
            actual = _sha256(path)
            if actual != shard["sha256"]:
                raise DataError(
                    f"shard {str(path)!r} is corrupt or was modified: sha256 {actual} != {shard['sha256']} in the manifest"
                )


def _check_tile(tile: Sequence[int], spatial: Sequence[int], tfrecord_dir: Path) -> tuple[int, int, int]:
    try:
        values = tuple(int(t) for t in tile)
    except (TypeError, ValueError):
        raise ValueError(f"tile must be 3 positive integers, got {tile!r}") from None
    if len(values) != 3 or min(values) < 1:
        raise ValueError(f"tile must be 3 positive integers, got {tile!r}")
    if any(t > s for t, s in zip(values, spatial)):
        raise ValueError(
            f"tile {values} is larger than the volumes {tuple(spatial)} stored in {str(tfrecord_dir)!r}; "
            f"use a tile no larger than the volume on every axis"
        )
    return values  # type: ignore[return-value]


def make_dataset(
    tfrecord_dir: str | Path,
    split: str,
    *,
    batch_size: int,
    shuffle: bool = False,
    seed: int = 0,
    tile: Sequence[int] | None = None,
    cache: bool = True,
    drop_remainder: bool = False,
    shard: tuple[int, int] | None = None,
    repeat: bool = False,
    tile_sampling: float = 0.0,
    augment: AugmentSpec | None = None,
) -> tf.data.Dataset:
    """tf.data pipeline of ``(image, label)`` batches for one split.

    shards -> interleave(TFRecordDataset) -> parse + reshape -> [shard] ->
    cache -> shuffle (buffer = all cases, reshuffled each epoch) -> [repeat] ->
    random tile crop (same offset for image and label) -> [augment] -> batch -> prefetch.

    The element order and the tiles are a deterministic function of ``seed``
    (and of the epoch, when the same dataset object is iterated again).

    Args:
        shard: ``(num_shards, index)`` keeps every ``num_shards``-th case
            starting at ``index`` (one data-parallel worker's part).
        repeat: make the dataset endless (take a fixed number of batches per epoch).
        tile_sampling: the fraction of tiles centred on a foreground voxel (any label channel), drawn at
            random; the others at a uniform random offset (``training.tile_sampling``).
        augment: ``training.augment``: random transforms of each element after its tile is cut
            (:mod:`distmis.data.augment_tf`; training pipelines only), seeded by ``seed`` and the epoch.

    Returns:
        a dataset of ``image`` float32 ``(B, h, w, d, 4)`` and ``label`` float32
        ``(B, h, w, d, C)``, where ``(h, w, d)`` is ``tile`` if given.
    """
    tfrecord_dir = Path(tfrecord_dir)
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    manifest = read_manifest(tfrecord_dir)
    paths, num_cases = _split_shards(tfrecord_dir, manifest, split)
    image_shape = [int(s) for s in manifest["image_shape"]]
    label_shape = [int(s) for s in manifest["label_shape"]]
    tile3 = _check_tile(tile, image_shape[:3], tfrecord_dir) if tile is not None else None
    if shard is not None:
        num_shards, index = (int(v) for v in shard)
        if num_shards < 1 or not 0 <= index < num_shards:
            raise ValueError(f"shard must be (num_shards >= 1, index in [0, num_shards)), got {tuple(shard)!r}")
        num_cases = max(1, len(range(index, num_cases, num_shards)))

    tf = _tf()
    autotune = tf.data.AUTOTUNE
    files = tf.data.Dataset.from_tensor_slices([str(p) for p in paths])
    ds = files.interleave(
        tf.data.TFRecordDataset,
        cycle_length=min(len(paths), INTERLEAVE_CYCLE),
        block_length=1,
        num_parallel_calls=autotune,
        deterministic=True,
    )
    ds = ds.map(_parser(tf, image_shape, label_shape), num_parallel_calls=autotune, deterministic=True)
    if shard is not None:
        ds = ds.shard(num_shards, index)
    if cache:
        ds = ds.cache()
    if shuffle:
        ds = ds.shuffle(num_cases, seed=seed, reshuffle_each_iteration=True)
    if repeat:
        ds = ds.repeat()
    augmenting = augment is not None and augment.active
    if tile3 is None and not augmenting:
        ds = ds.map(lambda image, label: (image, tf.cast(label, tf.float32)), num_parallel_calls=autotune,
                    deterministic=True)
    else:  # each element drawn a random integer, re-drawn each epoch: its tile's and its transforms' seed
        ds = tf.data.Dataset.zip((ds, tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True)))
        if tile3 is not None:
            crop = _tiler(tf, tile3, image_shape, label_shape, seed, tile_sampling)
            ds = ds.map(lambda pair, draw: (crop(pair, draw), draw), num_parallel_calls=autotune, deterministic=True)
        ds = ds.map(lambda pair, draw: (pair[0], tf.cast(pair[1], tf.float32), draw), num_parallel_calls=autotune,
                    deterministic=True)
        if augmenting:
            from distmis.data.augment_tf import augmenter

            spatial = tile3 if tile3 is not None else tuple(image_shape[:3])
            ds = ds.map(augmenter(tf, augment, spatial, seed), num_parallel_calls=autotune, deterministic=True)
        else:
            ds = ds.map(lambda image, label, draw: (image, label), num_parallel_calls=autotune, deterministic=True)
    ds = ds.batch(int(batch_size), drop_remainder=drop_remainder)
    return ds.prefetch(autotune)


def _parser(tf: Any, image_shape: list[int], label_shape: list[int]) -> Callable[[Any], tuple[Any, Any]]:
    features = {
        "case_id": tf.io.FixedLenFeature([], tf.string),
        "image": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.string),
        "image_shape": tf.io.FixedLenFeature([len(image_shape)], tf.int64),
        "label_shape": tf.io.FixedLenFeature([len(label_shape)], tf.int64),
    }

    def parse(record: Any) -> tuple[Any, Any]:
        example = tf.io.parse_single_example(record, features)
        checks = [
            tf.debugging.assert_equal(example["image_shape"], tf.constant(image_shape, tf.int64), message="image_shape differs from the manifest"),
            tf.debugging.assert_equal(example["label_shape"], tf.constant(label_shape, tf.int64), message="label_shape differs from the manifest"),
        ]
        with tf.control_dependencies(checks):
            image = tf.reshape(tf.io.decode_raw(example["image"], tf.float32, little_endian=True), image_shape)
            label = tf.reshape(tf.io.decode_raw(example["label"], tf.uint8), label_shape)
        return tf.ensure_shape(image, image_shape), tf.ensure_shape(label, label_shape)

    return parse


def _tiler(
    tf: Any, tile: tuple[int, int, int], image_shape: list[int], label_shape: list[int], seed: int,
    tile_sampling: float = 0.0,
) -> Callable[[Any, Any], tuple[Any, Any]]:
    """Random crop of ``tile`` at one offset for image and label, from a per-element random int: a uniform
    offset, or with probability ``tile_sampling`` the tile centred on a random foreground voxel (moved inside
    the volume where it would stick out; a case without foreground keeps its uniform offset). The foreground
    draws come from a stream of their own, so the uniform offsets are those of ``tile_sampling`` 0."""
    max_offset = tf.constant([s - t for s, t in zip(image_shape[:3], tile)], tf.float32)
    half = tf.constant([t // 2 for t in tile], tf.int32)
    if not 0.0 <= tile_sampling <= 1.0:
        raise ValueError(f"tile_sampling must lie in [0, 1], got {tile_sampling}")

    def crop(pair: Any, draw: Any) -> tuple[Any, Any]:
        image, label = pair
        u = tf.random.stateless_uniform([3], seed=tf.stack([tf.constant(seed, tf.int64), draw]), dtype=tf.float32)
        offset = uniform = tf.cast(tf.minimum(tf.floor(u * (max_offset + 1.0)), max_offset), tf.int32)
        if tile_sampling > 0:
            coin, pick = tf.unstack(tf.random.stateless_uniform(
                [2], seed=tf.stack([tf.constant(seed, tf.int64) + 1, draw]), dtype=tf.float32))
            foreground = tf.cast(tf.where(tf.reduce_any(label > 0, axis=-1)), tf.int32)  # (N, 3) voxels
            count = tf.shape(foreground)[0]

            def centred() -> Any:
                centre = foreground[tf.minimum(tf.cast(pick * tf.cast(count, tf.float32), tf.int32), count - 1)]
                return tf.clip_by_value(centre - half, 0, tf.cast(max_offset, tf.int32))

            offset = tf.cond(tf.logical_and(coin < tile_sampling, count > 0), centred, lambda: uniform)
        begin = tf.concat([offset, [0]], axis=0)
        image = tf.slice(image, begin, list(tile) + [image_shape[3]])
        label = tf.slice(label, begin, list(tile) + [label_shape[3]])
        return tf.ensure_shape(image, list(tile) + [image_shape[3]]), tf.ensure_shape(label, list(tile) + [label_shape[3]])

    return crop


def iter_cases(tfrecord_dir: str | Path, split: str) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """Yield ``(case_id, image, label)`` of ``split`` in stored order, as numpy arrays.

    ``image`` is float32 ``(h, w, d, 4)`` and ``label`` uint8 ``(h, w, d, C)``,
    bit-identical to what :func:`~distmis.data.preprocess.preprocess_case`
    produced.  Meant for whole-volume validation and inspection, and the torch
    trainers' input: it reads the files without TensorFlow (:mod:`distmis.data.records`).
    """
    tfrecord_dir = Path(tfrecord_dir)
    manifest = read_manifest(tfrecord_dir)
    paths, _ = _split_shards(tfrecord_dir, manifest, split)
    image_shape = tuple(int(s) for s in manifest["image_shape"])
    label_shape = tuple(int(s) for s in manifest["label_shape"])
    for path in paths:
        for record in read_records(path):  # no TensorFlow: torch trials read their cases with this
            feature = parse_example(record)
            case_id = bytes(feature["case_id"]).decode("utf-8")  # type: ignore[arg-type]
            if tuple(feature["image_shape"]) != image_shape or tuple(feature["label_shape"]) != label_shape:
                raise DataError(f"shard {str(path)!r}: case {case_id!r} has shapes that differ from the manifest")
            image = np.frombuffer(feature["image"], dtype="<f4").astype(np.float32).reshape(image_shape)  # type: ignore[arg-type]
            label = np.frombuffer(feature["label"], dtype=np.uint8).copy().reshape(label_shape)  # type: ignore[arg-type]
            yield case_id, image, label
