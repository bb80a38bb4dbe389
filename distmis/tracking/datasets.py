"""A search's data as MLflow's dataset inputs: what the UI's "Dataset" column and a run's "Datasets used" show.

The data a search trains on is its TFRecord folder (:func:`distmis.search.prepare.prepare_data`), cut into parts:
``train``, ``val`` and ``test``, or with cross-validation ``fold0`` ... ``fold{k-1}`` and ``test``. Each part is one
MLflow dataset:

- **name**: the data set's (its ``dataset.json`` ``name``, else its folder's), the same for every part, so that
  ``datasets.name = '...'`` finds every run trained on it;
- **digest**: of the part's content, the sha256 of its TFRecord shards as the manifest records them (10 hex digits;
  the same cases preprocessed the same way give the same digest, wherever the files are);
- **source**: the data set's folder (``dataset.path``), a ``local`` source;
- **schema**: the image and label tensors (dtype, ``(-1, H, W, D, C)``), MLflow's tensor schema;
- **profile**: the part's case count, shards, channels, target channels, and the TFRecord folder with its
  fingerprint (the folder's name: what the preprocessing, the split and the source files make it).

An input's tags say how a run used the part: ``mlflow.data.context`` (MLflow's context: ``train``, ``val`` or
``test`` on a trial's run; the part's own name on the search's and a configuration's run) and ``distmis.part``.
The search's run gets every part, a trial's run its training and validation parts (and the test part once it is
scored on it), a cross-validation configuration's run its folds.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from mlflow.data.dataset import Dataset
from mlflow.data.schema import TensorDatasetSchema
from mlflow.data.sources import LocalArtifactDatasetSource
from mlflow.entities import Dataset as DatasetEntity
from mlflow.entities import DatasetInput, InputTag
from mlflow.types.schema import Schema, TensorSpec

__all__ = ["CONTEXT_TAG", "PART_TAG", "DataPart", "TrackedData", "PartDataset"]

CONTEXT_TAG = "mlflow.data.context"  # MLflow's own input tag (mlflow.log_input's context)
PART_TAG = "distmis.part"
DIGEST_LENGTH = 10  # MLflow recommends 8 to 10 characters

#: A trial's training and validation parts: ``(("train",), ("val",))``, or the other folds and its own.
TrialParts = tuple[tuple[str, ...], tuple[str, ...]]


@dataclass(frozen=True)
class DataPart:
    """One part of a search's TFRecord folder: its name, case count, shard files and content digest."""

    name: str
    num_cases: int
    shards: tuple[str, ...]
    digest: str


@dataclass(frozen=True)
class TrackedData:
    """What MLflow records of a search's data (see the module docstring). ``trial_parts``: each trial's parts by
    its fold (``None`` without cross-validation), as the trainers read them (:func:`distmis.data.split.fold_parts`)."""

    name: str
    source: str
    tfrecord_dir: str
    fingerprint: str
    image_shape: tuple[int, ...]
    label_shape: tuple[int, ...]
    image_dtype: str
    label_dtype: str
    channels: tuple[str, ...]
    targets: tuple[str, ...]
    parts: Mapping[str, DataPart]
    trial_parts: Mapping[int | None, TrialParts]

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any], *, source: str | Path, tfrecord_dir: str | Path,
                      trial_parts: Mapping[int | None, TrialParts]) -> TrackedData:
        """From a TFRecord folder's manifest (:func:`distmis.data.tfrecord.read_manifest`)."""
        described = manifest.get("dataset") or {}
        parts = {}
        for name, info in manifest["splits"].items():
            shards = tuple(str(shard["file"]) for shard in info["shards"])
            content = hashlib.sha256("".join(str(shard["sha256"]) for shard in info["shards"]).encode())
            parts[name] = DataPart(name, int(info["num_cases"]), shards, content.hexdigest()[:DIGEST_LENGTH])
        targets = (manifest.get("targets") or {}).get("channels") or []
        return cls(name=str(described.get("name") or Path(source).name), source=str(Path(source).resolve()),
                   tfrecord_dir=str(tfrecord_dir), fingerprint=Path(tfrecord_dir).name,
                   image_shape=tuple(int(v) for v in manifest["image_shape"]),
                   label_shape=tuple(int(v) for v in manifest["label_shape"]),
                   image_dtype=str(manifest.get("image_dtype", "float32")),
                   label_dtype=str(manifest.get("label_dtype", "uint8")),
                   channels=tuple(str(c) for c in manifest.get("channels") or ()),
                   targets=tuple(str(t["name"]) for t in targets), parts=parts, trial_parts=dict(trial_parts))

    def dataset(self, part: str) -> PartDataset:
        return PartDataset(self, self.parts[part])

    def inputs(self, contexts: Mapping[str, str]) -> list[DatasetInput]:
        """MLflow dataset inputs of ``{part: context}`` (parts the folder lacks are left out)."""
        return [DatasetInput(DatasetEntity(**self.dataset(part).to_dict()),
                             tags=[InputTag(CONTEXT_TAG, context), InputTag(PART_TAG, part)])
                for part, context in contexts.items() if part in self.parts]

    def search_inputs(self) -> list[DatasetInput]:
        """The search's run: every part, its context its name."""
        return self.inputs({part: part for part in self.parts})

    def trial_inputs(self, fold: int | None) -> list[DatasetInput]:
        """A trial's run: its training parts (context ``train``) and validation part (``val``)."""
        train, val = self.trial_parts.get(fold, ((), ()))
        return self.inputs({**{part: "train" for part in train}, **{part: "val" for part in val}})

    def configuration_inputs(self, folds: tuple[int, ...]) -> list[DatasetInput]:
        """A cross-validation configuration's run: the folds it trains and validates on in turn."""
        return self.inputs({f"fold{fold}": f"fold{fold}" for fold in folds})

    def test_inputs(self) -> list[DatasetInput]:
        """The run of a trial (or configuration) scored on the test split."""
        return self.inputs({"test": "test"})


class PartDataset(Dataset):
    """One part of a search's data as an MLflow dataset (``mlflow.data``): no data, its description only."""

    def __init__(self, data: TrackedData, part: DataPart) -> None:
        self.data, self.part = data, part
        super().__init__(source=LocalArtifactDatasetSource(data.source), name=data.name, digest=part.digest)

    def _compute_digest(self) -> str:
        return self.part.digest

    @property
    def schema(self) -> TensorDatasetSchema:
        image = Schema([TensorSpec(np.dtype(self.data.image_dtype), (-1, *self.data.image_shape), "image")])
        label = Schema([TensorSpec(np.dtype(self.data.label_dtype), (-1, *self.data.label_shape), "label")])
        return TensorDatasetSchema(features=image, targets=label)

    @property
    def profile(self) -> dict[str, Any]:
        return {"part": self.part.name, "num_cases": self.part.num_cases, "shards": list(self.part.shards),
                "channels": list(self.data.channels), "targets": list(self.data.targets),
                "tfrecords": self.data.tfrecord_dir, "fingerprint": self.data.fingerprint}

    def to_dict(self) -> dict[str, str]:
        return {**super().to_dict(), "schema": json.dumps(self.schema.to_dict()), "profile": json.dumps(self.profile)}
