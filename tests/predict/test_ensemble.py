"""A fold ensemble: one MLflow python_function model holding one network per cross-validation fold, whose prediction
is the thresholded (sigmoid) or argmaxed (softmax) MEAN of its folds' probabilities; ``params={"folds": [...]}`` and
``distmis predict --folds`` pick a subset; bad folds are refused; single-network folders, new and old, still work.

The networks are distmis's own tiny U-Nets with random weights: their probabilities vary around 0.5, so the mean's
label map differs from every network's own, and a wrong average (or the wrong network for a fold) shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import yaml

from distmis import pyfunc_model as pm
from distmis.cli.main import main
from distmis.data.manifest import DataManifest
from distmis.predict.model import SegmentationModel
from distmis.predict.recipe import InferenceSettings, ModelRecipe, RecipeError
from distmis.predict.registry import save_model
from tests.conftest import small_spec_tree
from tests.predict.test_segment import ROTATED, bright_case, write_msd_case

WINDOW = (8, 8, 8)
SHAPE = (14, 12, 10)
CLASSES = {"mode": "classes", "activation": "softmax",
           "channels": [{"name": n, "key": n, "values": [v], "paint": v}
                        for n, v in (("background", 0), ("liver", 1), ("spleen", 5))]}


def regions_recipe(folds: tuple[int, ...] = (0, 1, 2)) -> ModelRecipe:
    """BraTS regions of MSD Task01 (sigmoid), cropped: probabilities go through the crop and back."""
    return ModelRecipe(framework="torch", model="unet3d", layout="msd", labels="regions", num_classes=3,
                       window=WINDOW, output="probabilities", crop=(12, 12, 12),
                       inference=InferenceSettings(overlap=0.5, batch_size=2), folds=folds)


def classes_recipe(folds: tuple[int, ...] = (0, 2)) -> ModelRecipe:
    """Three one-channel CT classes (softmax; label values 0, 1, 5), resized: probabilities come back linearly."""
    return ModelRecipe(framework="torch", model="unet3d", layout="msd", labels="classes", num_classes=3,
                       window=WINDOW, output="probabilities", resize=(12, 12, 12), modalities=("CT",),
                       targets=CLASSES, inference=InferenceSettings(overlap=0.25, batch_size=4), folds=folds)


def unets(recipe: ModelRecipe, count: int) -> list:
    """``count`` tiny torch U-Nets of distinct random weights, built through distmis's model registry."""
    import torch

    from distmis.models.registry import NetworkInput, model_entry

    from distmis.networks import build_network

    entry = model_entry("unet3d")
    params = entry.params(base_filters=2, levels=2, norm="group", norm_groups=2)
    network_input = NetworkInput(in_channels=len(recipe.modalities), out_channels=recipe.num_classes, tile=WINDOW,
                                 activation=recipe.scheme["activation"])
    networks = []
    for seed in range(count):
        torch.manual_seed(100 + seed)
        networks.append(build_network(entry, params, network_input).eval())
    return networks


def raw_image(channels: int, seed: int = 0) -> np.ndarray:
    """A head with a bright tumour (the first ``channels`` of :func:`bright_case`'s four), and noise."""
    image, _ = bright_case(SHAPE, seed)
    image = image[..., :channels] if channels <= 4 else np.repeat(image[..., :1], channels, -1)
    noise = np.random.default_rng(seed).normal(0, 0.3, image.shape).astype(np.float32)
    return np.where(image > 0, image + noise, 0).astype(np.float32)


def hand_labels(inner, image: np.ndarray, indices: list[int]) -> np.ndarray:
    """The label map of the mean of the loaded networks ``indices``' probabilities, each network predicted alone
    (:func:`pm.network_probabilities`) and averaged here."""
    recipe = inner.recipe

    def mean(volume: np.ndarray) -> np.ndarray:
        probs = [pm.network_probabilities(inner.networks[i], volume, recipe, inner.device) for i in indices]
        return sum(probs[1:], probs[0].copy()) / np.float32(len(probs)) if len(probs) > 1 else probs[0]

    return pm.segment(image, recipe, mean)


@pytest.fixture(scope="module")
def regions_folder(tmp_path_factory) -> tuple[Path, list]:
    """The sigmoid ensemble of folds 0, 1, 2, saved once for the tests of this module."""
    recipe = regions_recipe()
    networks = unets(recipe, 3)
    return save_model(networks, recipe, tmp_path_factory.mktemp("ensemble") / "model"), networks


