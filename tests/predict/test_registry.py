"""A model through MLflow and back: logged on its run, registered, loaded by version and by alias, predicting as
the network did; for the PyTorch U-Net and ViT and the Keras U-Net, on a sqlite store and a tracking server."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from distmis.predict.model import SegmentationModel
from distmis.predict.recipe import InferenceSettings, ModelRecipe
from distmis.predict.resolve import ModelNotFound, model_folder
from distmis.predict.registry import BEST_ALIAS, log_model, register_model, save_model
from distmis.tracking.mlflow_tracking import default_tracking_uri

WINDOW = (16, 16, 16)


def network(kind: str):
    if kind == "tensorflow":
        os.environ.setdefault("KERAS_BACKEND", "tensorflow")
        from distmis.models.unet3d_tf import build_unet3d

        return build_unet3d(in_channels=4, num_classes=3, base_filters=4, levels=2, norm="group", norm_groups=2)
    import torch

    torch.manual_seed(0)
    if kind == "unet3d":
        from distmis.models.unet3d_torch import UNet3D

        return UNet3D(in_channels=4, num_classes=3, base_filters=4, levels=2, norm="group", norm_groups=2).eval()
    from distmis.models.vit_seg import ViTSeg

    return ViTSeg(4, 3, WINDOW, patch=8, layers=1, embed_dim=16, heads=2, decoder_features=8).eval()


def recipe_for(kind: str) -> ModelRecipe:
    return ModelRecipe(framework="tensorflow" if kind == "tensorflow" else "torch",
                       model="vit-seg" if kind == "vit-seg" else "unet3d", layout="brats", labels="regions",
                       num_classes=3, window=WINDOW, output="logits" if kind == "vit-seg" else "probabilities",
                       crop=(20, 20, 20), inference=InferenceSettings(overlap=0.5, batch_size=2), spec_name="roundtrip")


def finished_run(uri: str, tmp_path: Path) -> str:
    client = MlflowClient(uri)
    experiment = client.create_experiment("roundtrip", artifact_location=(tmp_path / "artifacts").as_uri())
    run = client.create_run(experiment, run_name="trial")
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def round_trip(kind: str, uri: str, tmp_path: Path) -> None:
    net, recipe = network(kind), recipe_for(kind)
    volume = np.random.default_rng(0).normal(size=(20, 20, 20, 4)).astype(np.float32)
    expected = SegmentationModel(recipe, net).probabilities(volume)
    assert expected.shape == (20, 20, 20, 3) and 0 <= expected.min() and expected.max() <= 1

    run_id = finished_run(uri, tmp_path)
    model_uri = log_model([net], recipe, uri, run_id)
    client = MlflowClient(uri)
    assert client.get_run(run_id).info.status == "FINISHED"  # logging on it did not reopen the trial's run
    assert "preprocessing.json" in {a.path for a in client.list_artifacts(run_id)}
    version, best = register_model(uri, model_uri, "roundtrip", run_id=run_id, tags={"test_dice_mean": "0.5"},
                                   score=("test_dice_mean", 0.5, "max"))
    assert (version, best) == ("1", True)
    registered = client.get_model_version("roundtrip", version)
    assert registered.run_id == run_id and registered.tags["test_dice_mean"] == "0.5"

    for reference in ("models:/roundtrip/1", f"models:/roundtrip@{BEST_ALIAS}", f"runs:/{run_id}", model_uri):
        with model_folder(reference, uri) as folder:
            loaded = SegmentationModel.load(folder)
            assert loaded.recipe == recipe
            np.testing.assert_allclose(loaded.probabilities(volume), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", [pytest.param("unet3d", marks=pytest.mark.slow), "vit-seg",
                                  pytest.param("tensorflow", marks=pytest.mark.slow)])
def test_registry_round_trip_on_the_sqlite_store(tmp_path: Path, kind: str):
    round_trip(kind, default_tracking_uri(tmp_path), tmp_path)


@pytest.mark.slow  # a real mlflow server: about 10 s
def test_registry_round_trip_through_a_tracking_server(tmp_path: Path):
    from distmis.service.net import free_port
    from distmis.service.server import start_server

    with start_server(default_tracking_uri(tmp_path), artifacts=tmp_path / "served", port=free_port(),
                      log_path=tmp_path / "server.log") as server:
        round_trip("unet3d", server.url, tmp_path)


def test_a_network_trained_channels_last_is_saved_in_the_default_layout_without_a_warning(tmp_path: Path):
    """``training.performance`` may train a network channels-last: its saved program holds the same function in
    PyTorch's default layout (torch.export's archive warned once per weight of the other), and the caller's network
    keeps its own layout."""
    import warnings

    import torch

    net, recipe = network("unet3d"), recipe_for("unet3d")
    volume = np.random.default_rng(0).normal(size=(20, 20, 20, 4)).astype(np.float32)
    expected = SegmentationModel(recipe, net).probabilities(volume)
    net.to(memory_format=torch.channels_last_3d)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", module=r"torch\.")  # torch's, which the console would have printed
        folder = save_model([net], recipe, tmp_path / "model")
    assert net.head.weight.is_contiguous(memory_format=torch.channels_last_3d)
    loaded = SegmentationModel.load(folder)
    weights = [t for t in loaded.networks[0].state_dict().values() if t.dim() == 5]
    assert weights and all(t.is_contiguous() for t in weights)
    np.testing.assert_allclose(loaded.probabilities(volume), expected, rtol=0, atol=1e-5)


def test_the_best_alias_moves_only_to_a_better_score(tmp_path: Path):
    uri = default_tracking_uri(tmp_path)
    net, recipe = network("unet3d"), recipe_for("unet3d")
    versions = []
    for score in (0.7, 0.6, 0.8):
        run_id = finished_run(uri, tmp_path) if not versions else MlflowClient(uri).create_run(
            MlflowClient(uri).get_experiment_by_name("roundtrip").experiment_id).info.run_id
        model_uri = log_model([net], recipe, uri, run_id)
        versions.append(register_model(uri, model_uri, "search", run_id=run_id, tags={},
                                       score=("test_dice_WT", score, "max")))
    assert versions == [("1", True), ("2", False), ("3", True)]
    assert str(MlflowClient(uri).get_model_version_by_alias("search", BEST_ALIAS).version) == "3"


def test_a_model_folder_is_written_whole_and_only_over_a_model_folder(tmp_path: Path):
    net, recipe = network("unet3d"), recipe_for("unet3d")
    folder = save_model([net], recipe, tmp_path / "model")
    assert (folder / "MLmodel").is_file() and (folder / "artifacts" / "preprocessing.json").is_file()
    save_model([net], recipe, folder)  # replaces its own earlier model
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging folder left behind
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not a model folder distmis wrote"):
        save_model([net], recipe, tmp_path / "notes")
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep"
    with model_folder(str(tmp_path)) as found:  # a search's output folder: its model/
        assert found == folder


@pytest.mark.parametrize("reference,message", [
    ("models:/nobody/1", "does not resolve"),
    ("runs:/0123456789abcdef", "does not resolve"),
])
def test_a_model_uri_that_does_not_resolve_is_named(tmp_path: Path, reference: str, message: str):
    uri = default_tracking_uri(tmp_path)
    finished_run(uri, tmp_path)
    with pytest.raises(ModelNotFound, match=message):
        with model_folder(reference, uri):
            pass


def test_a_model_reference_that_is_no_model_is_named(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ModelNotFound, match="give --tracking-uri"):
        with model_folder("models:/x/1"):
            pass
    with pytest.raises(ModelNotFound, match="no such folder"):
        with model_folder(str(tmp_path / "absent")):
            pass
    (tmp_path / "search_state.json").write_text("{}")
    with pytest.raises(ModelNotFound, match="holds no model"):
        with model_folder(str(tmp_path)):
            pass
