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
from typing import Any, Iterator, Sequence

from distmis.data.errors import DataError
from distmis.data.layouts import CaseFiles, Layout, case_spatial_shape, discover_cases
from distmis.data.preprocess import LabelMode, PreprocessConfig, preprocessed_shape
from distmis.data.split import development_cases, make_split
from distmis.data.synthetic import synthesize_dataset
from distmis.data.tfrecord import convert_to_tfrecords, read_manifest, verify_checksums
from distmis.spec.curriculum import training_stages
from distmis.spec.load import (SpecError, apply_config, check_input_shape, check_spec, shown, volume_shape,
                               with_volume)
from distmis.spec.schema import DatasetSpec, Spec


@dataclass(frozen=True)
class PreparedData:
    tfrecord_dir: Path
    manifest: dict[str, Any]
    split: dict[str, Any]
    generated: bool


def dataset_description(spec: Spec | DatasetSpec) -> Any:
    """The data set's :class:`~distmis.data.description.DatasetDescription`: read from its ``dataset.json`` (MSD,
    nnU-Net), the layout's own (BraTS), or, for a synthetic data set not generated yet, what it will hold."""
    from distmis.data.description import describe_dataset, layout_description

    data = spec.dataset if isinstance(spec, Spec) else spec
    root = Path(data.path)
    if root.exists():
        return describe_dataset(root, data.layout)
    synthetic = data.synthetic
    if synthetic is not None and (synthetic.kind == "ct" or data.layout == "nnunet"):
        return _synthetic_description(data.layout, synthetic.kind)
    return layout_description(data.layout)


def _synthetic_description(layout: str, kind: str) -> Any:
    """What ``distmis data synth --kind KIND --layout LAYOUT`` writes into its dataset.json."""
    from distmis.data.description import DatasetDescription, layout_description
    from distmis.data.synthetic import CT_LABELS

    if kind == "ct":
        return DatasetDescription(layout=Layout(layout), channels=("CT",),
                                  classes=tuple((name, value) for value, name in CT_LABELS.items()))
    brain = layout_description("msd")
    return DatasetDescription(layout=Layout(layout), channels=brain.channels, classes=brain.classes)


def normalization_schemes(spec: Spec | DatasetSpec, channels: Sequence[str]) -> list[str]:
    """Each channel's scheme (``zscore`` or ``ct``): ``dataset.normalization`` where it names one (a scheme for all,
    a list, or ``{channel name: scheme}``), else the channel's name decides (``CT`` -> ``ct``; else ``zscore``).

    Raises:
        SpecError: a list of another length, or a name that is not one of the channels (naming them).
    """
    data = spec.dataset if isinstance(spec, Spec) else spec
    name = spec.name if isinstance(spec, Spec) else "dataset"
    given = data.normalization
    default = ["ct" if channel.strip().upper() == "CT" else "zscore" for channel in channels]
    if given is None:
        return default
    if isinstance(given, str):
        return [given] * len(channels)
    if isinstance(given, list):
        if len(given) != len(channels):
            raise SpecError(name, [("dataset.normalization", f"a list of {len(given)} scheme(s), but the data set "
                                                                  f"has {len(channels)} channel(s): {list(channels)}")])
        return list(given)
    by_name = {channel.strip().lower(): index for index, channel in enumerate(channels)}
    schemes = list(default)
    for channel, scheme in given.items():
        index = by_name.get(str(channel).strip().lower())
        if index is None:
            raise SpecError(name, [(f"dataset.normalization.{channel}", f"no channel {channel!r} in the data set; "
                                                                        f"its channels are {list(channels)}")])
        schemes[index] = scheme
    return schemes


def preprocess_config(spec: Spec | DatasetSpec, description: Any = None,
                      cases: Sequence[CaseFiles] | None = None,
                      split: dict[str, Any] | None = None) -> PreprocessConfig:
    """The preprocessing of ``spec`` resolved for its data set: channels and target scheme from the data set's
    description, each channel's normalisation scheme (without the CT statistics: :func:`with_statistics`), and
    ``spacing: auto`` as the median spacing of the non-test cases (``cases`` and ``split`` needed then).

    Raises:
        DataError / SpecError: naming what does not fit the data set (a label mode, a normalisation channel).
    """
    from distmis.data.statistics import median_spacing
    from distmis.data.targets import target_scheme

    data = spec.dataset if isinstance(spec, Spec) else spec
    description = description if description is not None else dataset_description(spec)
    spacing = data.spacing
    if spacing == "auto":
        if cases is None or split is None:
            raise ValueError("spacing 'auto' is resolved from the cases and the split: pass them")
        test = set(split.get("test", []))
        spacing = median_spacing([c for c in cases if c.case_id not in test], data.orientation)
    schemes = normalization_schemes(spec, description.channels)
    return PreprocessConfig(
        layout=Layout(data.layout), labels=LabelMode(data.labels), crop=data.crop, resize=data.resize,
        channels=tuple(description.channels), normalization=tuple({"scheme": s} for s in schemes),
        orientation=data.orientation, spacing=spacing, interpolation=data.interpolation,
        targets=target_scheme(description, data.labels),
    )