@pytest.fixture(scope="module")
def regions_loaded(regions_folder):
    """The sigmoid ensemble loaded once: by MLflow, and by distmis (:class:`SegmentationModel`)."""
    import mlflow.pyfunc

    return mlflow.pyfunc.load_model(str(regions_folder[0])), SegmentationModel.load(regions_folder[0])


@pytest.mark.parametrize("kind", ["regions", "classes"])
def test_an_ensemble_predicts_the_label_map_of_its_folds_mean_probabilities(tmp_path: Path, kind, regions_folder):
    import mlflow.pyfunc

    if kind == "regions":
        recipe, (folder, networks) = regions_recipe(), regions_folder
    else:
        recipe = classes_recipe()
        networks = unets(recipe, 2)
        folder = save_model(networks, recipe, tmp_path / "model")
    folds = recipe.folds
    mlmodel = yaml.safe_load((folder / "MLmodel").read_text())
    artifacts = mlmodel["flavors"]["python_function"]["artifacts"]
    assert set(artifacts) == {"recipe"} | {f"network_fold{f}" for f in folds}
    assert sorted(p.name for p in (folder / "artifacts").glob("network*")) == [f"network_fold{f}.pt2" for f in folds]
    params = {p["name"]: p for p in json.loads(mlmodel["signature"]["params"])}
    assert params["folds"] == {"name": "folds", "type": "long", "default": [], "shape": [-1]}
    assert json.loads((folder / "artifacts" / "preprocessing.json").read_text())["folds"] == list(folds)

    loaded = mlflow.pyfunc.load_model(str(folder))
    inner = loaded.unwrap_python_model()
    assert inner.folds == folds and len(inner.networks) == len(folds)
    image = raw_image(len(recipe.modalities))
    volume = pm.prepare_image(image, inner.recipe)[0]
    given = []
    for network, saved in zip(networks, inner.networks):  # each fold's network is the one given for that fold
        given.append(pm.network_probabilities(network, volume, recipe.to_dict()))
        np.testing.assert_allclose(pm.network_probabilities(saved, volume, inner.recipe), given[-1], atol=1e-5)
    np.testing.assert_allclose(inner.probabilities(volume), np.mean(given, axis=0), atol=1e-5)  # the mean

    labels = loaded.predict(image)
    assert labels.shape == SHAPE and labels.dtype == np.uint8
    everything = list(range(len(folds)))
    np.testing.assert_array_equal(labels, hand_labels(inner, image, everything))
    singles = [hand_labels(inner, image, [i]) for i in everything]
    assert all((labels != single).any() for single in singles), "the mean's labels should differ from each network's"
    assert len(np.unique(labels)) > 1  # not a trivial map
    if kind == "classes":
        assert set(np.unique(labels)) <= {0, 1, 5}  # the data set's values, argmaxed

    # a subset of the folds: that network alone, or the mean of those
    np.testing.assert_array_equal(loaded.predict(image, params={"folds": [folds[1]]}), singles[1])
    np.testing.assert_array_equal(loaded.predict(image, params={"folds": list(folds)}), labels)
    # distmis's SegmentationModel loads the same model, knows its folds and predicts the same
    model = SegmentationModel.load(folder)
    assert model.folds == folds and len(model.networks) == len(folds)
    np.testing.assert_array_equal(model.segment(image), labels)
    np.testing.assert_array_equal(model.segment(image, folds=[folds[1]]), singles[1])
    # the networks in memory, before saving: the mean of their probabilities too
    np.testing.assert_allclose(SegmentationModel(recipe, networks).probabilities(volume, folds=[folds[0]]),
                               pm.network_probabilities(networks[0], volume, recipe.to_dict()), atol=1e-6)
    np.testing.assert_allclose(SegmentationModel(recipe, networks).probabilities(volume),
                               inner.probabilities(volume), atol=1e-5)


def test_three_folds_subset_is_the_mean_of_those_folds(regions_loaded):
    loaded = regions_loaded[0]
    inner = loaded.unwrap_python_model()
    image = raw_image(4, seed=1)
    np.testing.assert_array_equal(loaded.predict(image, params={"folds": [2, 0]}), hand_labels(inner, image, [2, 0]))
    volume = pm.prepare_image(image, inner.recipe)[0]
    mean = (pm.network_probabilities(inner.networks[0], volume, inner.recipe)
            + pm.network_probabilities(inner.networks[2], volume, inner.recipe)) / 2
    np.testing.assert_allclose(inner.probabilities(volume, [0, 2]), mean, atol=1e-6)


