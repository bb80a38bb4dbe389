"""Postprocessing chosen on cross-validation (the driver, after a cross-validated search): nnU-Net's rule.

The published model of a cross-validated search is a fold ensemble: its best configuration's, or a configuration
ensemble's (:mod:`distmis.search.configuration_ensemble`). Before it is scored on the test split and published, each
fold's network predicts the cases of the fold it was validated on (its out-of-fold predictions, mirrored as the
published model predicts; :mod:`distmis.search.model_choice`), and on those predictions, against their truth:

1. **the foreground as a whole**: removing all but the largest connected component of the scored channels together
   is kept if it raises the mean dice over the cases and the scored channels;
2. **each class or region**, on top of that: removing all but its own largest component is kept for the channels
   whose mean dice over the cases it raises.

A change that leaves the dice equal is not kept (nnU-Net keeps only an improvement). The choice goes into the
model's recipe (``postprocessing``), which :func:`distmis.pyfunc_model.postprocess_masks` applies, in ``distmis
predict`` and the MLflow model alike, and the test split is scored with it; the search run records the dice before
and after (:meth:`PostprocessingChoice.metrics`).

Each case's masks are dropped after its dice are counted (:func:`case_scores`): what is kept is four dice per
channel and case (as predicted, after the foreground's removal, and each channel's own removal on top of either),
enough for every decision above, whatever the size of the data set.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


__all__ = ["PostprocessingChoice", "case_scores", "decide"]


@dataclass(frozen=True)
class PostprocessingChoice:
    """What cross-validation chose: ``postprocessing`` (the recipe's ``{"foreground", "channels"}``), the mean
    out-of-fold dice of each scored channel ``before`` and ``after`` it, over ``cases`` cases."""

    postprocessing: dict[str, Any]
    before: dict[str, float]
    after: dict[str, float]
    cases: int
    foreground_dice: tuple[float, float] = field(default=(float("nan"), float("nan")))  # mean dice, as is / removed

    @property
    def applies(self) -> bool:
        return bool(self.postprocessing["foreground"] or self.postprocessing["channels"])

    def metrics(self) -> dict[str, float]:
        """The search run's figures: ``cv_oof_dice_<key>`` before and ``cv_oof_dice_<key>_postprocessed`` after, their
        means (``cv_oof_dice_mean``, ``cv_oof_dice_mean_postprocessed``)."""
        out = {f"cv_oof_dice_{key}": value for key, value in self.before.items()}
        out.update({f"cv_oof_dice_{key}_postprocessed": value for key, value in self.after.items()})
        out["cv_oof_dice_mean"] = float(np.mean(list(self.before.values())))
        out["cv_oof_dice_mean_postprocessed"] = float(np.mean(list(self.after.values())))
        return out

    def summary(self) -> str:
        chosen = self.postprocessing
        what = [*(["the foreground's largest component"] if chosen["foreground"] else []),
                *(f"{key}'s largest component" for key in chosen["channels"])]
        before, after = np.mean(list(self.before.values())), np.mean(list(self.after.values()))
        kept = f"keeps {', '.join(what)}" if what else "keeps every component"
        return (f"postprocessing chosen on {self.cases} out-of-fold case(s): {kept} (mean dice {before:.4f} -> "
                f"{after:.4f})")


def decide(scores: Sequence[Mapping[str, np.ndarray]], keys: Sequence[str]) -> PostprocessingChoice:
    """nnU-Net's decisions from each case's dice per scored channel (``keys``, in order): ``plain`` as predicted,
    ``foreground`` after the foreground's removal, ``own`` and ``foreground_own`` after each channel's own removal
    on top of ``plain`` or ``foreground`` (arrays of ``len(keys)``)."""
    if not scores:
        raise ValueError("no out-of-fold case to choose the postprocessing on")
    mean = {name: np.mean([case[name] for case in scores], axis=0)
            for name in ("plain", "foreground", "own", "foreground_own")}
    use_foreground = bool(mean["foreground"].mean() > mean["plain"].mean())
    base = mean["foreground"] if use_foreground else mean["plain"]
    own = mean["foreground_own"] if use_foreground else mean["own"]
    channels = [key for key, b, o in zip(keys, base, own) if o > b]
    after = np.where([key in channels for key in keys], own, base)
    return PostprocessingChoice({"foreground": use_foreground, "channels": channels},
                                dict(zip(keys, map(float, mean["plain"]))), dict(zip(keys, map(float, after))),
                                len(scores), (float(mean["plain"].mean()), float(mean["foreground"].mean())))


def case_scores(prob: np.ndarray, truth: np.ndarray, targets: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The four dice per scored channel of one case (see :func:`decide`): ``prob`` its predicted probabilities
    ``(h, w, d, C)``, ``truth`` its scored channels' true masks ``(h, w, d, K)``."""
    from distmis.pyfunc_model import channel_masks, foreground, postprocess_masks
    from distmis.train.metrics import foreground_indices, mask_dice

    targets = dict(targets)
    keys = [channel["key"] for channel in foreground(targets)]
    scored = foreground_indices(targets)
    masks = channel_masks(prob, targets)
    whole = postprocess_masks(masks, targets, {"foreground": True, "channels": []})

    def dice(found: np.ndarray) -> np.ndarray:
        return mask_dice(found[..., scored], truth)

    def each_own(start: np.ndarray) -> np.ndarray:  # channel k's own removal on top of ``start``, k alone
        return np.array([mask_dice(postprocess_masks(start, targets, {"foreground": False, "channels": [key]})
                                   [..., index:index + 1], truth[..., k:k + 1])[0]
                         for k, (key, index) in enumerate(zip(keys, scored))])

    return {"plain": dice(masks), "foreground": dice(whole), "own": each_own(masks), "foreground_own": each_own(whole)}
