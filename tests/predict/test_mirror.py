"""Test-time mirroring of the registered model (nnU-Net's): every sliding window predicted on every subset of the
recipe's ``inference.mirror`` axes flipped, flipped back, and the probabilities averaged; the ``mirror`` parameter of
the MLflow model and ``distmis predict --mirror`` / ``--no-mirror`` choose other axes.

The network is distmis's own tiny torch U-Net with random weights: not symmetric, so its probabilities (about 0.5
everywhere) change when a window is flipped, and mirrored label maps differ from unmirrored ones.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import yaml

from distmis import pyfunc_model as pm
from distmis.cli.main import main
from distmis.predict.model import SegmentationModel
from distmis.predict.recipe import InferenceSettings, ModelRecipe
from distmis.predict.registry import save_model
from tests.predict.test_ensemble import SHAPE, WINDOW, msd_case, raw_image, unets

RECIPE_MIRROR = (0, 2)


def recipe(mirror: tuple[int, ...] = RECIPE_MIRROR) -> ModelRecipe:
    """BraTS regions of MSD Task01 (sigmoid), cropped to 12^3: 8 windows of 8^3 at overlap 0.5."""
    return ModelRecipe(framework="torch", model="unet3d", layout="msd", labels="regions", num_classes=3,
                       window=WINDOW, output="probabilities", crop=(12, 12, 12),
                       inference=InferenceSettings(overlap=0.5, batch_size=3, mirror=mirror))


def flipped(network, subset: tuple[int, ...]):
    """``network`` seeing its windows flipped on the volume axes ``subset`` (tensor dims a + 2), its output flipped
    back: one of the 2^k terms of a mirrored prediction, written by hand."""
    import torch

    dims = [a + 2 for a in subset]

    def forward(windows):
        return torch.flip(network(torch.flip(windows, dims)), dims) if dims else network(windows)
    return forward


def mirrored_by_hand(network, volume: np.ndarray, stored: dict, axes: tuple[int, ...]) -> np.ndarray:
    """The mean, over every subset S of ``axes`` (the empty one included), of the unmirrored sliding-window
    probabilities of the network flipped on S."""
    plain = stored | {"inference": stored["inference"] | {"mirror": []}}
    subsets = [s for k in range(len(axes) + 1) for s in itertools.combinations(axes, k)]
    probs = [pm.network_probabilities(flipped(network, s), volume, plain) for s in subsets]
    return np.mean(probs, axis=0)


@pytest.fixture(scope="module")
def network():
    return unets(recipe(), 1)[0]


@pytest.fixture(scope="module")
def folder(network, tmp_path_factory) -> Path:
    """The model of the network, its recipe mirroring on axes 0 and 2, saved once for this module."""
    return save_model([network], recipe(), tmp_path_factory.mktemp("mirror") / "model")


@pytest.mark.parametrize("axes", [(0,), (0, 2), (0, 1, 2)])
def test_the_probabilities_are_the_mean_of_every_flipped_windows(network, axes):
    stored = recipe().to_dict()
    volume = pm.prepare_image(raw_image(4), stored)[0]
    assert volume.shape[:3] == (12, 12, 12)  # windows of 8^3: several per axis
    expected = mirrored_by_hand(network, volume, stored, axes)
    np.testing.assert_allclose(pm.network_probabilities(network, volume, stored, mirror=list(axes)), expected,
                               atol=1e-6)
    # the recipe's own axes when none are given
    recorded = stored | {"inference": stored["inference"] | {"mirror": list(axes)}}
    np.testing.assert_allclose(pm.network_probabilities(network, volume, recorded), expected, atol=1e-6)
    plain = pm.network_probabilities(network, volume, stored, mirror=[])
    assert np.abs(plain - expected).max() > 1e-3  # not symmetric: mirroring changes the probabilities


def test_the_registered_model_mirrors_as_its_recipe_says_and_its_mirror_parameter_chooses(folder, network):
    import mlflow.pyfunc
    from mlflow.exceptions import MlflowException

    mlmodel = yaml.safe_load((folder / "MLmodel").read_text())
    params = {p["name"]: p for p in json.loads(mlmodel["signature"]["params"])}
    assert params["mirror"] == {"name": "mirror", "type": "long", "default": [0, 2], "shape": [-1]}
    stored = json.loads((folder / "artifacts" / "preprocessing.json").read_text())
    assert stored["inference"]["mirror"] == [0, 2] and stored["version"] >= 5

    loaded = mlflow.pyfunc.load_model(str(folder))
    inner = loaded.unwrap_python_model()
    image = raw_image(4, seed=2)

    def labels(axes: tuple[int, ...]) -> np.ndarray:
        return pm.segment(image, stored, lambda volume: mirrored_by_hand(inner.networks[0], volume, stored, axes))

    default = loaded.predict(image)
    np.testing.assert_array_equal(default, labels(RECIPE_MIRROR))
    np.testing.assert_array_equal(loaded.predict(image, params={"mirror": [0, 1, 2]}), labels((0, 1, 2)))
    unmirrored = loaded.predict(image, params={"mirror": []})
    np.testing.assert_array_equal(unmirrored, labels(()))
    assert (default != unmirrored).any()
    # distmis's SegmentationModel: the same model, the same choices
    model = SegmentationModel.load(folder)
    assert model.mirror == RECIPE_MIRROR and model.mirrors()
    np.testing.assert_array_equal(model.segment(image), default)
    np.testing.assert_array_equal(model.segment(image, mirror=()), unmirrored)
    volume = pm.prepare_image(image, stored)[0]
    np.testing.assert_allclose(model.probabilities(volume, mirror=[1]),
                               mirrored_by_hand(inner.networks[0], volume, stored, (1,)), atol=1e-6)
    # the network in memory, before saving, predicts the same
    np.testing.assert_array_equal(SegmentationModel(recipe(), network).segment(image), default)
    with pytest.raises(ValueError, match=r"the mirror parameter must be a list of distinct spatial axes 0, 1, 2"):
        loaded.predict(image, params={"mirror": [3]})
    with pytest.raises(MlflowException, match="mirror"):  # MLflow's signature: a list of integers
        loaded.predict(image, params={"mirror": [0.5]})


@pytest.mark.parametrize("given,axes", [
    (None, RECIPE_MIRROR), ([], ()), ([2, 0], (0, 2)), ((1,), (1,)), (np.array([0, 1, 2]), (0, 1, 2)),
    (np.array([], dtype=np.int64), ()), (1, (1,)), (np.int64(2), (2,)),
])
def test_check_params_takes_a_list_of_axes_and_defaults_to_the_recipes(given, axes):
    params = {} if given is None else {"mirror": given}
    assert pm.check_params(params, recipe().to_dict())["mirror"] == axes
    assert pm.check_params(params, recipe(()).to_dict())["mirror"] == (() if given is None else axes)


@pytest.mark.parametrize("given,message", [
    ([3], r"must be a list of distinct spatial axes 0, 1, 2 \(e\.g\. \[0, 1, 2\]; \[\] for none\), got \[3\]"),
    ([0, 0], r"\[0, 0\] names axis\(es\) \[0\] more than once"),
    ("0,1", r"got '0,1'"),
    ("all", r"got 'all'"),
    ([0.5], r"got \[0\.5\]"),
    ([True], r"got \[True\]"),
    (np.zeros((1, 2), np.int64), "must be a list of distinct spatial axes"),
])
def test_check_params_refuses_what_is_not_distinct_axes(given, message):
    with pytest.raises(ValueError, match=message) as refused:
        pm.check_params({"mirror": given}, recipe().to_dict())
    assert str(refused.value).startswith("the mirror parameter ")


def test_a_recipe_written_before_mirroring_means_none():
    stored = recipe().to_dict()
    before = stored | {"version": 4, "inference": {k: v for k, v in stored["inference"].items() if k != "mirror"}}
    assert ModelRecipe.from_dict(before).inference.mirror == ()
    assert pm.recipe_mirror(before) == () and pm.recipe_mirror({"layout": "msd"}) == ()
    assert pm.check_params({}, before)["mirror"] == ()


# --------------------------------------------------------------------------- distmis predict --mirror


def written(tmp_path: Path, name: str) -> np.ndarray:
    return np.asarray(nib.load(str(tmp_path / name / "BRATS_007_seg.nii.gz")).dataobj)


def test_distmis_predict_mirror_chooses_the_axes(tmp_path: Path, folder, capsys):
    image_file = msd_case(tmp_path)
    runs = {"default": [], "all": ["--mirror"], "one": ["--mirror", "1"], "none": ["--no-mirror"]}
    said = {}
    for name, option in runs.items():
        assert main(["predict", str(folder), str(image_file), "--output", str(tmp_path / name), *option,
                     "--quiet"]) == 0
        said[name] = capsys.readouterr().out
    assert "mirrored on axes 0, 2," in said["default"] and "mirrored on axes 0, 1, 2," in said["all"]
    assert "mirrored on axes 1," in said["one"] and "mirrored" not in said["none"]

    loaded = SegmentationModel.load(folder)
    inner = loaded.pyfunc.unwrap_python_model()
    stored = inner.recipe
    image = np.asarray(nib.load(str(image_file)).dataobj, dtype=np.float32)
    for name, axes in (("default", RECIPE_MIRROR), ("all", (0, 1, 2)), ("one", (1,)), ("none", ())):
        expected = pm.segment(image, stored,
                              lambda volume, a=axes: mirrored_by_hand(inner.networks[0], volume, stored, a))
        np.testing.assert_array_equal(written(tmp_path, name), expected, err_msg=name)
    assert (written(tmp_path, "default") != written(tmp_path, "none")).any()


@pytest.mark.parametrize("option,culprit", [
    (["--mirror", "3"], "--mirror: expected axes like 0,1 (of 0, 1, 2), got '3'"),
    (["--mirror", "0,0"], "--mirror: an axis is named more than once in '0,0'"),
    (["--mirror", "x"], "--mirror: expected axes like 0,1"),
    (["--mirror", "--no-mirror"], "not allowed with argument"),
])
def test_distmis_predict_mirror_is_a_comma_list_of_axes(tmp_path: Path, capsys, option, culprit):
    with pytest.raises(SystemExit) as exit_:
        main(["predict", str(tmp_path / "model"), str(tmp_path), "--output", str(tmp_path / "out"), *option])
    assert exit_.value.code == 2
    assert culprit in capsys.readouterr().err


def test_a_folder_saved_before_mirroring_predicts_unmirrored_and_refuses_other_axes(tmp_path: Path, network, capsys):
    """Its signature declares no ``mirror`` (MLflow would drop one) and its recipe records none: it predicts as it
    did, and asking it to mirror is refused before a scan is read."""
    folder = save_model([network], recipe(()), tmp_path / "model")
    mlmodel = yaml.safe_load((folder / "MLmodel").read_text())
    mlmodel["signature"]["params"] = json.dumps([p for p in json.loads(mlmodel["signature"]["params"])
                                                 if p["name"] != "mirror"])
    (folder / "MLmodel").write_text(yaml.safe_dump(mlmodel))
    model = SegmentationModel.load(folder)
    assert not model.mirrors() and model.mirror == ()
    image = raw_image(4)
    np.testing.assert_array_equal(model.segment(image, mirror=()),
                                  SegmentationModel(recipe(()), network).segment(image))
    with pytest.raises(ValueError, match=r"mirror \[0, 1, 2\]: this model folder was saved before test-time "
                                         "mirroring"):
        model.segment(image, mirror=(0, 1, 2))
    image_file = msd_case(tmp_path)
    assert main(["predict", str(folder), str(image_file), "--output", str(tmp_path / "out"), "--mirror",
                 "--quiet"]) == 2
    assert "--mirror: mirror [0, 1, 2]: this model folder was saved before test-time mirroring" in \
        capsys.readouterr().err
    assert not (tmp_path / "out").exists()
