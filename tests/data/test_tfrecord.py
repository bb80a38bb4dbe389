"""Tests for distmis.data.tfrecord: conversion, manifest, checksums and tf.data pipeline."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distmis.data import (
    DataError,
    PreprocessConfig,
    convert_to_tfrecords,
    discover_cases,
    iter_cases,
    make_dataset,
    make_split,
    preprocess_case,
    read_case,
    read_manifest,
    verify_checksums,
)
from distmis.data.tfrecord import _shard_sizes

from .conftest import corrupt_gzip, write_nifti

BRATS_CONFIG = PreprocessConfig(layout="brats", labels="regions", crop=(12, 12, 12))
MSD_CONFIG = PreprocessConfig(layout="msd", labels="whole-tumour", resize=(10, 10, 10))


@pytest.fixture(scope="module")
def brats_tfr(brats_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """BraTS data set converted with region labels and a crop; train has 3 cases in 2 shards."""
    cases = discover_cases(brats_root, "brats")
    split = make_split([c.case_id for c in cases], train=0.6, val=0.2, test=0.2, seed=0)
    out = tmp_path_factory.mktemp("tfr") / "brats_tfr"
    manifest = convert_to_tfrecords(cases, split, BRATS_CONFIG, out, shards_per_split=2, workers=2, progress=False)
    return out, manifest, split


@pytest.fixture(scope="module")
def msd_tfr(msd_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cases = discover_cases(msd_root, "msd")
    split = make_split([c.case_id for c in cases], train=0.5, val=0.5, test=0.0, seed=1)
    out = tmp_path_factory.mktemp("tfr") / "msd_tfr"
    convert_to_tfrecords(cases, split, MSD_CONFIG, out, workers=2, progress=False)
    return out


def _expected(root: Path, layout: str, config: PreprocessConfig) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for case in discover_cases(root, layout):
        image, label, _ = read_case(case, layout)
        out[case.case_id] = preprocess_case(image, label, config)
    return out


# --------------------------------------------------------------------------- conversion


def test_shard_sizes() -> None:
    assert _shard_sizes(20, None) == [7, 7, 6]  # ~8 cases per shard
    assert _shard_sizes(8, None) == [8]
    assert _shard_sizes(3, 10) == [1, 1, 1]  # at most one shard per case
    assert _shard_sizes(5, 2) == [3, 2]
    assert _shard_sizes(0, None) == []


def test_round_trip_is_bit_exact(brats_tfr, brats_root: Path) -> None:
    out, manifest, split = brats_tfr
    expected = _expected(brats_root, "brats", BRATS_CONFIG)
    for name in ("train", "val", "test"):
        got = list(iter_cases(out, name))
        assert [case_id for case_id, _, _ in got] == split[name]  # stored order = split order
        for case_id, image, label in got:
            assert image.dtype == np.float32 and label.dtype == np.uint8
            assert image.shape == (12, 12, 12, 4) and label.shape == (12, 12, 12, 3)
            assert np.array_equal(image, expected[case_id][0])
            assert np.array_equal(label, expected[case_id][1])


def test_round_trip_msd_resize(msd_tfr: Path, msd_root: Path) -> None:
    expected = _expected(msd_root, "msd", MSD_CONFIG)
    manifest = read_manifest(msd_tfr)
    assert manifest.label_shape == (10, 10, 10, 1) and manifest.num_classes == 1
    assert [s["file"] for s in manifest.splits["train"]["shards"]] == ["train-00000-of-00001.tfrecord"]
    assert manifest.splits["test"] == {"num_cases": 0, "case_ids": [], "shards": []}
    seen = 0
    for name in ("train", "val"):
        for case_id, image, label in iter_cases(msd_tfr, name):
            assert np.array_equal(image, expected[case_id][0]) and np.array_equal(label, expected[case_id][1])
            seen += 1
    assert seen == 4


def test_round_trip_brats2023_regions(brats2023_root: Path, tmp_path: Path) -> None:
    config = PreprocessConfig(layout="brats2023", labels="regions")
    cases = discover_cases(brats2023_root, "brats2023")
    split = {"train": [c.case_id for c in cases], "val": [], "test": []}
    out = tmp_path / "tfr"
    manifest = convert_to_tfrecords(cases, split, config, out, workers=1, progress=False)
    assert manifest.preprocess["layout"] == "brats2023" and manifest.num_classes == 3
    expected = _expected(brats2023_root, "brats2023", config)
    got = list(iter_cases(out, "train"))
    assert [case_id for case_id, _, _ in got] == split["train"]
    for case_id, image, target in got:
        assert np.array_equal(image, expected[case_id][0]) and np.array_equal(target, expected[case_id][1])
        assert target[..., 2].any() and (target[..., 2] <= target[..., 1]).all()  # ET lies inside TC


def test_manifest_contents(brats_tfr) -> None:
    out, manifest, split = brats_tfr
    assert read_manifest(out) == manifest
    assert manifest.format_version == 1
    assert manifest.preprocess == BRATS_CONFIG.to_dict()
    assert PreprocessConfig.from_dict(manifest.preprocess) == BRATS_CONFIG
    assert manifest.image_shape == (12, 12, 12, 4) and manifest.label_shape == (12, 12, 12, 3)
    assert manifest.image_dtype == "float32" and manifest.label_dtype == "uint8"
    assert manifest.num_classes == 3
    assert manifest.split == split
    train = manifest.splits["train"]
    assert train["num_cases"] == 3 and train["case_ids"] == split["train"]
    assert [(s["file"], s["num_cases"]) for s in train["shards"]] == [
        ("train-00000-of-00002.tfrecord", 2),
        ("train-00001-of-00002.tfrecord", 1),
    ]
    assert [s["file"] for s in manifest.splits["val"]["shards"]] == ["val-00000-of-00001.tfrecord"]
    files = sorted(p.name for p in out.iterdir())
    listed = sorted(s["file"] for info in manifest.splits.values() for s in info["shards"])
    assert files == sorted(listed + ["manifest.json"])
    for info in manifest.splits.values():
        for shard in info["shards"]:
            assert shard["sha256"] == hashlib.sha256((out / shard["file"]).read_bytes()).hexdigest()
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary folder left


def test_verify_checksums_names_modified_shard(brats_tfr, tmp_path: Path) -> None:
    out, _, _ = brats_tfr
    verify_checksums(out)
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    shard = copy / "train-00001-of-00002.tfrecord"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"train-00001-of-00002\.tfrecord.*sha256"):
        verify_checksums(copy)
    shard.unlink()
    with pytest.raises(DataError, match=r"train-00001-of-00002\.tfrecord.*does not exist"):
        verify_checksums(copy)


def test_read_manifest_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="manifest.json.*not found"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 99}))
    with pytest.raises(DataError, match="format_version 99"):
        read_manifest(tmp_path)


# --------------------------------------------------------------------------- tf.data


def _batches(ds) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(x.numpy(), y.numpy()) for x, y in ds]


def test_make_dataset_whole_volumes(brats_tfr) -> None:
    out, _, split = brats_tfr
    stored = {case_id: (image, label) for case_id, image, label in iter_cases(out, "train")}
    batches = _batches(make_dataset(out, "train", batch_size=2))
    assert [b[0].shape for b in batches] == [(2, 12, 12, 12, 4), (1, 12, 12, 12, 4)]
    assert [b[1].shape for b in batches] == [(2, 12, 12, 12, 3), (1, 12, 12, 12, 3)]
    assert batches[0][0].dtype == np.float32 and batches[0][1].dtype == np.float32
    images = [img for x, _ in batches for img in x]
    labels = [lab for _, y in batches for lab in y]
    matched = []
    for image, label in zip(images, labels):
        (case_id,) = [c for c, (i, _) in stored.items() if np.array_equal(i, image)]
        assert np.array_equal(stored[case_id][1].astype(np.float32), label)
        matched.append(case_id)
    assert sorted(matched) == split["train"]  # every case exactly once per epoch
    dropped = _batches(make_dataset(out, "train", batch_size=2, drop_remainder=True, cache=False))
    assert [b[0].shape[0] for b in dropped] == [2]


def test_make_dataset_runs_without_an_autotuning_thread(brats_tfr) -> None:
    """Dropping an iterator joins its autotuning thread, which sleeps out its optimization period first: a trial
    sat idle for seconds at an epoch's end. The pipelines run at a fixed parallelism instead."""
    out, _, _ = brats_tfr
    for ds in (make_dataset(out, "train", batch_size=1), make_dataset(out, "train", batch_size=1, tile=(6, 6, 6),
                                                                      shard=(2, 0), repeat=True)):
        assert ds.options().autotune.enabled is False


