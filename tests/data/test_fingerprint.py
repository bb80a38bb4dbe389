"""The data set's fingerprint: what it finds in cases whose content the test wrote, kept and reused until a file
changes, and printed by ``distmis data inspect --json``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

import distmis.data.fingerprint as fingerprint_module
from distmis.cli.main import main
from distmis.data.fingerprint import (
    FINGERPRINT_FILE,
    DatasetFingerprint,
    compute_fingerprint,
    fingerprint_for,
    nonzero_box,
)
from distmis.data.layouts import discover_cases
from distmis.data.synthetic import synthesize_dataset

SHAPE = (20, 18, 10)
SPACINGS = [(0.8, 0.8, 4.0), (0.7, 0.9, 5.0)]  # anisotropic: median 0.75 x 0.85 x 4.5


def known_case(index: int) -> tuple[np.ndarray, np.ndarray]:
    """A CT-like case: air (0) outside a body box, two liver blobs (label 1) and one spleen blob (2) inside it."""
    image = np.zeros(SHAPE, np.float32)
    label = np.zeros(SHAPE, np.uint8)
    image[2:16, 3:15, 1:8 + index] = -100.0  # the body: the non-zero region
    label[4:8, 4:8, 2:4] = 1  # 32 voxels
    label[10:12, 10:12, 2:3] = 1  # 4 voxels, apart from the first
    label[4:6, 10:14, 5:7] = 2  # 16 voxels
    image[label == 1] = 60.0 + index
    image[label == 2] = 120.0 + 10 * index
    return image, label


@pytest.fixture()
def dataset(tmp_path: Path) -> Path:
    """A one-channel MSD data set of two cases, rewritten with :func:`known_case`'s content."""
    root = tmp_path / "ct"
    synthesize_dataset(root, "msd", cases=2, shape=(16, 16, 8), seed=0, progress=False, kind="ct")
    for index, case in enumerate(discover_cases(root, "msd")):
        image, label = known_case(index)
        affine = np.diag([*SPACINGS[index], 1.0])
        nib.save(nib.Nifti1Image(image, affine), str(case.images[0]))
        nib.save(nib.Nifti1Image(label, affine), str(case.label))
    return root


def test_the_fingerprint_finds_what_the_cases_hold(dataset: Path):
    found = compute_fingerprint(dataset, "msd")
    first, second = found.cases
    assert (first.shape, first.spacing, first.orientation) == (SHAPE, pytest.approx(SPACINGS[0]), "RAS")
    assert first.cropped_shape == (14, 12, 7) and second.cropped_shape == (14, 12, 8)  # the body box
    assert first.label_voxels == {0: 20 * 18 * 10 - 52, 1: 36, 2: 16}
    voxel_mm3 = 0.8 * 0.8 * 4.0
    assert first.objects[1] == pytest.approx((32 * voxel_mm3, 4 * voxel_mm3)) and len(first.objects[2]) == 1

    assert found.median_spacing == pytest.approx((0.75, 0.85, 4.5))
    assert found.median_shape == (14, 12, 8)  # the median of 7 and 8 rounded to even
    resampled = np.median([np.array(c.cropped_shape) * c.spacing / (0.75, 0.85, 4.5) for c in found.cases], axis=0)
    assert found.median_shape_at_median_spacing == tuple(int(v) for v in np.round(resampled))
    assert found.anisotropy == pytest.approx(4.5 / 0.75) and found.anisotropic

    # the foreground intensities over both cases: every voxel, as few as they are (no sampling)
    values = np.concatenate([known_case(i)[0][known_case(i)[1] > 0] for i in range(2)]).astype(np.float64)
    [channel] = found.channels
    assert channel.mean == pytest.approx(values.mean()) and channel.std == pytest.approx(values.std())
    assert (channel.min, channel.median, channel.max) == (60.0, pytest.approx(np.median(values)), 130.0)
    assert channel.percentile_99_5 == pytest.approx(np.percentile(values, 99.5))

    classes = {c.value: c for c in found.classes}
    assert [classes[v].name for v in (0, 1, 2, 3)] == ["background", "liver", "spleen", "kidney"]
    assert classes[1].voxel_fraction == pytest.approx(72 / (2 * 20 * 18 * 10))
    assert (classes[1].cases, classes[1].median_objects) == (2, 2.0)
    assert classes[3].cases == 0 and classes[3].median_object_mm3 is None  # named, in no case
    assert DatasetFingerprint.from_dict(json.loads(found.to_json())) == found


def test_the_box_is_where_any_channel_is_not_zero():
    image = np.zeros((6, 5, 4, 2), np.float32)
    image[1, 2, 3, 0] = 1.0
    image[4, 1, 0, 1] = -2.0
    assert nonzero_box(image) == (slice(1, 5), slice(1, 3), slice(0, 4))
    assert nonzero_box(np.zeros((3, 4, 5, 1))) == (slice(0, 3), slice(0, 4), slice(0, 5))  # nothing to crop to


def test_a_large_foreground_is_sampled_the_same_way_every_time(dataset: Path, monkeypatch):
    monkeypatch.setattr(fingerprint_module, "FOREGROUND_SAMPLES_PER_CASE", 10)
    once, twice = compute_fingerprint(dataset, "msd"), compute_fingerprint(dataset, "msd")
    assert once.channels == twice.channels
    assert (once.channels[0].min, once.channels[0].max) == (60.0, 130.0)  # over every voxel, not the sample


def test_a_kept_fingerprint_is_reused_until_a_file_changes(dataset: Path, tmp_path: Path):
    folder = tmp_path / "prepared"
    first = fingerprint_for(dataset, "msd", folder)
    kept = folder / FINGERPRINT_FILE
    written = kept.stat().st_mtime_ns
    assert fingerprint_for(dataset, "msd", folder) == first and kept.stat().st_mtime_ns == written  # reused
    assert not [p for p in folder.iterdir() if p.name != FINGERPRINT_FILE]  # nothing half-written left

    # a case's label changed: computed again and kept again
    case = discover_cases(dataset, "msd")[0]
    image, label = known_case(0)
    label[4:8, 4:8, 2:4] = 2
    nib.save(nib.Nifti1Image(label, np.diag([*SPACINGS[0], 1.0])), str(case.label))
    changed = fingerprint_for(dataset, "msd", folder)
    assert changed.cases[0].label_voxels[2] == 48 and changed.files_key != first.files_key
    assert DatasetFingerprint.from_dict(json.loads(kept.read_text())) == changed

    # another version's fingerprint, or a damaged one, is computed again
    document = json.loads(kept.read_text())
    kept.write_text(json.dumps({**document, "version": 0}))
    os.utime(kept, ns=(0, 0))
    assert fingerprint_for(dataset, "msd", folder) == changed and kept.stat().st_mtime_ns != 0
    kept.write_text("{")
    assert fingerprint_for(dataset, "msd", folder) == changed


def test_inspect_json_prints_the_fingerprint(dataset: Path, capsys):
    assert main(["data", "inspect", str(dataset), "--json", "--quiet"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert DatasetFingerprint.from_dict(printed) == compute_fingerprint(dataset, "msd")
    assert printed["anisotropic"] is True
