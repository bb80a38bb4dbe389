"""A TFRecord folder's manifest as a typed object: read back as written, checked, its derived shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distmis.data.errors import DataError
from distmis.data.manifest import MANIFEST_NAME, DataManifest, read_manifest

DOCUMENT = {"format_version": 1, "preprocess": {"layout": "msd"}, "modalities": ["CT"], "channels": ["CT"],
            "targets": {"activation": "softmax", "channels": []}, "dataset": None, "image_shape": [24, 20, 16, 1],
            "label_shape": [24, 20, 16, 4], "image_dtype": "float32", "label_dtype": "uint8", "num_classes": 4,
            "splits": {"train": {"num_cases": 2, "case_ids": ["a", "b"], "shards": []}},
            "split": {"train": ["a", "b"], "val": [], "test": []}}


def test_a_manifest_reads_back_as_written_with_its_volume_and_channels(tmp_path: Path):
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(DOCUMENT))
    manifest = read_manifest(tmp_path)
    assert manifest.to_dict() == DOCUMENT
    assert manifest.volume == (24, 20, 16) and manifest.in_channels == 1 and manifest.num_cases("train") == 2
    assert DataManifest.from_dict(manifest.to_dict()) == manifest


def test_an_older_manifest_without_the_later_fields_reads_with_their_defaults(tmp_path: Path):
    older = {k: DOCUMENT[k] for k in ("format_version", "preprocess", "image_shape", "label_shape", "splits")}
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(older))
    manifest = read_manifest(tmp_path)
    assert manifest.channels == () and manifest.targets is None and manifest.split == {}


@pytest.mark.parametrize("change, message", [
    ({"image_shape": "big"}, "wrong type"),
    ({"format_version": 2}, "format_version 2"),
    ({"splits": None}, "wrong type"),
])
def test_a_manifest_that_is_not_ours_is_refused_naming_the_file(tmp_path: Path, change, message):
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(DOCUMENT | change))
    with pytest.raises(DataError, match=message) as caught:
        read_manifest(tmp_path)
    assert MANIFEST_NAME in str(caught.value)
