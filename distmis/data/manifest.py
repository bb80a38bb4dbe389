"""A TFRecord folder's ``manifest.json``, read into a :class:`DataManifest`.

:func:`~distmis.data.tfrecord.convert_to_tfrecords` writes the manifest: the format version, the preprocessing it
applied (``preprocess``: a :class:`~distmis.data.preprocess.PreprocessConfig` as a dict), the channels, the target
scheme, the data set's description, the shapes and dtypes every case was written with, the number of output
channels, each part's shards (``splits``: ``train``, ``val``, ``test``, or ``fold0`` ... and ``test``) and the
split of the cases it was written from. :func:`read_manifest` reads it back, checked, as a :class:`DataManifest`;
the trainers, the search, the model's recipe and the tracking read its fields by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distmis.data.errors import DataError

__all__ = ["FORMAT_VERSION", "MANIFEST_NAME", "DataManifest", "read_manifest"]

#: Version of the on-disk format written by :func:`~distmis.data.tfrecord.convert_to_tfrecords`.
FORMAT_VERSION = 1
#: Name of the manifest file inside a TFRecord folder.
MANIFEST_NAME = "manifest.json"
#: What every manifest holds (the rest was added later: an older folder's manifest may lack it).
REQUIRED = ("preprocess", "image_shape", "label_shape", "splits")


@dataclass(frozen=True)
class DataManifest:
    """What a TFRecord folder holds (its ``manifest.json``). ``image_shape`` is ``(H, W, D, C)``, channels last, as
    every case was written; ``splits`` maps each part to its ``num_cases`` and ``shards`` (file, cases, sha256)."""

    preprocess: dict[str, Any]
    image_shape: tuple[int, ...]
    label_shape: tuple[int, ...]
    splits: dict[str, dict[str, Any]]
    num_classes: int = 0
    channels: tuple[str, ...] = ()
    targets: dict[str, Any] | None = None  # the target scheme (distmis.data.targets); older folders: None
    dataset: dict[str, Any] | None = None  # the data set's description (DatasetDescription.to_dict)
    split: dict[str, Any] = field(default_factory=dict)  # the split the cases were written from
    image_dtype: str = "float32"
    label_dtype: str = "uint8"
    format_version: int = FORMAT_VERSION

    @property
    def volume(self) -> tuple[int, int, int]:
        """The spatial shape of every case, ``(H, W, D)``: what a network's whole-volume input is."""
        height, width, depth = (int(v) for v in self.image_shape[:3])
        return height, width, depth

    @property
    def in_channels(self) -> int:
        """The number of image channels (the last axis of ``image_shape``)."""
        return int(self.image_shape[-1])

    def num_cases(self, part: str) -> int:
        return int(self.splits[part]["num_cases"])

    @classmethod
    def from_dict(cls, document: dict[str, Any]) -> DataManifest:
        """The manifest of a ``manifest.json`` document (as written, or as :meth:`to_dict` gives it)."""
        return cls(
            preprocess=dict(document["preprocess"]),
            image_shape=tuple(int(v) for v in document["image_shape"]),
            label_shape=tuple(int(v) for v in document["label_shape"]),
            splits={str(name): dict(info) for name, info in document["splits"].items()},
            num_classes=int(document.get("num_classes") or 0),
            channels=tuple(str(c) for c in document.get("channels") or document.get("modalities") or ()),
            targets=document.get("targets"),
            dataset=document.get("dataset"),
            split=dict(document.get("split") or {}),
            image_dtype=str(document.get("image_dtype", "float32")),
            label_dtype=str(document.get("label_dtype", "uint8")),
            format_version=int(document.get("format_version", FORMAT_VERSION)),
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``manifest.json`` document (what the search's MLflow run logs as ``tfrecord_manifest.json``)."""
        return {
            "format_version": self.format_version,
            "preprocess": self.preprocess,
            "modalities": list(self.channels),  # the older name of channels, still written for older readers
            "channels": list(self.channels),
            "targets": self.targets,
            "dataset": self.dataset,
            "image_shape": list(self.image_shape),
            "label_shape": list(self.label_shape),
            "image_dtype": self.image_dtype,
            "label_dtype": self.label_dtype,
            "num_classes": self.num_classes,
            "splits": self.splits,
            "split": self.split,
        }


def read_manifest(tfrecord_dir: str | Path) -> DataManifest:
    """The manifest of a TFRecord folder.

    Raises:
        DataError: if the folder or manifest is missing, not JSON, of an unsupported format version, or lacks a
            field every manifest holds.
    """
    path = Path(tfrecord_dir) / MANIFEST_NAME
    if not path.is_file():
        raise DataError(
            f"{str(path)!r} not found: {str(tfrecord_dir)!r} is not a TFRecord folder written by "
            f"convert_to_tfrecords (make one with `distmis data tfrecord`)"
        )
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{str(path)!r} is not valid JSON: {exc}") from exc
    version = document.get("format_version") if isinstance(document, dict) else None
    if version != FORMAT_VERSION:
        raise DataError(f"{str(path)!r} has format_version {version!r}; this version of distmis reads {FORMAT_VERSION}")
    missing = [k for k in REQUIRED if k not in document]
    if missing:
        raise DataError(f"{str(path)!r} lacks the field(s) {missing}")
    try:
        return DataManifest.from_dict(document)
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        raise DataError(f"{str(path)!r} has a field of the wrong type: {type(exc).__name__}: {exc}") from exc
