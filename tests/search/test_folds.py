"""The cross-validation searcher and scheduler (distmis.search.folds), without Ray running: what each trial is given,
what the inner searcher (Optuna included) learns, and which ASHA sees which fold."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from ray import tune
from ray.tune.search import Searcher

from distmis.search.folds import (
    CONFIGURATION_KEY, FOLD_KEY, Configurations, FoldScheduler, FoldSearchGenerator, FoldSearcher, fold_of,
    searched_config,
)
from distmis.search.search_space import num_trials, scheduler, search_algorithm, tune_param_space
from distmis.spec.load import validate_spec


class Recording(Searcher):
    """An inner searcher that gives configurations {"x": 0}, {"x": 1}, ... and records what it is told."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count, self.given, self.told = count, [], []

    def suggest(self, trial_id: str) -> Any:
        if len(self.given) == self.count:
            return Searcher.FINISHED
        self.given.append(trial_id)
        return {"x": len(self.given) - 1}

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        self.told.append((trial_id, result, error))


def _hand_out(searcher: FoldSearcher, count: int, start: int = 0) -> list[tuple[str, dict]]:
    return [(f"t{i}", searcher.suggest(f"t{i}")) for i in range(start, start + count)]


def test_each_configuration_is_handed_out_once_per_fold_then_finished() -> None:
    searcher = FoldSearcher(Recording(2), [0, 2], "val_dice", "max")
    trials = _hand_out(searcher, 4)
    assert [(c["x"], c[FOLD_KEY], c[CONFIGURATION_KEY]) for _, c in trials] == [
        (0, 0, "c000"), (0, 2, "c000"), (1, 0, "c001"), (1, 2, "c001")]
    assert searcher.suggest("t4") == Searcher.FINISHED
    assert searched_config(trials[1][1]) == {"x": 0} and fold_of(trials[1][1]) == 2


def test_the_inner_searcher_learns_the_mean_of_each_folds_best_once_the_last_fold_ends() -> None:
    inner = Recording(2)
    searcher = FoldSearcher(inner, [0, 1, 2], "val_dice", "max")
    (a0, _), (a1, _), (a2, _), (b0, _), (b1, _), (b2, _) = _hand_out(searcher, 6)
    for trial, values in ((a0, [0.2, 0.6, 0.5]), (a1, [0.7]), (a2, [0.1, 0.3])):
        for value in values:
            searcher.on_trial_result(trial, {"val_dice": value})
    searcher.on_trial_complete(a0, {"val_dice": 0.5})
    searcher.on_trial_complete(a1, {"val_dice": 0.7})
    assert inner.told == []  # fold 2 still runs
    searcher.on_trial_complete(a2, {"val_dice": 0.3})
    assert inner.told == [("c000", {"val_dice": pytest.approx((0.6 + 0.7 + 0.3) / 3)}, False)]
    # a configuration with a failed fold is an error for the inner searcher, whatever its other folds gave
    searcher.on_trial_complete(b0, {"val_dice": 0.9})
    searcher.on_trial_complete(b1, None, error=True)
    searcher.on_trial_complete(b2, {"val_dice": 0.8})
    assert inner.told[-1] == ("c001", None, True)


def test_minimising_takes_each_folds_lowest() -> None:
    inner = Recording(1)
    searcher = FoldSearcher(inner, [0, 1], "val_loss", "min")
    (a0, _), (a1, _) = _hand_out(searcher, 2)
    for trial, values in ((a0, [0.9, 0.4, 0.6]), (a1, [0.8, 0.2])):
        for value in values:
            searcher.on_trial_result(trial, {"val_loss": value})
        searcher.on_trial_complete(trial, {"val_loss": values[-1]})
    assert inner.told == [("c000", {"val_loss": pytest.approx(0.3)}, False)]


def test_a_restored_searcher_hands_out_the_folds_it_had_not_yet(tmp_path) -> None:
    searcher = FoldSearcher(Recording(2), [0, 1, 2], "val_dice", "max")
    first = _hand_out(searcher, 2)  # c000's folds 0 and 1
    searcher.on_trial_result("t0", {"val_dice": 0.4})
    searcher.save(str(tmp_path / "searcher.pkl"))
    restored = FoldSearcher(Recording(2), [0, 1, 2], "val_dice", "max")
    restored.restore(str(tmp_path / "searcher.pkl"))
    rest = _hand_out(restored, 4, start=2)
    assert [(c[CONFIGURATION_KEY], c[FOLD_KEY]) for _, c in first + rest] == [
        ("c000", 0), ("c000", 1), ("c000", 2), ("c001", 0), ("c001", 1), ("c001", 2)]
    assert restored.best == {"t0": 0.4}
    assert restored.suggest("t6") == Searcher.FINISHED