@pytest.mark.parametrize("folds,message", [
    ([3], r"fold\(s\) \[3\] not in this model: it is a fold ensemble of folds \[0, 1, 2\]"),
    ([0, 7, 9], r"fold\(s\) \[7, 9\] not in this model: .*folds \[0, 1, 2\]"),
    ([1, 1], r"name fold\(s\) \[1\] more than once"),
    ([-1], r"folds must be a list of fold numbers \(integers >= 0\)"),
    (["0"], r"folds must be a list of fold numbers"),
    ([0.5], r"folds must be a list of fold numbers"),
])
def test_bad_folds_are_refused_naming_the_models_folds(regions_loaded, folds, message):
    inner = regions_loaded[0].unwrap_python_model()
    image = raw_image(4)
    with pytest.raises(ValueError, match=message):
        inner.predict(None, image, params={"folds": folds})
    with pytest.raises(ValueError, match=message):
        regions_loaded[1].segment(image, folds=folds)
    with pytest.raises(ValueError, match=message):
        inner.probabilities(pm.prepare_image(image, inner.recipe)[0], folds)


def test_mlflow_passes_folds_to_the_model_and_refuses_what_is_not_a_list_of_integers(regions_loaded):
    from mlflow.exceptions import MlflowException

    loaded = regions_loaded[0]
    image = raw_image(4)
    with pytest.raises(ValueError, match=r"fold\(s\) \[5\] not in this model"):  # the model's own check
        loaded.predict(image, params={"folds": [5]})
    with pytest.raises(MlflowException, match="folds"):  # MLflow's signature: a list of integers
        loaded.predict(image, params={"folds": [0.5]})


def test_a_single_network_is_saved_as_before_and_refuses_folds(tmp_path: Path):
    import mlflow.pyfunc

    recipe = regions_recipe(folds=())
    [network] = unets(recipe, 1)
    folder = save_model([network], recipe, tmp_path / "model")
    artifacts = yaml.safe_load((folder / "MLmodel").read_text())["flavors"]["python_function"]["artifacts"]
    assert set(artifacts) == {"recipe", "network"} and (folder / "artifacts" / "network.pt2").is_file()
    loaded = mlflow.pyfunc.load_model(str(folder))
    image = raw_image(4)
    np.testing.assert_array_equal(loaded.predict(image), SegmentationModel(recipe, network).segment(image))
    for params in ({"folds": [0]}, {"folds": [1, 2]}):
        with pytest.raises(ValueError, match="this model is not a fold ensemble: it holds one network"):
            loaded.predict(image, params=params)
    model = SegmentationModel.load(folder)
    assert model.folds == () and model.networks == [model.network]
    with pytest.raises(ValueError, match="not a fold ensemble"):
        model.segment(image, folds=[0])
    assert loaded.predict(image, params={"folds": []}).shape == SHAPE  # MLflow's default: all (the one)


@pytest.mark.parametrize("count,folds,message", [
    (2, (0, 1, 2), r"2 network\(s\) given: a fold ensemble of folds \[0, 1, 2\] takes 3 network\(s\)"),
    (2, (), r"2 network\(s\) given: a recipe without folds takes exactly one network"),
    (0, (), r"0 network\(s\) given"),
])
def test_the_networks_must_match_the_recipes_folds(tmp_path: Path, count, folds, message):
    recipe = regions_recipe(folds=folds)
    networks = unets(recipe, count)
    with pytest.raises(ValueError, match=message):
        save_model(networks, recipe, tmp_path / "model")
    assert not (tmp_path / "model").exists()
    with pytest.raises(ValueError, match="wrap a single network in a list"):
        save_model(unets(regions_recipe(folds=()), 1)[0], regions_recipe(folds=()), tmp_path / "model")
    with pytest.raises(ValueError, match=r"a fold ensemble of folds \[0, 1, 2\] takes a list of 3 network"):
        SegmentationModel(regions_recipe(), networks[:count])


