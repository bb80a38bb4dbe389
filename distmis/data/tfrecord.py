"""Offline binarization to sharded TFRecords, and the tf.data reader used for training.

As in the DistMIS paper, NIfTI decoding and preprocessing happen once, before any trial, not every
epoch: :func:`convert_to_tfrecords` reads and preprocesses cases in parallel processes and writes
``{split}-{i:05d}-of-{n:05d}.tfrecord`` shards plus a ``manifest.json`` (shapes, dtypes, case counts
and ids per split, per-shard sha256). Each record is one case::

    case_id      bytes
    image        raw float32 bytes, shape image_shape  (h, w, d, 4)
    label        raw uint8 bytes,   shape label_shape  (h, w, d, C)
    image_shape  int64 list
    label_shape  int64 list

The conversion writes into a temporary sibling folder and renames it into place at the end; on any
error the temporary folder is removed, so a failed conversion leaves no partial shard.

:func:`make_dataset` is the training-time reader: interleaved shard reads, parse + shape check,
optional in-memory cache, seeded shuffle, seeded random tiles, batch, prefetch.
TensorFlow is imported inside the functions, so the rest of :mod:`distmis.data` never needs it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from distmis.data.errors import DataError
from distmis.data.layouts import CaseFiles, read_case
from distmis.data.preprocess import PreprocessConfig, preprocess_case

__all__ = [
    "MANIFEST_NAME",
    "convert_to_tfrecords",
    "read_manifest",
    "verify_checksums",
    "make_dataset",
    "iter_cases",
]

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
CASES_PER_SHARD = 8
SPLITS = ("train", "val", "test")


# --------------------------------------------------------------------------- conversion
def _load_and_preprocess(case: CaseFiles, config_dict: dict[str, Any]) -> tuple[str, np.ndarray, np.ndarray]:
    """Worker: read one case through nibabel and preprocess it (numpy only, no TensorFlow)."""
    config = PreprocessConfig.from_dict(config_dict)
    image, label, _spacing = read_case(case, config.layout)
    if not np.isfinite(image).all():
        raise DataError(f"{case.images[0]}: case {case.case_id!r} holds NaN or infinite intensities")
    try:
        image, target = preprocess_case(image, label, config)
    except ValueError as exc:
        raise DataError(f"case {case.case_id!r} ({case.label}): {exc}") from None
    return case.case_id, image, target


def _shard_count(num_cases: int, requested: int | None) -> int:
    if num_cases == 0:
        return 0
    if requested is not None:
        if requested < 1:
            raise ValueError(f"shards_per_split must be >= 1, got {requested}")
        return min(requested, num_cases)
    return max(1, math.ceil(num_cases / CASES_PER_SHARD))


def _example(case_id: str, image: np.ndarray, target: np.ndarray) -> bytes:
    import tensorflow as tf

    def _bytes(value: bytes) -> tf.train.Feature:
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))

    def _ints(values: Sequence[int]) -> tf.train.Feature:
        return tf.train.Feature(int64_list=tf.train.Int64List(value=list(values)))

    features = {
        "case_id": _bytes(case_id.encode()),
        "image": _bytes(np.ascontiguousarray(image, dtype=np.float32).tobytes()),
        "label": _bytes(np.ascontiguousarray(target, dtype=np.uint8).tobytes()),
        "image_shape": _ints(image.shape),
        "label_shape": _ints(target.shape),
    }
    return tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def convert_to_tfrecords(
    cases: Sequence[CaseFiles],
    split: dict[str, Any],
    config: PreprocessConfig,
    out_dir: str | Path,
    *,
    shards_per_split: int | None = None,
    workers: int | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Convert ``cases`` into sharded TFRecords per split under ``out_dir``; returns the manifest.

    Args:
        cases: the data set's cases (from :func:`~distmis.data.layouts.discover_cases`).
        split: ``{"train": [ids], "val": [ids], "test": [ids], ...}`` from :func:`~distmis.data.split.make_split`.
        config: preprocessing applied to every case.
        out_dir: folder to create.
        shards_per_split: shards per split (default: about 8 cases per shard).
        workers: processes reading and preprocessing cases (default: min(CPUs, 4)).
        progress: tqdm progress bar on stderr.
        overwrite: replace an existing ``out_dir``.

    Raises:
        DataError: an unreadable file, mismatched image/label shapes, a label value outside the
            layout's set, cases whose preprocessed shapes differ, or an existing ``out_dir``.
    """
    import tensorflow as tf
    from tqdm import tqdm

    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise DataError(f"output folder {str(out_dir)!r} already exists; choose a new folder or pass overwrite")
    by_id = {c.case_id: c for c in cases}
    for name in SPLITS:
        unknown = [cid for cid in split.get(name, []) if cid not in by_id]
        if unknown:
            raise DataError(f"split {name!r} names cases that are not in the data set: {unknown[:5]}")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    workers = workers or min(os.cpu_count() or 1, 4)
    config_dict = config.to_dict()
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "preprocess": config_dict,
        "num_classes": config.num_classes,
        "image_dtype": "float32",
        "label_dtype": "uint8",
        "image_shape": None,
        "label_shape": None,
        "split": split,
        "splits": {},
    }
    total = sum(len(split.get(name, [])) for name in SPLITS)
    try:
        with ProcessPoolExecutor(max_workers=workers) as pool, tqdm(
            total=total, desc="tfrecords", unit="case", disable=not progress, file=sys.stderr
        ) as bar:
            for name in SPLITS:
                ids = list(split.get(name, []))
                num_shards = _shard_count(len(ids), shards_per_split)
                shards: list[dict[str, Any]] = []
                # Cases go to shards round-robin, in split order; the pool keeps that order.
                results = pool.map(_load_and_preprocess, [by_id[i] for i in ids], [config_dict] * len(ids))
                writers, counts = [], [0] * num_shards
                files = [f"{name}-{i:05d}-of-{num_shards:05d}.tfrecord" for i in range(num_shards)]
                writers = [tf.io.TFRecordWriter(str(tmp / f)) for f in files]
                try:
                    for index, (case_id, image, target) in enumerate(results):
                        if manifest["image_shape"] is None:
                            manifest["image_shape"] = list(image.shape)
                            manifest["label_shape"] = list(target.shape)
                        elif list(image.shape) != manifest["image_shape"]:
                            raise DataError(
                                f"case {case_id!r} has shape {list(image.shape)} after preprocessing, other cases "
                                f"{manifest['image_shape']}; set dataset.crop or dataset.resize (--crop/--resize) "
                                "so that every case has the same shape"
                            )
                        writers[index % num_shards].write(_example(case_id, image, target))
                        counts[index % num_shards] += 1
                        bar.update(1)
                finally:
                    for writer in writers:
                        writer.close()
                for file, count in zip(files, counts):
                    shards.append({"file": file, "num_cases": count, "sha256": _sha256(tmp / file)})
                manifest["splits"][name] = {"num_cases": len(ids), "case_ids": ids, "shards": shards}
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


