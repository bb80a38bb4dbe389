"""The trainers a process keeps between trials: restarted when a trial's key matches, the least recently used
dropped first, a failed trial's forgotten."""

from __future__ import annotations

import pytest

from distmis.trial.kept_trainers import KeptTrainers, trainer_key
from distmis.spec import validate_spec
from tests.conftest import small_spec_tree


class Recorder:
    """A restartable trainer that records which specs it was restarted for."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.restarts: list[object] = []

    def restart(self, spec: object, layout: object) -> None:
        self.restarts.append(spec)


def test_a_matching_key_restarts_the_kept_trainer_and_others_build() -> None:
    kept = KeptTrainers(capacity=2)
    a, reused = kept.trainer_for("a", "spec-1", "layout", lambda: Recorder("a"))
    assert not reused and a.restarts == []
    again, reused = kept.trainer_for("a", "spec-2", "layout", lambda: Recorder("never"))
    assert reused and again is a and a.restarts == ["spec-2"]
    kept.trainer_for("b", "spec-3", "layout", lambda: Recorder("b"))
    kept.trainer_for("a", "spec-4", "layout", lambda: Recorder("never"))  # a is now the most recently used
    kept.trainer_for("c", "spec-5", "layout", lambda: Recorder("c"))  # b, the least recently used, goes
    assert "a" in kept and "c" in kept and "b" not in kept and len(kept) == 2


def test_a_failed_trials_trainer_is_built_anew_and_a_failed_restart_is_not_kept() -> None:
    kept = KeptTrainers()
    first, _ = kept.trainer_for("a", "spec", "layout", lambda: Recorder("first"))
    kept.discard("a")
    second, reused = kept.trainer_for("a", "spec", "layout", lambda: Recorder("second"))
    assert not reused and second is not first

    class Refuses(Recorder):
        def restart(self, spec: object, layout: object) -> None:
            raise ValueError("other graphs")

    kept.trainer_for("r", "spec", "layout", lambda: Refuses("r"))
    with pytest.raises(ValueError, match="other graphs"):
        kept.trainer_for("r", "spec", "layout", lambda: Recorder("never"))
    assert "r" not in kept
    with pytest.raises(ValueError, match="at least 1"):
        KeptTrainers(capacity=0)


def test_the_key_ignores_the_learning_rate_and_seed_but_not_the_model_or_the_data(tmp_path) -> None:
    tree = small_spec_tree(tmp_path)
    base = validate_spec(tree)
    lr = validate_spec({**tree, "training": {**tree["training"], "optimizer": {"lr": 0.5}, "seed": 3}})
    norm = validate_spec({**tree, "model": {**tree["model"], "params": {**tree["model"]["params"], "norm": "group"}}})
    assert trainer_key(base, "/records/a") == trainer_key(lr, "/records/a")
    assert trainer_key(base, "/records/a") != trainer_key(norm, "/records/a")
    assert trainer_key(base, "/records/a") != trainer_key(base, "/records/b")
