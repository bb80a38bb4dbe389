"""Reading and writing distmis's TFRecord files without TensorFlow.

A torch trial only needs the bytes of its cases, and importing TensorFlow to get them costs each of its
processes seconds and hundreds of megabytes (``benchmarks/startup.py``); so did the search's own process, which
imported it only to write the records. The two formats involved are small and stable, so they are read and
written here with the standard library and CRC-32C from ``google-crc32c``:

- a TFRecord file is a sequence of records, each ``uint64 length``, ``uint32 masked CRC-32C of the length``,
  ``length`` bytes of data, ``uint32 masked CRC-32C of the data`` (little-endian);
- each record of distmis's files is a serialized ``tf.train.Example``: ``Example{features=1}``,
  ``Features{map<string, Feature> feature=1}``, ``Feature{oneof bytes_list=1, float_list=2, int64_list=3}``,
  each list a ``repeated value=1`` (int64 lists packed or not; floats are not used by distmis).

Writing (:func:`write_record`, :func:`serialize_example`) gives the bytes TensorFlow's ``TFRecordWriter`` and
``tf.train.Example`` give (``tests/data/test_records.py`` compares them), and TensorFlow reads them back.
When reading, the length's checksum is verified (a truncated or misaligned file fails at once, naming the file);
the data's is not: the shards' sha256 sums in the manifest are checked when a search prepares its data
(:func:`~distmis.data.tfrecord.verify_checksums`).

Besides reading a file front to back (:func:`read_records`), :func:`record_offsets` indexes one by its headers
alone (12 bytes read per record, the data skipped with a seek) and :func:`read_record_at` reads one record at
an indexed offset: random access to the cases of a split without a second copy of the data in another format
(:class:`~distmis.data.cases.SplitCases`), so a trainer can read each case when it needs it instead of holding
the split in memory.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO, Iterator, Mapping, Sequence

import google_crc32c

from distmis.data.errors import DataError


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord uses it."""
    return int(google_crc32c.value(bytes(data)))


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


#: Bytes before a record's data (``uint64`` length, ``uint32`` masked CRC of the length) and after it (the
#: data's masked CRC).
HEADER_BYTES = 12
FOOTER_BYTES = 4


def _read_length(f: BinaryIO, path: Path) -> int | None:
    """The data length of the record whose header starts at ``f``'s position; None at a clean end of file.

    Raises:
        DataError: naming ``path`` if the header is cut short or fails its checksum.
    """
    header = f.read(HEADER_BYTES)
    if not header:
        return None
    if len(header) < HEADER_BYTES:
        raise DataError(f"{path}: the file ends inside a record header (truncated?)")
    length_bytes, length_crc = header[:8], struct.unpack("<I", header[8:])[0]
    if masked_crc32c(length_bytes) != length_crc:
        raise DataError(f"{path}: a record's length fails its checksum (not a TFRecord file, or corrupt)")
    return int(struct.unpack("<Q", length_bytes)[0])


def read_records(path: str | Path) -> Iterator[bytes]:
    """The records of one TFRecord file, in order."""
    path = Path(path)
    with open(path, "rb") as f:
        while True:
            length = _read_length(f, path)
            if length is None:
                return
            data = f.read(length)
            if len(data) < length or len(f.read(FOOTER_BYTES)) < FOOTER_BYTES:
                raise DataError(f"{path}: the file ends inside a record (truncated?)")
            yield data


def record_offsets(path: str | Path) -> list[int]:
    """The byte offset of every record of one TFRecord file, in order, for :func:`read_record_at`.

    Only the 12-byte headers are read (their length checksums verified); the data is skipped with a seek, so
    indexing a shard of gigabytes reads kilobytes.

    Raises:
        DataError: naming the file if it is truncated (a record reaches past its end) or a header is corrupt.
    """
    path = Path(path)
    offsets: list[int] = []
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        while True:
            offset = f.tell()
            length = _read_length(f, path)
            if length is None:
                return offsets
            end = offset + HEADER_BYTES + length + FOOTER_BYTES
            if end > size:
                raise DataError(f"{path}: the file ends inside a record (truncated?): the record at byte {offset} "
                                f"needs {end} bytes, the file has {size}")
            offsets.append(offset)
            f.seek(end)


