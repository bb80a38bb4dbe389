"""``training.optimizer``: adam, adamw or sgd, each with its own fields and weight decay; the fields that do not apply
refused by name; searchable by name, with every trial's optimizer checked before anything starts."""

from __future__ import annotations

import pytest

from distmis.spec import SpecError, apply_config, validate_spec
from distmis.spec.layout import resolve_trial
from distmis.spec.load import spec_to_dict
from distmis.spec.schema import OptimizerSpec
from tests.conftest import small_spec_tree


def tree(tmp_path, space: dict | None = None, **optimizer) -> dict:
    spec = small_spec_tree(tmp_path / "data")
    spec["training"]["optimizer"] = {"lr": 1.0e-3, **optimizer}
    spec["search"]["space"] = space if space is not None else {}
    return spec


def problems(exc: pytest.ExceptionInfo) -> dict[str, str]:
    return dict(exc.value.problems)


# --------------------------------------------------------------------------- the defaults
def test_adam_is_the_default_as_it_always_was():
    adam = OptimizerSpec()
    assert (adam.name, adam.lr, adam.beta1, adam.beta2, adam.amsgrad, adam.epsilon) == ("adam", 1e-4, 0.9, 0.999,
                                                                                        False, 1e-7)
    assert adam.effective_weight_decay == 0.0
    # its dump: the fields it always had, and its weight decay (none)
    assert adam.model_dump() == {"name": "adam", "lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "amsgrad": False,
                                 "epsilon": 1e-7, "weight_decay": 0.0}


def test_sgd_defaults_are_nnunets_momentum_and_nesterov_and_no_decay():
    sgd = OptimizerSpec(name="sgd")
    assert (sgd.momentum, sgd.effective_nesterov, sgd.effective_weight_decay, sgd.lr) == (0.99, True, 0.0, 1e-4)
    assert sgd.model_dump() == {"name": "sgd", "lr": 1e-4, "momentum": 0.99, "nesterov": True, "weight_decay": 0.0}
    plain = OptimizerSpec(name="sgd", momentum=0)  # no momentum: no Nesterov, unless asked for (refused below)
    assert plain.effective_nesterov is False
    assert OptimizerSpec(name="sgd", nesterov=False).effective_nesterov is False
    assert OptimizerSpec(name="sgd", weight_decay=3e-5).effective_weight_decay == 3e-5


def test_adamw_decays_by_torchs_default_unless_told():
    assert OptimizerSpec(name="adamw").effective_weight_decay == 0.01
    assert OptimizerSpec(name="adamw", weight_decay=0).effective_weight_decay == 0.0
    assert OptimizerSpec(name="adamw", amsgrad=True, beta2=0.99).model_dump(mode="json") == {
        "name": "adamw", "lr": 1e-4, "beta1": 0.9, "beta2": 0.99, "amsgrad": True, "epsilon": 1e-7,
        "weight_decay": 0.01}


@pytest.mark.parametrize("optimizer", [{}, {"name": "adamw", "weight_decay": 0.05},
                                       {"name": "sgd", "momentum": 0.9, "weight_decay": 3e-5},
                                       {"name": "sgd", "momentum": 0}])
def test_a_resolved_spec_reads_back_as_the_same_spec(tmp_path, optimizer):
    spec = validate_spec(tree(tmp_path, **optimizer))
    again = validate_spec(spec_to_dict(spec))
    assert again.training.optimizer.model_dump() == spec.training.optimizer.model_dump()
    assert again.training.optimizer.effective_weight_decay == spec.training.optimizer.effective_weight_decay


# --------------------------------------------------------------------------- what is refused
@pytest.mark.parametrize("optimizer, field, takes", [
    ({"momentum": 0.9}, "momentum", "adam"),
    ({"nesterov": True}, "nesterov", "adam"),
    ({"name": "adamw", "momentum": 0.5}, "momentum", "adamw"),
    ({"name": "sgd", "amsgrad": True}, "amsgrad", "sgd"),
    ({"name": "sgd", "beta2": 0.99}, "beta2", "sgd"),
    ({"name": "sgd", "epsilon": 1e-8}, "epsilon", "sgd"),
])
def test_a_field_of_another_optimizer_is_refused_by_name(tmp_path, optimizer, field, takes):
    with pytest.raises(SpecError) as exc:
        validate_spec(tree(tmp_path, **optimizer))
    message = problems(exc)[f"training.optimizer.{field}"]
    assert f"{field} does not apply to optimizer {takes!r}" in message
    taken = "momentum, nesterov, weight_decay" if takes == "sgd" else "beta1, beta2, amsgrad, epsilon, weight_decay"
    assert f"which takes lr, {taken}" in message


def test_a_field_at_its_default_is_taken_with_any_optimizer(tmp_path):
    """A resolved spec of an older distmis, or one written out in full, names every field at its default."""
    spec = validate_spec(tree(tmp_path, name="sgd", beta1=0.9, amsgrad=False, epsilon=1e-7))
    assert spec.training.optimizer.name == "sgd"
    assert validate_spec(tree(tmp_path, momentum=0.99, nesterov=None)).training.optimizer.name == "adam"


def test_nesterov_without_momentum_is_refused(tmp_path):
    with pytest.raises(SpecError) as exc:
        validate_spec(tree(tmp_path, name="sgd", momentum=0, nesterov=True))
    message = problems(exc)["training.optimizer"]
    assert "nesterov: true needs momentum > 0" in message and "nesterov: false" in message


