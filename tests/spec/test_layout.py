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


# --------------------------------------------------------------------------- degree: auto
def auto_tree(spec_tree, memory, **sp):
    """A math-kernel ViT on 16^3 tiles whose patch 2 (512 tokens) and 4 (64 tokens) differ in memory."""
    tree = vit_tree(spec_tree, mode="data", workers=1, resources_per_worker={"cpu": 0.5})
    tree["model"]["params"].update(embed_dim=32, heads=4, layers=2, patch=2, attention_kernel="math")
    tree["training"]["tile"] = [16, 16, 16]
    tree["parallelism"]["sequence_parallel"] = {"degree": "auto", "memory_per_worker": memory, "max_degree": 4, **sp}
    return tree


def peaks_at_patch_2(spec_tree, **params) -> dict[int, float]:
    """The predicted per-rank peak of every degree the model allows (``params`` changed)."""
    from distmis.spec.load import network_input
    from distmis.spec.sizing import auto_sp_degree

    tree = auto_tree(spec_tree, "64GB")
    tree["model"]["params"].update(params)
    spec = validate_spec(tree)
    return auto_sp_degree(spec, network_input(spec)).peaks


def between(low: float, high: float) -> float:
    """A memory_per_worker that holds a peak of ``low`` bytes but not one of ``high``, after the 512 MiB reserve."""
    return 512 * 2**20 + (low + high) / 2


def test_auto_picks_the_smallest_degree_that_fits_and_the_trial_spec_gets_it(spec_tree):
    peaks = peaks_at_patch_2(spec_tree)
    assert peaks[1] > peaks[2] > peaks[4]  # the score matrices shrink with the degree
    spec = validate_spec(auto_tree(spec_tree, between(peaks[2], peaks[1])))
    assert spec.parallelism.sequence_parallel.degree == "auto"
    trial, layout = resolve_trial(spec, {})
    assert (layout.sp, layout.world_size, layout.distributed) == (2, 2, True)
    assert trial.parallelism.sequence_parallel.degree == 2  # the workers, the trainer and MLflow read an int
    roomy = validate_spec(auto_tree(spec_tree, "64GB"))
    assert resolve_trial(roomy, {})[1].sp == 1


def test_auto_is_decided_per_trial_and_lays_out_every_degree_it_can_choose(spec_tree):
    from distmis.search.plan import plan_search

    peaks = peaks_at_patch_2(spec_tree)
    tree = auto_tree(spec_tree, between(peaks[4], peaks[2]))
    tree["search"]["space"] = {"model.params.patch": {"grid": [4, 2]}}
    spec = validate_spec(tree)
    eight, four = (resolve_trial(spec, {"model.params.patch": p})[1] for p in (4, 2))
    assert (eight.sp, four.sp) == (1, 4)
    assert eight.distributed  # a search where some trial holds 4 ranks runs every trial as a worker group
    assert sorted(layout.world_size for layout in plan_search(spec).layouts) == [1, 4]


def test_auto_as_a_searched_value(spec_tree):
    peaks = peaks_at_patch_2(spec_tree)
    tree = auto_tree(spec_tree, between(peaks[2], peaks[1]))
    tree["search"]["space"] = {"parallelism.sequence_parallel.degree": {"grid": [4, "auto"]}}
    spec = validate_spec(tree)
    assert [resolve_trial(spec, {"parallelism.sequence_parallel.degree": d})[1].sp for d in (4, "auto")] == [4, 2]


def test_a_spec_where_no_degree_fits_is_refused_naming_tile_patch_and_memory(spec_tree):
    peaks = peaks_at_patch_2(spec_tree)
    tree = auto_tree(spec_tree, between(0, peaks[1]), max_degree=1)
    with pytest.raises(SpecError) as refused:
        validate_spec(tree)
    message = str(refused.value)
    assert "parallelism.sequence_parallel.degree: 'auto': no degree up to 1 fits tile 16x16x16 at patch 2" in message
    assert f"the smallest predicted peak is {peaks[1] / 2**30:.2f} GiB per worker at SP=1" in message
    assert f"a worker has {peaks[1] / 2 / 2**30:.2f} GiB" in message  # memory_per_worker less the 512 MiB reserve


