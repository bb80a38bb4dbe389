from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from distmis.spec import SpecError, load_spec, parse_set_options, validate_spec
from distmis.spec.load import set_path

ROOT = Path(__file__).resolve().parents[2]


def problems_of(tree) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        validate_spec(tree, source="test.yaml")
    assert "test.yaml" in str(info.value)
    return info.value.problems


def test_good_spec_fills_defaults(spec_tree):
    spec = validate_spec(spec_tree)
    assert spec.training.optimizer.beta2 == 0.999
    assert spec.search.mode == "max"  # derived from metric val_dice
    assert spec.dataset.split.train == 0.5
    assert spec.experiment_name == "tiny"


def test_metric_min_mode_default(spec_tree):
    spec_tree["search"]["metric"] = "val_loss"
    assert validate_spec(spec_tree).search.mode == "min"


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "search_spaces").glob("*.yaml")))
def test_shipped_specs_are_valid(path):
    spec = load_spec(ROOT / path)
    assert spec.search.space


def test_paper_grid_has_32_points():
    from distmis.search.search_space import num_trials

    spec = load_spec(ROOT / "search_spaces/distmis_grid.yaml")
    assert num_trials(spec) == 32
    assert spec.dataset.crop == (240, 240, 152)


def test_unknown_key_lists_allowed_keys(spec_tree):
    spec_tree["training"]["optimizer"]["lrr"] = 1.0
    [(path, message)] = problems_of(spec_tree)
    assert path == "training.optimizer.lrr"
    assert "unknown key 'lrr'" in message and "lr" in message and "amsgrad" in message


def test_unknown_top_level_section(spec_tree):
    spec_tree["trainig"] = {}
    [(path, message)] = problems_of(spec_tree)
    assert path == "trainig" and "dataset" in message


def test_bad_enum_names_value_and_allowed(spec_tree):
    spec_tree["dataset"]["layout"] = "nifti"
    [(path, message)] = problems_of(spec_tree)
    assert path == "dataset.layout"
    assert "'msd'" in message and "'nnunet'" in message and "'brats'" in message and "'brats2023'" in message
    assert "nifti" in message


@pytest.mark.parametrize("layout", ["msd", "nnunet", "brats", "brats2023"])
def test_every_data_layout_is_a_dataset_layout(spec_tree, layout):
    spec_tree["dataset"]["layout"] = layout
    assert validate_spec(spec_tree).dataset.layout == layout


def test_dataset_layouts_are_the_data_layouts():
    from typing import get_args

    from distmis.data.layouts import Layout
    from distmis.spec.schema import DatasetSpec

    assert get_args(DatasetSpec.model_fields["layout"].annotation) == tuple(m.value for m in Layout)


def test_out_of_range_number(spec_tree):
    spec_tree["training"]["optimizer"]["beta2"] = 1.5
    [(path, message)] = problems_of(spec_tree)
    assert path == "training.optimizer.beta2" and "1.5" in message


def test_missing_required(spec_tree):
    del spec_tree["dataset"]["path"]
    [(path, message)] = problems_of(spec_tree)
    assert path == "dataset.path" and "missing" in message


def test_split_must_sum_to_one(spec_tree):
    spec_tree["dataset"]["split"] = {"train": 0.5, "val": 0.4, "test": 0.4}
    [(path, message)] = problems_of(spec_tree)
    assert path == "dataset.split" and "must be 1" in message


def test_bad_name(spec_tree):
    spec_tree["name"] = "my search/../x"
    [(path, _)] = problems_of(spec_tree)
    assert path == "name"


def test_several_problems_reported_together(spec_tree):
    spec_tree["training"]["epochs"] = 0
    spec_tree["model"]["params"]["norm"] = "layer"
    paths = {p for p, _ in problems_of(spec_tree)}
    assert paths == {"training.epochs", "model.params.norm"}


def test_group_norm_groups_must_divide_filters(spec_tree):
    spec_tree["model"]["params"].update(norm="group", norm_groups=3)
    [(path, message)] = problems_of(spec_tree)
    assert path == "model.params" and "norm_groups" in message