def test_make_dataset_tiles_crop_image_and_label_together(brats_tfr) -> None:
    out, _, _ = brats_tfr
    stored = [(image, label) for _, image, label in iter_cases(out, "train")]
    ds = make_dataset(out, "train", batch_size=3, tile=(6, 5, 4), seed=1)
    assert ds.element_spec[0].shape.as_list() == [None, 6, 5, 4, 4]
    ((x, y),) = _batches(ds)
    assert x.shape == (3, 6, 5, 4, 4) and y.shape == (3, 6, 5, 4, 3)
    offsets = []
    for tile_image, tile_label in zip(x, y):
        hits = [
            (k, i, j, l)
            for k, (image, _) in enumerate(stored)
            for i in range(7)
            for j in range(8)
            for l in range(9)
            if np.array_equal(image[i : i + 6, j : j + 5, l : l + 4], tile_image)
        ]
        assert len(hits) == 1
        k, i, j, l = hits[0]
        assert np.array_equal(stored[k][1][i : i + 6, j : j + 5, l : l + 4].astype(np.float32), tile_label)
        offsets.append((i, j, l))
    assert len(set(offsets)) > 1  # offsets are random, not always the same corner


def test_foreground_tile_sampling_centres_tiles_on_the_label(brats_tfr) -> None:
    out, _, _ = brats_tfr
    assert all(label.any() for _, _, label in iter_cases(out, "train"))

    def label_tiles(fraction: float) -> list[np.ndarray]:
        ds = make_dataset(out, "train", batch_size=1, shuffle=True, seed=2, tile=(2, 2, 2), tile_sampling=fraction)
        return [y[0] for _ in range(8) for _, y in _batches(ds)]  # 8 epochs of 3 cases

    uniform, centred = label_tiles(0.0), label_tiles(1.0)
    assert any(not y.any() for y in uniform)  # a uniform offset misses the foreground at times
    assert all(y.any() for y in centred)  # a centred tile never does
    # the coin's and the centre's draws come from a stream of their own: a tile not centred is a uniform one
    half = label_tiles(0.5)
    assert any(np.array_equal(h, u) for h, u in zip(half, uniform)) and not all(
        np.array_equal(h, u) for h, u in zip(half, uniform))


