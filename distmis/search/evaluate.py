"""What a search ends with, besides its table: its best models scored on the test split, the best one as an MLflow
model (logged, registered, and copied into the output folder: :mod:`distmis.search.publish`), and a picture.

Runs in the driver once the trials are done. Each of the ``search.evaluate_top`` best trials (by the best value of
the search metric) is rebuilt in this process, on one device (its weights do not depend on the layout it trained
in), loads its best epoch's weights from its last checkpoint (:mod:`distmis.train.checkpoint`), predicts every
test case whole (by sliding windows of its tile, as ``training.inference`` says) and is scored per case and scored
channel (:mod:`distmis.train.evaluation`: each foreground channel of the data's target scheme, named by its key: WT,
TC, ET for the brain-tumour modes, the data set's classes for ``classes``) at the voxel spacing of the preprocessed
volume, from the NIfTI headers and the preprocessing the data was converted with.

A trial with test-time mirroring (``training.inference.mirror``, which its published model applies) is scored as its
model predicts, every window mirrored, and again without mirroring: the scores of both are recorded
(``test_dice_<name>`` and ``test_dice_<name>_nomirror``, ...), with the seconds a case's prediction took each way.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Hashable, Iterable, Iterator, Mapping, Protocol, Sequence

import numpy as np
import pandas as pd

from distmis.search.prepare import PreparedData

from distmis.search.data_config import preprocess_config
from distmis.spec.layout import resolve_trial
from distmis.spec.schema import Spec

if TYPE_CHECKING:
    from distmis.data.layouts import CaseFiles
    from distmis.trial.trainables import TrialConfig
    from distmis.train.loop import StoredCheckpoint
    from distmis.train.protocol import Trainer

logger = logging.getLogger(__name__)


class TrialResult(Protocol):
    """What :func:`best_models` reads of a trial's result in Tune's ``ResultGrid`` (a ``ray.tune.Result``)."""

    metrics: Mapping[str, object] | None
    error: BaseException | None
    checkpoint: StoredCheckpoint | None
    config: Mapping[str, object] | None


@dataclass(frozen=True)
class BestModel:
    """A finished trial, ranked by its best value of the search metric, with where its weights are."""

    trial_id: str
    config: TrialConfig
    best_value: float
    checkpoint: StoredCheckpoint  # a ray Checkpoint: the trial's newest complete checkpoint folder


@dataclass(frozen=True)
class Candidate:
    """What a search may publish as its model: one finished trial's best weights, or (cross-validation) a
    configuration's fold models, every fold finished, ranked by the mean over the folds of each one's best value.

    ``name``: the trial's id, or the configuration's; ``models``: fold -> its trial (``{None: trial}`` without
    folds)."""

    name: str
    best_value: float
    models: dict[int | None, BestModel]

    @property
    def folds(self) -> tuple[int, ...]:
        """The folds of a fold ensemble, in order; ``()`` for one trial."""
        return tuple(sorted(fold for fold in self.models if fold is not None))

    @property
    def trial_id(self) -> str:  # the name notes, tags and the registry give it
        return self.name

    @classmethod
    def of(cls, model: BestModel) -> Candidate:
        return cls(model.trial_id, model.best_value, {None: model})


#: What the metrics of a test split predicted without test-time mirroring end with (``test_dice_WT_nomirror``).
NOMIRROR_SUFFIX = "_nomirror"


@dataclass(frozen=True)
class TestEvaluation:
    """One trial's scores on the test split: a row per case (``case``, ``dice_<name>``, ``hd95_<name>``, a name per
    scored channel: a region or a class), predicted as its model predicts; ``seconds``: the mean seconds a case's
    prediction took (NaN: not timed). With test-time mirroring, ``mirror`` its axes and ``unmirrored`` the same
    cases predicted without it (each window once)."""

    trial_id: str
    cases: pd.DataFrame
    seconds: float = math.nan
    mirror: tuple[int, ...] = ()
    unmirrored: TestEvaluation | None = None

    @property
    def regions(self) -> list[str]:
        return [c.removeprefix("dice_") for c in self.cases.columns if c.startswith("dice_")]

    @property
    def scores(self) -> dict[str, float]:
        """``test_dice_<name>`` and ``test_hd95_<name>`` over the cases; with several scored channels (regions or
        classes) also their mean (``test_dice_mean``, ``test_hd95_mean``), as BraTS reports."""
        out = {f"test_{column}": float(self.cases[column].mean()) for column in self.cases.columns if column != "case"}
        if len(self.regions) > 1:
            for metric in ("dice", "hd95"):
                out[f"test_{metric}_mean"] = float(np.mean([out[f"test_{metric}_{r}"] for r in self.regions]))
        return out

    @property
    def means(self) -> dict[str, float]:
        """The test metrics logged: :attr:`scores`; with test-time mirroring also those of the unmirrored
        prediction (``test_dice_<name>_nomirror``, ..., ``test_dice_mean_nomirror``) and the mean seconds a case's
        prediction took, mirrored and not (``test_seconds_per_case``, ``test_seconds_per_case_nomirror``)."""
        out = self.scores
        if self.unmirrored is not None:
            out.update({f"{key}{NOMIRROR_SUFFIX}": value for key, value in self.unmirrored.scores.items()})
            out["test_seconds_per_case"] = float(self.seconds)
            out[f"test_seconds_per_case{NOMIRROR_SUFFIX}"] = float(self.unmirrored.seconds)
        return out

    def summary(self) -> str:
        """One line: the case count and each scored channel's mean dice and HD95 (and their mean); with test-time
        mirroring, the unmirrored prediction's as well, and the seconds a case took each way."""
        parts = self._score_parts()
        if self.unmirrored is None:
            return f"{len(self.cases)} case(s): " + "; ".join(parts)
        axes = ", ".join(map(str, self.mirror))
        return (f"{len(self.cases)} case(s), mirrored on axes {axes} ({self.seconds:.2f} s a case): "
                + "; ".join(parts) + f" | without mirroring ({self.unmirrored.seconds:.2f} s a case): "
                + "; ".join(self.unmirrored._score_parts()))

    def _score_parts(self) -> list[str]:
        regions, scores = self.regions, self.scores
        parts = [f"dice {r} {scores[f'test_dice_{r}']:.4f}, HD95 {r} {scores[f'test_hd95_{r}']:.2f} mm"
                 for r in regions]
        if len(regions) > 1:
            parts.append(f"mean dice {scores['test_dice_mean']:.4f}, mean HD95 {scores['test_hd95_mean']:.2f} mm")
        return parts


