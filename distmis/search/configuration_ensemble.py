"""Configuration ensembles chosen on cross-validation (the driver, after a cross-validated search): nnU-Net's and
Auto3DSeg's last step.

A cross-validated search ends with its configurations ranked by their mean validation value over the folds. Its
top configurations (:data:`LARGEST` at most) each predict every development case by the network of the fold that
case was validated on (out-of-fold predictions, mirrored as the published model predicts); every option is then
scored on those predictions against their truth:

- each of the top configurations alone;
- each ensemble of 2 to :data:`LARGEST` of them, whose probabilities are the mean of its members' (each member
  itself the mean of its folds' networks: the published model's rule, one level up).

An ensemble is chosen only where its mean dice over the cases and the scored channels beats every single
configuration's (a tie keeps the single one: one configuration's model is cheaper to apply); otherwise the model is
the search's best configuration alone, as its cross-validation ranked it (the ranking, the results table and the
model agree). The
configurations share the search's prepared data, so their out-of-fold probabilities are of the same voxels.

The predictions are made, and this module's :func:`decide` called, by :func:`distmis.search.model_choice.choose_model`,
which chooses the postprocessing of the chosen option on the same predictions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any

import numpy as np


__all__ = ["LARGEST", "EnsembleChoice", "decide", "ensemble_probabilities", "option_dice", "options"]

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
        """The search's best configuration (the first single option: its cross-validation's ranking)."""
        return next(option for option in self.scores if len(option) == 1)

    @property
    def is_ensemble(self) -> bool:
        return len(self.members) > 1

    def metrics(self) -> dict[str, float]:
        """The search run's figures: ``cv_oof_dice_of_<a>`` for a configuration, ``cv_oof_dice_of_<a>-<b>`` for
        an ensemble (MLflow's metric names hold no ``+``), and ``cv_oof_dice_of_chosen``."""
        out = {f"cv_oof_dice_of_{'-'.join(option)}": value for option, value in self.scores.items()}
        out["cv_oof_dice_of_chosen"] = self.scores[self.members]
        return out

    def table(self) -> list[dict[str, Any]]:
        """One row per option, best first: its members, size, mean out-of-fold dice and whether it was chosen."""
        rows = [{"members": "+".join(option), "configurations": len(option), "cv_oof_dice": value,
                 "chosen": option == self.members} for option, value in self.scores.items()]
        return sorted(rows, key=lambda row: -row["cv_oof_dice"])

    def summary(self) -> str:
        single = self.best_single
        if not self.is_ensemble:
            return (f"configuration {single[0]} alone (out-of-fold dice {self.scores[single]:.4f} on {self.cases} "
                    f"case(s)): no ensemble of the top configurations beat each of them alone")
        return (f"an ensemble of configurations {', '.join(self.members)}: out-of-fold dice "
                f"{self.scores[self.members]:.4f} against {self.scores[single]:.4f} for {single[0]} alone, on "
                f"{self.cases} case(s)")


def decide(per_case: Sequence[Mapping[Option, float]], choices: Sequence[Option]) -> EnsembleChoice:
    """The ensemble of the highest mean dice over the cases (:func:`option_dice` each) where it beats every single
    configuration (of two ensembles of equal dice the smaller); else the search's best configuration, the first
    single option of ``choices`` (:func:`options`: the search's ranking), which its cross-validation ranked first."""
    if not per_case:
        raise ValueError("no out-of-fold case to compare the configurations on")
    scores = {tuple(option): float(np.mean([case[tuple(option)] for case in per_case])) for option in choices}
    singles = [option for option in scores if len(option) == 1]
    if not singles:
        raise ValueError("the options hold no single configuration to compare the ensembles with")
    best, bar = singles[0], max(scores[option] for option in singles)
    for option in sorted(scores, key=len):
        if len(option) > 1 and scores[option] > bar:
            best, bar = option, scores[option]
    return EnsembleChoice(best, scores, len(per_case))
