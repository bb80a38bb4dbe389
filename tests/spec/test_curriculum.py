"""training.curriculum: its schema, its stages, and the checks of each stage as a spec of its own."""

from __future__ import annotations

import copy

import pytest

from distmis.search.input_fit import tiles_to_check
from distmis.spec import SpecError, validate_spec
from distmis.spec.curriculum import inference_window, stage_at, training_stages
from distmis.spec.load import stage_spec


def curriculum_tree(spec_tree, stages=None, **training) -> dict:
    tree = copy.deepcopy(spec_tree)  # 16^3 volumes, a U-Net of 3 levels: inputs divide by 4
    tree["training"].pop("epochs")
    tree["training"]["curriculum"] = stages if stages is not None else [
        {"tile": [8, 8, 8], "epochs": 2, "batch_size": 4, "tile_sampling": 1.0},
        {"tile": [12, 12, 8], "epochs": 1},
        {"tile": None, "epochs": 3, "batch_size": 1},
    ]
    tree["training"].update(training)
    return tree


def problems_of(tree) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        validate_spec(tree)
    return info.value.problems


def test_the_stages_of_a_curriculum(spec_tree):
    training = validate_spec(curriculum_tree(spec_tree, tile_sampling=0.25)).training
    assert training.epochs == 6  # the stages' sum, when training.epochs is left out
    stages = training_stages(training)
    assert [(s.number, s.tile, s.batch_size, s.tile_sampling, s.first_epoch, s.last_epoch) for s in stages] == [
        (1, (8, 8, 8), 4, 1.0, 1, 2),
        (2, (12, 12, 8), 2, 0.25, 3, 3),  # batch and sampling from training
        (3, None, 1, 0.0, 4, 6),  # whole volumes: nothing to centre
    ]
    assert [stage_at(training, e).number for e in range(0, 8)] == [1, 1, 1, 2, 3, 3, 3, 3]
    assert inference_window(training) is None  # validated and used on the whole volume, as it ends


def test_a_spec_without_a_curriculum_is_one_stage(spec_tree):
    spec_tree["training"].update(tile=[8, 8, 8], epochs=3, tile_sampling=0.5)
    training = validate_spec(spec_tree).training
    [stage] = training_stages(training)
    assert (stage.tile, stage.batch_size, stage.tile_sampling, stage.first_epoch, stage.last_epoch) == (
        (8, 8, 8), 2, 0.5, 1, 3)
    assert inference_window(training) == (8, 8, 8)


def test_a_stage_as_a_spec_of_its_own(spec_tree):
    spec = validate_spec(curriculum_tree(spec_tree))
    first = stage_spec(spec, training_stages(spec.training)[0])
    assert first.training.curriculum is None and first.training.epochs == 6  # the schedule spans every stage
    assert (first.training.tile, first.training.batch_size, first.training.tile_sampling) == ((8, 8, 8), 4, 1.0)


def test_the_epochs_must_agree_with_the_stages(spec_tree):
    [(path, message)] = problems_of(curriculum_tree(spec_tree, epochs=5))
    assert path == "training" and "the curriculum's stages train 6 epochs, but training.epochs is 5" in message


def test_a_curriculum_gives_the_tiles(spec_tree):
    [(path, message)] = problems_of(curriculum_tree(spec_tree, tile=[8, 8, 8]))
    assert path == "training" and "with a curriculum each stage gives its tile; leave training.tile out" in message
    [(path, message)] = problems_of(curriculum_tree(spec_tree, stages=[]))
    assert "at least one stage" in message


def test_a_whole_volume_stage_centres_nothing(spec_tree):
    [(path, message)] = problems_of(curriculum_tree(spec_tree, stages=[{"tile": None, "epochs": 1, "tile_sampling": 0.5}]))
    assert path == "training.curriculum.0" and "tile_sampling (0.5) needs a tile" in message


def test_every_stage_is_checked_as_a_spec(spec_tree):
    stages = [{"tile": [8, 8, 6], "epochs": 1}, {"tile": [32, 16, 16], "epochs": 1}, {"tile": None, "epochs": 1}]
    problems = problems_of(curriculum_tree(spec_tree, stages=stages))
    assert [p for p, _ in problems] == ["training.curriculum[0]", "training.curriculum[1]"]
    assert "training.tile: every dimension must divide by 4" in problems[0][1] and "[8, 8, 6]" in problems[0][1]
    assert "[32, 16, 16] is larger than the preprocessed volume [16, 16, 16]" in problems[1][1]
    # rules of the training section, for each stage's tile: a rotation needs two equal sides
    stages = [{"tile": [4, 8, 12], "epochs": 1}, {"tile": None, "epochs": 1}]
    [(path, message)] = problems_of(curriculum_tree(spec_tree, stages=stages,
                                                    augment={"enabled": True, "rotate90": 0.5}))
    assert path == "training.curriculum[0]" and "rotate90" in message and "[4, 8, 12]" in message


def test_a_curriculum_needs_a_unet(spec_tree):
    tree = curriculum_tree(spec_tree)
    tree["model"] = {"name": "vit-seg", "framework": "torch", "params": {"patch": 4, "heads": 2, "embed_dim": 16}}
    [(path, message)] = problems_of(tree)
    assert path == "training.curriculum" and "needs model.name 'unet3d'" in message


def test_pipeline_micro_batches_divide_every_stages_batch(spec_tree):
    tree = curriculum_tree(spec_tree, stages=[{"tile": [8, 8, 8], "epochs": 1, "batch_size": 4},
                                              {"tile": None, "epochs": 1, "batch_size": 1}])
    tree["model"] = {"name": "unet3d", "framework": "torch", "params": {"base_filters": 4, "levels": 3}}
    tree["parallelism"] = {"pipeline": {"stages": 2, "microbatches": 2}}
    [(path, message)] = problems_of(tree)
    assert path == "parallelism.pipeline.microbatches"
    assert "training.curriculum[1].batch_size 1 must divide into 2" in message


def test_the_stage_tiles_are_checked_against_the_data(spec_tree):
    spec = validate_spec(curriculum_tree(spec_tree))
    assert [(field, tile) for field, _, tile in tiles_to_check(spec)] == [
        ("training.curriculum[0].tile", (8, 8, 8)), ("training.curriculum[1].tile", (12, 12, 8))]
