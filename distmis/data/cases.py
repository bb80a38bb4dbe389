"""Random access to the cases of one split of a TFRecord folder (or of several), read from disk at each access.

A torch trainer used to read its whole training split into memory, so its resident memory grew with the number
of cases (``benchmarks/torch_memory.py``). :class:`SplitCases` holds only where each case lies: on creation it
indexes every shard of the split by its record headers (:func:`~distmis.data.records.record_offsets`, kilobytes
read), and ``cases[i]`` reads and decodes that one record (:func:`~distmis.data.records.read_record_at`). The
index is on the TFRecords themselves rather than on a second, seekable copy of the data: the shards stay the one
format written, checksummed (the manifest's sha256) and read by both frameworks, with no conversion step to keep
in step with them and no doubled disk. Like :func:`~distmis.data.tfrecord.iter_cases` it never imports
TensorFlow, so a torch trial stays free of it.

    cases = SplitCases(tfrecord_dir, "val")
    len(cases), cases.case_ids
    case_id, image, label = cases[0]        # image float32 (h, w, d, 4), label uint8 (h, w, d, C)
    for case_id, image, label in cases[rank::world_size]:   # a lazy share: nothing read until iterated
        ...
    SplitCases(tfrecord_dir, ["fold0", "fold2"])   # several parts: a cross-validation trial's training folds
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import overload

import numpy as np
from numpy.typing import DTypeLike

from distmis.data.errors import DataError
from distmis.data.manifest import DataManifest
from distmis.data.records import parse_example, read_record_at, record_offsets
from distmis.data.split import part_names

__all__ = ["Case", "SplitCases"]

#: ``(case_id, image (h, w, d, 4) float32, label (h, w, d, C))``.
Case = tuple[str, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class _Location:
    """Where one case's record lies, and the id the manifest gives it."""

    case_id: str
    path: Path
    offset: int


@dataclass(frozen=True)
class _SplitIndex:
    """Every case of one split: its record's location and the shapes the manifest promises."""

    locations: tuple[_Location, ...]
    image_shape: tuple[int, ...]
    label_shape: tuple[int, ...]


def _index_split(tfrecord_dir: Path, split: str, manifest: DataManifest) -> _SplitIndex:
    """Index the shards of ``split`` as the manifest lists them; DataError where they disagree with it."""
    splits = manifest.splits
    if split not in splits:
        raise DataError(f"split {split!r} is not in {str(tfrecord_dir)!r}; available: {sorted(splits)}")
    info = splits[split]
    case_ids = [str(c) for c in info.get("case_ids", [])]
    locations: list[_Location] = []
    for shard in info["shards"]:
        path = tfrecord_dir / shard["file"]
        if not path.is_file():
            raise DataError(f"shard {str(path)!r} listed in the manifest does not exist")
        offsets = record_offsets(path)
        if len(offsets) != int(shard["num_cases"]):
            raise DataError(f"shard {str(path)!r} holds {len(offsets)} records, but the manifest says "
                            f"{shard['num_cases']} cases: the file was replaced or cut short")
        start = len(locations)
        ids = case_ids[start:start + len(offsets)]
        if len(ids) < len(offsets):
            raise DataError(f"{str(tfrecord_dir)!r}: the manifest's case_ids of split {split!r} are fewer than "
                            f"its shards' cases")
        locations.extend(_Location(cid, path, offset) for cid, offset in zip(ids, offsets))
    if len(locations) != len(case_ids):
        raise DataError(f"{str(tfrecord_dir)!r}: split {split!r} lists {len(case_ids)} case ids, but its shards "
                        f"hold {len(locations)} records")
    return _SplitIndex(tuple(locations), tuple(int(s) for s in manifest.image_shape),
                       tuple(int(s) for s in manifest.label_shape))