def test_the_recipe_records_the_folds_and_reads_older_recipes_as_one_network(tmp_path: Path):
    from distmis.spec import validate_spec

    tree = small_spec_tree(tmp_path)
    tree["model"] = {"name": "unet3d", "framework": "torch", "params": {"base_filters": 4, "levels": 2}}
    manifest = DataManifest(preprocess={"layout": "msd", "labels": "whole-tumour", "crop": None, "resize": None},
                            image_shape=(16, 16, 16, 4), label_shape=(16, 16, 16, 1), splits={}, num_classes=1)
    spec = validate_spec(tree)
    recipe = ModelRecipe.from_spec(spec, manifest, folds=[0, np.int64(2)])
    assert recipe.folds == (0, 2) and recipe.ensemble and ModelRecipe.from_spec(spec, manifest).folds == ()
    assert recipe.to_dict()["folds"] == [0, 2]
    assert ModelRecipe.from_dict(recipe.to_dict()) == recipe
    assert ModelRecipe.read(recipe.write(tmp_path / "preprocessing.json")) == recipe
    before = {k: v for k, v in recipe.to_dict().items() if k != "folds"} | {"version": 2}  # written before folds
    assert ModelRecipe.from_dict(before).folds == () and not ModelRecipe.from_dict(before).ensemble
    for folds, message in (([1, 1], r"name fold\(s\) \[1\] more than once"), ([-1], "integers >= 0"),
                           ([0.5], "integers >= 0")):
        with pytest.raises(RecipeError, match=message):
            ModelRecipe.from_dict(recipe.to_dict() | {"folds": folds})


LEGACY_MODEL = '''
class SegmentationModel:  # the python_function model's class before fold ensembles: one network, no folds param
    def load_context(self, context):
        with open(context.artifacts[RECIPE_ARTIFACT], encoding="utf-8") as handle:
            self.recipe = json.load(handle)
        self.network, self.device = load_network(context.artifacts[NETWORK_ARTIFACT], self.recipe["framework"])

    def probabilities(self, image):
        return network_probabilities(self.network, image, self.recipe, self.device)

    def predict(self, context, model_input, params=None):
        image = check_image(model_input, self.recipe["modalities"])
        unknown = sorted(set(params or {}) - {"spacing", "layout", "orientation"})
        if unknown:
            raise ValueError(f"unknown parameter(s) {unknown}")
        settings = check_params(params, self.recipe)
        return segment(image, self.recipe, self.probabilities, settings["layout"], settings["spacing"],
                       settings["orientation"])


if __name__ != "distmis.pyfunc_model":
    import mlflow.models

    mlflow.models.set_model(pyfunc_class()())
'''


def test_a_python_function_folder_saved_before_fold_ensembles_still_loads_and_predicts(tmp_path: Path):
    """Its code (copied into the folder when it was saved) knew one ``network`` and no ``folds``; its recipe has no
    ``folds`` (version 2); its signature no ``folds`` parameter. The folder is made so from a new one."""
    recipe = regions_recipe(folds=())
    [network] = unets(recipe, 1)
    folder = save_model([network], recipe, tmp_path / "model")
    code = (folder / "pyfunc_model.py").read_text()
    code = code[:code.index("\nclass SegmentationModel:")] + code[code.index("\ndef pyfunc_class()"):]
    code = code[:code.index('\nif __name__ != "distmis.pyfunc_model":')] + LEGACY_MODEL
    (folder / "pyfunc_model.py").write_text(code)
    stored = json.loads((folder / "artifacts" / "preprocessing.json").read_text())
    stored = {k: v for k, v in stored.items() if k != "folds"} | {"version": 2}
    (folder / "artifacts" / "preprocessing.json").write_text(json.dumps(stored))
    mlmodel = yaml.safe_load((folder / "MLmodel").read_text())
    params = [p for p in json.loads(mlmodel["signature"]["params"]) if p["name"] not in ("folds", "mirror")]
    mlmodel["signature"]["params"] = json.dumps(params)
    (folder / "MLmodel").write_text(yaml.safe_dump(mlmodel))

    model = SegmentationModel.load(folder)
    inner = model.pyfunc.unwrap_python_model()
    assert not hasattr(inner, "networks") and model.folds == () and model.network is inner.network
    image = raw_image(4)
    expected = SegmentationModel(recipe, network).segment(image)
    np.testing.assert_array_equal(model.segment(image), expected)
    volume = pm.prepare_image(image, stored)[0]
    np.testing.assert_allclose(model.probabilities(volume), pm.network_probabilities(network, volume, stored),
                               atol=1e-5)
    with pytest.raises(ValueError, match="not a fold ensemble"):
        model.segment(image, folds=[0])