# --------------------------------------------------------------------------- manifest
def read_manifest(tfrecord_dir: str | Path) -> dict[str, Any]:
    path = Path(tfrecord_dir) / MANIFEST_NAME
    if not path.is_file():
        raise DataError(f"{str(path)!r} not found: not a distmis TFRecord folder (make one with `distmis data tfrecord`)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(f"{str(path)!r} is not valid JSON: {exc}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{str(path)!r}: format version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}")
    return manifest


def verify_checksums(tfrecord_dir: str | Path) -> None:
    """Raise ``DataError`` naming the first shard that is missing or whose sha256 differs from the manifest."""
    tfrecord_dir = Path(tfrecord_dir)
    manifest = read_manifest(tfrecord_dir)
    for name, info in manifest["splits"].items():
        for shard in info["shards"]:
            path = tfrecord_dir / shard["file"]
            if not path.is_file():
                raise DataError(f"shard {str(path)!r} listed in the manifest is missing")
            if _sha256(path) != shard["sha256"]:
                raise DataError(f"shard {str(path)!r} is corrupt: its sha256 differs from the manifest")


# --------------------------------------------------------------------------- reading
def _shard_paths(tfrecord_dir: Path, manifest: dict[str, Any], split: str) -> list[str]:
    if split not in manifest["splits"]:
        raise DataError(f"{tfrecord_dir}: no split {split!r}; splits: {sorted(manifest['splits'])}")
    return [str(tfrecord_dir / s["file"]) for s in manifest["splits"][split]["shards"]]


