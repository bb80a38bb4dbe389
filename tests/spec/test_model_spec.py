"""``model`` in a spec: every registered network's params validated by its entry, the parallelisms and inputs each
network takes, and ``model.name`` itself searched (with ``model.per_model``, the params of each model it picks)."""

from __future__ import annotations

from typing import Any

import pytest

from distmis.models.registry import MODELS
from distmis.spec.load import SpecError, apply_config, network_tile, validate_spec
from tests.conftest import small_spec_tree

SEGRESNET = {"name": "segresnet", "framework": "torch", "params": {"init_filters": 8, "blocks_down": [1, 1, 1],
                                                                   "blocks_up": [1, 1]}}


def problems_of(tree: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        validate_spec(tree)
    return info.value.problems


def tree_with(tmp_path, model: dict[str, Any], *, shape=(64, 64, 64), tile=(64, 32, 32), **training: Any) -> dict:
    """The small spec, its data ``shape``, with ``model`` and a ``tile`` every registered network takes."""
    tree = small_spec_tree(tmp_path / "data", model=model)
    tree["dataset"]["synthetic"]["shape"] = list(shape)
    tree["training"] = {**tree["training"], "tile": list(tile) if tile else None, **training}
    tree["search"] = {"algorithm": "grid", "space": {}}
    return tree


# --------------------------------------------------------------------------- params
def test_every_registered_network_is_a_valid_model(tmp_path):
    for name in MODELS:
        framework = "tensorflow" if name == "unet3d" else "torch"
        params = {"vit-seg": {"patch": 16, "embed_dim": 32, "heads": 4}}.get(name, {})
        spec = validate_spec(tree_with(tmp_path, {"name": name, "framework": framework, "params": params}))
        assert spec.model.name == name and spec.model.entry is MODELS[name]


def test_an_unknown_argument_names_the_model_and_every_argument_it_takes(tmp_path):
    model = {**SEGRESNET, "params": {**SEGRESNET["params"], "not_an_arg": 1}}
    [(path, message)] = problems_of(tree_with(tmp_path, model))
    assert path == "model.params.not_an_arg"
    assert message == ("segresnet takes no argument 'not_an_arg'; allowed: init_filters, dropout_prob, act, norm, "
                       "blocks_down, blocks_up, upsample_mode")


def test_an_ill_typed_argument_names_the_field_and_the_type(tmp_path):
    model = {**SEGRESNET, "params": {**SEGRESNET["params"], "init_filters": "eight"}}
    [(path, message)] = problems_of(tree_with(tmp_path, model))
    assert path == "model.params.init_filters" and "valid integer" in message and "'eight'" in message
    model = {"name": "dynunet", "framework": "torch", "params": {"filters": [4, "x", 16]}}
    (path, message), *_ = problems_of(tree_with(tmp_path, model))
    assert path == "model.params.filters.1" and "valid integer" in message


@pytest.mark.parametrize("model, fragment", [
    ({"name": "segresnet", "params": {"blocks_down": [1, 2], "blocks_up": [1, 1]}}, "len(blocks_down) - 1 = 1"),
    ({"name": "segresnet", "params": {"init_filters": 12}}, "num_groups (8) must divide"),
    ({"name": "segresnet", "params": {"norm": "layer"}}, "unknown norm 'layer': one of instance, batch, group"),
    ({"name": "segresnet", "params": {"norm": ["group", {"groups": 4}]}}, "takes no option 'groups'"),
    ({"name": "segresnet", "params": {"act": ["leakyrelu", {"negative_slope": 0.2}]}}, None),
    ({"name": "unetr", "params": {"hidden_size": 48, "num_heads": 5}}, "hidden_size (48) must divide by num_heads"),
    ({"name": "swinunetr", "params": {"feature_size": 16}}, "multiple of 12"),
    ({"name": "swinunetr", "params": {"depths": [2, 2, 2]}}, "at least 4 items"),
    ({"name": "swinunetr", "params": {"feature_size": 12, "num_heads": [5, 6, 12, 24]}}, "num_heads[0] = 5"),
    ({"name": "dynunet", "params": {"deep_supervision": True}}, "deep_supervision must be false"),
    ({"name": "dynunet", "params": {"strides": [1, 2, 2]}}, "kernel_size and strides are given together"),
    ({"name": "dynunet", "params": {"strides": [2, 2, 2], "kernel_size": [3, 3, 3]}}, "strides[0] must be 1"),
    ({"name": "dynunet", "params": {"strides": [1, 2], "kernel_size": [3, 3]}}, "at least three levels"),
    ({"name": "dynunet", "params": {"strides": [1, 2, 2], "kernel_size": [2, 3, 3]}}, "stride 1 needs an odd"),
    ({"name": "basicunet", "params": {"features": [4, 4, 8, 16, 32]}}, "at least 6 items"),
])
def test_cross_field_rules_of_the_params(tmp_path, model, fragment):
    tree = tree_with(tmp_path, {"framework": "torch", **model})
    if fragment is None:
        validate_spec(tree)
        return
    [(path, message)] = problems_of(tree)
    assert path.startswith("model.params") and fragment in message, (path, message)


def test_a_network_built_in_torch_only_says_so(tmp_path):
    [(path, message)] = problems_of(tree_with(tmp_path, {**SEGRESNET, "framework": "tensorflow"}))
    assert path == "model" and "'segresnet' is built in torch only: set framework: torch" in message


# --------------------------------------------------------------------------- inputs
def test_the_tile_divides_by_each_network_s_multiple(tmp_path):
    [(path, message)] = problems_of(tree_with(tmp_path, {"name": "swinunetr", "framework": "torch"},
                                              tile=(48, 32, 32)))
    assert path == "training.tile" and "divide by 32 (SwinUNETR's 2^3 patches" in message
    model = {"name": "dynunet", "framework": "torch", "params": {"strides": [1, 2, [2, 2, 1], [2, 2, 1]],
                                                                 "kernel_size": [3, 3, 3, 3]}}
    [(path, message)] = problems_of(tree_with(tmp_path, model, tile=(32, 32, 4)))
    assert path == "training.tile" and "divide by 8" in message and "[8, 8, 2]" in message
    validate_spec(tree_with(tmp_path, model, tile=(32, 32, 8)))
    validate_spec(tree_with(tmp_path, {"name": "dynunet", "framework": "torch"}, tile=(40, 24, 8)))  # planned


def test_a_deepest_feature_map_of_one_voxel_is_refused_under_instance_normalization(tmp_path):
    [(path, message)] = problems_of(tree_with(tmp_path, {"name": "swinunetr", "framework": "torch"},
                                              tile=(32, 32, 32)))
    assert path == "training.tile" and "swinunetr cannot train on [32, 32, 32]" in message
    assert "instance normalization" in message and "[64, 32, 32]" in message
    model = {"name": "swinunetr", "framework": "torch", "params": {"norm_name": "batch"}}
    [(path, message)] = problems_of(tree_with(tmp_path, model, tile=(32, 32, 32)))  # a short last batch of one
    assert path == "training.tile" and "batch normalization" in message and "group normalization" in message
    model["params"] = {"norm_name": ["group", {"num_groups": 4}]}
    validate_spec(tree_with(tmp_path, model, tile=(32, 32, 32)))  # group norm: several channels per group


def test_a_curriculum_that_changes_a_fixed_input_is_refused(tmp_path):
    unetr = {"name": "unetr", "framework": "torch", "params": {"hidden_size": 48, "num_heads": 4, "mlp_dim": 96}}
    stages = [{"tile": [32, 32, 32], "epochs": 1}, {"tile": [64, 32, 32], "epochs": 1}]
    [(path, message)] = problems_of(tree_with(tmp_path, unetr, tile=None, curriculum=stages, epochs=2))
    assert path == "training.curriculum" and "unetr is built for one input size" in message
    assert "needs model.name 'unet3d', 'segresnet'" in message
    same = [{"tile": [32, 32, 32], "epochs": 1, "batch_size": 1}, {"tile": [32, 32, 32], "epochs": 1}]
    validate_spec(tree_with(tmp_path, unetr, tile=None, curriculum=same, epochs=2))  # only the batch changes
    validate_spec(tree_with(tmp_path, SEGRESNET, tile=None, curriculum=stages, epochs=2))


def test_the_network_tile_divides_every_input_of_a_curriculum(tmp_path):
    stages = [{"tile": [32, 32, 16], "epochs": 1}, {"tile": [48, 48, 16], "epochs": 1},
              {"tile": None, "epochs": 1}]
    spec = validate_spec(tree_with(tmp_path, {"name": "dynunet", "framework": "torch"}, tile=None,
                                   curriculum=stages, epochs=3))
    assert network_tile(spec) == (16, 16, 16)  # the spec's volume is 64^3
    assert network_tile(spec, (96, 80, 40)) == (16, 16, 8)
    spec = validate_spec(tree_with(tmp_path, SEGRESNET))
    assert network_tile(spec) == (64, 32, 32)


# --------------------------------------------------------------------------- parallelisms
def test_sequence_parallelism_needs_a_network_that_supports_it(tmp_path):
    tree = tree_with(tmp_path, SEGRESNET)
    tree["parallelism"] = {"sequence_parallel": {"degree": 2}}
    [(path, message)] = problems_of(tree)
    assert path == "parallelism.sequence_parallel.degree"
    assert "model 'segresnet' does not support sequence parallelism" in message and "'vit-seg'" in message
    tree["parallelism"] = {"sequence_parallel": {"degree": "auto", "memory_per_worker": "8GB"}}
    [(path, message)] = problems_of(tree)
    assert path == "parallelism.sequence_parallel.degree" and "does not support sequence parallelism" in message
    tree["parallelism"] = {}
    tree["search"]["space"] = {"parallelism.sequence_parallel.degree": {"grid": [1, 2]}}
    [(path, message)] = problems_of(tree)
    assert path == "search.space.parallelism.sequence_parallel.degree" and "value 2" in message


def test_pipeline_stages_need_a_network_that_supports_them(tmp_path):
    tree = tree_with(tmp_path, {"name": "swinunetr", "framework": "torch"}, batch_size=4)
    tree["parallelism"] = {"pipeline": {"stages": 2, "microbatches": 2}}
    [(path, message)] = problems_of(tree)
    assert path == "parallelism.pipeline.stages"
    assert "model 'swinunetr' does not support pipeline stages" in message
    assert "needs model.name 'unet3d' with model.framework 'torch'" in message


# --------------------------------------------------------------------------- searching model.name
PER_MODEL = {"segresnet": {"init_filters": 8}, "swinunetr": {"feature_size": 12, "depths": [1, 1, 1, 1]},
             "dynunet": {"filters": [8, 16, 32, 64]}}


def search_tree(tmp_path, names, *, per_model=PER_MODEL, framework="torch", **space: Any) -> dict:
    model = {"name": "unet3d", "framework": framework, "params": {"base_filters": 4, "levels": 3},
             "per_model": per_model}
    tree = tree_with(tmp_path, model)
    tree["search"]["space"] = {"model.name": {"grid": names}, **space}
    return tree


def test_model_name_is_searched_with_each_model_s_params(tmp_path):
    spec = validate_spec(search_tree(tmp_path, ["unet3d", "segresnet", "swinunetr", "dynunet", "basicunet"]))
    assert spec.model.per_model == {"segresnet": {"init_filters": 8}, "swinunetr": {"feature_size": 12,
                                                                                    "depths": (1, 1, 1, 1)},
                                    "dynunet": {"filters": (8, 16, 32, 64)}}
    swin = apply_config(spec, {"model.name": "swinunetr"})
    assert swin.model.name == "swinunetr" and swin.model.params.feature_size == 12
    assert swin.model.params.depths == (1, 1, 1, 1) and swin.model.params.num_heads == (3, 6, 12, 24)
    # the trial's per_model holds every other model's params, the spec's own model's included
    assert "swinunetr" not in swin.model.per_model and swin.model.per_model["unet3d"] == {"base_filters": 4,
                                                                                         "levels": 3}
    assert apply_config(swin, {"model.name": "unet3d"}).model == spec.model.model_copy(
        update={"per_model": {**spec.model.per_model}})
    basic = apply_config(spec, {"model.name": "basicunet"})  # no per_model entry: its defaults
    assert basic.model.params == MODELS["basicunet"].params()
    assert apply_config(spec, {"model.name": "unet3d"}).model == spec.model  # the spec's own model: unchanged
    assert apply_config(spec, {"model.name": "dynunet", "training.optimizer.lr": 0.01}).training.optimizer.lr == 0.01


def test_per_model_is_validated_at_load_time(tmp_path):
    [(path, message)] = problems_of(search_tree(tmp_path, ["unet3d"], per_model={"swinunetr": {"feature_size": 13}}))
    assert path == "model.per_model.swinunetr.feature_size" and "multiple of 12" in message
    [(path, message)] = problems_of(search_tree(tmp_path, ["unet3d"], per_model={"segresnet": {"width": 8}}))
    assert path == "model.per_model.segresnet.width" and message.startswith("segresnet takes no argument 'width'")
    [(path, message)] = problems_of(search_tree(tmp_path, ["unet3d"], per_model={"resnet": {}}))
    assert path == "model.per_model.resnet" and "no model 'resnet'; registered: unet3d, vit-seg" in message
    [(path, message)] = problems_of(search_tree(tmp_path, ["unet3d"], per_model={"unet3d": {"levels": 2}}))
    assert path == "model" and "per_model names 'unet3d', which is model.name" in message


def test_every_searched_model_is_checked_as_a_trial(tmp_path):
    # a TensorFlow spec: the torch-only networks are refused, each by name
    problems = problems_of(search_tree(tmp_path, ["unet3d", "segresnet", "dynunet"], framework="tensorflow"))
    assert [p for p, _ in problems] == ["search.space.model.name"] * 2
    assert "value 'segresnet' is invalid for model: model 'segresnet' is built in torch only" in problems[0][1]
    assert "value 'dynunet'" in problems[1][1]
    # a tile one model takes and another does not
    tree = search_tree(tmp_path, ["unet3d", "swinunetr"])
    tree["training"]["tile"] = [16, 16, 16]
    [(path, message)] = problems_of(tree)
    assert path == "search.space.model.name" and "value 'swinunetr' makes training.tile invalid" in message
    [(path, message)] = problems_of(search_tree(tmp_path, ["unet3d", "unknown"]))
    assert path == "search.space.model.name" and "no model 'unknown'" in message
    tree = search_tree(tmp_path, ["unet3d", "segresnet"])
    tree["parallelism"] = {"pipeline": {"stages": 2, "microbatches": 2}}
    [(path, message)] = problems_of(tree)
    assert path == "search.space.model.name" and "'segresnet' makes parallelism.pipeline.stages invalid" in message


def test_searched_model_names_are_checked_with_every_other_searched_value(tmp_path):
    tree = search_tree(tmp_path, ["unet3d", "swinunetr"],
                       **{"training.tile": {"grid": [[64, 32, 32], [32, 32, 32]]}})
    problems = problems_of(tree)
    assert problems == [("search.space", problems[0][1])]
    assert "the trial with model.name=swinunetr, training.tile=[32, 32, 32]: training.tile" in problems[0][1]


def test_an_argument_is_searched_with_model_name_when_every_picked_model_takes_it(tmp_path):
    per_model = {"unetr": {"hidden_size": 48, "num_heads": 4, "mlp_dim": 96}, "swinunetr": {"depths": [1, 1, 1, 1]}}
    tree = search_tree(tmp_path, ["unetr", "swinunetr"], per_model=per_model,
                       **{"model.params.feature_size": {"grid": [12, 24]}})
    spec = validate_spec(tree)
    trial = apply_config(spec, {"model.name": "unetr", "model.params.feature_size": 24})
    assert (trial.model.params.feature_size, trial.model.params.hidden_size) == (24, 48)
    # a value one picked model refuses
    tree["search"]["space"]["model.params.feature_size"] = {"grid": [12, 16]}
    [(path, message)] = problems_of(tree)
    assert path == "search.space.model.params.feature_size"
    assert "value 16 (model.name 'swinunetr') is invalid for model.params.feature_size" in message
    # an argument one picked model does not take
    tree = search_tree(tmp_path, ["unet3d", "swinunetr"], **{"model.params.feature_size": {"grid": [12, 24]}})
    [(path, message)] = problems_of(tree)
    assert path == "search.space.model.params.feature_size"
    assert "picks 'unet3d', which takes no argument 'feature_size'" in message
    # a trial config that gives a model an argument it does not take (a sampler's): apply_config says so
    with pytest.raises(SpecError) as info:
        apply_config(spec, {"model.name": "unet3d", "model.params.feature_size": 12})
    [(path, message)] = info.value.problems
    assert path == "model.params.feature_size" and message.startswith("unet3d takes no argument 'feature_size'")


def test_an_unknown_searched_argument_names_the_allowed_ones(tmp_path):
    tree = tree_with(tmp_path, SEGRESNET)
    tree["search"]["space"] = {"model.params.filters": {"grid": [4, 8]}}
    [(path, message)] = problems_of(tree)
    assert path == "search.space.model.params.filters"
    assert message.startswith("segresnet takes no argument 'filters'; allowed: init_filters")
    spec = validate_spec(tree_with(tmp_path, SEGRESNET))
    with pytest.raises(SpecError, match="segresnet takes no argument 'filters'"):
        apply_config(spec, {"model.params.filters": 4})
    assert apply_config(spec, {"model.params.init_filters": 16}).model.params.init_filters == 16
