"""A trial's spec and layout: the trial config applied once, the layout resolved once (pure, no Ray)."""

from __future__ import annotations

import pytest

from distmis.spec import SpecError, apply_config, resolve_layout, resolve_trial, validate_spec
from distmis.spec.layout import TrialLayout


def vit_tree(spec_tree, degree=1, **parallelism):
    spec_tree["model"] = {"name": "vit-seg", "framework": "torch",
                          "params": {"layers": 1, "embed_dim": 16, "heads": 4, "patch": 4, "decoder_features": 8}}
    spec_tree["training"]["tile"] = [8, 8, 8]
    spec_tree["parallelism"] = {"sequence_parallel": {"degree": degree}, **parallelism}
    return spec_tree


# --------------------------------------------------------------------------- apply_config
def test_apply_config_sets_typed_values_and_leaves_the_search_spec_alone(spec_tree):
    spec = validate_spec(spec_tree)
    trial = apply_config(spec, {"training.optimizer.lr": "5e-3", "model.params.norm": "group"})
    assert trial.training.optimizer.lr == 5e-3 and isinstance(trial.training.optimizer.lr, float)
    assert trial.model.params.norm == "group"
    assert spec.training.optimizer.lr == 1e-3 and spec.model.params.norm == "batch"
    assert apply_config(spec, {}) is spec


def test_apply_config_validates_a_section_as_a_whole(spec_tree):
    spec = validate_spec(spec_tree)
    # base_filters 6 with norm_groups 3 is valid only together; set one at a time, the first would fail.
    trial = apply_config(spec, {"model.params.norm": "group", "model.params.norm_groups": 3,
                                "model.params.base_filters": 6})
    assert (trial.model.params.base_filters, trial.model.params.norm_groups) == (6, 3)
    with pytest.raises(SpecError, match=r"model.params: norm_groups \(4\) must divide base_filters \(6\)"):
        apply_config(spec, {"model.params.norm": "group", "model.params.base_filters": 6})


def test_apply_config_names_the_bad_path(spec_tree):
    spec = validate_spec(spec_tree)
    with pytest.raises(SpecError, match=r"training.optimizer.lr: .*greater than 0"):
        apply_config(spec, {"training.optimizer.lr": -1.0})
    with pytest.raises(SpecError, match=r"no field 'training.optimiser'"):
        apply_config(spec, {"training.optimiser.lr": 1.0})


# --------------------------------------------------------------------------- resolve_layout
def test_experiment_trial_is_one_process_at_the_spec_lr(spec_tree):
    spec_tree["parallelism"] = {"resources_per_trial": {"cpu": 2, "gpu": 1}}
    layout = resolve_layout(validate_spec(spec_tree))
    assert (layout.dp, layout.sp, layout.pp, layout.world_size, layout.distributed) == (1, 1, 1, 1, False)
    assert (layout.cpu, layout.gpu, layout.effective_lr) == (2, 1, 1e-3)


@pytest.mark.parametrize("scaling, lr", [("linear", 4e-3), ("none", 1e-3)])
def test_data_parallel_trial_scales_the_lr_with_the_replicas(spec_tree, scaling, lr):
    spec_tree["parallelism"] = {"mode": "data", "workers": 4, "lr_scaling": scaling,
                                "resources_per_worker": {"cpu": 0.5}}
    layout = resolve_layout(validate_spec(spec_tree))
    assert (layout.dp, layout.world_size, layout.distributed, layout.cpu) == (4, 4, True, 0.5)
    assert layout.effective_lr == pytest.approx(lr)


def test_sequence_parallel_ranks_share_a_sample_so_they_do_not_scale_the_lr(spec_tree):
    spec = validate_spec(vit_tree(spec_tree, degree=2, mode="data", workers=2))
    layout = resolve_layout(spec)
    assert (layout.dp, layout.sp, layout.world_size) == (2, 2, 4)
    assert layout.effective_lr == pytest.approx(2e-3)


def test_a_searched_degree_makes_every_trial_a_worker_group(spec_tree):
    tree = vit_tree(spec_tree)
    tree["search"]["space"] = {"parallelism.sequence_parallel.degree": {"grid": [1, 2]}}
    spec = validate_spec(tree)
    one, two = (resolve_trial(spec, {"parallelism.sequence_parallel.degree": d})[1] for d in (1, 2))
    assert (one.world_size, one.distributed, two.world_size, two.distributed) == (1, True, 2, True)
    assert one.effective_lr == two.effective_lr == 1e-3


def test_hybrid_trials(spec_tree):
    spec_tree["parallelism"] = {"workers_per_trial": 3, "resources_per_worker": {"cpu": 1, "gpu": 1}}
    layout = resolve_layout(validate_spec(spec_tree))
    assert (layout.dp, layout.world_size, layout.distributed, layout.gpu) == (3, 3, True, 1)
    assert layout.worker_resources == {"CPU": 1, "GPU": 1}


def test_compare_has_no_single_layout(spec_tree):
    spec_tree["parallelism"] = {"mode": "compare", "workers": [2]}
    with pytest.raises(ValueError, match="comparison"):
        resolve_layout(validate_spec(spec_tree))


def test_layout_refuses_an_impossible_shape():
    with pytest.raises(ValueError, match="Ray Train worker group"):
        TrialLayout(dp=2, sp=1, pp=1, distributed=False, cpu=1, gpu=0, lr=1e-3, lr_scaling="linear")
    with pytest.raises(ValueError, match="sp must be a positive int"):
        TrialLayout(dp=1, sp=0, pp=1, distributed=True, cpu=1, gpu=0, lr=1e-3, lr_scaling="linear")