def test_configurations_are_tunes_variants_seeded() -> None:
    space = {"training.optimizer.lr": tune.grid_search([0.1, 0.2]), "model.params.dropout": tune.uniform(0, 1)}
    one, again, other = (Configurations(space, 2, seed) for seed in (0, 0, 1))
    assert len(one.configs) == 4 and one.configs == again.configs and one.configs != other.configs
    assert [c["training.optimizer.lr"] for c in one.configs] == [0.1, 0.2, 0.1, 0.2]
    assert len({c["model.params.dropout"] for c in one.configs}) == 4  # a draw per configuration
    assert [one.suggest(str(i)) for i in range(4)] == one.configs
    assert one.suggest("4") == Searcher.FINISHED


def _spec(**search: Any) -> Any:
    return validate_spec({
        "name": "folds", "dataset": {"path": "data", "split": {"folds": 3, "test": 0.25}},
        "training": {"epochs": 4},
        "search": {"space": {"training.optimizer.lr": {"choice": [0.001, 0.01]}}, **search},
    })


def test_optuna_learns_the_folds_mean() -> None:
    spec = _spec(algorithm="optuna", num_samples=2, folds=[0, 2])
    searcher = search_algorithm(spec)
    assert isinstance(searcher, FoldSearcher) and searcher.folds == (0, 2)
    assert tune_param_space(spec) == {} and num_trials(spec) == 4
    searcher.set_search_properties("val_dice", "max", {})
    a0, a2 = (searcher.suggest(t) for t in ("a0", "a2"))
    assert a0["training.optimizer.lr"] == a2["training.optimizer.lr"] in (0.001, 0.01)
    for trial, value in (("a0", 0.5), ("a2", 0.7)):
        searcher.on_trial_result(trial, {"val_dice": value})
        searcher.on_trial_complete(trial, {"val_dice": value})
    study = searcher.inner._ot_study
    assert [t.value for t in study.trials if t.value is not None] == [pytest.approx(0.6)]


def test_asha_judges_each_fold_against_the_same_fold() -> None:
    spec = _spec(algorithm="random", scheduler="asha", asha={"grace_period": 1, "reduction_factor": 2})
    chosen = scheduler(spec)
    assert isinstance(chosen, FoldScheduler) and set(chosen.by_fold) == {0, 1, 2}
    assert chosen.set_search_properties("val_dice", "max")
    controller = SimpleNamespace()
    trials = {(c, f): SimpleNamespace(trial_id=f"{c}{f}", config={FOLD_KEY: f, CONFIGURATION_KEY: c})
              for c in ("a", "b") for f in (0, 1, 2)}
    for trial in trials.values():
        chosen.on_trial_add(controller, trial)
    # fold 0: a is better, so b is stopped at the first rung; fold 1: b is better, so a is stopped there
    decisions = {}
    for (c, f), value in {("a", 0): 0.9, ("b", 0): 0.1, ("b", 1): 0.9, ("a", 1): 0.1}.items():
        decisions[(c, f)] = chosen.on_trial_result(controller, trials[(c, f)], {"epoch": 1, "val_dice": value,
                                                                               "training_iteration": 1})
    assert decisions[("a", 0)] == decisions[("b", 1)] == "CONTINUE"
    assert decisions[("b", 0)] == decisions[("a", 1)] == "STOP"
    # fold 2 has seen nothing yet: its first trial continues whatever the other folds gave
    assert chosen.on_trial_result(controller, trials[("a", 2)], {"epoch": 1, "val_dice": 0.0,
                                                                  "training_iteration": 1}) == "CONTINUE"
    stray = SimpleNamespace(trial_id="x", config={FOLD_KEY: 5})
    with pytest.raises(ValueError, match="fold 5"):
        chosen.on_trial_add(controller, stray)


def test_a_search_without_folds_is_as_before() -> None:
    # (a TensorFlow one hands out its configurations by graph: tests/search/test_affinity.py)
    spec = validate_spec({"name": "plain", "dataset": {"path": "data"}, "model": {"framework": "torch"},
                          "search": {"space": {"training.optimizer.lr": {"grid": [0.001, 0.01]}}}})
    assert spec.cv_folds == () and search_algorithm(spec) is None and scheduler(spec) is None
    assert num_trials(spec) == 2 and list(tune_param_space(spec)) == ["training.optimizer.lr"]