def best_models(grid: Iterable[TrialResult], last_checkpoint: dict[str, str], configs: dict[str, TrialConfig],
                best: dict[str, tuple[float, int]], mode: str, top: int, finished: set[str]) -> list[BestModel]:
    """The ``top`` best finished trials that have weights to load, best first.

    ``finished``: the trials whose own final status is FINISHED (the MLflow callback's record: a trial Tune could
    not write an error for still failed); ``best``: each trial's best value and epoch, as the callback recorded
    them; ``grid``: Tune's ``ResultGrid`` (may be empty when Tune itself stopped), whose checkpoint and config are
    used when it has them, else the callback's: ``last_checkpoint`` (the latest checkpoint path each trial
    reported) and ``configs``. The weights are read from the trial's newest complete checkpoint folder, whichever
    one Tune names (:func:`~distmis.trial.checkpoints.newest_complete`).
    """
    from distmis.trial.checkpoints import newest_complete

    in_grid = {}
    for result in grid:
        trial_id = (result.metrics or {}).get("trial_id")
        if trial_id is not None and result.error is None:
            in_grid[trial_id] = result
    found = []
    for trial_id in sorted(finished & set(best)):
        result = in_grid.get(trial_id)
        checkpoint = (result.checkpoint if result is not None else None) or last_checkpoint.get(trial_id)
        config = dict(result.config or {}) if result is not None else configs.get(trial_id)
        if checkpoint is not None and config is not None:
            found.append(BestModel(trial_id, config, best[trial_id][0], newest_complete(checkpoint)))
    found.sort(key=lambda model: model.best_value, reverse=mode == "max")
    return found[:top]


def fold_candidates(models: Iterable[BestModel], trial_folds: Mapping[str, tuple[str, int]],
                    cv_means: Mapping[str, float], folds: Sequence[int], mode: str, top: int) -> list[Candidate]:
    """The ``top`` best configurations of a cross-validated search as fold ensembles, best first: those of
    ``cv_means`` (configuration -> the mean over its folds, every fold finished) with weights for every fold of
    ``folds`` among ``models`` (:func:`best_models` of the finished trials); ``trial_folds``: trial id ->
    (configuration, fold)."""
    grouped: dict[str, dict[int | None, BestModel]] = {}
    for model in models:
        if model.trial_id in trial_folds:
            configuration, fold = trial_folds[model.trial_id]
            grouped.setdefault(configuration, {})[fold] = model
    found = [Candidate(configuration, value, dict(sorted(grouped[configuration].items())))
             for configuration, value in cv_means.items() if set(grouped.get(configuration, {})) == set(folds)]
    found.sort(key=lambda candidate: candidate.best_value, reverse=mode == "max")
    return found[:top]


