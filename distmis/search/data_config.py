"""What a search's data set is and how its cases are preprocessed, from the spec and the files: its description
(``dataset.json``, or the synthetic data set's), each channel's normalization, the preprocessing configuration (with
the CT channels' statistics learnt from the training split) and the split of its cases."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from distmis.data.errors import DataError
from distmis.data.layouts import CaseFiles, Layout
from distmis.data.preprocess import LabelMode, PreprocessConfig
from distmis.data.split import development_cases, make_split
from distmis.spec.load import SpecError
from distmis.spec.schema import DatasetSpec, Spec


def dataset_description(spec: Spec | DatasetSpec) -> Any:
    """The data set's :class:`~distmis.data.description.DatasetDescription`: read from its ``dataset.json`` (MSD,
    nnU-Net), the layout's own (BraTS), or, for a synthetic data set not generated yet, what it will hold."""
    from distmis.data.dataset_layouts import describe_dataset, layout_description

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
    from distmis.data.dataset_layouts import layout_description
    from distmis.data.description import DatasetDescription
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
        crop_to_nonzero=data.crop_to_nonzero,
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


def split_cases(spec: Spec, cases: Sequence[CaseFiles]) -> dict[str, Any]:
    """The spec's split of ``cases``: train / val / test, or with ``dataset.split.folds`` k folds and test."""
    s = spec.dataset.split
    ids = [c.case_id for c in cases]
    try:
        if s.folds is not None:
            return make_split(ids, test=s.test, seed=s.seed, folds=s.folds)
        return make_split(ids, train=s.train, val=s.val, test=s.test, seed=s.seed)
    except ValueError as exc:
        raise DataError(f"dataset.split for {spec.dataset.path}: {exc}") from None