def test_each_searched_value_and_each_combination_must_leave_a_degree_that_fits(spec_tree):
    peaks = peaks_at_patch_2(spec_tree)
    tree = auto_tree(spec_tree, between(peaks[4], peaks[2]), max_degree=2)
    tree["model"]["params"]["patch"] = 4
    tree["search"]["space"] = {"model.params.patch": {"grid": [4, 2]}}
    with pytest.raises(SpecError, match=r"search.space.model.params.patch: value 2 makes "
                                        r"parallelism.sequence_parallel.degree invalid: 'auto': no degree up to 2"):
        validate_spec(tree)
    # Each value alone fits (patch 2 at width 16, width 32 at patch 4); together they do not.
    narrow, wide = peaks_at_patch_2(spec_tree, embed_dim=16)[2], peaks[2]
    tree = auto_tree(spec_tree, between(narrow, wide), max_degree=2)
    tree["model"]["params"].update(patch=4, embed_dim=16)
    tree["search"]["space"] = {"model.params.patch": {"grid": [4, 2]}, "model.params.embed_dim": {"grid": [16, 32]}}
    with pytest.raises(SpecError) as refused:
        validate_spec(tree)
    assert str(refused.value).count("  - ") == 1
    assert "search.space: the trial with model.params.patch=2, model.params.embed_dim=32: degree 'auto'" in str(
        refused.value)


@pytest.mark.parametrize("change, match", [
    ({"model": {"name": "unet3d"}}, "needs model.name 'vit-seg'"),
    ({"sequence_parallel": {"degree": "auto"}}, "set memory_per_worker"),
    ({"sequence_parallel": {"degree": "auto", "memory_per_worker": "6XB"}}, "'6XB' is not a size"),
])
def test_auto_errors(spec_tree, change, match):
    tree = auto_tree(spec_tree, "8GB")
    if "model" in change:
        tree["model"] = {"name": "unet3d", "framework": "torch"}
    else:
        tree["parallelism"]["sequence_parallel"] = change["sequence_parallel"]
    with pytest.raises(SpecError, match=match):
        validate_spec(tree)


# --------------------------------------------------------------------------- pipeline stages
def pipeline_tree(spec_tree, stages=2, **parallelism):
    spec_tree["model"] = {"name": "unet3d", "framework": "torch",
                          "params": {"base_filters": 4, "levels": 3, "norm": "group", "norm_groups": 2}}
    spec_tree["parallelism"] = {"pipeline": {"stages": stages, "microbatches": 2}, **parallelism}
    return spec_tree


def test_a_pipelined_trial_holds_a_worker_per_stage_and_replica(spec_tree):
    layout = resolve_layout(validate_spec(pipeline_tree(spec_tree, workers_per_trial=2,
                                                        resources_per_worker={"cpu": 0.5})))
    assert (layout.dp, layout.sp, layout.pp, layout.world_size, layout.distributed) == (2, 1, 2, 4, True)
    assert layout.effective_lr == pytest.approx(2e-3)  # scaled by the replicas, not the stages
    assert layout.describe() == "4 worker(s): dp=2 x sp=1 x pp=2, 0.5 CPU each"


def test_searched_stages_make_every_trial_a_worker_group(spec_tree):
    from distmis.search.plan import trial_layouts

    tree = pipeline_tree(spec_tree, stages=1)
    tree["search"] = {"algorithm": "grid", "space": {"parallelism.pipeline.stages": {"grid": [1, 2, 4]}}}
    tree["training"]["batch_size"] = 4
    spec = validate_spec(tree)
    assert resolve_layout(spec).distributed  # even the 1-stage trials: all laid out and timed alike
    assert [(layout.pp, layout.world_size) for layout in trial_layouts(spec)] == [(1, 1), (2, 2), (4, 4)]
    _, layout = resolve_trial(spec, {"parallelism.pipeline.stages": 4})
    assert (layout.pp, layout.world_size) == (4, 4)


def test_a_layout_is_sequence_parallel_or_pipelined():
    with pytest.raises(ValueError, match="sequence-parallel \\(the ViT\\) or pipelined \\(the U-Net\\), not both"):
        TrialLayout(dp=1, sp=2, pp=2, distributed=True, cpu=1, gpu=0, lr=1e-3, lr_scaling="linear")
