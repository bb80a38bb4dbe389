"""Get a search's data ready before any trial starts.

Generate the synthetic dataset if asked, find the cases, split them with the spec's seed and
convert them once to TFRecords. The TFRecords are keyed by everything that shapes them (the
preprocessing, the split, the source files), so a second search over the same data reuses them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distmis.data.errors import DataError
from distmis.data.layouts import CaseFiles, Layout, discover_cases
from distmis.data.preprocess import LabelMode, PreprocessConfig
from distmis.data.split import make_split
from distmis.data.synthetic import synthesize_dataset
from distmis.data.tfrecord import convert_to_tfrecords, read_manifest, verify_checksums
from distmis.spec.load import SpecError, check_input_shape
from distmis.spec.schema import Spec


@dataclass(frozen=True)
class PreparedData:
    tfrecord_dir: Path
    manifest: dict[str, Any]
    split: dict[str, Any]
    generated: bool


def preprocess_config(spec: Spec) -> PreprocessConfig:
    data = spec.dataset
    return PreprocessConfig(
        layout=Layout(data.layout), labels=LabelMode(data.labels), crop=data.crop, resize=data.resize
    )


def check_dataset_path(spec: Spec) -> None:
    """DataError, before anything starts, when ``dataset.path`` is missing and nothing would generate it."""
    root = Path(spec.dataset.path)
    if not root.exists() and spec.dataset.synthetic is None:
        raise DataError(
            f"dataset.path {str(root)!r} does not exist; point it at an MSD or BraTS folder, "
            "or add dataset.synthetic to generate a synthetic dataset there"
        )


def ensure_dataset(spec: Spec, *, progress: bool = True) -> bool:
    """Generate the synthetic dataset at ``dataset.path`` if it is absent and asked for. True if generated."""
    root = Path(spec.dataset.path)
    if root.exists():
        return False
    check_dataset_path(spec)
    synthetic = spec.dataset.synthetic
    assert synthetic is not None
    synthesize_dataset(
        root, Layout(spec.dataset.layout), cases=synthetic.cases, shape=synthetic.shape,
        seed=synthetic.seed, progress=progress,
    )
    return True


def _fingerprint(cases: list[CaseFiles], config: PreprocessConfig, split: dict[str, Any]) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps(config.to_dict(), sort_keys=True).encode())
    digest.update(json.dumps({k: split[k] for k in ("train", "val", "test")}, sort_keys=True).encode())
    for case in cases:
        for path in (*case.images, case.label):
            stat = path.stat()
            digest.update(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def prepare_data(spec: Spec, output_dir: str | Path, *, progress: bool = True) -> PreparedData:
    """Synthesize (if needed), split and convert the dataset; reuse an identical earlier conversion."""
    generated = ensure_dataset(spec, progress=progress)
    cases = discover_cases(Path(spec.dataset.path), Layout(spec.dataset.layout))
    s = spec.dataset.split
    try:
        split = make_split([c.case_id for c in cases], train=s.train, val=s.val, test=s.test, seed=s.seed)
    except ValueError as exc:
        raise DataError(f"dataset.split for {spec.dataset.path}: {exc}") from None
    config = preprocess_config(spec)
    tfrecord_dir = Path(output_dir).resolve() / "tfrecords" / _fingerprint(cases, config, split)
    if (tfrecord_dir / "manifest.json").is_file():
        verify_checksums(tfrecord_dir)
    else:
        convert_to_tfrecords(cases, split, config, tfrecord_dir, progress=progress)
    manifest = read_manifest(tfrecord_dir)
    shape = tuple(int(v) for v in manifest["image_shape"][:3])
    problems = check_input_shape(spec, shape)
    if problems:
        raise SpecError(f"{spec.name} (with the data at {spec.dataset.path})", problems)
    return PreparedData(tfrecord_dir, manifest, split, generated)