def test_a_restored_searcher_agrees_with_the_trials_tune_restored(tmp_path) -> None:
    """Tune's experiment state and the searcher's are separate files: a driver killed between their writes leaves
    one older than the other (issue 37's CI run). Trials Tune kept that the saved searcher never handed out are
    adopted, not handed out twice; trials the searcher handed out that Tune lost are handed out again."""
    searcher = FoldSearcher(Recording(2), [0, 1, 2], "val_dice", "max", limit=2)
    handed = dict(_hand_out(searcher, 3))  # c000's folds 0, 1, 2
    searcher.save(str(tmp_path / "searcher.pkl"))  # the searcher's state, saved here...
    handed.update(_hand_out(searcher, 1, start=3))  # ...then c001's fold 0 (t3), which Tune's newer state holds

    older = FoldSearcher(Recording(2), [0, 1, 2], "val_dice", "max", limit=2)
    older.restore(str(tmp_path / "searcher.pkl"))
    older.reconcile({tid: handed[tid] for tid in ("t0", "t1", "t2", "t3")})
    rest = _hand_out(older, 2, start=4)
    assert [(c[CONFIGURATION_KEY], c[FOLD_KEY], c["x"]) for _, c in rest] == [("c001", 1, 1), ("c001", 2, 1)]
    assert older.suggest("t6") == Searcher.FINISHED  # c001's fold 0 is t3's: not trained twice
    for tid, value in (("t3", 0.5), ("t4", 0.7), ("t5", 0.6)):
        older.on_trial_complete(tid, {"val_dice": value})
    assert older.inner.told == []  # c001 came from Tune's trials, not from this (restored) inner searcher

    newer = FoldSearcher(Recording(2), [0, 1, 2], "val_dice", "max", limit=2)
    newer.restore(str(tmp_path / "searcher.pkl"))
    newer.reconcile({tid: handed[tid] for tid in ("t0", "t1")})  # Tune lost t2 (c000's fold 2)
    again = newer.suggest("t7")
    assert (again[CONFIGURATION_KEY], again[FOLD_KEY], again["x"]) == ("c000", 2, 0)
    assert [(c[CONFIGURATION_KEY], c[FOLD_KEY]) for _, c in _hand_out(newer, 3, start=8)] == [
        ("c001", 0), ("c001", 1), ("c001", 2)]


def test_a_state_saved_before_reconciliation_existed_restores_with_its_configurations_from_the_inner_searcher(
        tmp_path) -> None:
    """A search begun before ``limit``, ``given`` and ``from_inner`` were saved: resumed, its configurations' ends
    still reach the inner searcher (they came from it)."""
    import pickle

    searcher = FoldSearcher(Recording(1), [0, 1], "val_dice", "max")
    handed = _hand_out(searcher, 2)  # c000's two folds
    state = searcher.__dict__.copy()
    for field in ("limit", "given", "from_inner"):
        del state[field]
    (tmp_path / "old.pkl").write_bytes(pickle.dumps(state))

    resumed = FoldSearcher(Recording(1), [0, 1], "val_dice", "max", limit=1)
    resumed.restore(str(tmp_path / "old.pkl"))
    assert resumed.limit == 1 and resumed.given == {} and resumed.from_inner == {"c000"}
    for (tid, _), value in zip(handed, (0.5, 0.7)):
        resumed.on_trial_complete(tid, {"val_dice": value})
    assert [(tid, result) for tid, result, _ in resumed.inner.told] == [("c000", {"val_dice": 0.6})]
    assert resumed.suggest("t2") == Searcher.FINISHED


def test_a_restored_generator_asks_again_for_a_fold_whose_trial_tune_lost() -> None:
    """Issue 46, 13, without Ray: Tune's generator state says "finished" and its limiter counts the lost trial as
    running; restored after the fold searcher reconciled, the generator hands the fold out again, then finishes.
    (tests/search/test_fold_search_restore.py runs the same through Tune itself.)"""
    searcher = FoldSearcher(Recording(1), [0, 1], "val_dice", "max", limit=1)
    generator = FoldSearchGenerator(searcher, max_concurrent=1)
    limiter = generator.searcher
    first = limiter.suggest("t0")
    limiter.on_trial_complete("t0", {"val_dice": 0.5})
    assert limiter.suggest("t1")[FOLD_KEY] == 1 and limiter.suggest("t2") is None  # t1 runs: one at a time
    saved = {"counter": 2, "total_samples": 2**63 - 1, "finished": True, "experiment": None}

    searcher.reconcile({"t0": first})  # Tune's older state lost t1, which the saved searcher state handed out
    generator.set_state(dict(saved))
    assert not generator.is_finished() and limiter.live_trials == set()
    again = limiter.suggest("t3")
    assert (again[CONFIGURATION_KEY], again[FOLD_KEY]) == ("c000", 1)
    limiter.on_trial_complete("t3", {"val_dice": 0.7})
    assert limiter.suggest("t4") == Searcher.FINISHED

    generator.set_state(dict(saved))  # nothing to hand out again: finished as saved
    assert generator.is_finished()
