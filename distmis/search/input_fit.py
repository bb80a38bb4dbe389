"""Before anything starts: the data set's path and description fit the spec (:func:`check_dataset_path`), and every
network input (its tile, or the whole volume) fits the preprocessed volumes (:func:`check_inputs_fit`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from distmis.data.errors import DataError
from distmis.data.layouts import Layout, case_spatial_shape, discover_cases
from distmis.data.preprocess import PreprocessConfig, preprocessed_shape
from distmis.search.data_config import dataset_description, normalization_schemes, preprocess_config, split_cases
from distmis.spec.curriculum import training_stages
from distmis.spec.load import SpecError, apply_config, check_spec, shown, volume_shape, with_volume
from distmis.spec.schema import Spec


def check_dataset_path(spec: Spec) -> None:
    """Before anything starts (no Ray, no output folder, no conversion): DataError when ``dataset.path`` is
    missing and nothing would generate it, or its ``dataset.json`` is missing a key or does not fit the spec
    (``dataset.labels``); SpecError when a ``dataset.normalization`` channel or a ``search.metric`` class is not the
    data set's, or a network input does not fit the volumes (:func:`check_inputs_fit`)."""
    from distmis.data.targets import metric_keys, target_scheme

    root = Path(spec.dataset.path)
    if not root.exists() and spec.dataset.synthetic is None:
        raise DataError(
            f"dataset.path {str(root)!r} does not exist; point it at an MSD, nnU-Net or BraTS folder, "
            "or add dataset.synthetic to generate a synthetic dataset there"
        )
    description = dataset_description(spec)
    keys = metric_keys(target_scheme(description, spec.dataset.labels))
    metric = spec.search.metric
    if metric.startswith("val_dice_") and metric.removeprefix("val_dice_") not in keys:
        allowed = ", ".join(f"val_dice_{key}" for key in keys)
        raise SpecError(spec.name, [("search.metric", f"{metric!r} is no class or region of this data set with "
                                                      f"labels {spec.dataset.labels!r}; its per-class metrics are "
                                                      f"{allowed} (or val_dice, their mean)")])
    normalization_schemes(spec, description.channels)
    check_inputs_fit(spec)


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
    if config.orientation is not None:
        steps.append(f"dataset.orientation {config.orientation}")
    if config.spacing is not None:
        steps.append(f"dataset.spacing {[round(v, 4) for v in config.spacing]} mm")
    steps += [f"dataset.{name} {list(value)}" for name, value in (("crop", config.crop), ("resize", config.resize))
              if value is not None]
    return " -> ".join(steps) if len(steps) > 1 else f"{steps[0]}, no dataset.crop or dataset.resize"


def preprocessed_volumes(spec: Spec, nonzero: Mapping[str, Sequence[int]] | None = None) -> Iterator[Volume]:
    """The preprocessed shape of each case, from the NIfTI headers only (no voxel data is read); with ``nonzero``
    (case id -> its shape cropped to its non-zero region: the fingerprint's), of each case's non-zero region.

    A synthetic dataset not generated yet: the one shape ``dataset.synthetic.shape`` gives (nothing when it is
    resampled: its spacings are not known before it is written). Raises DataError when the cases cannot be found
    or a header cannot be read.
    """
    from distmis.data.layouts import case_orientation, case_spacing

    root = Path(spec.dataset.path)
    synthetic = spec.dataset.synthetic
    if not root.exists():
        if synthetic is not None and spec.dataset.spacing is None:
            config = preprocess_config(spec)
            stored = tuple(synthetic.shape)
            yield Volume(preprocessed_shape(stored, config, axcodes="RAS"),
                         f"the synthetic cases dataset.synthetic will generate at {str(root)!r} "
                         f"({_geometry(f'dataset.synthetic.shape {list(stored)}', config)})")  # type: ignore[arg-type]
        return
    cases = discover_cases(root, Layout(spec.dataset.layout))
    split = split_cases(spec, cases) if spec.dataset.spacing == "auto" else None
    config = preprocess_config(spec, cases=cases, split=split)
    for case in cases:
        stored = tuple(nonzero[case.case_id]) if nonzero is not None else case_spatial_shape(case)
        start = f"{'non-zero region' if nonzero is not None else 'stored shape'} {list(stored)}"
        geometry = {"spacing": case_spacing(case) if config.spacing is not None else None,
                    "axcodes": case_orientation(case) if config.orientation is not None else None}
        yield Volume(preprocessed_shape(stored, config, **geometry),  # type: ignore[arg-type]
                     f"case file {str(case.images[0])!r} ({_geometry(start, config)})")


