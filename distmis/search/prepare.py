"""Get a search's data ready before any trial starts.

Generate the synthetic dataset if asked, find the cases, split them with the spec's seed and
convert them once to TFRecords. The TFRecords are keyed by everything that shapes them (the
preprocessing, the split, the source files), so a second search over the same data reuses them. The data set's
fingerprint (:mod:`distmis.data.fingerprint`) is kept in the output folder, reused while the data set's files are
unchanged.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distmis.data.fingerprint import DatasetFingerprint, fingerprint_for
from distmis.data.layouts import CaseFiles, Layout, discover_cases
from distmis.data.preprocess import PreprocessConfig
from distmis.data.synthetic import synthesize_dataset
from distmis.data.manifest import DataManifest, read_manifest
from distmis.data.tfrecord import convert_to_tfrecords, verify_checksums
from distmis.search.data_config import dataset_description, preprocess_config, split_cases, with_statistics
from distmis.search.input_fit import check_dataset_path
from distmis.spec.load import SpecError, check_input_shape, with_volume
from distmis.spec.schema import Spec


@dataclass(frozen=True)
class PreparedData:
    tfrecord_dir: Path
    manifest: DataManifest
    split: dict[str, Any]
    generated: bool
    fingerprint: DatasetFingerprint


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
        seed=synthetic.seed, progress=progress, kind=synthetic.kind, lps_cases=synthetic.lps_cases,
    )
    return True


def dataset_files(spec: Spec) -> dict[str, list[int]]:
    """What a resumed search must find unchanged: every file of the data set's cases (relative to
    ``dataset.path``) with its size and modification time, ``{path: [bytes, mtime_ns]}``; ``{}`` when the data set
    is not there (a synthetic one not generated yet). Reads directory entries and file metadata only."""
    root = Path(spec.dataset.path)
    if not root.exists():
        return {}
    files: dict[str, list[int]] = {}
    for case in discover_cases(root, Layout(spec.dataset.layout)):
        for path in (*case.images, case.label):
            stat = path.stat()
            files[_relative(path, root)] = [int(stat.st_size), int(stat.st_mtime_ns)]
    return files


def _relative(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:  # a file listed outside the data set's folder
        return str(path)


def dataset_changes(before: dict[str, list[int]], now: dict[str, list[int]], limit: int = 5) -> list[str]:
    """How the data set's files differ from a recorded :func:`dataset_files`, in words (``[]``: the same)."""
    added = sorted(set(now) - set(before))
    removed = sorted(set(before) - set(now))
    changed = sorted(path for path in set(before) & set(now) if list(before[path]) != list(now[path]))

    def some(paths: list[str]) -> str:
        return ", ".join(paths[:limit]) + (f" and {len(paths) - limit} more" if len(paths) > limit else "")

    out = []
    if changed:
        out.append(f"{len(changed)} file(s) changed (size or modification time): {some(changed)}")
    if added:
        out.append(f"{len(added)} file(s) added: {some(added)}")
    if removed:
        out.append(f"{len(removed)} file(s) gone: {some(removed)}")
    return out


def _conversion_key(cases: list[CaseFiles], config: PreprocessConfig, split: dict[str, Any]) -> str:
    """What the TFRecords are a function of: the preprocessing (its learnt statistics follow from the rest), the
    split (its train, val and test cases, or its folds and test cases: a fold split and a plain one never share a
    folder) and every source file (path, size, modification time)."""
    digest = hashlib.sha256()
    digest.update(json.dumps(config.to_dict(statistics=False), sort_keys=True).encode())
    keys = ("folds", "test") if "folds" in split else ("train", "val", "test")
    digest.update(json.dumps({k: split[k] for k in keys}, sort_keys=True).encode())
    for case in cases:
        for path in (*case.images, case.label):
            stat = path.stat()
            digest.update(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def prepare_data(spec: Spec, output_dir: str | Path, *, progress: bool = True) -> PreparedData:
    """Synthesize (if needed), check, split and convert the dataset; reuse an identical earlier conversion.

    The cases are checked against their ``dataset.json`` from their headers first (channel count and shapes,
    image and label spacings: :func:`~distmis.data.layouts.check_cases`); the CT channels' intensity statistics
    are learnt from the training split's foreground (with ``dataset.split.folds``: every non-test case's) just
    before a conversion (:func:`with_statistics`). With folds, one folder holds every fold (``fold0`` ...
    ``fold{k-1}``, ``test``): each trial reads its own (``dataset.split.fold``). The data set's fingerprint is
    kept in the output folder (``dataset_fingerprint.json``, beside ``tfrecords/``), computed the first time. (Not
    in a TFRecord folder: an overwrite of one replaces only the files its manifest lists.)"""
    from distmis.data.layouts import check_cases

    generated = ensure_dataset(spec, progress=progress)
    description = dataset_description(spec)
    cases = discover_cases(Path(spec.dataset.path), Layout(spec.dataset.layout))
    check_cases(cases, description)
    split = split_cases(spec, cases)
    config = preprocess_config(spec, description, cases, split)
    tfrecord_dir = Path(output_dir).resolve() / "tfrecords" / _conversion_key(cases, config, split)
    if (tfrecord_dir / "manifest.json").is_file():
        verify_checksums(tfrecord_dir)
    else:
        config = with_statistics(config, cases, split, description, progress=progress)
        convert_to_tfrecords(cases, split, config, tfrecord_dir, progress=progress, description=description)
    manifest = read_manifest(tfrecord_dir)
    problems = check_input_shape(with_volume(spec, manifest.volume, f"the image_shape of {tfrecord_dir / 'manifest.json'}"))
    if problems:
        raise SpecError(f"{spec.name} (with the data at {spec.dataset.path})", problems)
    fingerprint = fingerprint_for(spec.dataset.path, spec.dataset.layout, output_dir, progress=progress)
    return PreparedData(tfrecord_dir, manifest, split, generated, fingerprint)