def with_statistics(config: PreprocessConfig, cases: Sequence[CaseFiles], split: dict[str, Any], description: Any,
                    *, progress: bool = False) -> PreprocessConfig:
    """``config`` with its CT channels' intensity statistics, learnt from the training split's foreground
    (:func:`~distmis.data.statistics.ct_statistics`); unchanged when no channel is ``ct``.

    With cross-validation folds (``split["folds"]``) there is no one training split: each fold's trial trains on
    the others. The statistics are then learnt from every development (non-test) case, the union of the folds
    (:func:`~distmis.data.split.development_cases`), as nnU-Net learns its dataset fingerprint from every training
    case before it cuts its five folds; the one TFRecord folder serves every fold (a fold's validation cases
    thus share in the statistics, as in nnU-Net, but never the test cases)."""
    from dataclasses import replace

    from distmis.data.statistics import ct_statistics

    schemes = config.normalization or ()
    ct = [index for index, scheme in enumerate(schemes) if scheme["scheme"] == "ct"]
    if not ct:
        return config
    train = set(development_cases(split) if "folds" in split else split.get("train", []))
    statistics = ct_statistics([c for c in cases if c.case_id in train], description, ct, progress=progress)
    normalization = tuple({"scheme": "ct", **statistics[index]} if index in statistics else dict(scheme)
                          for index, scheme in enumerate(schemes))
    return replace(config, normalization=normalization)


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


def preprocessed_volumes(spec: Spec) -> Iterator[Volume]:
    """The preprocessed shape of each case, from the NIfTI headers only (no voxel data is read).

    A synthetic dataset not generated yet: the one shape ``dataset.synthetic.shape`` gives (nothing when it is
    resampled: its spacings are not known before it is written). Raises DataError when the cases cannot be found
    or a header cannot be read.
    """
    from distmis.data.layouts import case_spacing
    from distmis.data.layouts import case_orientation

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
    split = _split(spec, cases) if spec.dataset.spacing == "auto" else None
    config = preprocess_config(spec, cases=cases, split=split)
    for case in cases:
        stored = case_spatial_shape(case)
        geometry = {"spacing": case_spacing(case) if config.spacing is not None else None,
                    "axcodes": case_orientation(case) if config.orientation is not None else None}
        yield Volume(preprocessed_shape(stored, config, **geometry),
                     f"case file {str(case.images[0])!r} ({_geometry(f'stored shape {list(stored)}', config)})")


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


def _fingerprint(cases: list[CaseFiles], config: PreprocessConfig, split: dict[str, Any]) -> str:
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


def _split(spec: Spec, cases: Sequence[CaseFiles]) -> dict[str, Any]:
    """The spec's split of ``cases``: train / val / test, or with ``dataset.split.folds`` k folds and test."""
    s = spec.dataset.split
    ids = [c.case_id for c in cases]
    try:
        if s.folds is not None:
            return make_split(ids, test=s.test, seed=s.seed, folds=s.folds)
        return make_split(ids, train=s.train, val=s.val, test=s.test, seed=s.seed)
    except ValueError as exc:
        raise DataError(f"dataset.split for {spec.dataset.path}: {exc}") from None


def prepare_data(spec: Spec, output_dir: str | Path, *, progress: bool = True) -> PreparedData:
    """Synthesize (if needed), check, split and convert the dataset; reuse an identical earlier conversion.

    The cases are checked against their ``dataset.json`` from their headers first (channel count and shapes,
    image and label spacings: :func:`~distmis.data.layouts.check_cases`); the CT channels' intensity statistics
    are learnt from the training split's foreground (with ``dataset.split.folds``: every non-test case's) just
    before a conversion (:func:`with_statistics`). With folds, one folder holds every fold (``fold0`` ...
    ``fold{k-1}``, ``test``): each trial reads its own (``dataset.split.fold``)."""
    from distmis.data.layouts import check_cases

    generated = ensure_dataset(spec, progress=progress)
    description = dataset_description(spec)
    cases = discover_cases(Path(spec.dataset.path), Layout(spec.dataset.layout))
    check_cases(cases, description)
    split = _split(spec, cases)
    config = preprocess_config(spec, description, cases, split)
    tfrecord_dir = Path(output_dir).resolve() / "tfrecords" / _fingerprint(cases, config, split)
    if (tfrecord_dir / "manifest.json").is_file():
        verify_checksums(tfrecord_dir)
    else:
        config = with_statistics(config, cases, split, description, progress=progress)
        convert_to_tfrecords(cases, split, config, tfrecord_dir, progress=progress, description=description)
    manifest = read_manifest(tfrecord_dir)
    shape = tuple(int(v) for v in manifest["image_shape"][:3])
    problems = check_input_shape(with_volume(spec, shape, f"the image_shape of {tfrecord_dir / 'manifest.json'}"))
    if problems:
        raise SpecError(f"{spec.name} (with the data at {spec.dataset.path})", problems)
    return PreparedData(tfrecord_dir, manifest, split, generated)
