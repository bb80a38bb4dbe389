"""What Ray Tune's saved experiment state holds, read as Tune reads it when ``--resume`` restores a search: the
newest ``experiment_state-*.json`` in the experiment folder (Tune saves it every few seconds while it runs)."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

__all__ = ["restored_trials", "running_when_saved"]


def _saved_trials(checkpoint_dir: str) -> list[str] | None:
    """The trials' JSON states in the newest experiment state in ``checkpoint_dir``; None when there is none."""
    paths = glob.glob(os.path.join(checkpoint_dir, "experiment_state-*.json"))
    if not paths:
        return None
    with open(max(paths)) as handle:
        state = json.load(handle)
    return [json_state for json_state, _metadata in state.get("trial_data", [])]


def restored_trials(checkpoint_dir: str) -> dict[str, dict[str, Any]] | None:
    """Trial id -> config of the trials Tune resumes from ``checkpoint_dir``; None when it saved none."""
    from ray.tune.experiment.trial import Trial

    saved = _saved_trials(checkpoint_dir)
    if saved is None:
        return None
    trials = {}
    for json_state in saved:
        trial = Trial.from_json_state(json_state, stub=True)
        trials[trial.trial_id] = dict(trial.config)
    return trials


def running_when_saved(checkpoint_dir: str) -> set[str]:
    """The ids of the trials that were running when Tune last saved ``checkpoint_dir`` (Tune restores them as
    pending, so their own restored status does not say it)."""
    states = (json.loads(json_state) for json_state in _saved_trials(checkpoint_dir) or [])
    return {state["trial_id"] for state in states if state.get("status") == "RUNNING"}