def test_volume_not_divisible_by_pooling(spec_tree):
    spec_tree["dataset"]["crop"] = [30, 32, 32]
    [(path, message)] = problems_of(spec_tree)
    assert path == "dataset.crop" and "divide by 4" in message


def test_a_nonzero_crop_needs_a_common_shape(spec_tree):
    spec_tree["dataset"].pop("crop", None)
    spec_tree["dataset"]["crop_to_nonzero"] = True
    [(path, message)] = problems_of(spec_tree)
    assert path == "dataset" and "crop_to_nonzero needs crop" in message
    spec_tree["dataset"]["crop"] = [32, 32, 32]
    assert validate_spec(spec_tree).dataset.crop_to_nonzero is True


def test_tile_larger_than_volume(spec_tree):
    spec_tree["training"]["tile"] = [32, 32, 32]
    [(path, message)] = problems_of(spec_tree)
    assert path == "training.tile" and "larger" in message


def test_search_path_must_exist(spec_tree):
    spec_tree["search"]["space"] = {"training.optimiser.lr": {"grid": [0.1]}}
    [(path, message)] = problems_of(spec_tree)
    assert path == "search.space.training.optimiser.lr" and "no field 'training.optimiser'" in message


def test_search_value_validated_before_start(spec_tree):
    spec_tree["search"]["space"] = {"model.params.norm": {"grid": ["batch", "instance"]}}
    [(path, message)] = problems_of(spec_tree)
    assert path == "search.space.model.params.norm" and "'instance'" in message


def test_searched_schedules_are_checked_against_the_epochs(spec_tree):
    spec_tree["training"]["epochs"] = 2
    spec_tree["search"]["space"] = {"training.lr_schedule.name": {"grid": ["constant", "cosine", "cyclic", "poly"]},
                                    "training.lr_schedule.warmup_epochs": {"grid": [0, 1, 2]}}
    [(path, message)] = problems_of(spec_tree)
    assert path == "search.space.training.lr_schedule.warmup_epochs"
    assert "value 2" in message and "must be fewer than training.epochs (2)" in message


def test_search_range_ends_validated(spec_tree):
    spec_tree["search"] = {"algorithm": "random", "space": {"training.optimizer.beta2": {"uniform": [0.9, 1.2]}}}
    [(path, message)] = problems_of(spec_tree)
    assert path == "search.space.training.optimizer.beta2" and "1.2" in message


def test_real_valued_range_over_an_integer_field_is_refused(spec_tree):
    spec_tree["search"] = {"algorithm": "random", "space": {"model.params.base_filters": {"uniform": [4, 8]},
                                                            "training.batch_size": {"loguniform": [1, 4]},
                                                            "training.optimizer.lr": {"uniform": [1e-4, 1e-2]}}}
    problems = dict(problems_of(spec_tree))
    assert set(problems) == {"search.space.model.params.base_filters", "search.space.training.batch_size"}
    assert "use randint: [4, 8]" in problems["search.space.model.params.base_filters"]
    assert "'loguniform' samples real numbers" in problems["search.space.training.batch_size"]


def test_every_integer_of_a_randint_range_is_checked(spec_tree):
    spec_tree["model"] = {"name": "vit-seg", "framework": "torch",
                          "params": {"layers": 1, "embed_dim": 16, "heads": 4, "patch": 4, "decoder_features": 8}}
    spec_tree["training"]["tile"] = [16, 16, 16]
    spec_tree["search"] = {"algorithm": "random", "space": {"model.params.patch": {"randint": [2, 8]}}}
    problems = problems_of(spec_tree)
    # 2, 4 and 8 are powers of two; 3, 5, 6 and 7 between the valid ends are not.
    assert [message.split()[1] for _, message in problems] == ["3", "5", "6", "7"]
    spec_tree["search"]["space"] = {"model.params.patch": {"choice": [2, 4, 8]}}
    validate_spec(spec_tree)


def test_dataset_is_not_searchable(spec_tree):
    spec_tree["search"]["space"] = {"dataset.crop": {"grid": [[16, 16, 16]]}}
    [(path, message)] = problems_of(spec_tree)
    assert path == "search.space.dataset.crop" and "model, training" in message


