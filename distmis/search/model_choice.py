"""The published model chosen on cross-validation (the driver, at a cross-validated search's end): which of the top
configurations, alone or ensembled, and which postprocessing, both on the same out-of-fold predictions.

Every case of the development split was validated on by exactly one fold. Each of the top configurations (best
ranked first) predicts it with its network of that fold, mirrored as the published model predicts
(:func:`out_of_fold_cases`); from those predictions, case by case, the dice of every option of
:func:`distmis.search.configuration_ensemble.options` (each configuration alone, each ensemble of them) are
counted with and without nnU-Net's largest-component removals (:func:`distmis.search.postprocessing.case_scores`),
and the probabilities dropped. Then the option is decided
(:func:`distmis.search.configuration_ensemble.decide`, on the dice as predicted), and the postprocessing of that
option (:func:`distmis.search.postprocessing.decide`): each network predicts each case once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from distmis.search.configuration_ensemble import EnsembleChoice, ensemble_probabilities, options
from distmis.search.configuration_ensemble import decide as decide_ensemble
from distmis.search.postprocessing import PostprocessingChoice, case_scores
from distmis.search.postprocessing import decide as decide_postprocessing
from distmis.search.prepare import PreparedData
from distmis.train.protocol import Trainer

__all__ = ["ModelChoice", "choose_model", "out_of_fold_cases"]


@dataclass(frozen=True)
class ModelChoice:
    """What cross-validation chose: the configuration or ensemble (``ensemble``: its members and every option's
    out-of-fold dice) and the postprocessing of that choice (``postprocessing``)."""

    ensemble: EnsembleChoice
    postprocessing: PostprocessingChoice

    @property
    def members(self) -> tuple[str, ...]:
        return self.ensemble.members


def out_of_fold_cases(configurations: Mapping[str, Mapping[int, Trainer]], data: PreparedData,
                      mirror: Sequence[int]) -> Iterator[tuple[str, dict[str, np.ndarray], np.ndarray]]:
    """``(case_id, {configuration: probabilities}, label)`` of every case a fold was validated on, each
    configuration's by its network of that fold (``configurations``: name -> fold -> trainer, the same folds for
    all), every window mirrored on ``mirror``."""
    from distmis.data.split import fold_parts
    from distmis.data.tfrecord import iter_cases

    folds = {tuple(sorted(trainers)) for trainers in configurations.values()}
    if len(folds) != 1:
        raise ValueError(f"the configurations do not share their folds: {sorted(folds)}")
    for fold in next(iter(folds)):
        _, val = fold_parts(data.manifest.split, fold)
        for case_id, image, label in iter_cases(data.tfrecord_dir, val):
            yield case_id, {name: trainers[fold].predict_volume(image, mirror=tuple(mirror))
                            for name, trainers in configurations.items()}, np.asarray(label)


def choose_model(configurations: Mapping[str, Mapping[int, Trainer]], data: PreparedData) -> ModelChoice:
    """The model of a cross-validated search (see the module's docstring): ``configurations`` its top
    configurations (name -> fold -> trainer with its best weights, best ranked first; one alone: only its
    postprocessing is chosen), mirrored as the best one's spec says."""
    from distmis.pyfunc_model import foreground
    from distmis.train.epoch import trainer_targets
    from distmis.train.metrics import foreground_indices

    if not configurations:
        raise ValueError("no configuration to choose a model from")
    targets = trainer_targets(data.manifest, data.tfrecord_dir)
    keys = [channel["key"] for channel in foreground(dict(targets))]
    scored = foreground_indices(targets)
    choices = options(list(configurations))
    mirror = next(iter(next(iter(configurations.values())).values())).spec.training.inference.mirror
    scores: dict[tuple[str, ...], list[dict[str, np.ndarray]]] = {option: [] for option in choices}
    for _, probabilities, label in out_of_fold_cases(configurations, data, mirror):
        truth = label[..., scored] > 0.5
        for option in choices:
            prob = ensemble_probabilities([probabilities[name] for name in option])
            scores[option].append(case_scores(prob, truth, targets))
    cases = len(scores[choices[0]])
    per_case = [{option: float(scores[option][case]["plain"].mean()) for option in choices} for case in range(cases)]
    ensemble = decide_ensemble(per_case, choices)
    return ModelChoice(ensemble, decide_postprocessing(scores[ensemble.members], keys))