@contextmanager
def loaded_trainer(model: BestModel, spec: Spec, data: PreparedData) -> Iterator[Trainer]:
    """The trial's trainer in this process, on one device (a local mesh: the trial's layout as it was, no
    process group), with its best epoch's weights, predicting as its published model does
    (:func:`as_published`)."""
    from distmis.parallel.mesh import TrialMesh
    from distmis.trial.trainers import build_trainer

    trial, layout = resolve_trial(spec, model.config)
    trainer = build_trainer(as_published(trial), layout, data.tfrecord_dir, mesh=TrialMesh.local(layout))
    with model.checkpoint.as_directory() as directory:
        trainer.load(directory)
    yield trainer


def as_published(trial: Spec) -> Spec:
    """A trial's spec as its published model computes: a torch trial trained in mixed precision (``bf16``,
    ``fp16``: autocast over fp32 master weights) in ``fp32``, for the published network is a ``torch.export``
    program of those fp32 weights without autocast (it runs on any CPU or GPU; bfloat16 is emulated, slowly, on a
    CPU without its instructions, and float16 refused), in PyTorch's default memory format and not compiled: the
    trainer that scores it measures no training step (``training.performance``: ``contiguous``, ``off``; ``auto``
    would time training steps on a copy of the network in each format, in the driver, for a trainer that never
    trains). Its test split is scored, and its overlay drawn, by what is published. A Keras model keeps its layers'
    dtype policy in its file: it is scored as it is."""
    from distmis.spec.load import apply_config

    if trial.model.framework != "torch":
        return trial
    published = {"training.precision": "fp32", "training.performance.memory_format": "contiguous",
                 "training.performance.compile": "off"}
    current = {"training.precision": trial.training.precision,
               "training.performance.memory_format": trial.training.performance.memory_format,
               "training.performance.compile": trial.training.performance.compile}
    if current == published:
        return trial
    return apply_config(trial, published, source="the published model's computation")


def test_spacings(spec: Spec, data: PreparedData) -> dict[str, tuple[float, float, float]]:
    """The voxel spacing (mm) of each test case after preprocessing, from its NIfTI header and the preprocessing the
    TFRecords were made with (the manifest's: a target spacing ``auto`` resolved; the spec's for a manifest
    without one)."""
    from distmis.data.layouts import Layout, case_spacing, case_spatial_shape, discover_cases
    from distmis.data.preprocess import PreprocessConfig, preprocessed_spacing

    test = set(data.split.get("test", []))
    recorded = data.manifest.preprocess
    config = PreprocessConfig.from_dict(recorded) if recorded else preprocess_config(spec)
    spacings = {}
    for case in discover_cases(Path(spec.dataset.path), Layout(spec.dataset.layout)):
        if case.case_id in test:
            axcodes = _axcodes(case) if config.orientation is not None else None
            spacings[case.case_id] = preprocessed_spacing(case_spatial_shape(case), case_spacing(case), config,
                                                          axcodes)
    return spacings


def _axcodes(case: CaseFiles) -> str:
    """Where the axes of a case's image point (e.g. ``"LPS"``), from its first file's header."""
    import nibabel as nib

    return "".join(nib.aff2axcodes(nib.load(str(case.images[0])).affine))


def evaluate_on_test(trainer: Trainer, spec: Spec, data: PreparedData, trial_id: str,
                     spacings: dict[str, tuple[float, float, float]]) -> TestEvaluation | None:
    """Score ``trainer``'s model on every test case, mirrored as the trial's ``spec`` says
    (``training.inference.mirror``, and then unmirrored too: :func:`evaluate_ensemble_on_test`); None when the test
    split is empty."""
    if not data.split.get("test"):
        return None
    return evaluate_ensemble_on_test({None: trainer}, data, trial_id, spacings,
                                     mirror=spec.training.inference.mirror)[1]