@pytest.mark.parametrize(
    "domain, fragment",
    [
        ({"grid": []}, "at least one value"),
        ({"uniform": [2, 1]}, "low < high"),
        ({"loguniform": [0, 1]}, "low > 0"),
        ({"grid": [1], "choice": [2]}, "exactly one"),
        ({"normal": [0, 1]}, "unknown key 'normal'"),
    ],
)
def test_bad_domains(spec_tree, domain, fragment):
    spec_tree["search"] = {"algorithm": "random", "space": {"training.optimizer.lr": domain}}
    problems = problems_of(spec_tree)
    assert any(fragment in message for _, message in problems), problems


def test_algorithm_domain_compatibility(spec_tree):
    tree = copy.deepcopy(spec_tree)
    tree["search"] = {"algorithm": "optuna", "space": {"training.optimizer.lr": {"grid": [0.1]}}}
    assert "choice" in problems_of(tree)[0][1]
    tree["search"] = {"algorithm": "grid", "space": {"training.optimizer.lr": {"loguniform": [1e-4, 1e-2]}}}
    assert "only 'grid'" in problems_of(tree)[0][1]


def test_load_from_file_with_overrides(tmp_path, spec_tree):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_tree))
    spec = load_spec(path, parse_set_options(["training.epochs=7", "model.params.norm=group", "training.tile=[8,8,8]"]))
    assert spec.training.epochs == 7 and spec.model.params.norm == "group" and spec.training.tile == (8, 8, 8)
    with pytest.raises(SpecError, match="training.epochs"):
        load_spec(path, {"training.epochs": "many"})


