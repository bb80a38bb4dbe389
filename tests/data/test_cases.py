"""Random access to a split's cases in the TFRecords (no TensorFlow): the record index and SplitCases."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from distmis.data.cases import SplitCases
from distmis.data.errors import DataError
from distmis.data.records import read_record_at, read_records, record_offsets
from distmis.data.tfrecord import iter_cases, read_manifest
from tests.data.test_records import record


@pytest.fixture(scope="module")
def tfrecords(tmp_path_factory) -> Path:
    """An 8-case synthetic MSD set converted with 2 shards per split (train 4 cases, val 2, test 2). Read only."""
    from distmis.data import PreprocessConfig, convert_to_tfrecords, discover_cases, make_split, synthesize_dataset

    tmp = tmp_path_factory.mktemp("cases")
    synthesize_dataset(tmp / "Task01_BrainTumour", "msd", cases=8, shape=(12, 12, 12), seed=2, progress=False)
    cases = discover_cases(tmp / "Task01_BrainTumour", "msd")
    split = make_split([c.case_id for c in cases], train=0.5, val=0.25, test=0.25, seed=0)
    config = PreprocessConfig(layout="msd", labels="whole-tumour", resize=(10, 10, 10))
    convert_to_tfrecords(cases, split, config, tmp / "tfr", shards_per_split=2, workers=1, progress=False)
    return tmp / "tfr"


@pytest.fixture
def copy(tfrecords, tmp_path) -> Path:
    """A copy of the folder to damage."""
    return Path(shutil.copytree(tfrecords, tmp_path / "tfrecords"))


# --------------------------------------------------------------------------- the record index
def test_offsets_index_every_record_and_read_it_back(tmp_path):
    path = tmp_path / "x.tfrecord"
    datas = [b"", b"abc", bytes(range(256)) * 40, b"z"]
    path.write_bytes(b"".join(record(d) for d in datas))
    offsets = record_offsets(path)
    assert offsets == [0, 16, 16 + 19, 16 + 19 + 16 + 10240]
    assert [read_record_at(path, o) for o in reversed(offsets)] == datas[::-1]
    assert list(read_records(path)) == datas
    empty = tmp_path / "empty.tfrecord"
    empty.write_bytes(b"")
    assert record_offsets(empty) == []


def test_the_index_reads_headers_only(tmp_path, monkeypatch):
    """Indexing skips the data: the bytes read are 12 per record, whatever the records' size."""
    import builtins

    path = tmp_path / "big.tfrecord"
    path.write_bytes(b"".join(record(bytes(1 << 20)) for _ in range(3)))
    reads = []
    real_open = builtins.open

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            data = self.f.read(n)
            reads.append(len(data))
            return data

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(builtins, "open", lambda *a, **k: Counting(real_open(*a, **k)))
    assert len(record_offsets(path)) == 3
    assert sum(reads) == 3 * 12


def test_a_truncated_file_fails_the_index_naming_itself(tmp_path):
    path = tmp_path / "cut.tfrecord"
    path.write_bytes(record(b"abcdef") + record(b"ghijkl")[:-2])  # the last record's checksum is cut
    with pytest.raises(DataError, match=r"cut\.tfrecord.*ends inside a record.*22 needs 44 bytes, the file has 42"):
        record_offsets(path)
    path.write_bytes(record(b"abcdef") + record(b"ghijkl")[:7])
    with pytest.raises(DataError, match=r"cut\.tfrecord.*ends inside a record header"):
        record_offsets(path)


def test_a_read_at_a_wrong_offset_or_past_the_end_names_the_file(tmp_path):
    path = tmp_path / "x.tfrecord"
    path.write_bytes(record(b"abcdef") + record(b"ghijkl"))
    with pytest.raises(DataError, match=r"x\.tfrecord.*checksum"):
        read_record_at(path, 3)
    with pytest.raises(DataError, match=r"x\.tfrecord.*no record at byte 44"):
        read_record_at(path, 44)
    path.write_bytes(record(b"abcdef") + record(b"ghijkl")[:-3])
    with pytest.raises(DataError, match=r"x\.tfrecord.*ends inside the record at byte 22"):
        read_record_at(path, 22)


# --------------------------------------------------------------------------- SplitCases
@pytest.mark.parametrize("split", ["train", "val", "test"])
def test_random_access_equals_iter_cases(tfrecords, split):
    expected = list(iter_cases(tfrecords, split))
    cases = SplitCases(tfrecords, split)
    assert len(cases) == len(expected) == read_manifest(tfrecords).splits[split]["num_cases"]
    assert cases.case_ids == [cid for cid, _, _ in expected] == read_manifest(tfrecords).splits[split]["case_ids"]
    for i in reversed(range(len(cases))):  # any order
        case_id, image, label = cases[i]
        want_id, want_image, want_label = expected[i]
        assert case_id == want_id
        assert image.dtype == np.float32 and label.dtype == np.uint8
        np.testing.assert_array_equal(image, want_image)
        np.testing.assert_array_equal(label, want_label)
        assert image.flags.writeable and label.flags.writeable
    assert [c[0] for c in cases] == cases.case_ids  # iteration reads them in order