def _decode(record: bytes, location: _Location, index: _SplitIndex, label_dtype: np.dtype) -> Case:
    """One record's case, checked against the manifest (its id and shapes), as writable arrays of their own."""
    path = str(location.path)
    try:
        feature = parse_example(record)
        case_id = bytes(feature["case_id"]).decode("utf-8")  # type: ignore[arg-type]
        shapes = tuple(feature["image_shape"]), tuple(feature["label_shape"])  # type: ignore[arg-type]
        image_bytes, label_bytes = feature["image"], feature["label"]
    except (KeyError, IndexError, ValueError, TypeError, UnicodeDecodeError) as exc:
        raise DataError(f"shard {path!r}: the record at byte {location.offset} is not a distmis case "
                        f"({type(exc).__name__}: {exc})") from exc
    if case_id != location.case_id:
        raise DataError(f"shard {path!r}: the record at byte {location.offset} holds case {case_id!r}, but the "
                        f"manifest puts {location.case_id!r} there")
    if shapes != (index.image_shape, index.label_shape):
        raise DataError(f"shard {path!r}: case {case_id!r} has shapes {shapes[0]} / {shapes[1]} that differ from "
                        f"the manifest's {index.image_shape} / {index.label_shape}")
    try:
        image = np.frombuffer(image_bytes, dtype="<f4").reshape(index.image_shape)  # type: ignore[arg-type]
        label = np.frombuffer(label_bytes, dtype=np.uint8).reshape(index.label_shape)  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        raise DataError(f"shard {path!r}: case {case_id!r} holds {len(image_bytes)} image / {len(label_bytes)} "
                        f"label bytes, which do not fill its shapes: {exc}") from exc
    # Copies: writable, native-endian, and not views of the record's bytes.
    return case_id, image.astype(np.float32), label.astype(label_dtype)


class SplitCases(Sequence[Case]):
    """The cases of one split of a TFRecord folder (or of several), each read from disk when it is indexed.

    Args:
        tfrecord_dir: a folder written by :func:`~distmis.data.tfrecord.convert_to_tfrecords`.
        split: ``"train"``, ``"val"``, ``"test"`` or a fold's ``"fold0"``...; or several parts
            (``["fold0", "fold2"]``): their cases, part after part in the order given.
        label_dtype: the labels' dtype (stored as uint8 0/1; the trainers validate on float32).
        manifest: the folder's manifest if already read (:func:`~distmis.data.tfrecord.read_manifest`).

    ``cases[i]`` is ``(case_id, image float32 (h, w, d, 4), label (h, w, d, C))``, read anew at every access;
    ``cases[a:b:c]`` is a lazy :class:`SplitCases` of those cases (one rank's share). The split's shards are
    indexed on creation, so a missing, truncated or replaced shard fails here, naming it; a record whose id or
    shapes differ from the manifest fails when read.

    Raises:
        DataError: as above, or if the folder has no such split.
    """

    def __init__(self, tfrecord_dir: str | Path, split: str | Sequence[str], *, label_dtype: DTypeLike = np.uint8,
                 manifest: DataManifest | None = None) -> None:
        from distmis.data.manifest import read_manifest

        tfrecord_dir = Path(tfrecord_dir)
        #: the parts read, in order (``split`` as a tuple)
        self.parts: tuple[str, ...] = part_names(split)
        self.tfrecord_dir, self.split = tfrecord_dir, split
        self.label_dtype = np.dtype(label_dtype)
        manifest = read_manifest(tfrecord_dir) if manifest is None else manifest
        indexes = [_index_split(tfrecord_dir, part, manifest) for part in self.parts]
        self._index = _SplitIndex(tuple(location for index in indexes for location in index.locations),
                                  indexes[0].image_shape, indexes[0].label_shape)
        self._positions: range = range(len(self._index.locations))

    def _share(self, positions: range) -> SplitCases:
        share = object.__new__(type(self))
        share.__dict__.update(self.__dict__)
        share._positions = positions
        return share

    @property
    def case_ids(self) -> list[str]:
        """The ids of these cases, in order (from the manifest: nothing is read)."""
        return [self._index.locations[p].case_id for p in self._positions]

    def __len__(self) -> int:
        return len(self._positions)

    @overload
    def __getitem__(self, item: int) -> Case: ...

    @overload
    def __getitem__(self, item: slice) -> SplitCases: ...

    def __getitem__(self, item: int | slice) -> Case | SplitCases:
        if isinstance(item, slice):
            return self._share(self._positions[item])
        try:
            position = self._positions[item]
        except IndexError:
            raise IndexError(f"case index {item} out of range for {len(self)} cases of split {self._named()} "
                             f"of {str(self.tfrecord_dir)!r}") from None
        return self._read(position)

    def _read(self, position: int) -> Case:
        """Read and decode the case at ``position`` of the whole split (all its parts)."""
        location = self._index.locations[position]
        return _decode(read_record_at(location.path, location.offset), location, self._index, self.label_dtype)

    def __iter__(self) -> Iterator[Case]:
        for position in self._positions:
            yield self._read(position)

    def _named(self) -> str:
        return repr(self.parts[0]) if len(self.parts) == 1 else repr(list(self.parts))

    def __repr__(self) -> str:
        return f"SplitCases({str(self.tfrecord_dir)!r}, {self._named()}: {len(self)} cases)"