#: The most distinct preprocessed shapes whose whole volumes are checked against the networks: the conversion takes
#: cases of one shape only (it refuses the others), so more than one already means a spec to change.
MAX_CHECKED_SHAPES = 8


def check_inputs_fit(spec: Spec) -> None:
    """SpecError when a trial's network input does not fit the data set's preprocessed volumes, read once from the
    NIfTI headers (no voxel data): a tile larger than a case's volume (:func:`check_tile_fits`) or, where no field
    fixes the volume (no ``dataset.crop`` or ``resize``, the data set on disk), a whole volume that a network the
    search may train does not take (:func:`check_whole_volumes`). Reads nothing when no input needs it."""
    whole = volume_shape(spec) is None and takes_whole_volumes(spec)
    if not tiles_to_check(spec) and not whole:
        return
    volumes = distinct_volumes(spec)
    check_tile_fits(spec, volumes)
    if whole:
        check_whole_volumes(spec, volumes)


def takes_whole_volumes(spec: Spec) -> bool:
    """Whether some trial of ``spec`` trains on whole volumes: ``training.tile`` null, a curriculum stage's, or a
    value of a search over the tile, the curriculum or the whole ``training`` section that makes one so."""
    trials = [spec]
    for path, domain in spec.search.space.items():
        if path in ("training", "training.tile", "training.curriculum"):
            for value in domain.values:
                try:
                    trials.append(apply_config(spec, {path: value}))
                except SpecError:
                    continue  # the spec's own checks report it
    return any(stage.tile is None for trial in trials for stage in training_stages(trial.training))


def distinct_volumes(spec: Spec) -> list[Volume]:
    """The preprocessed shapes of the cases (:func:`preprocessed_volumes`), each once with the first case that has it;
    those before a case whose header cannot be read, none when the cases cannot be found (preparing the data reports
    either)."""
    volumes: dict[tuple[int, int, int], Volume] = {}
    try:
        for volume in preprocessed_volumes(spec):
            volumes.setdefault(volume.shape, volume)
    except DataError:
        pass
    return list(volumes.values())


def check_whole_volumes(spec: Spec, volumes: Sequence[Volume]) -> None:
    """SpecError when a whole preprocessed volume of the data set on disk breaks the input rule of a network that a
    trial trains on it (the spec's, each ``model.name`` of a search, each whole-volume curriculum stage's): the spec's
    own checks (:func:`~distmis.spec.load.check_spec`), run as if the spec fixed that volume
    (:func:`~distmis.spec.load.with_volume`), for each distinct shape up to :data:`MAX_CHECKED_SHAPES`."""
    for volume in volumes[:MAX_CHECKED_SHAPES]:
        problems = check_spec(with_volume(spec, volume.shape, volume.source))
        if problems:
            raise SpecError(f"{spec.name} (with the data at {spec.dataset.path})", problems)


def check_tile_fits(spec: Spec, volumes: Sequence[Volume] | None = None) -> None:
    """SpecError when ``training.tile``, or a tile the search may try, is larger than a case's preprocessed
    volume in any dimension: conversion would succeed and every trial would then fail.

    The shapes come from the NIfTI headers (crop and resize applied as the preprocessing applies them), or
    from ``dataset.synthetic`` for a dataset not generated yet (``volumes``: those already read). When they cannot
    be read (no cases found, a broken header) this says nothing: preparing the data reports that, and the trainers
    check the tile again.
    """
    pending = tiles_to_check(spec)
    if not pending:
        return
    problems: list[tuple[str, str]] = []
    for volume in volumes if volumes is not None else distinct_volumes(spec):
        too_large = [item for item in pending if any(t > v for t, v in zip(item[2], volume.shape))]
        for field, value, tile in too_large:
            problems.append((field, _too_large_message(value, tile, volume)))
        pending = [item for item in pending if item not in too_large]
    if problems:
        raise SpecError(f"{spec.name} (with the data at {spec.dataset.path})", problems)


def _too_large_message(value: Any, tile: tuple[int, int, int], volume: Volume) -> str:
    """What is wrong and what is allowed; ``value``: the searched value that sets the tile (None: the spec's)."""
    allowed = list(volume.shape)
    subject = (f"{list(tile)} is" if value is None
               else f"value {shown(value)} makes training.tile {list(tile)}, which is")
    return (f"{subject} larger than the preprocessed volume {allowed} of {volume.source}; a tile must be at most "
            f"the volume in every dimension (here <= {allowed}), or set dataset.crop / dataset.resize to a shape "
            "at least as large as the tile")