def evaluate_ensemble_on_test(trainers: Mapping[Hashable, Trainer], data: PreparedData, name: str,
                              spacings: dict[str, tuple[float, float, float]], *,
                              mirror: Sequence[int] | None = None,
                              postprocessing: Mapping[str, object] | None = None
                              ) -> tuple[dict[Hashable, TestEvaluation], TestEvaluation]:
    """Score each of ``trainers`` (fold -> its trial's trainer) and their ensemble on every test case: the
    ensemble's probabilities are the mean of theirs, thresholded (sigmoid) or argmaxed (softmax) after averaging,
    as the fold ensemble's MLflow model predicts. Returns each one's scores (named after ``name`` and the fold) and
    the ensemble's (named ``name``); with one trainer they are the same scores.

    ``mirror``: the axes each window is test-time mirrored on, as the published model predicts (None: the trials'
    own ``training.inference.mirror``, the first trainer's spec's: the folds of one configuration share it). When it
    names any, the cases are scored a second time without mirroring, kept as each evaluation's ``unmirrored``; each
    way's prediction is timed (:attr:`TestEvaluation.seconds`; an ensemble's: its folds' added up).

    ``postprocessing``: what cross-validation chose for the ensemble (:mod:`distmis.search.postprocessing`), applied
    to the ensemble's masks as its published model applies it (each fold's own scores are of its network alone)."""
    from distmis.pyfunc_model import check_mirror

    if mirror is None:
        mirror = next(iter(trainers.values())).spec.training.inference.mirror
    axes = check_mirror(mirror, "training.inference.mirror")
    each, ensemble = _score_test_split(trainers, data, name, spacings, axes or None, postprocessing)
    if not axes:
        return each, ensemble
    each_plain, ensemble_plain = _score_test_split(trainers, data, name, spacings, (), postprocessing)
    return ({fold: replace(found, mirror=axes, unmirrored=each_plain[fold]) for fold, found in each.items()},
            replace(ensemble, mirror=axes, unmirrored=ensemble_plain))


def _score_test_split(trainers: Mapping[Hashable, Trainer], data: PreparedData, name: str,
                      spacings: dict[str, tuple[float, float, float]], mirror: tuple[int, ...] | None,
                      postprocessing: Mapping[str, object] | None = None
                      ) -> tuple[dict[Hashable, TestEvaluation], TestEvaluation]:
    """:func:`evaluate_ensemble_on_test` of one way of predicting: every window mirrored on ``mirror`` (``()``:
    none, asked for; None: a trial without mirroring, whose trainers are asked as validation asks them,
    ``predict_volume(image)``)."""
    from distmis.data.tfrecord import iter_cases
    from distmis.train.epoch import trainer_targets
    from distmis.train.evaluation import case_metrics, score_names
    from distmis.pyfunc_model import channel_masks, postprocess_masks
    from distmis.train.metrics import foreground_indices, foreground_masks

    targets = trainer_targets(data.manifest, data.tfrecord_dir)
    names, scored = score_names(targets), foreground_indices(targets)

    def row(case_id: str, prob: np.ndarray, truth: np.ndarray, *, postprocessed: bool = False) -> dict[str, object]:
        if postprocessed and postprocessing:
            masks = postprocess_masks(channel_masks(prob, dict(targets)), dict(targets), dict(postprocessing))
            found = masks[..., scored]
        else:
            found = foreground_masks(prob, targets)
        return {"case": case_id, **case_metrics(found, truth, spacings[case_id], names)}

    def predict(trainer: Trainer, image: np.ndarray) -> tuple[np.ndarray, float]:
        start = time.perf_counter()
        prob = trainer.predict_volume(image) if mirror is None else trainer.predict_volume(image, mirror=mirror)
        return prob, time.perf_counter() - start

    rows: dict[Hashable, list[dict[str, object]]] = {fold: [] for fold in trainers}
    seconds: dict[Hashable, list[float]] = {fold: [] for fold in trainers}
    ensemble: list[dict[str, object]] = []
    for case_id, image, label in iter_cases(data.tfrecord_dir, "test"):
        truth = np.asarray(label)[..., scored] > 0.5
        probs = {}
        for fold, trainer in trainers.items():
            probs[fold], took = predict(trainer, image)
            seconds[fold].append(took)
        for fold, prob in probs.items():
            rows[fold].append(row(case_id, prob, truth))
        ensemble.append(row(case_id, np.mean(list(probs.values()), axis=0), truth, postprocessed=True)
                        if len(probs) > 1 or postprocessing else rows[next(iter(probs))][-1])

    def mean(values: Sequence[float]) -> float:
        return float(np.mean(values)) if len(values) else math.nan

    each = {fold: TestEvaluation(name if fold is None else f"{name} fold {fold}", pd.DataFrame(found),
                                 mean(seconds[fold])) for fold, found in rows.items()}
    total = [sum(case) for case in zip(*seconds.values())]  # the ensemble predicts with every fold
    return each, TestEvaluation(name, pd.DataFrame(ensemble), mean(total))
