"""A bf16 torch search through ``distmis run`` (issue 37's acceptance): the U-Net and the ViT-seg, each in fp32 and in
bf16, searched in one grid of 2-epoch trials on 32^3 synthetic cases. Every trial finishes with finite losses, logs
its precision, and bf16's validation dice is within 0.05 of fp32's for the same network, seed and data."""

from __future__ import annotations

import math

import mlflow
import pytest
import yaml

from distmis.cli.main import main
from distmis.search.state import SearchState

VIT = {"patch": 8, "layers": 1, "embed_dim": 32, "heads": 2, "decoder_features": 8, "attention_kernel": "fused"}


@pytest.fixture(scope="module")
def trials(ray_local, tmp_path_factory) -> tuple[mlflow.MlflowClient, dict[tuple[str, str], mlflow.entities.Run]]:
    folder = tmp_path_factory.mktemp("precision-search")
    tree = {
        "name": "precision",
        "dataset": {"path": str(folder / "data"), "layout": "msd",
                    "synthetic": {"cases": 6, "shape": [32, 32, 32], "seed": 0},
                    "split": {"train": 0.5, "val": 0.25, "test": 0.25, "seed": 0}},
        "model": {"name": "unet3d", "framework": "torch", "params": {"base_filters": 4, "levels": 3, "norm": "group"},
                  "per_model": {"vit-seg": VIT}},
        "training": {"epochs": 2, "batch_size": 2, "optimizer": {"lr": 1.0e-3}, "seed": 0},
        "search": {"algorithm": "grid", "evaluate_top": 0,
                   "space": {"model.name": {"grid": ["unet3d", "vit-seg"]},
                             "training.precision": {"grid": ["fp32", "bf16"]}}},
        "parallelism": {"resources_per_trial": {"cpu": 1}},
        "tracking": {"register_model": False},
    }
    spec = folder / "spec.yaml"
    spec.write_text(yaml.safe_dump(tree))
    assert main(["run", str(spec), "--output", str(folder / "out")]) == 0
    state = SearchState.load(folder / "out")
    assert state is not None and state.status == "finished"
    client = mlflow.MlflowClient(state.tracking_store)
    search_run = client.get_run(state.run_id)
    runs = client.search_runs([search_run.info.experiment_id],
                              filter_string=f"tags.mlflow.parentRunId = '{state.run_id}'")
    return client, {(run.data.params["model.name"], run.data.params["training.precision"]): run for run in runs}


@pytest.mark.parametrize("network", ["unet3d", "vit-seg"])
def test_bf16_trains_as_fp32_does(trials, network):
    client, runs = trials
    assert set(runs) == {(n, p) for n in ("unet3d", "vit-seg") for p in ("fp32", "bf16")}
    fp32, bf16 = runs[(network, "fp32")], runs[(network, "bf16")]
    for run in (fp32, bf16):
        assert run.info.status == "FINISHED"
        assert run.data.metrics["epochs_completed"] == 2
        for key in ("train_loss", "val_loss", "val_dice"):
            values = [m.value for m in client.get_metric_history(run.info.run_id, key)]
            assert len(values) == 2 and all(math.isfinite(v) for v in values), (key, values)
    assert abs(bf16.data.metrics["val_dice"] - fp32.data.metrics["val_dice"]) <= 0.05
    assert abs(bf16.data.metrics["train_loss"] - fp32.data.metrics["train_loss"]) <= 0.05
