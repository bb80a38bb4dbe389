"""A tiny ``dataset.labels: classes`` TFRecord folder for the trainers' tests: the synthetic one-channel CT-like data
set (background, liver, spleen, kidney) in the MSD layout, converted as a search converts it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distmis.data.manifest import DataManifest
from tests.conftest import small_spec_tree

CLASS_KEYS = ("liver", "spleen", "kidney")  # the foreground classes of distmis.data.synthetic's CT kind


@dataclass(frozen=True)
class ClassesData:
    root: Path  # the NIfTI data set
    tfrecord_dir: Path
    manifest: DataManifest
    split: dict[str, Any]

    def spec_tree(self, **model: Any) -> dict[str, Any]:
        """A small spec of this data set (``dataset.labels: classes``, loss ``dice-ce``, one epoch); ``model``
        replaces the model section."""
        tree = small_spec_tree(self.root, **({"model": model} if model else {}))
        tree["dataset"]["labels"] = "classes"
        tree["dataset"]["synthetic"]["kind"] = "ct"
        tree["training"].update({"epochs": 1, "loss": {"name": "dice-ce"}})
        return tree


def make_classes_data(tmp: Path) -> ClassesData:
    """6 cases of 16^3 voxels: 3 training, 2 validation, 1 test."""
    from distmis.data.dataset_layouts import describe_dataset
    from distmis.data.layouts import discover_cases
    from distmis.data.preprocess import PreprocessConfig
    from distmis.data.split import make_split
    from distmis.data.synthetic import synthesize_dataset
    from distmis.data.targets import target_scheme
    from distmis.data.tfrecord import convert_to_tfrecords

    root = tmp / "ct"
    synthesize_dataset(root, "msd", cases=6, shape=(16, 16, 16), seed=0, progress=False, kind="ct")
    description = describe_dataset(root, "msd")
    config = PreprocessConfig(layout="msd", labels="classes", channels=description.channels,
                              targets=target_scheme(description, "classes"))
    cases = discover_cases(root, "msd")
    split = make_split([case.case_id for case in cases], train=0.5, val=0.34, test=0.16, seed=0)
    manifest = convert_to_tfrecords(cases, split, config, tmp / "tfrecords", workers=1, progress=False,
                                    description=description)
    return ClassesData(root, tmp / "tfrecords", manifest, split)