def read_record_at(path: str | Path, offset: int) -> bytes:
    """The data of the record whose header starts at byte ``offset`` of ``path`` (from :func:`record_offsets`).

    Opens the file for this one read, so that reads from several threads never share a file position.

    Raises:
        DataError: naming the file if no record starts there (its length fails its checksum), or the file now
            ends before the record does (truncated since it was indexed).
    """
    path = Path(path)
    with open(path, "rb") as f:
        f.seek(offset)
        length = _read_length(f, path)
        if length is None:
            raise DataError(f"{path}: no record at byte {offset}: the file ends there (truncated?)")
        data = f.read(length)
        if len(data) < length or len(f.read(FOOTER_BYTES)) < FOOTER_BYTES:
            raise DataError(f"{path}: the file ends inside the record at byte {offset} (truncated?)")
    return data


def write_record(f: BinaryIO, data: bytes) -> None:
    """Append one record holding ``data`` to the TFRecord file open for writing as ``f``."""
    length = struct.pack("<Q", len(data))
    f.write(length + struct.pack("<I", masked_crc32c(length)))
    f.write(data)
    f.write(struct.pack("<I", masked_crc32c(data)))


def _key(number: int, wire: int) -> bytes:
    return _encode_varint(number << 3 | wire)


def _encode_varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # a negative int64 as its two's complement, as protobuf writes it (10 bytes)
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _delimited(number: int, payload: bytes) -> bytes:
    return _key(number, 2) + _encode_varint(len(payload)) + payload


def serialize_example(features: Mapping[str, bytes | Sequence[int]]) -> bytes:
    """A ``tf.train.Example`` of ``features`` serialized, in their order: bytes as a one-element ``BytesList``,
    int sequences as a packed ``Int64List`` (what :func:`parse_example` reads back)."""
    entries = []
    for key, value in features.items():
        if isinstance(value, (bytes, bytearray, memoryview)):
            feature = _delimited(1, _delimited(1, bytes(value)))  # Feature.bytes_list{value: [value]}
        else:
            packed = b"".join(_encode_varint(int(v)) for v in value)
            feature = _delimited(3, _delimited(1, packed) if packed else b"")  # Feature.int64_list{value: [...]}
        entries.append(_delimited(1, _delimited(1, key.encode("utf-8")) + _delimited(2, feature)))
    return _delimited(1, b"".join(entries))  # Example.features{feature: {key: Feature}}


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf: memoryview) -> Iterator[tuple[int, int | memoryview]]:
    """``(field number, value)`` of a protobuf message: ints for varints, views for length-delimited fields."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield number, value
        elif wire == 2:
            size, pos = _varint(buf, pos)
            yield number, buf[pos:pos + size]
            pos += size
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _feature(buf: memoryview) -> bytes | list[int]:
    for number, value in _fields(buf):
        if number == 1:  # BytesList
            return b"".join(bytes(v) for n, v in _fields(value) if n == 1)  # type: ignore[arg-type]
        if number == 3:  # Int64List, packed or not
            ints: list[int] = []
            for n, v in _fields(value):  # type: ignore[arg-type]
                if n != 1:
                    continue
                if isinstance(v, int):
                    ints.append(_signed(v))
                else:
                    pos = 0
                    while pos < len(v):
                        item, pos = _varint(v, pos)
                        ints.append(_signed(item))
            return ints
        if number == 2:
            raise ValueError("float features are not used by distmis's records")
    return b""


def parse_example(record: bytes) -> dict[str, bytes | list[int]]:
    """The features of one serialized ``tf.train.Example``: bytes (a one-element bytes list) or int lists."""
    features: dict[str, bytes | list[int]] = {}
    for number, example_field in _fields(memoryview(record)):
        if number != 1 or isinstance(example_field, int):
            continue
        for entry_number, entry in _fields(example_field):  # Features.feature map entries
            if entry_number != 1 or isinstance(entry, int):
                continue
            key, value = "", memoryview(b"")
            for n, v in _fields(entry):
                if n == 1 and not isinstance(v, int):
                    key = bytes(v).decode("utf-8")
                elif n == 2 and not isinstance(v, int):
                    value = v
            features[key] = _feature(value)
    return features
