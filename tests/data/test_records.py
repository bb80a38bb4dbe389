"""Reading and writing TFRecords without TensorFlow: the same bytes as TensorFlow's own reader and writer, and
clear errors."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from distmis.data.errors import DataError
from distmis.data.records import (
    crc32c, masked_crc32c, parse_example, read_records, serialize_example, write_record,
)


def test_crc32c_check_value():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C catalogue's check value
    assert crc32c(b"") == 0


def write_with_tensorflow(path: Path, examples: list[dict]) -> list[bytes]:
    import tensorflow as tf

    serialized = []
    with tf.io.TFRecordWriter(str(path)) as writer:
        for features in examples:
            feature = {}
            for key, value in features.items():
                if isinstance(value, bytes):
                    feature[key] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))
                else:
                    feature[key] = tf.train.Feature(int64_list=tf.train.Int64List(value=value))
            record = tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()
            writer.write(record)
            serialized.append(record)
    return serialized


def test_records_and_examples_written_by_tensorflow_read_back_exactly(tmp_path):
    rng = np.random.default_rng(0)
    examples = [
        {"case_id": f"case_{i}".encode(), "image": rng.normal(size=(5, 4, 3, 2)).astype("<f4").tobytes(),
         "image_shape": [5, 4, 3, 2], "big": [2**40 + i, -7, 0, 300]}
        for i in range(3)
    ]
    examples.append({"case_id": b"", "image": b"", "image_shape": [], "big": [-(2**63)]})
    path = tmp_path / "x.tfrecord"
    serialized = write_with_tensorflow(path, examples)

    records = list(read_records(path))
    assert records == serialized
    for record, expected in zip(records, examples):
        assert parse_example(record) == expected


def test_records_written_without_tensorflow_are_the_bytes_tensorflow_writes_and_reads(tmp_path):
    import tensorflow as tf

    rng = np.random.default_rng(1)
    examples = [
        {"case_id": f"case_{i}".encode(), "image": rng.normal(size=(3, 2, 2)).astype("<f4").tobytes(),
         "image_shape": [3, 2, 2], "big": [2**40 + i, -7, 0, 300]}
        for i in range(2)
    ]
    examples.append({"case_id": b"", "image_shape": [], "big": [-(2**63), 2**63 - 1]})
    theirs = write_with_tensorflow(tmp_path / "theirs.tfrecord", examples)
    ours = [serialize_example(features) for features in examples]
    for one, other in zip(ours, theirs):  # the same message (a map's entries may come in another order)
        assert tf.train.Example.FromString(one) == tf.train.Example.FromString(other)
    # one feature: no order to differ in, so the very bytes
    shape = tf.train.Feature(int64_list=tf.train.Int64List(value=[5, 4, 3, 2]))
    one = tf.train.Example(features=tf.train.Features(feature={"image_shape": shape}))
    assert serialize_example({"image_shape": [5, 4, 3, 2]}) == one.SerializeToString()
    # the framing: TensorFlow's records of the same data, byte for byte
    with open(tmp_path / "framed.tfrecord", "wb") as f:
        for record in theirs:
            write_record(f, record)
    assert (tmp_path / "framed.tfrecord").read_bytes() == (tmp_path / "theirs.tfrecord").read_bytes()
    # TensorFlow reads ours (checking both checksums of every record), and so does distmis's reader
    with open(tmp_path / "ours.tfrecord", "wb") as f:
        for record in ours:
            write_record(f, record)
    assert [r.numpy() for r in tf.data.TFRecordDataset(str(tmp_path / "ours.tfrecord"))] == ours
    assert [parse_example(r) for r in read_records(tmp_path / "ours.tfrecord")] == examples
    # a data checksum off by one is refused by TensorFlow: it does check what write_record computes
    broken = bytearray((tmp_path / "ours.tfrecord").read_bytes())
    broken[12 + len(ours[0])] ^= 1
    (tmp_path / "broken.tfrecord").write_bytes(bytes(broken))
    with pytest.raises(tf.errors.DataLossError):
        list(tf.data.TFRecordDataset(str(tmp_path / "broken.tfrecord")))


def test_distmis_shards_decode_to_the_arrays_tensorflow_decodes(tmp_path):
    """iter_cases (no TensorFlow) against TensorFlow's parser over a converted dataset."""
    import tensorflow as tf

    from distmis.data.tfrecord import iter_cases
    from distmis.search.prepare import prepare_data
    from distmis.spec import validate_spec
    from tests.conftest import small_spec_tree

    spec = validate_spec(small_spec_tree(tmp_path / "data"))
    tfrecord_dir = prepare_data(spec, tmp_path / "out", progress=False).tfrecord_dir
    ours = list(iter_cases(tfrecord_dir, "train"))
    theirs = []
    for path in sorted(tfrecord_dir.glob("train-*.tfrecord")):
        for record in tf.data.TFRecordDataset(str(path)):
            feature = tf.train.Example.FromString(record.numpy()).features.feature
            theirs.append((feature["case_id"].bytes_list.value[0].decode(),
                           np.frombuffer(feature["image"].bytes_list.value[0], "<f4"),
                           np.frombuffer(feature["label"].bytes_list.value[0], np.uint8)))
    assert len(ours) == len(theirs) > 0
    for (case_id, image, label), (tf_id, tf_image, tf_label) in zip(ours, theirs):
        assert case_id == tf_id
        np.testing.assert_array_equal(image.ravel(), tf_image)
        np.testing.assert_array_equal(label.ravel(), tf_label)


def record(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def test_a_truncated_file_names_itself(tmp_path):
    path = tmp_path / "cut.tfrecord"
    path.write_bytes(record(b"abcdef") + record(b"ghijkl")[:-6])
    reader = read_records(path)
    assert next(reader) == b"abcdef"
    with pytest.raises(DataError, match=r"cut\.tfrecord.*ends inside a record"):
        next(reader)


def test_a_file_that_is_not_a_tfrecord_fails_its_length_checksum(tmp_path):
    path = tmp_path / "notes.tfrecord"
    path.write_text("this is not a TFRecord file at all\n")
    with pytest.raises(DataError, match=r"notes\.tfrecord.*checksum"):
        list(read_records(path))


def test_preparing_and_reading_cases_do_not_import_tensorflow(tmp_path):
    """What a torch search does with its data, in a fresh interpreter: the driver synthesizes and converts it
    (through the spawned readers), a trial reads it; TensorFlow stays out of the process."""
    from tests.conftest import small_spec_tree

    tree = small_spec_tree(str(tmp_path / "data"))
    tree["model"]["framework"] = "torch"
    code = (
        "import sys\n"
        "from distmis.search.prepare import prepare_data\n"
        "from distmis.spec import validate_spec\n"
        "from distmis.data.tfrecord import iter_cases\n"
        "if __name__ == '__main__':\n"
        f"    data = prepare_data(validate_spec({tree!r}), {str(tmp_path / 'out')!r}, progress=False)\n"
        "    cases = list(iter_cases(data.tfrecord_dir, 'val'))\n"
        "    assert cases, 'no cases'\n"
        "    print('tensorflow' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