@pytest.mark.parametrize("optimizer, path, says", [
    ({"name": "rmsprop"}, "training.optimizer.name", "'adam', 'adamw' or 'sgd'"),
    ({"name": "sgd", "momentum": 1.0}, "training.optimizer.momentum", "less than 1"),
    ({"name": "sgd", "momentum": -0.1}, "training.optimizer.momentum", "greater than or equal to 0"),
    ({"weight_decay": -1e-4}, "training.optimizer.weight_decay", "greater than or equal to 0"),
    ({"weight_decay": float("inf")}, "training.optimizer.weight_decay", "finite"),
])
def test_bad_values_name_the_field_and_what_is_allowed(tmp_path, optimizer, path, says):
    with pytest.raises(SpecError) as exc:
        validate_spec(tree(tmp_path, **optimizer))
    assert says in problems(exc)[path]


# --------------------------------------------------------------------------- searching the optimizer
def test_the_optimizer_is_searchable_by_name_and_each_trial_gets_its_own(tmp_path):
    spec = validate_spec(tree(tmp_path, {"training.optimizer.name": {"grid": ["adam", "adamw", "sgd"]}},
                              weight_decay=3e-5))
    assert spec.search.space["training.optimizer.name"].values == ["adam", "adamw", "sgd"]
    trial, layout = resolve_trial(spec, {"training.optimizer.name": "sgd"})
    sgd = trial.training.optimizer
    assert (sgd.name, sgd.lr, sgd.momentum, sgd.effective_nesterov, sgd.effective_weight_decay) == (
        "sgd", 1.0e-3, 0.99, True, 3e-5)
    assert layout.effective_lr == 1.0e-3
    assert spec_to_dict(trial)["training"]["optimizer"] == {"name": "sgd", "lr": 1.0e-3, "momentum": 0.99,
                                                            "nesterov": True, "weight_decay": 3e-5}
    adamw = apply_config(spec, {"training.optimizer.name": "adamw"}).training.optimizer
    assert (adamw.name, adamw.effective_weight_decay) == ("adamw", 3e-5)
    assert spec.training.optimizer.name == "adam"  # the search's own spec is left as it was


def test_a_spec_field_that_a_searched_optimizer_does_not_take_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(SpecError) as exc:
        validate_spec(tree(tmp_path, {"training.optimizer.name": {"grid": ["adam", "sgd"]}}, amsgrad=True))
    message = problems(exc)["search.space.training.optimizer.name"]
    assert "value 'sgd' is invalid for training.optimizer.amsgrad" in message
    assert "amsgrad does not apply to optimizer 'sgd'" in message


def test_a_searched_field_that_a_searched_optimizer_does_not_take_is_refused(tmp_path):
    space = {"training.optimizer.name": {"grid": ["adam", "sgd"]}, "training.optimizer.amsgrad": {"grid": [True, False]}}
    with pytest.raises(SpecError) as exc:
        validate_spec(tree(tmp_path, space))
    message = problems(exc)["search.space"]
    assert "training.optimizer.name=sgd, training.optimizer.amsgrad=True" in message
    assert "amsgrad does not apply to optimizer 'sgd'" in message and "training.optimizer as a whole" in message
    space = {"training.optimizer.name": {"grid": ["adam", "sgd"]}, "training.optimizer.momentum": {"grid": [0.9]}}
    with pytest.raises(SpecError, match="momentum does not apply to optimizer 'adam'"):
        validate_spec(tree(tmp_path, space))
    space = {"training.optimizer.name": {"grid": ["adam", "sgd"]}, "training.optimizer.lr": {"grid": [1e-3, 1e-2]}}
    assert len(validate_spec(tree(tmp_path, space)).search.space) == 2  # lr goes with every optimizer


def test_searching_the_section_whole_gives_each_optimizer_its_own_fields(tmp_path):
    choices = [{"name": "adam", "lr": 1.0e-3, "amsgrad": True}, {"name": "sgd", "lr": 1.0e-2, "weight_decay": 3e-5}]
    spec = validate_spec(tree(tmp_path, {"training.optimizer": {"grid": choices}}))
    adam = apply_config(spec, {"training.optimizer": choices[0]}).training.optimizer
    sgd = apply_config(spec, {"training.optimizer": choices[1]}).training.optimizer
    assert (adam.name, adam.amsgrad) == ("adam", True)
    assert (sgd.name, sgd.lr, sgd.momentum, sgd.effective_weight_decay) == ("sgd", 1.0e-2, 0.99, 3e-5)
    bad = [{"name": "sgd", "amsgrad": True}]
    with pytest.raises(SpecError, match="amsgrad does not apply to optimizer 'sgd'"):
        validate_spec(tree(tmp_path, {"training.optimizer": {"grid": bad}}))


def test_the_nnunet_training_in_the_docs_validates(tmp_path):
    spec_tree = tree(tmp_path)
    spec_tree["training"].update({"optimizer": {"name": "sgd", "lr": 0.01, "weight_decay": 3.0e-5},
                                  "lr_schedule": {"name": "poly"}})
    sgd = validate_spec(spec_tree).training.optimizer
    assert (sgd.momentum, sgd.effective_nesterov, sgd.effective_weight_decay, sgd.lr) == (0.99, True, 3e-5, 0.01)