def _parser(manifest: dict[str, Any]):
    import tensorflow as tf

    image_shape = [int(v) for v in manifest["image_shape"]]
    label_shape = [int(v) for v in manifest["label_shape"]]
    spec = {
        "case_id": tf.io.FixedLenFeature([], tf.string),
        "image": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.string),
        "image_shape": tf.io.FixedLenFeature([4], tf.int64),
        "label_shape": tf.io.FixedLenFeature([4], tf.int64),
    }

    def parse(record):
        ex = tf.io.parse_single_example(record, spec)
        tf.debugging.assert_equal(ex["image_shape"], tf.constant(image_shape, tf.int64),
                                  message="record image shape differs from the manifest")
        tf.debugging.assert_equal(ex["label_shape"], tf.constant(label_shape, tf.int64),
                                  message="record label shape differs from the manifest")
        image = tf.ensure_shape(tf.reshape(tf.io.decode_raw(ex["image"], tf.float32), image_shape), image_shape)
        label = tf.ensure_shape(tf.reshape(tf.io.decode_raw(ex["label"], tf.uint8), label_shape), label_shape)
        return ex["case_id"], image, label

    return parse


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
):
    """A ``tf.data.Dataset`` of ``(image (B, h, w, d, 4) float32, label (B, h, w, d, C) float32)``.

    Deterministic for a given ``seed``: the shuffle order of each epoch and each epoch's tiles.
    ``shard=(num_shards, index)`` keeps every ``num_shards``-th case starting at ``index`` (one data-parallel
    worker's part); ``repeat`` makes the dataset endless (take a fixed number of batches per epoch).
    """
    import tensorflow as tf

    tfrecord_dir = Path(tfrecord_dir)
    manifest = read_manifest(tfrecord_dir)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    paths = _shard_paths(tfrecord_dir, manifest, split)
    num_cases = int(manifest["splits"][split]["num_cases"])
    volume = [int(v) for v in manifest["image_shape"][:3]]
    if tile is not None:
        tile = [int(t) for t in tile]
        if len(tile) != 3 or any(t < 1 or t > v for t, v in zip(tile, volume)):
            raise ValueError(f"tile {tile} must be 3 positive sizes no larger than the volume {volume}")

    ds = tf.data.Dataset.from_tensor_slices(paths)
    ds = ds.interleave(
        tf.data.TFRecordDataset, cycle_length=max(1, min(len(paths), 4)),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True,
    )
    ds = ds.map(_parser(manifest), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    ds = ds.map(lambda _cid, image, label: (image, tf.cast(label, tf.float32)))
    if shard is not None:
        num_shards, index = shard
        if not 0 <= index < num_shards:
            raise ValueError(f"shard index must be in [0, {num_shards}), got {index}")
        ds = ds.shard(num_shards, index)
        num_cases = max(1, len(range(index, num_cases, num_shards)))
    if cache:
        ds = ds.cache()
    if shuffle:
        ds = ds.shuffle(max(1, num_cases), seed=seed, reshuffle_each_iteration=True)
    if repeat:
        ds = ds.repeat()
    if tile is not None:
        ds = _random_tiles(ds, tile, volume, seed)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    return ds.prefetch(tf.data.AUTOTUNE)


def _random_tiles(ds, tile: list[int], volume: list[int], seed: int):
    """Crop each (image, label) pair at the same random offset; offsets come from a seeded stream."""
    import tensorflow as tf

    offsets = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).batch(3)  # endless, seeded

    def crop(pair, rnd):
        image, label = pair
        high = tf.constant([v - t + 1 for v, t in zip(volume, tile)], tf.int64)
        start = tf.math.floormod(tf.abs(rnd), high)
        size_i = tf.constant(tile + [-1], tf.int64)
        begin = tf.concat([start, tf.zeros([1], tf.int64)], axis=0)
        return tf.slice(image, begin, size_i), tf.slice(label, begin, size_i)

    return tf.data.Dataset.zip((ds, offsets)).map(crop, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def iter_cases(tfrecord_dir: str | Path, split: str) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """Yield ``(case_id, image (h, w, d, 4) float32, label (h, w, d, C) uint8)`` in stored shard order."""
    import tensorflow as tf

    tfrecord_dir = Path(tfrecord_dir)
    manifest = read_manifest(tfrecord_dir)
    parse = _parser(manifest)
    for path in _shard_paths(tfrecord_dir, manifest, split):
        for record in tf.data.TFRecordDataset(path):
            case_id, image, label = parse(record)
            yield case_id.numpy().decode(), image.numpy(), label.numpy()
