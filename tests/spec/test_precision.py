"""``training.precision``: validated, searchable, checked against where trials run, logged with the trial's params,
and part of the TensorFlow trainer's graph key (issue 37)."""

from __future__ import annotations

import pytest

from distmis.spec import SpecError, apply_config, validate_spec
from distmis.spec.load import spec_to_dict
from tests.conftest import small_spec_tree


def tree(tmp_path, *, framework: str = "torch", **training) -> dict:
    spec = small_spec_tree(tmp_path / "data", model={"name": "unet3d", "framework": framework,
                                                     "params": {"base_filters": 4, "levels": 3}})
    spec["training"].update(training)
    return spec


def problems(exc: pytest.ExceptionInfo) -> dict[str, str]:
    return dict(exc.value.problems)


def test_fp32_is_the_default_and_each_precision_is_taken(tmp_path):
    assert validate_spec(tree(tmp_path)).training.precision == "fp32"
    for precision in ("fp32", "bf16", "fp16"):
        assert validate_spec(tree(tmp_path, precision=precision)).training.precision == precision


@pytest.mark.parametrize("bad", ["half", "float16", "BF16", 16, None, ["bf16"]])
def test_a_bad_precision_is_refused_naming_the_allowed_values(tmp_path, bad):
    with pytest.raises(SpecError) as exc:
        validate_spec(tree(tmp_path, precision=bad))
    message = problems(exc)["training.precision"]
    assert "'fp32', 'bf16', 'fp16' (bf16 and fp16: mixed precision with fp32 master weights) or 'auto'" in message and repr(bad) in message


@pytest.mark.parametrize("algorithm, kind", [("grid", "grid"), ("random", "choice"), ("optuna", "choice")])
def test_precision_is_searchable_and_applied_to_each_trial(tmp_path, algorithm, kind):
    spec_tree = tree(tmp_path)
    spec_tree["search"] = {"algorithm": algorithm, "num_samples": 2,
                           "space": {"training.precision": {kind: ["fp32", "bf16"]}}}
    spec = validate_spec(spec_tree)
    assert spec.search.space["training.precision"].values == ["fp32", "bf16"]
    trial = apply_config(spec, {"training.precision": "bf16"})
    assert trial.training.precision == "bf16" and spec.training.precision == "fp32"
    with pytest.raises(SpecError, match=r"'fp32', 'bf16', 'fp16' \(bf16 and fp16: mixed precision with fp32 master weights\) or 'auto'"):
        apply_config(spec, {"training.precision": "fp8"})
    spec_tree["search"]["space"]["training.precision"] = {kind: ["fp32", "fp8"]}
    with pytest.raises(SpecError) as exc:
        validate_spec(spec_tree)
    assert "value 'fp8' is invalid for training.precision" in problems(exc)["search.space.training.precision"]


def test_tensorflow_fp16_needs_a_gpu_and_says_why(tmp_path):
    """TensorFlow's CPU max pooling has no float16 kernel: refused before anything starts, the spec's value or a
    searched one; with GPUs for the trials (or for the workers of a data-parallel search) it is taken."""
    with pytest.raises(SpecError) as exc:
        validate_spec(tree(tmp_path, framework="tensorflow", precision="fp16"))
    message = problems(exc)["training.precision"]
    assert "needs a GPU" in message and "MaxPool3D" in message and "bf16" in message
    searched = tree(tmp_path, framework="tensorflow")
    searched["search"] = {"algorithm": "grid", "space": {"training.precision": {"grid": ["bf16", "fp16"]}}}
    with pytest.raises(SpecError) as exc:
        validate_spec(searched)
    assert "value 'fp16' makes training.precision invalid" in problems(exc)["search.space.training.precision"]
    on_gpus = tree(tmp_path, framework="tensorflow", precision="fp16")
    on_gpus["parallelism"] = {"resources_per_trial": {"cpu": 1, "gpu": 1}}
    assert validate_spec(on_gpus).training.precision == "fp16"
    data_mode = tree(tmp_path, framework="tensorflow", precision="fp16")
    data_mode["parallelism"] = {"mode": "data", "workers": 2, "resources_per_worker": {"cpu": 1, "gpu": 1}}
    assert validate_spec(data_mode).parallelism.mode == "data"
    data_mode["parallelism"]["resources_per_worker"] = {"cpu": 1}
    with pytest.raises(SpecError, match="needs a GPU"):
        validate_spec(data_mode)
    # bf16 runs on TensorFlow's CPU kernels, and torch's fp16 is checked where the trial runs
    assert validate_spec(tree(tmp_path, framework="tensorflow", precision="bf16")).training.precision == "bf16"
    assert validate_spec(tree(tmp_path, precision="fp16")).training.precision == "fp16"


def test_the_precision_is_a_logged_param_of_every_trial(tmp_path):
    """The trial's params are its flattened spec (distmis.tracking.mlflow_tracking)."""
    from distmis.tracking.mlflow_tracking import flatten

    spec = apply_config(validate_spec(tree(tmp_path)), {"training.precision": "bf16"})
    assert flatten(spec_to_dict(spec))["training.precision"] == "bf16"


def test_a_tensorflow_trainer_traced_in_one_precision_is_never_reused_for_another(tmp_path):
    from distmis.models.unet3d_tf import KERAS_POLICIES
    from distmis.train.tf_unet import graph_key

    spec = validate_spec(tree(tmp_path, framework="tensorflow"))
    same = apply_config(spec, {"training.optimizer.lr": 0.5, "training.seed": 3})
    assert graph_key(same) == graph_key(spec)
    assert graph_key(apply_config(spec, {"training.precision": "bf16"})) != graph_key(spec)
    assert [KERAS_POLICIES[p] for p in ("fp32", "bf16", "fp16")] == [None, "mixed_bfloat16", "mixed_float16"]
