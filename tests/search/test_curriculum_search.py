"""Searches whose trials train on a curriculum (small positive tiles, larger tiles, the whole volume), end to end
through ``distmis run``: every epoch's stage and tile in MLflow, and a model that works on the whole volume. A
pipelined torch search on a curriculum: tests/search/test_layout_in_workers.py (its pipelined trials)."""

from __future__ import annotations

from pathlib import Path

import pytest

from distmis.predict.model import SegmentationModel
from tests.conftest import small_spec_tree
from tests.search.test_sequence_parallel_search import curve, run_spec, trial_runs

pytestmark = pytest.mark.slow

CURRICULUM = [
    {"tile": [8, 8, 8], "epochs": 1, "batch_size": 2, "tile_sampling": 1.0},
    {"tile": [12, 12, 8], "epochs": 1, "batch_size": 2, "tile_sampling": 0.5},
    {"tile": None, "epochs": 1, "batch_size": 2},
]


def curriculum_tree(data: Path, framework: str, name: str) -> dict:
    tree = small_spec_tree(data, model={"name": "unet3d", "framework": framework,
                                        "params": {"base_filters": 4, "levels": 3, "norm": "group", "norm_groups": 2}})
    tree["name"] = name
    tree["dataset"]["synthetic"]["cases"] = 8
    tree["training"].pop("epochs")
    tree["training"]["curriculum"] = CURRICULUM
    return tree


def check_curricula(client, runs, tmp_path: Path) -> None:
    trials = trial_runs(runs)
    assert len(trials) == 2
    for run in trials:
        assert run.info.status == "FINISHED"
        assert curve(client, run, "curriculum_stage") == [1, 2, 3]
        tiles = [curve(client, run, f"tile_{axis}") for axis in "hwd"]
        assert [tuple(t) for t in zip(*tiles)] == [(8, 8, 8), (12, 12, 8), (16, 16, 16)]
        assert len(curve(client, run, "val_dice")) == 3
    # the registered model is applied as it was trained last: to the whole volume
    assert SegmentationModel.load(tmp_path / "out" / "model").recipe.window == (16, 16, 16)


def test_a_data_parallel_tensorflow_curriculum_search(ray_local, tmp_path: Path, capsys):
    """Two TensorFlow workers per trial (MultiWorkerMirroredStrategy on the search's kept worker group): each
    stage's input pipeline is sharded over them and its step traced for it; the second trial restarts the
    group's trainer from the first stage again. (A one-process TensorFlow trainer on a curriculum:
    tests/train/test_curriculum.py; a one-process trial's path through a search is every other TensorFlow search's.)"""
    tree = curriculum_tree(tmp_path / "data", "tensorflow", "tiny-tf-dp-curriculum")
    tree["parallelism"] = {"mode": "data", "workers": 2, "resources_per_worker": {"cpu": 1}}
    client, runs = run_spec(tree, tmp_path, capsys)
    check_curricula(client, runs, tmp_path)
    for run in trial_runs(runs):
        assert run.data.params["trial.workers"] == "2"