def test_the_train_split_spans_shards(tfrecords):
    assert len(read_manifest(tfrecords).splits["train"]["shards"]) == 2
    cases = SplitCases(tfrecords, "train")
    assert {loc.path for loc in cases._index.locations} == {
        tfrecords / shard["file"] for shard in read_manifest(tfrecords).splits["train"]["shards"]}


def test_slices_are_lazy_shares(tfrecords, monkeypatch):
    cases = SplitCases(tfrecords, "train", label_dtype=np.float32)
    n = len(cases)
    assert n == 4
    reads = []
    read = SplitCases._read
    monkeypatch.setattr(SplitCases, "_read", lambda self, position: (reads.append(position), read(self, position))[1])
    share = cases[1::2]
    assert isinstance(share, SplitCases) and not reads  # nothing read by slicing
    assert len(share) == len(range(1, n, 2)) and share.case_ids == cases.case_ids[1::2]
    assert share[0][0] == cases[1][0] and share[-1][0] == cases[-1 if n % 2 == 0 else -2][0]
    assert share[0][2].dtype == np.float32  # the share keeps the label dtype
    assert [c[0] for c in share[::-1]] == cases.case_ids[1::2][::-1]
    assert len(cases[n:]) == 0 and list(cases[n:]) == []
    with pytest.raises(IndexError, match=f"case index {n} out of range for {n} cases of split 'train'"):
        cases[n]
    with pytest.raises(IndexError):
        share[len(share)]


def test_a_missing_split_or_shard(copy):
    with pytest.raises(DataError, match="split 'holdout' is not in"):
        SplitCases(copy, "holdout")
    shard = next(copy.glob("val-*.tfrecord"))
    shard.unlink()
    with pytest.raises(DataError, match=f"shard .*{shard.name}.* does not exist"):
        SplitCases(copy, "val")


def test_a_truncated_shard_fails_on_creation_naming_it(copy):
    shard = sorted(copy.glob("train-*.tfrecord"))[-1]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(DataError, match=f"{shard.name}.*truncated"):
        SplitCases(copy, "train")


def test_a_shard_cut_after_indexing_fails_on_read_naming_it(copy):
    cases = SplitCases(copy, "val")
    shard = next(copy.glob("val-*.tfrecord"))
    shard.write_bytes(shard.read_bytes()[:50])
    with pytest.raises(DataError, match=f"{shard.name}.*truncated"):
        cases[0]


def test_a_shard_with_other_records_than_the_manifest_says(copy):
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["num_cases"] += 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"holds \d+ records, but the manifest says \d+ cases"):
        SplitCases(copy, "train")


def test_shapes_or_ids_that_differ_from_the_manifest_fail_naming_the_shard(copy):
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["image_shape"][0] += 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    shard = next(copy.glob("val-*.tfrecord"))
    with pytest.raises(DataError, match=f"{shard.name}.*shapes .* differ from the manifest"):
        SplitCases(copy, "val")[0]
    manifest["image_shape"][0] -= 1
    manifest["splits"]["val"]["case_ids"][0] = "someone_else"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=f"{shard.name}.*holds case .* but the manifest puts 'someone_else' there"):
        SplitCases(copy, "val")[0]


def test_a_record_that_is_not_a_case(tmp_path, copy):
    shard = next(copy.glob("val-*.tfrecord"))
    shard.write_bytes(b"".join(record(b"\x0a\x03abc") for _ in read_records(shard)))  # not an Example of a case
    with pytest.raises(DataError, match=f"{shard.name}.*record at byte 0 is not a distmis case"):
        SplitCases(copy, "val")[0]


def test_reading_split_cases_does_not_import_tensorflow(tfrecords):
    code = (
        "import sys\n"
        "from distmis.data.cases import SplitCases\n"
        "import distmis.data.tfrecord\n"
        f"cases = SplitCases({str(tfrecords)!r}, 'train')\n"
        "assert len(cases[0][1]) and len(list(cases[1::2])) == len(cases) // 2\n"
        "print('tensorflow' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_several_parts_are_their_union_part_after_part(tfrecords):
    manifest = read_manifest(tfrecords)
    cases = SplitCases(tfrecords, ["val", "test"])
    assert cases.parts == ("val", "test")
    assert cases.case_ids == manifest.splits["val"]["case_ids"] + manifest.splits["test"]["case_ids"]
    expected = list(iter_cases(tfrecords, ("val", "test")))
    assert [c for c, _, _ in expected] == cases.case_ids
    for (case_id, image, label), (want_id, want_image, want_label) in zip(cases, expected):
        assert case_id == want_id
        np.testing.assert_array_equal(image, want_image)
        np.testing.assert_array_equal(label, want_label)
    single = SplitCases(tfrecords, "val")
    assert single.parts == ("val",) and single.split == "val" and repr(single).endswith("'val': 2 cases)")
