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
from typing import Any, Iterator

from distmis.data.errors import DataError
from distmis.data.layouts import CaseFiles, Layout, case_spatial_shape, discover_cases
from distmis.data.preprocess import LabelMode, PreprocessConfig, preprocessed_shape
from distmis.data.split import make_split
from distmis.data.synthetic import synthesize_dataset
from distmis.data.tfrecord import convert_to_tfrecords, read_manifest, verify_checksums
from distmis.spec.load import SpecError, apply_config, check_input_shape
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
    """Before anything starts (no Ray, no output folder, no conversion): DataError when ``dataset.path`` is
    missing and nothing would generate it; SpecError when a tile is larger than the volumes
    (:func:`check_tile_fits`)."""
    root = Path(spec.dataset.path)
    if not root.exists() and spec.dataset.synthetic is None:
        raise DataError(
            f"dataset.path {str(root)!r} does not exist; point it at an MSD or BraTS folder, "
            "or add dataset.synthetic to generate a synthetic dataset there"
        )
    check_tile_fits(spec)


# --------------------------------------------------------------------------- tile against the volumes
@dataclass(frozen=True)
class Volume:
    """The spatial shape one case has after preprocessing, and where that shape comes from (for messages)."""

    shape: tuple[int, int, int]
    source: str


def tiles_to_check(spec: Spec) -> list[tuple[str, Any, tuple[int, int, int]]]:
    """Every tile a trial may train on: ``(field, searched value or None, tile)`` for ``training.tile``, each stage
    of ``training.curriculum`` and each value of a search over it (``search.space.training.tile``, or over the
    whole ``training`` section).

    Values that give no tile (null: the whole volume) or no valid spec (reported by the spec's own checks)
    are left out.
    """
    tiles = []
    if spec.training.tile is not None:
        tiles.append(("training.tile", None, tuple(spec.training.tile)))
    for number, stage in enumerate(spec.training.curriculum or []):
        if stage.tile is not None:
            tiles.append((f"training.curriculum[{number}].tile", None, tuple(stage.tile)))
    for path, domain in spec.search.space.items():
        if path not in ("training", "training.tile"):
            continue
        for value in domain.values:
            try:
                tile = apply_config(spec, {path: value}).training.tile
            except SpecError:
                continue
            if tile is not None:
                tiles.append((f"search.space.{path}", value, tuple(tile)))
    return tiles  # type: ignore[return-value]


def _geometry(start: str, config: PreprocessConfig) -> str:
    """How a shape becomes the preprocessed one, e.g. ``stored shape [240, 240, 155] -> dataset.crop [...]``."""
    steps = [start]
    steps += [f"dataset.{name} {list(value)}" for name, value in (("crop", config.crop), ("resize", config.resize))
              if value is not None]
    return " -> ".join(steps) if len(steps) > 1 else f"{steps[0]}, no dataset.crop or dataset.resize"


def preprocessed_volumes(spec: Spec) -> Iterator[Volume]:
    """The preprocessed shape of each case, from the NIfTI headers only (no voxel data is read).

    A synthetic dataset not generated yet: the one shape ``dataset.synthetic.shape`` gives. Raises DataError
    when the cases cannot be found or a header cannot be read.
    """
    config = preprocess_config(spec)
    root = Path(spec.dataset.path)
    synthetic = spec.dataset.synthetic
    if not root.exists():
        if synthetic is not None:
            stored = tuple(synthetic.shape)
            yield Volume(preprocessed_shape(stored, config),
                         f"the synthetic cases dataset.synthetic will generate at {str(root)!r} "
                         f"({_geometry(f'dataset.synthetic.shape {list(stored)}', config)})")  # type: ignore[arg-type]
        return
    for case in discover_cases(root, Layout(spec.dataset.layout)):
        stored = case_spatial_shape(case)
        yield Volume(preprocessed_shape(stored, config),
                     f"case file {str(case.images[0])!r} ({_geometry(f'stored shape {list(stored)}', config)})")


def check_tile_fits(spec: Spec) -> None:
    """SpecError when ``training.tile``, or a tile the search may try, is larger than a case's preprocessed
    volume in any dimension: conversion would succeed and every trial would then fail.

    The shapes come from the NIfTI headers (crop and resize applied as the preprocessing applies them), or
    from ``dataset.synthetic`` for a dataset not generated yet. When they cannot be read (no cases found, a
    broken header) this says nothing: preparing the data reports that, and the trainers check the tile again.
    """
    pending = tiles_to_check(spec)
    problems: list[tuple[str, str]] = []
    try:
        for volume in preprocessed_volumes(spec):
            if not pending:
                break
            too_large = [item for item in pending if any(t > v for t, v in zip(item[2], volume.shape))]
            for field, value, tile in too_large:
                problems.append((field, _too_large_message(value, tile, volume)))
            pending = [item for item in pending if item not in too_large]
    except DataError:  # cases or a header that cannot be read: reported when the data is prepared
        pass
    if problems:
        raise SpecError(f"{spec.name} (with the data at {spec.dataset.path})", problems)


def _too_large_message(value: Any, tile: tuple[int, int, int], volume: Volume) -> str:
    """What is wrong and what is allowed; ``value``: the searched value that sets the tile (None: the spec's)."""
    allowed = list(volume.shape)
    subject = f"{list(tile)} is" if value is None else f"value {value!r} makes training.tile {list(tile)}, which is"
    return (f"{subject} larger than the preprocessed volume {allowed} of {volume.source}; a tile must be at most "
            f"the volume in every dimension (here <= {allowed}), or set dataset.crop / dataset.resize to a shape "
            "at least as large as the tile")


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
