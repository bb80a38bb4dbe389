"""Cross-validation fields of a spec: dataset.split.folds and fold, search.folds (schema and check_folds)."""

from __future__ import annotations

import pytest

from distmis.spec import SpecError, validate_spec
from distmis.spec.load import SpecError as LoadSpecError, apply_config


def problems_of(tree) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        validate_spec(tree, source="test.yaml")
    assert "test.yaml" in str(info.value)
    return info.value.problems


@pytest.fixture
def folds_tree(spec_tree):
    spec_tree["dataset"]["split"] = {"test": 0.2, "seed": 1, "folds": 3}
    return spec_tree


def test_a_fold_spec_lists_its_folds(folds_tree, spec_tree):
    spec = validate_spec(folds_tree)
    assert spec.dataset.split.folds == 3 and spec.dataset.split.fold is None
    assert spec.cv_folds == (0, 1, 2)
    folds_tree["search"]["folds"] = [2, 0]
    assert validate_spec(folds_tree).cv_folds == (0, 2)


def test_train_or_val_given_with_folds_is_refused(folds_tree):
    folds_tree["dataset"]["split"].update(train=0.6, val=0.2)
    [(path, message)] = problems_of(folds_tree)
    assert path == "dataset.split"
    assert "with folds, every non-test case is in one fold: give test (and seed) only, not train or val" in message


def test_a_fold_outside_the_folds_is_refused(folds_tree):
    folds_tree["dataset"]["split"]["fold"] = 3
    [(path, message)] = problems_of(folds_tree)
    assert path == "dataset.split" and "fold 3 is not one of the 3 folds (0 to 2)" in message


def test_fewer_than_two_folds_are_refused(folds_tree):
    folds_tree["dataset"]["split"]["folds"] = 1
    [(path, message)] = problems_of(folds_tree)
    assert path == "dataset.split.folds" and "greater than or equal to 2" in message


def test_a_fold_in_a_users_spec_is_refused(folds_tree):
    folds_tree["dataset"]["split"]["fold"] = 1
    [(path, message)] = problems_of(folds_tree)
    assert path == "dataset.split.fold" and "is set by the search for each trial (got 1)" in message
    assert "search.folds" in message


def test_a_fold_without_folds_is_refused(spec_tree):
    spec_tree["dataset"]["split"]["fold"] = 1
    [(path, message)] = problems_of(spec_tree)
    assert path == "dataset.split" and "fold 1 needs folds (dataset.split.folds: k)" in message


def test_search_folds_naming_a_missing_fold_is_refused(folds_tree):
    folds_tree["search"]["folds"] = [0, 3]
    [(path, message)] = problems_of(folds_tree)
    assert path == "search.folds"
    assert "[0, 3] names folds that do not exist: dataset.split.folds 3 makes folds 0 to 2" in message


def test_search_folds_without_split_folds_is_refused(spec_tree):
    spec_tree["search"]["folds"] = [0, 1]
    [(path, message)] = problems_of(spec_tree)
    assert path == "search.folds" and "needs cross-validation folds: set dataset.split.folds (k >= 2)" in message


@pytest.mark.parametrize("folds, fragment", [([], "non-empty"), ([1, 1], "distinct"), ([-1], "distinct")])
def test_search_folds_must_be_distinct_fold_numbers(folds_tree, folds, fragment):
    folds_tree["search"]["folds"] = folds
    [(path, message)] = problems_of(folds_tree)
    assert path == "search.folds" and fragment in message


def test_the_search_sets_a_trials_fold_through_apply_config(folds_tree):
    spec = validate_spec(folds_tree)
    trial = apply_config(spec, {"dataset.split.fold": 2, "training.optimizer.lr": 5.0e-3})
    assert trial.dataset.split.fold == 2 and trial.dataset.split.folds == 3 and trial.dataset.split.test == 0.2
    assert trial.training.optimizer.lr == 5.0e-3 and spec.dataset.split.fold is None
    with pytest.raises(LoadSpecError, match=r"fold 3 is not one of the 3 folds \(0 to 2\)"):
        apply_config(spec, {"dataset.split.fold": 3})
