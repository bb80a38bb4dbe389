"""The registered model's name against MLflow's rule, at spec validation (issue 46, finding 4)."""

from __future__ import annotations

import pytest

from distmis.spec import SpecError, validate_spec
from distmis.spec.schema import NAME_PATTERN, registered_model_name_problem

NAMES = ["brats-unet3d", "ct_spleen.v2", "a b", "Ünïcode", "x.", "a..b", "-lead", "..", ".", "..hidden", "../../etc",
         "a/b", "/abs", "a:b", "c:\\models", "100%", "a%20b", "back\\slash", " ", "\t", "ok\n", "é/", "a/./b", "./a"]


def mlflow_refuses(name: str) -> bool:
    """Whether MLflow 3's model registry refuses ``name``: the check every store applies and its file store's own."""
    from mlflow.exceptions import MlflowException
    from mlflow.store.model_registry.file_store import _validate_model_name as file_store_check
    from mlflow.utils.validation import _validate_model_name

    try:
        _validate_model_name(name)
        file_store_check(name)
    except MlflowException:
        return True
    return False


@pytest.mark.parametrize("name", NAMES)
def test_the_rule_agrees_with_mlflows_validators(name):
    assert (registered_model_name_problem(name) is not None) == mlflow_refuses(name)


def test_every_search_name_is_a_name_mlflow_registers():
    """Without tracking.model_name the model is registered under the spec's name, whose own rule is stricter."""
    for name in NAMES + ["tiny", "quickstart", "v1.0", "9_lives", "A-b.c_d"]:
        if NAME_PATTERN.fullmatch(name):
            assert not mlflow_refuses(name), name


def test_a_model_name_mlflow_refuses_is_a_spec_error_naming_the_field_the_value_and_the_rule(spec_tree):
    spec_tree["tracking"] = {"model_name": "../../etc"}
    with pytest.raises(SpecError) as info:
        validate_spec(spec_tree)
    (path, message), = info.value.problems
    assert path == "tracking.model_name"
    assert message == ("MLflow's model registry refuses this name (it holds '/'): a registered model's name must not "
                       "be blank, hold '/', ':' or '%', be '.' or start with '..' (e.g. 'brats-unet3d') (got "
                       "'../../etc')")
    spec_tree["tracking"] = {"model_name": "brats-unet3d"}
    assert validate_spec(spec_tree).registered_model_name == "brats-unet3d"
    del spec_tree["tracking"]
    assert validate_spec(spec_tree).registered_model_name == "tiny"
