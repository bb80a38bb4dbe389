"""The saved model is an MLflow python_function model from code: what its folder holds, its ``predict`` against
``distmis predict`` (the same label map), its refusals, its use without distmis, and models saved the old way.

The network is :class:`tests.predict.nets.BrightFlair`, whose segmentation of a case is known exactly.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import yaml

from distmis import pyfunc_model
from distmis.data.scans import discover_scans
from distmis.predict.model import SegmentationModel
from distmis.predict.recipe import RECIPE_FILE
from distmis.predict.registry import save_model
from distmis.predict.segment import predict_scans
from tests.predict.test_segment import ROTATED, bright_case, bright_model, write_msd_case

SCRIPT = Path(__file__).with_name("without_distmis.py")
SHAPE = (23, 19, 17)


def regions_model():
    return bright_model("regions", crop=(20, 20, 20), window=(8, 8, 8))


def read_mlmodel(folder: Path) -> dict:
    return yaml.safe_load((folder / "MLmodel").read_text())


def assert_python_function_from_code(folder: Path) -> None:
    """The python_function flavour only, its code a file of the folder (no pickled python model); an input example
    and a signature with the spacing parameter; requirements of public versions."""
    mlmodel = read_mlmodel(folder)
    assert set(mlmodel["flavors"]) == {"python_function"}
    conf = mlmodel["flavors"]["python_function"]
    assert Path(conf["model_code_path"]).name == "pyfunc_model.py" and (folder / "pyfunc_model.py").is_file()
    assert "python_model" not in conf and not list(folder.rglob("*.pkl"))
    assert set(conf["artifacts"]) == {"recipe", "network"}
    assert mlmodel["saved_input_example_info"]["type"] == "ndarray" and (folder / "input_example.json").is_file()
    example = np.asarray(json.loads((folder / "input_example.json").read_text()))
    assert example.shape == (8, 8, 8, 4)  # small: a JSON file
    inputs, outputs, params = (json.loads(mlmodel["signature"][k]) for k in ("inputs", "outputs", "params"))
    assert inputs[0]["tensor-spec"] == {"dtype": "float32", "shape": [-1, -1, -1, 4]}
    assert outputs[0]["tensor-spec"] == {"dtype": "uint8", "shape": [-1, -1, -1]}
    assert {p["name"]: p["default"] for p in params}["spacing"] == []
    requirements = (folder / "requirements.txt").read_text().split()
    assert not [r for r in requirements if "+" in r], requirements
    assert {r.split("==")[0] for r in requirements} >= {"mlflow", "numpy", "scipy", "torch", "monai"}


def test_the_saved_model_is_python_function_from_code(tmp_path: Path):
    model = regions_model()
    folder = save_model([model.network], model.recipe, tmp_path / "model")
    assert_python_function_from_code(folder)
    assert (folder / "artifacts" / "network.pt2").is_file()
    assert json.loads((folder / "artifacts" / RECIPE_FILE).read_text()) == model.recipe.to_dict()


def test_mlflow_predict_is_distmis_predict_voxel_for_voxel(tmp_path: Path):
    import mlflow.pyfunc

    model = regions_model()
    folder = save_model([model.network], model.recipe, tmp_path / "model")
    truth = write_msd_case(tmp_path / "data", "case_001", SHAPE, ROTATED, seed=1)
    scans = discover_scans(tmp_path / "data" / "imagesTr")
    loaded = SegmentationModel.load(folder)
    assert loaded.pyfunc is not None and loaded.recipe == model.recipe
    written = np.asarray(nib.load(str(predict_scans(loaded, scans, tmp_path / "out", progress=False)[0].output)).dataobj)

    image = np.asarray(nib.load(str(scans[0].images[0])).dataobj, dtype=np.float32)
    pyfunc = mlflow.pyfunc.load_model(str(folder))
    labels = pyfunc.predict(image, params={"spacing": [1.2, 0.9, 2.5]})
    assert labels.dtype == np.uint8 and labels.shape == SHAPE
    np.testing.assert_array_equal(labels, written)
    box = tuple(slice((s - 20) // 2, (s - 20) // 2 + 20) if s > 20 else slice(None) for s in SHAPE)
    inside = np.zeros(SHAPE, dtype=bool)
    inside[box] = True
    np.testing.assert_array_equal(labels, np.where(inside, truth, 0))  # the MSD values, inside the crop
    # the network in memory, as before saving: the same labels
    np.testing.assert_array_equal(model.segment(image, "msd"), labels)
    # a batch of one is that case; BraTS label values on request
    np.testing.assert_array_equal(pyfunc.unwrap_python_model().predict(None, image[None]), labels)
    brats = pyfunc.predict(image, params={"layout": "brats"})
    np.testing.assert_array_equal(brats, np.select([labels == 3, labels == 2, labels == 1], [4, 1, 2], 0))


@pytest.mark.parametrize("bad,message", [
    (np.zeros((8, 8, 8, 3), np.float32), r"4 channels \(flair, t1, t1ce, t2\).*got shape \(8, 8, 8, 3\)"),
    (np.zeros((8, 8, 4), np.float32), r"ONE case's raw image .*\(H, W, D, 4\).*got shape \(8, 8, 4\)"),
    (np.zeros((2, 8, 8, 8, 4), np.float32), r"batch of one.*got shape \(2, 8, 8, 8, 4\)"),
    (np.full((8, 8, 8, 4), np.nan, np.float32), "NaN"),
])
def test_a_wrong_input_is_refused_naming_what_is_expected(tmp_path: Path, bad, message):
    model = pyfunc_model.SegmentationModel()
    model.recipe, model.networks, model.device = regions_model().recipe.to_dict(), [None], "cpu"
    with pytest.raises(ValueError, match=message):
        model.predict(None, bad)


@pytest.mark.parametrize("params,message", [
    ({"spacing": [1.0, 1.0]}, "spacing must be the case's voxel spacing: 3 positive numbers"),
    ({"spacing": [1.0, 0.0, 1.0]}, "3 positive numbers"),
    ({"layout": "kits"}, "layout must be one of"),
    ({"size": 3}, r"unknown parameter\(s\) \['size'\]"),
])
def test_wrong_parameters_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        pyfunc_model.check_params(params, regions_model().recipe.to_dict())
    assert pyfunc_model.check_params({"spacing": [1, 2, 3]}, {"layout": "msd"}) == {"spacing": (1.0, 2.0, 3.0),
                                                                                      "layout": "msd",
                                                                                      "orientation": None,
                                                                                      "folds": None,
                                                                                      "mirror": ()}
    assert pyfunc_model.check_params({"spacing": []}, {"layout": "brats"})["spacing"] is None


def test_the_model_code_imports_no_distmis_and_its_libraries_lazily():
    tree = ast.parse(Path(pyfunc_model.__file__).read_text())
    top = {alias.name.split(".")[0] for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
           for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])}
    assert top <= {"__future__", "json", "math", "os", "re", "statistics", "time", "types", "typing", "weakref",
                   "numpy"}, top
    everywhere = {(node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
                  for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                  for alias in node.names}
    assert "distmis" not in everywhere and everywhere <= top | {"mlflow", "scipy", "torch", "monai", "keras"}


def test_a_model_folder_saved_the_old_way_still_predicts(tmp_path: Path):
    """Before the python_function model: mlflow.pytorch (a pickled module) with extra_files/preprocessing.json."""
    import mlflow.pytorch

    model = regions_model()
    recipe_file = model.recipe.write(tmp_path / RECIPE_FILE)
    old = tmp_path / "old-model"
    mlflow.pytorch.save_model(model.network, str(old), serialization_format="pickle", extra_files=[str(recipe_file)])
    assert "pytorch" in read_mlmodel(old)["flavors"] and (old / "extra_files" / RECIPE_FILE).is_file()
    write_msd_case(tmp_path / "data", "case_002", SHAPE, ROTATED, seed=2)
    scans = discover_scans(tmp_path / "data" / "imagesTr")

    loaded = SegmentationModel.load(old)
    assert loaded.pyfunc is None and loaded.recipe == model.recipe
    written = predict_scans(loaded, scans, tmp_path / "old-out", progress=False)[0].output
    new = SegmentationModel.load(save_model([model.network], model.recipe, tmp_path / "new-model"))
    rewritten = predict_scans(new, scans, tmp_path / "new-out", progress=False)[0].output
    labels = [np.asarray(nib.load(str(path)).dataobj) for path in (written, rewritten)]
    assert labels[0].any() and set(np.unique(labels[0])) == {0, 1, 2, 3}
    np.testing.assert_array_equal(*labels)


def run_without_distmis(model_uri: str, tracking_uri: str, cases: list[str], out: Path, cwd: Path) -> dict:
    """Run :mod:`tests.predict.without_distmis` in a clean process (cwd ``cwd``, no PYTHONPATH) and return its
    report; the label maps lie in ``out``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    done = subprocess.run([sys.executable, str(SCRIPT), model_uri, tracking_uri, str(out), *cases], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["distmis_modules"] == [] and Path(report["cwd"]) == cwd
    assert not [r for r in report["requirements"] if "+" in r], report["requirements"]
    return report


@pytest.mark.slow  # a fresh Python importing mlflow, torch and MONAI: about 30 s
def test_the_saved_model_predicts_where_distmis_cannot_be_imported(tmp_path: Path):
    model = regions_model()
    folder = save_model([model.network], model.recipe, tmp_path / "model")
    image, _ = bright_case(SHAPE, seed=3)
    for index, name in enumerate(("flair", "t1", "t1ce", "t2")):  # a BraTS-like case: one file per modality
        nib.save(nib.Nifti1Image(image[..., index], ROTATED), str(tmp_path / f"case_{name}.nii.gz"))
    files = ",".join(str(tmp_path / f"case_{name}.nii.gz") for name in ("flair", "t1", "t1ce", "t2"))
    (tmp_path / "elsewhere").mkdir()
    run_without_distmis(str(folder), "sqlite:///" + str(tmp_path / "unused.db"), [files], tmp_path / "labels",
                        tmp_path / "elsewhere")
    np.testing.assert_array_equal(np.load(tmp_path / "labels" / "case_flair.npy"), model.segment(image, "msd"))


def test_a_keras_model_trained_in_float16_predicts_on_a_cpu(tmp_path: Path):
    """A Keras U-Net trained with ``training.precision: fp16`` (on a GPU: the ``mixed_float16`` policy, saved in the
    model file) cannot run on a CPU as saved: TensorFlow has no float16 ``MaxPool3D`` there. Where there is no GPU
    the model's code rebuilds it in float32 with its weights (the float32 master weights): MLflow's own
    ``predict`` gives the float32 network's label map. ``distmis predict`` does the same for a folder whose code was
    saved before that (its ``load_network`` emulated by the plain Keras load)."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import mlflow.pyfunc
    import tensorflow as tf

    from distmis.models.unet3d_tf import build_unet3d
    from tests.predict.test_registry import recipe_for

    assert not tf.config.list_physical_devices("GPU")
    keras.utils.set_random_seed(0)
    sizes = {"in_channels": 4, "num_classes": 3, "base_filters": 4, "levels": 2, "norm": "group", "norm_groups": 2}
    fp16 = build_unet3d(dtype_policy="mixed_float16", **sizes)
    float32 = build_unet3d(**sizes)
    float32.set_weights(fp16.get_weights())
    image = np.random.default_rng(0).normal(100, 20, (20, 20, 20, 4)).astype(np.float32)
    with pytest.raises(tf.errors.NotFoundError, match="MaxPool3D"):  # the model as saved, on this CPU
        fp16(image[None, :16, :16, :16], training=False)

    recipe = recipe_for("tensorflow")
    folder = save_model([fp16], recipe, tmp_path / "model")
    twin = SegmentationModel(recipe, float32)
    labels = mlflow.pyfunc.load_model(str(folder)).predict(image, params={"layout": recipe.layout})
    np.testing.assert_array_equal(labels, twin.segment(image))

    code = folder / "pyfunc_model.py"  # a folder saved before its code rebuilt the model
    plain_load = 'keras_runnable_here(keras.saving.load_model(path, compile=False)), "cpu"'
    assert plain_load in code.read_text()
    code.write_text(code.read_text().replace(plain_load, 'keras.saving.load_model(path, compile=False), "cpu"'))
    volume = pyfunc_model.zscore_nonzero(image)
    np.testing.assert_allclose(SegmentationModel.load(folder).probabilities(volume), twin.probabilities(volume),
                               rtol=0, atol=1e-5)