def test_make_dataset_augments_training_tiles_deterministically(brats_tfr) -> None:
    """training.augment in the pipeline: the same seed gives the same augmented batches twice, each epoch draws
    again, labels stay binary; augmentation off gives the batches of no augmentation."""
    from distmis.spec.schema import AugmentSpec

    out, _, _ = brats_tfr
    recipe = AugmentSpec(enabled=True, flip=0.5, rotate90=0.5, affine=1.0, elastic=0.5, elastic_sigma=(1.0, 2.0),
                         elastic_magnitude=(5.0, 10.0), noise=0.5)

    def epochs(augment) -> list[list[np.ndarray]]:
        ds = make_dataset(out, "train", batch_size=2, shuffle=True, seed=1, tile=(8, 8, 8), augment=augment)
        return [[a for x, y in _batches(ds) for a in (x, y)] for _ in range(2)]

    def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
        return all(np.array_equal(p, q) for p, q in zip(a, b))

    plain, first, again = epochs(None), epochs(recipe), epochs(recipe)
    assert same(first[0], again[0]) and same(first[1], again[1])
    assert not same(first[0], first[1])  # drawn again each epoch
    assert not same(first[0], plain[0])
    assert all(set(np.unique(y)) <= {0.0, 1.0} for epoch in first for y in epoch[1::2])
    assert all(x.shape[1:4] == (8, 8, 8) for epoch in first for x in epoch[0::2])
    off = epochs(AugmentSpec(enabled=False, flip=1.0))
    assert same(off[0], plain[0]) and same(off[1], plain[1])