def test_a_keras_ensemble_loads_and_averages(tmp_path: Path):
    import mlflow.pyfunc

    from distmis.models.unet3d_tf import build_unet3d

    recipe = ModelRecipe(framework="tensorflow", model="unet3d", layout="msd", labels="whole-tumour", num_classes=1,
                         window=WINDOW, output="probabilities", crop=(12, 12, 12),
                         inference=InferenceSettings(overlap=0.0, batch_size=4), folds=(1, 3))
    import keras

    networks = []
    for seed in (1, 2):
        keras.utils.set_random_seed(seed)
        networks.append(build_unet3d(in_channels=4, num_classes=1, base_filters=2, levels=2, norm="group",
                                     norm_groups=2))
    folder = save_model(networks, recipe, tmp_path / "model")
    assert sorted(p.name for p in (folder / "artifacts").glob("model_fold*")) == ["model_fold1.keras",
                                                                                  "model_fold3.keras"]
    loaded = mlflow.pyfunc.load_model(str(folder))
    inner = loaded.unwrap_python_model()
    image = raw_image(4)
    labels = loaded.predict(image)
    np.testing.assert_array_equal(labels, hand_labels(inner, image, [0, 1]))
    np.testing.assert_array_equal(loaded.predict(image, params={"folds": [3]}), hand_labels(inner, image, [1]))
    volume = pm.prepare_image(image, inner.recipe)[0]
    by_hand = [pm.network_probabilities(n, volume, recipe.to_dict()) for n in networks]  # the Keras models given
    np.testing.assert_allclose(inner.probabilities(volume), (by_hand[0] + by_hand[1]) / 2, atol=1e-5)
    assert np.abs(by_hand[0] - by_hand[1]).max() > 1e-3  # two different networks


# --------------------------------------------------------------------------- distmis predict --folds


def msd_case(tmp_path: Path) -> Path:
    write_msd_case(tmp_path / "data", "BRATS_007", SHAPE, ROTATED, seed=7)
    return tmp_path / "data" / "imagesTr" / "BRATS_007.nii.gz"


def test_distmis_predict_folds_segments_with_the_mean_of_those_folds(tmp_path: Path, regions_folder,
                                                                    regions_loaded, capsys):
    folder = regions_folder[0]
    image_file = msd_case(tmp_path)
    assert main(["predict", str(folder), str(image_file), "--output", str(tmp_path / "subset"), "--folds", "0,2",
                 "--quiet"]) == 0
    assert "folds 0, 2" in capsys.readouterr().out
    assert main(["predict", str(folder), str(image_file), "--output", str(tmp_path / "all"), "--quiet"]) == 0
    assert "folds 0, 1, 2" in capsys.readouterr().out
    scan = nib.load(str(image_file))
    image = np.asarray(scan.dataobj, dtype=np.float32)
    inner = regions_loaded[0].unwrap_python_model()
    written = {name: np.asarray(nib.load(str(tmp_path / name / "BRATS_007_seg.nii.gz")).dataobj)
               for name in ("subset", "all")}
    np.testing.assert_array_equal(written["subset"], hand_labels(inner, image, [0, 2]))
    np.testing.assert_array_equal(written["all"], hand_labels(inner, image, [0, 1, 2]))
    assert (written["subset"] != written["all"]).any()


@pytest.mark.parametrize("folds,culprit", [
    ("3", r"--folds: fold(s) [3] not in this model: it is a fold ensemble of folds [0, 1, 2]"),
    ("0,1,4", r"fold(s) [4] not in this model"),
    ("0", "--folds: folds [0]: this model is not a fold ensemble: it holds one network"),
])
def test_distmis_predict_refuses_folds_before_reading_a_scan(tmp_path: Path, regions_folder, capsys, monkeypatch,
                                                             folds, culprit):
    import distmis.data.scans
    import distmis.predict.segment

    if "not a fold ensemble" in culprit:
        recipe = regions_recipe(folds=())
        folder = save_model(unets(recipe, 1), recipe, tmp_path / "single")
    else:
        folder = regions_folder[0]
    image_file = msd_case(tmp_path)

    def no_reading(*args, **kwargs):
        raise AssertionError("a scan was read before --folds was checked")

    monkeypatch.setattr(distmis.predict.segment, "check_scans", no_reading)
    monkeypatch.setattr(distmis.data.scans, "read_scan", no_reading)
    code = main(["predict", str(folder), str(image_file), "--output", str(tmp_path / "out"), "--folds", folds,
                 "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert culprit in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("folds", ["a,b", "0,-1", "1,1", ""])
def test_distmis_predict_folds_is_a_comma_list_of_fold_numbers(tmp_path: Path, capsys, folds):
    with pytest.raises(SystemExit) as exit_:
        main(["predict", str(tmp_path / "model"), str(tmp_path), "--output", str(tmp_path / "out"), "--folds", folds])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--folds" in err and ("fold numbers like 0,2" in err or "more than once" in err)
