"""Offline binarization: bit-exact round trip, manifest, checksums, atomic failure, the tf.data reader."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from distmis.data import (
    DataError, LabelMode, Layout, PreprocessConfig, convert_to_tfrecords, discover_cases, iter_cases, make_dataset,
    make_split, preprocess_case, read_case, read_manifest, synthesize_dataset, verify_checksums,
)


@pytest.fixture(scope="module")
def brats(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tfr") / "brats"
    synthesize_dataset(root, "brats", cases=6, shape=(16, 16, 12), seed=0, progress=False)
    return root


def convert(root: Path, out: Path, **kwargs):
    cases = discover_cases(root, "brats")
    split = make_split([c.case_id for c in cases], train=0.5, val=0.25, test=0.25, seed=0)
    config = PreprocessConfig(layout=Layout.BRATS, labels=LabelMode.REGIONS, crop=(16, 16, 8))
    return cases, split, config, convert_to_tfrecords(cases, split, config, out, workers=2, progress=False, **kwargs)


def test_round_trip_is_bit_exact(brats, tmp_path):
    cases, split, config, manifest = convert(brats, tmp_path / "out", shards_per_split=2)
    by_id = {c.case_id: c for c in cases}
    for name in ("train", "val", "test"):
        seen = []
        for case_id, image, label in iter_cases(tmp_path / "out", name):
            expected_image, expected_label = preprocess_case(*read_case(by_id[case_id], "brats")[:2], config)
            assert image.dtype == np.float32 and label.dtype == np.uint8
            assert np.array_equal(image, expected_image) and np.array_equal(label, expected_label)
            seen.append(case_id)
        assert sorted(seen) == sorted(split[name])


def test_manifest(brats, tmp_path):
    _, split, config, manifest = convert(brats, tmp_path / "out", shards_per_split=2)
    assert manifest == read_manifest(tmp_path / "out")
    assert manifest["image_shape"] == [16, 16, 8, 4] and manifest["label_shape"] == [16, 16, 8, 3]
    assert manifest["num_classes"] == 3 and manifest["preprocess"] == config.to_dict()
    assert manifest["split"] == split
    train = manifest["splits"]["train"]
    assert train["num_cases"] == 3 and sorted(train["case_ids"]) == sorted(split["train"])
    assert [s["file"] for s in train["shards"]] == ["train-00000-of-00002.tfrecord", "train-00001-of-00002.tfrecord"]
    assert sum(s["num_cases"] for s in train["shards"]) == 3
    assert all(len(s["sha256"]) == 64 for s in train["shards"])
    verify_checksums(tmp_path / "out")


def test_corrupt_shard_is_detected(brats, tmp_path):
    convert(brats, tmp_path / "out")
    shard = next((tmp_path / "out").glob("val-*.tfrecord"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=shard.name):
        verify_checksums(tmp_path / "out")


def test_bad_case_leaves_nothing_behind(brats, tmp_path):
    bad = tmp_path / "bad"
    synthesize_dataset(bad, "brats", cases=4, shape=(8, 8, 8), seed=1, progress=False)
    seg = sorted(bad.glob("*/*_seg.nii.gz"))[2]
    img = nib.load(seg)
    label = np.asarray(img.dataobj).copy()
    label[0, 0, 0] = 3  # not a BraTS label
    nib.save(nib.Nifti1Image(label, img.affine), str(seg))
    with pytest.raises(DataError, match=seg.name):
        convert(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no temporary folder either


def test_cases_of_different_shapes_need_crop_or_resize(tmp_path):
    root = tmp_path / "msd"
    synthesize_dataset(root, "msd", cases=3, shape=(8, 8, 8), seed=0, progress=False)
    other = root / "imagesTr" / "BRATS_002.nii.gz"
    nib.save(nib.Nifti1Image(np.ones((8, 8, 16, 4), np.float32), np.eye(4)), str(other))
    nib.save(nib.Nifti1Image(np.zeros((8, 8, 16), np.uint8), np.eye(4)), str(root / "labelsTr" / "BRATS_002.nii.gz"))
    cases = discover_cases(root, "msd")
    split = {"train": [c.case_id for c in cases], "val": [], "test": []}
    with pytest.raises(DataError, match="BRATS_002.*crop"):
        convert_to_tfrecords(cases, split, PreprocessConfig(layout=Layout.MSD), tmp_path / "out", workers=1, progress=False)
    assert not (tmp_path / "out").exists()


def test_existing_output_is_not_overwritten_unless_asked(brats, tmp_path):
    convert(brats, tmp_path / "out")
    with pytest.raises(DataError, match="already exists"):
        convert(brats, tmp_path / "out")
    convert(brats, tmp_path / "out", overwrite=True)
    assert read_manifest(tmp_path / "out")["image_shape"] == [16, 16, 8, 4]


def test_dataset_batches_tiles_and_determinism(brats, tmp_path):
    convert(brats, tmp_path / "out")

    def epoch_sums(seed, tile=None, epochs=2):
        ds = make_dataset(tmp_path / "out", "train", batch_size=2, shuffle=True, seed=seed, tile=tile)
        return [[float(y.numpy().sum()) + float(x.numpy()[..., 0].sum()) for x, y in ds] for _ in range(epochs)]

    ds = make_dataset(tmp_path / "out", "train", batch_size=2)
    shapes = [(tuple(x.shape), tuple(y.shape), y.dtype.name) for x, y in ds]
    assert shapes == [((2, 16, 16, 8, 4), (2, 16, 16, 8, 3), "float32"), ((1, 16, 16, 8, 4), (1, 16, 16, 8, 3), "float32")]
    tiled = make_dataset(tmp_path / "out", "train", batch_size=3, tile=(8, 8, 4), shuffle=True, seed=0)
    x, y = next(iter(tiled))
    assert tuple(x.shape) == (3, 8, 8, 4, 4) and tuple(y.shape) == (3, 8, 8, 4, 3)
    assert epoch_sums(0, (8, 8, 4)) == epoch_sums(0, (8, 8, 4))  # same seed, same order and tiles
    a = epoch_sums(0, (8, 8, 4), epochs=3)
    assert a[0] != a[1] or a[1] != a[2]  # new tiles / order each epoch
    with pytest.raises(ValueError, match="tile"):
        make_dataset(tmp_path / "out", "train", batch_size=1, tile=(32, 8, 8))


def test_missing_manifest(tmp_path):
    with pytest.raises(DataError, match="manifest.json"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 99}))
    with pytest.raises(DataError, match="format version"):
        read_manifest(tmp_path)