def test_make_dataset_deterministic_for_a_seed(brats_tfr) -> None:
    out, _, _ = brats_tfr

    def two_epochs(seed: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        ds = make_dataset(out, "train", batch_size=1, shuffle=True, seed=seed, tile=(8, 8, 8))
        return [_batches(ds), _batches(ds)]

    def same(a, b) -> bool:
        return all(np.array_equal(p[0], q[0]) and np.array_equal(p[1], q[1]) for p, q in zip(a, b))

    first, again, other = two_epochs(3), two_epochs(3), two_epochs(4)
    assert same(first[0], again[0]) and same(first[1], again[1])
    assert not same(first[0], other[0])
    assert not same(first[0], first[1])  # a new shuffle and new tiles every epoch


def test_make_dataset_shard_and_repeat(brats_tfr) -> None:
    out, _, _ = brats_tfr
    stored = {case_id: image for case_id, image, _ in iter_cases(out, "train")}

    def ids(ds) -> list[str]:
        return [next(c for c, i in stored.items() if np.array_equal(i, x)) for batch, _ in _batches(ds) for x in batch]

    parts = [ids(make_dataset(out, "train", batch_size=1, shard=(2, k), shuffle=True, seed=k)) for k in range(2)]
    assert [len(p) for p in parts] == [2, 1]  # every 2nd case: data-parallel worker k's part
    assert sorted(parts[0] + parts[1]) == sorted(stored)
    endless = make_dataset(out, "train", batch_size=2, repeat=True, shuffle=True, tile=(4, 4, 4)).take(5)
    assert [x.shape[0] for x, _ in _batches(endless)] == [2] * 5
    with pytest.raises(ValueError, match="shard"):
        make_dataset(out, "train", batch_size=1, shard=(2, 2))


def test_make_dataset_errors(brats_tfr, msd_tfr: Path) -> None:
    out, _, _ = brats_tfr
    with pytest.raises(ValueError, match=r"tile \(13, 4, 4\) is larger than the volumes \(12, 12, 12\)"):
        make_dataset(out, "train", batch_size=1, tile=(13, 4, 4))
    with pytest.raises(DataError, match="'holdout'.*available"):
        make_dataset(out, "holdout", batch_size=1)
    with pytest.raises(DataError, match="'test'.*no cases"):
        make_dataset(msd_tfr, "test", batch_size=1)
    with pytest.raises(ValueError, match="batch_size"):
        make_dataset(out, "train", batch_size=0)


# --------------------------------------------------------------------------- failures


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_corrupt_file_leaves_nothing(brats_root: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(brats_root, src)
    corrupt_gzip(src / "BraTS2021_00003" / "BraTS2021_00003_flair.nii.gz")
    cases = discover_cases(src, "brats")
    split = make_split([c.case_id for c in cases], train=0.6, val=0.2, test=0.2, seed=0)
    with pytest.raises(DataError, match=r"BraTS2021_00003_flair\.nii\.gz"):
        convert_to_tfrecords(cases, split, BRATS_CONFIG, tmp_path / "out", workers=2, progress=False)
    assert _listing(tmp_path) == ["src"]  # no output folder, no temporary folder


def test_cases_with_different_shapes_need_crop_or_resize(tmp_path: Path) -> None:
    for case_id, shape in (("a", (8, 8, 8)), ("b", (8, 9, 8)), ("c", (8, 8, 8))):
        for name in ("flair", "t1", "t1ce", "t2"):
            write_nifti(tmp_path / "src" / case_id / f"{case_id}_{name}.nii.gz", np.ones(shape, np.int16))
        write_nifti(tmp_path / "src" / case_id / f"{case_id}_seg.nii.gz", np.zeros(shape, np.uint8))
    cases = discover_cases(tmp_path / "src", "brats")
    split = {"seed": 0, "train": ["a", "b"], "val": ["c"], "test": []}
    with pytest.raises(DataError, match=r"case 'b'.*\(8, 9, 8, 4\).*crop or resize"):
        convert_to_tfrecords(cases, split, PreprocessConfig(layout="brats"), tmp_path / "out", workers=2, progress=False)
    assert _listing(tmp_path) == ["src"]
    fixed = PreprocessConfig(layout="brats", crop=(8, 8, 8))
    manifest = convert_to_tfrecords(cases, split, fixed, tmp_path / "out", workers=1, progress=False)
    assert manifest.image_shape == (8, 8, 8, 4)


def test_bad_label_value_leaves_nothing(tmp_path: Path) -> None:
    seg = np.zeros((6, 6, 6), np.uint8)
    seg[2, 2, 2] = 3
    for name in ("flair", "t1", "t1ce", "t2"):
        write_nifti(tmp_path / "src" / "a" / f"a_{name}.nii.gz", np.ones((6, 6, 6), np.int16))
    write_nifti(tmp_path / "src" / "a" / "a_seg.nii.gz", seg)
    cases = discover_cases(tmp_path / "src", "brats")
    split = {"seed": 0, "train": ["a"], "val": [], "test": []}
    with pytest.raises(DataError, match=r"a_seg\.nii\.gz.*\[3\]"):
        convert_to_tfrecords(cases, split, PreprocessConfig(layout="brats"), tmp_path / "out", workers=1, progress=False)
    assert _listing(tmp_path) == ["src"]


def test_split_with_unknown_case(brats_root: Path, tmp_path: Path) -> None:
    cases = discover_cases(brats_root, "brats")
    split = {"seed": 0, "train": ["BraTS2021_00000", "nope"], "val": [], "test": []}
    with pytest.raises(DataError, match="not in the data set.*'nope'"):
        convert_to_tfrecords(cases, split, BRATS_CONFIG, tmp_path / "out", workers=1, progress=False)
    assert _listing(tmp_path) == []


def test_existing_output_and_overwrite(brats_root: Path, brats_tfr, tmp_path: Path) -> None:
    out, _, split = brats_tfr
    cases = discover_cases(brats_root, "brats")
    with pytest.raises(DataError, match="already exists.*overwrite=True"):
        convert_to_tfrecords(cases, split, BRATS_CONFIG, out, workers=1, progress=False)
    target = tmp_path / "tfr"
    shutil.copytree(out, target)
    small = {"seed": 0, "train": ["BraTS2021_00001"], "val": [], "test": []}
    manifest = convert_to_tfrecords(cases, small, BRATS_CONFIG, target, workers=1, progress=False, overwrite=True)
    assert read_manifest(target) == manifest and manifest.splits["train"]["num_cases"] == 1
    assert _listing(target) == ["manifest.json", "train-00000-of-00001.tfrecord"]
    assert _listing(tmp_path) == ["tfr"]
    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match="is not a TFRecord folder distmis wrote"):
        convert_to_tfrecords(cases, small, BRATS_CONFIG, unrelated, workers=1, progress=False, overwrite=True)
    assert _listing(unrelated) == ["notes.txt"]
    # A folder distmis wrote, with a file of someone else's beside the shards: left alone.
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match=r"not plain files its manifest.json lists: 'notes.txt' \(a file the manifest "
                                        r"does not list\)\. Overwrite replaces only what distmis wrote"):
        convert_to_tfrecords(cases, small, BRATS_CONFIG, target, workers=1, progress=False, overwrite=True)
    assert (target / "notes.txt").read_text() == "keep me" and read_manifest(target) == manifest


def test_a_small_data_set_is_read_in_process_and_a_large_one_by_reader_processes(msd_root: Path, monkeypatch):
    """Reader processes take a second or two to start: the default reads a data set whose files and records are
    both under IN_PROCESS_BYTES in the converting process, and one above by min(CPUs, 4) readers."""
    import os

    import distmis.data.tfrecord as tfrecord

    cases = discover_cases(msd_root, "msd")
    size = sum(path.stat().st_size for case in cases for path in (*case.images, case.label))
    parallel = min(os.cpu_count() or 1, 4)
    assert tfrecord.default_readers(cases, 1000) == 1
    assert tfrecord.default_readers(cases, tfrecord.IN_PROCESS_BYTES + 1) == parallel  # large records
    assert tfrecord.default_readers(cases, None) == parallel  # not known: as ever
    monkeypatch.setattr(tfrecord, "IN_PROCESS_BYTES", size - 1)  # large files
    assert tfrecord.default_readers(cases, 1000) == parallel