def test_yaml_is_loaded_safely(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("name: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(path)


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(SpecError, match="file not found"):
        load_spec(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(SpecError, match="mapping"):
        load_spec(tmp_path / "list.yaml")


def test_bad_set_option():
    with pytest.raises(SpecError, match="dotted.key=value"):
        parse_set_options(["training.epochs"])


def test_dotted_paths():
    tree: dict = {"a": {"b": 1}}
    set_path(tree, "a.x.c", 3)
    assert tree == {"a": {"b": 1, "x": {"c": 3}}}


# --------------------------------------------------------------------------- vit-seg and sequence parallelism
def vit_tree(spec_tree, **sequence_parallel):
    spec_tree["model"] = {"name": "vit-seg", "framework": "torch",
                          "params": {"layers": 2, "embed_dim": 32, "heads": 4, "patch": 4, "decoder_features": 16}}
    spec_tree["training"]["tile"] = [16, 16, 16]
    spec_tree["parallelism"] = {"sequence_parallel": sequence_parallel}
    return spec_tree


def test_vit_seg_params_and_sequence_parallel_defaults(spec_tree):
    spec = validate_spec(vit_tree(spec_tree, degree=2))
    assert spec.model.params.heads == 4 and spec.model.params.pos_embedding == "learned"
    sp = spec.parallelism.sequence_parallel
    assert (sp.degree, sp.attention, sp.decoder, sp.split) == (2, "allgather-kv", "gather", "ordered")
    assert spec.model.input_multiple == 4
    # A U-Net's params are U-Net params: the ViT's fields are unknown keys there, and the other way round.
    spec_tree["model"] = {"name": "unet3d", "params": {"heads": 4}}
    assert problems_of(spec_tree)[0][0] == "model.params.heads"


@pytest.mark.parametrize("change, path, fragment", [
    ({"params": {"embed_dim": 30}}, "model.params", "heads (4) must divide embed_dim (30)"),
    ({"params": {"patch": 6}}, "model.params", "power of two"),
    ({"framework": "tensorflow"}, "model", "set framework: torch"),
])
def test_bad_vit_seg_models(spec_tree, change, path, fragment):
    tree = vit_tree(spec_tree)
    for key, value in change.items():
        tree["model"][key] = {**tree["model"][key], **value} if isinstance(value, dict) else value
    [(where, message)] = problems_of(tree)
    assert where == path and fragment in message


def test_vit_tile_must_divide_by_the_patch(spec_tree):
    tree = vit_tree(spec_tree)
    tree["training"]["tile"] = [16, 16, 14]
    [(path, message)] = problems_of(tree)
    assert path == "training.tile" and "divide by 4 (the patch size, model.params.patch=4)" in message


@pytest.mark.parametrize("sequence_parallel, fragment", [
    ({"degree": 3}, "64 tokens (patch grid (4, 4, 4)) must be divisible by the sequence-parallel degree 3"),
    ({"degree": 8, "attention": "ulysses"}, "heads (4) divisible by the sequence-parallel degree (8)"),
    ({"degree": 3, "split": "spatial"}, "supports sequence-parallel degrees (1, 2, 4, 8)"),
])
def test_bad_sequence_parallel_layouts(spec_tree, sequence_parallel, fragment):
    [(path, message)] = problems_of(vit_tree(spec_tree, **sequence_parallel))
    assert path == "parallelism.sequence_parallel" and fragment in message


def test_no_gather_needs_box_chunks(spec_tree):
    tree = vit_tree(spec_tree, degree=4, decoder="no-gather", split="ordered")
    tree["training"]["tile"] = [16, 8, 8]  # a 4 x 2 x 2 patch grid: ordered quarters are single rows, boxes
    validate_spec(tree)
    tree["training"]["tile"] = [8, 12, 8]  # 2 x 3 x 2: a quarter of the order is 3 tokens, not a box
    [(path, message)] = problems_of(tree)
    assert path == "parallelism.sequence_parallel" and "decoder 'no-gather' needs every rank's tokens" in message
    assert validate_spec(vit_tree(spec_tree, degree=4, decoder="no-gather", split="spatial"))


def test_sequence_parallelism_needs_the_vit(spec_tree):
    spec_tree["parallelism"] = {"sequence_parallel": {"degree": 2}}
    [(path, message)] = problems_of(spec_tree)
    assert path == "parallelism.sequence_parallel.degree" and "needs model.name 'vit-seg'" in message


def test_sequence_parallel_degree_is_searchable_and_every_value_checked(spec_tree):
    tree = vit_tree(spec_tree)
    tree["search"] = {"algorithm": "grid", "space": {"parallelism.sequence_parallel.degree": {"grid": [1, 2]},
                                                     "model.params.patch": {"grid": [4, 8]}}}
    validate_spec(tree)
    tree["search"]["space"]["parallelism.sequence_parallel.degree"] = {"grid": [1, 2, 3]}
    [(path, message)] = problems_of(tree)
    assert path == "search.space.parallelism.sequence_parallel.degree" and "value 3" in message
    tree["search"]["space"] = {"parallelism.workers": {"grid": [1, 2]}}  # the rest of parallelism is not
    assert problems_of(tree)[0][0] == "search.space.parallelism.workers"


# --------------------------------------------------------------------------- axial attention and DSP
def axial_tree(spec_tree, tile=(16, 8, 16), **sequence_parallel):
    tree = vit_tree(spec_tree, **sequence_parallel)
    tree["model"]["params"]["attention"] = "axial"
    tree["training"]["tile"] = list(tile)
    return tree


def test_dsp_on_an_axial_model_and_its_search(spec_tree):
    spec = validate_spec(axial_tree(spec_tree, degree=4, attention="dsp"))  # grid (4, 2, 4): H and D divide by 4
    assert spec.model.params.attention == "axial" and spec.parallelism.sequence_parallel.attention == "dsp"
    tree = axial_tree(spec_tree, degree=2)
    tree["search"] = {"algorithm": "grid", "space": {
        "parallelism.sequence_parallel.attention": {"grid": ["ulysses", "dsp", "allgather-kv"]},
        "parallelism.sequence_parallel.degree": {"grid": [1, 2, 4]}}}
    validate_spec(tree)


def test_dsp_with_full_attention_is_refused_with_the_reason(spec_tree):
    [(path, message)] = problems_of(vit_tree(spec_tree, degree=2, attention="dsp"))
    assert path == "parallelism.sequence_parallel.attention"
    assert "needs model.name 'vit-seg' with model.params.attention 'axial', not model.params.attention 'full'" in message
    assert "full attention attends along every axis at once" in message
    # at degree 1 too (a searched degree would meet it), and on a U-Net
    assert problems_of(vit_tree(spec_tree, attention="dsp"))[0][0] == "parallelism.sequence_parallel.attention"
    spec_tree["model"] = {"name": "unet3d", "params": {"base_filters": 4, "levels": 3}}
    spec_tree["parallelism"] = {"sequence_parallel": {"attention": "dsp"}}
    [(path, message)] = problems_of(spec_tree)
    assert path == "parallelism.sequence_parallel.attention" and "not model.name 'unet3d'" in message
    # a searched model attention meets the same rule, value by value
    tree = axial_tree(spec_tree, degree=2, attention="dsp")
    tree["search"] = {"algorithm": "grid", "space": {"model.params.attention": {"grid": ["axial", "full"]}}}
    [(path, message)] = problems_of(tree)
    assert path == "search.space.model.params.attention" and "value 'full'" in message


def test_dsp_needs_two_grid_axes_that_divide_by_the_degree(spec_tree):
    [(path, message)] = problems_of(axial_tree(spec_tree, tile=(16, 8, 8), degree=4, attention="dsp"))
    assert path == "parallelism.sequence_parallel"
    assert ("at least two of its axes must divide by the sequence-parallel degree 4 (H=4, W=2, D=2)" in message
            and "token grid [4, 2, 2]" in message and "tile [16, 8, 8]" in message)
    tree = axial_tree(spec_tree, tile=(16, 8, 8), degree=2, attention="dsp")
    tree["search"] = {"algorithm": "grid", "space": {"parallelism.sequence_parallel.degree": {"grid": [2, 4]}}}
    [(path, message)] = problems_of(tree)
    assert path == "search.space.parallelism.sequence_parallel.degree" and "value 4" in message


def test_axial_baselines_need_box_chunks(spec_tree):
    validate_spec(axial_tree(spec_tree, degree=4, attention="ulysses"))  # ordered quarters of (4, 2, 4): H planes
    [(path, message)] = problems_of(axial_tree(spec_tree, tile=(8, 12, 8), degree=4))  # (2, 3, 2): 3-token chunks
    assert path == "parallelism.sequence_parallel" and "axial attention attends along the lines" in message
    validate_spec(axial_tree(spec_tree, tile=(8, 12, 8), degree=2, split="spatial"))


# --------------------------------------------------------------------------- pipeline parallelism (LAMP)
def pipeline_tree(spec_tree, *, levels: int = 3, batch_size: int = 4, **pipeline) -> dict:
    tree = copy.deepcopy(spec_tree)
    tree["model"] = {"name": "unet3d", "framework": "torch",
                     "params": {"base_filters": 4, "levels": levels, "norm": "group", "norm_groups": 2}}
    tree["training"]["batch_size"] = batch_size
    tree["parallelism"] = {"pipeline": {"stages": 2, "microbatches": 2, **pipeline}}
    return tree


def test_a_pipeline_spec_and_its_search(spec_tree):
    spec = validate_spec(pipeline_tree(spec_tree, stages=5, schedule="1f1b", microbatches=8, batch_size=8))
    assert (spec.parallelism.pipeline.stages, spec.parallelism.pipeline.schedule) == (5, "1f1b")
    assert validate_spec(spec_tree).parallelism.pipeline.stages == 1  # the default: no pipeline
    tree = pipeline_tree(spec_tree)
    tree["search"] = {"algorithm": "grid", "space": {"parallelism.pipeline.stages": {"grid": [1, 2, 4]},
                                                     "parallelism.pipeline.microbatches": {"grid": [1, 2, 4]},
                                                     "model.params.base_filters": {"grid": [4, 8]}}}
    validate_spec(tree)


def test_a_pipeline_needs_the_torch_unet(spec_tree):
    tree = pipeline_tree(spec_tree)
    tree["model"]["framework"] = "tensorflow"
    [(path, message)] = problems_of(tree)
    assert path == "parallelism.pipeline.stages"
    assert "needs model.name 'unet3d' with model.framework 'torch', not 'unet3d' (tensorflow)" in message
    tree["model"] = {"name": "vit-seg", "framework": "torch", "params": {"patch": 4, "heads": 2, "embed_dim": 16}}
    [(path, message)] = problems_of(tree)
    assert path == "parallelism.pipeline.stages" and "not 'vit-seg' (torch)" in message


def test_a_pipeline_has_no_more_stages_than_cells(spec_tree):
    [(path, message)] = problems_of(pipeline_tree(spec_tree, levels=2, stages=4, microbatches=4))
    assert path == "parallelism.pipeline.stages"
    assert "a U-Net of 2 levels (model.params.levels) is a sequence of 3 cells" in message
    assert "cannot be cut into 4 stages" in message


def test_micro_batches_divide_the_batch_and_1f1b_needs_one_per_stage(spec_tree):
    [(path, message)] = problems_of(pipeline_tree(spec_tree, microbatches=3))
    assert path == "parallelism.pipeline.microbatches" and "batch_size 4 must divide into 3 equal" in message
    [(path, message)] = problems_of(pipeline_tree(spec_tree, stages=4, microbatches=2, schedule="1f1b"))
    assert path == "parallelism.pipeline.microbatches" and "2 for 4 stages" in message
    validate_spec(pipeline_tree(spec_tree, stages=1, microbatches=3))  # no pipeline: micro-batches unused


def test_searched_pipeline_values_are_checked_alone_and_together(spec_tree):
    tree = pipeline_tree(spec_tree)
    tree["search"] = {"algorithm": "grid", "space": {"parallelism.pipeline.microbatches": {"grid": [2, 3]}}}
    [(path, message)] = problems_of(tree)
    assert path == "search.space.parallelism.pipeline.microbatches" and "value 3" in message
    # each value alone is valid with the spec's stages (1) and batch (4); 4 stages with 2 micro-batches is not
    tree = pipeline_tree(spec_tree, stages=1, microbatches=4, schedule="1f1b")
    tree["search"] = {"algorithm": "grid", "space": {"parallelism.pipeline.stages": {"grid": [1, 4]},
                                                     "parallelism.pipeline.microbatches": {"grid": [2, 4]}}}
    [(path, message)] = problems_of(tree)
    assert path == "search.space"
    assert ("the trial with parallelism.pipeline.stages=4, parallelism.pipeline.microbatches=2" in message
            and "needs at least one micro-batch per stage" in message)


def test_a_pipeline_is_not_compared(spec_tree):
    tree = pipeline_tree(spec_tree)
    tree["parallelism"].update(mode="compare", workers=[2])
    [(path, message)] = problems_of(tree)
    assert path == "parallelism.pipeline.stages" and "mode 'compare' runs trials of one worker" in message


# --------------------------------------------------------------------------- parallelism.mode: auto
def test_auto_mode_takes_one_pool_of_workers(spec_tree):
    spec_tree["parallelism"] = {"mode": "auto", "workers": 4, "resources_per_worker": {"cpu": 1}}
    assert validate_spec(spec_tree).parallelism.worker_counts == [4]
    spec_tree["parallelism"]["workers"] = [2, 4]
    [(path, message)] = problems_of(spec_tree)
    assert path == "parallelism" and "mode 'auto' takes one worker count, got [2, 4]" in message


def test_auto_mode_refuses_a_trial_split_over_ranks_by_name(spec_tree):
    tree = pipeline_tree(spec_tree)
    tree["parallelism"].update(mode="auto", workers=2)
    [(path, message)] = problems_of(tree)
    assert path == "parallelism.pipeline.stages" and "mode 'auto' sizes each trial by data-parallel replicas" in message
    assert "stages 2" in message and "use mode 'experiment' or 'data'" in message
    tree = vit_tree(spec_tree, degree=1)
    tree["parallelism"].update(mode="auto", workers=2)
    tree["search"]["space"] = {"parallelism.sequence_parallel.degree": {"grid": [1, 2]}}
    [(path, message)] = problems_of(tree)
    assert path == "parallelism.sequence_parallel.degree" and "searched over [1, 2]" in message
