"""Configuration ensembles chosen on cross-validation (the driver, after a cross-validated search): nnU-Net's and
Auto3DSeg's last step.

A cross-validated search ends with its configurations ranked by their mean validation value over the folds. Its
top configurations (:data:`LARGEST` at most) each predict every development case by the network of the fold that
case was validated on (out-of-fold predictions, mirrored as the published model predicts); every option is then
scored on those predictions against their truth:

- each of the top configurations alone;
- each ensemble of 2 to :data:`LARGEST` of them, whose probabilities are the mean of its members' (each member
  itself the mean of its folds' networks: the published model's rule, one level up).

The option of the highest mean dice over the cases and the scored channels wins; an ensemble wins only where it
beats every single configuration (a tie keeps the single one: one configuration's model is cheaper to apply). The
configurations share the search's prepared data, so their out-of-fold probabilities are of the same voxels.

Each case is predicted once by each configuration and its probabilities dropped once its dice are counted: what is
kept is one mean dice per option and case, whatever the size of the data set.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any

import numpy as np

from distmis.search.prepare import PreparedData
from distmis.train.protocol import Trainer

__all__ = ["LARGEST", "EnsembleChoice", "choose_configuration_ensemble", "decide", "ensemble_probabilities",
           "option_dice", "options", "out_of_fold_cases"]

#: The most configurations an ensemble holds (nnU-Net's 2, Auto3DSeg's up to 5; 3 keeps a model affordable).
LARGEST = 3

Option = tuple[str, ...]


def options(names: Sequence[str], largest: int = LARGEST) -> list[Option]:
    """What is compared: each of the ``largest`` best configurations (``names``, best first) alone, then each
    ensemble of 2 to ``largest`` of them, members in rank order."""
    if not names:
        raise ValueError("no configuration to ensemble")
    if largest < 1:
        raise ValueError(f"an ensemble holds 1 configuration or more, got largest={largest}")
    top = list(dict.fromkeys(names))[:largest]
    return [option for size in range(1, len(top) + 1) for option in combinations(top, size)]


def ensemble_probabilities(members: Sequence[np.ndarray]) -> np.ndarray:
    """The ensemble's probabilities: the mean of its members' (arrays of one shape)."""
    if not members:
        raise ValueError("an ensemble of no member has no probabilities")
    shapes = {np.shape(member) for member in members}
    if len(shapes) != 1:
        raise ValueError(f"the members' probabilities differ in shape: {sorted(shapes)}")
    return np.mean(np.stack([np.asarray(member, dtype=np.float32) for member in members]), axis=0)


def option_dice(probabilities: Mapping[str, np.ndarray], truth: np.ndarray, targets: Mapping[str, Any],
                choices: Sequence[Option]) -> dict[Option, float]:
    """One case's mean dice over its scored channels for each option of ``choices``: ``probabilities`` each
    configuration's ``(h, w, d, C)``, ``truth`` the scored channels' true masks ``(h, w, d, K)``."""
    from distmis.train.metrics import foreground_masks, mask_dice

    return {tuple(option): float(mask_dice(foreground_masks(
        ensemble_probabilities([probabilities[name] for name in option]), targets), truth).mean())
        for option in choices}


@dataclass(frozen=True)
class EnsembleChoice:
    """What cross-validation chose: ``members`` (one configuration, or an ensemble's, best ranked first), and the
    mean out-of-fold dice of every option compared (``scores``), over ``cases`` cases."""

    members: Option
    scores: dict[Option, float]
    cases: int

    @property
    def best_single(self) -> Option:
        return max((option for option in self.scores if len(option) == 1), key=lambda option: self.scores[option])

    @property
    def is_ensemble(self) -> bool:
        return len(self.members) > 1

    def metrics(self) -> dict[str, float]:
        """The search run's figures: ``cv_oof_dice_<a>`` for a configuration, ``cv_oof_dice_<a>+<b>`` for an
        ensemble, and ``cv_oof_dice_chosen``."""
        out = {f"cv_oof_dice_{'+'.join(option)}": value for option, value in self.scores.items()}
        out["cv_oof_dice_chosen"] = self.scores[self.members]
        return out

    def table(self) -> list[dict[str, Any]]:
        """One row per option, best first: its members, size, mean out-of-fold dice and whether it was chosen."""
        rows = [{"members": "+".join(option), "configurations": len(option), "cv_oof_dice": value,
                 "chosen": option == self.members} for option, value in self.scores.items()]
        return sorted(rows, key=lambda row: -row["cv_oof_dice"])

    def summary(self) -> str:
        single = self.best_single
        if not self.is_ensemble:
            return (f"configuration {single[0]} alone: no ensemble of its top configurations beat its out-of-fold "
                    f"dice {self.scores[single]:.4f} on {self.cases} case(s)")
        return (f"an ensemble of configurations {', '.join(self.members)}: out-of-fold dice "
                f"{self.scores[self.members]:.4f} against {self.scores[single]:.4f} for {single[0]} alone, on "
                f"{self.cases} case(s)")


def decide(per_case: Sequence[Mapping[Option, float]], choices: Sequence[Option]) -> EnsembleChoice:
    """The option of the highest mean dice over the cases (:func:`option_dice` each); an ensemble only where it
    beats every single configuration, and of two ensembles of equal dice the smaller."""
    if not per_case:
        raise ValueError("no out-of-fold case to compare the configurations on")
    scores = {tuple(option): float(np.mean([case[tuple(option)] for case in per_case])) for option in choices}
    singles = [option for option in scores if len(option) == 1]
    if not singles:
        raise ValueError("the options hold no single configuration to compare the ensembles with")
    best = max(singles, key=lambda option: scores[option])
    for option in sorted(scores, key=len):
        if len(option) > 1 and scores[option] > scores[best]:
            best = option
    return EnsembleChoice(best, scores, len(per_case))


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


def choose_configuration_ensemble(configurations: Mapping[str, Mapping[int, Trainer]],
                                  data: PreparedData) -> EnsembleChoice:
    """The best of the top configurations (``configurations``: name -> fold -> trainer with its best weights, best
    ranked first) alone or ensembled (see the module's docstring), on their out-of-fold predictions."""
    from distmis.train.epoch import trainer_targets
    from distmis.train.metrics import foreground_indices

    targets = trainer_targets(data.manifest, data.tfrecord_dir)
    scored = foreground_indices(targets)
    choices = options(list(configurations))
    first = next(iter(next(iter(configurations.values())).values()))
    per_case = [option_dice(probabilities, label[..., scored] > 0.5, targets, choices)
                for _, probabilities, label in out_of_fold_cases(configurations, data,
                                                                  first.spec.training.inference.mirror)]
    return decide(per_case, choices)
