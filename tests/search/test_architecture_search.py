"""Which network for my data: ``model.name`` searched over the DistMIS U-Net and MONAI's networks, end to end through
``distmis run``, in experiment mode (a process per trial) and in data mode (the U-Net and SwinUNETR, each trial on 2
Ray Train workers): every trial finishes, logs its network and parameter count (that of the MONAI constructor called
with the logged params), its data set as MLflow dataset inputs and its system use as MLflow system metrics, the best
one is registered and segments new scans through ``distmis predict``. Also searched: one network's own constructor
arguments (segresnet's ``init_filters``)."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
from pathlib import Path

import mlflow
import nibabel as nib
import numpy as np
import pytest
import yaml

from distmis.cli.main import main
from distmis.data.synthetic import synthesize_dataset
from distmis.models.registry import model_entry
from distmis.search.state import SearchState

ARCHITECTURES = ["unet3d", "segresnet", "swinunetr", "dynunet"]
# Data mode trains a convolutional network and the transformer on 2 workers each; every network's data-parallel
# wrapping of its own: tests/models/test_registry.py.
SEARCHED = {"experiment": ARCHITECTURES, "data": ["unet3d", "swinunetr"]}
PER_MODEL = {"segresnet": {"init_filters": 8, "blocks_down": [1, 1, 1], "blocks_up": [1, 1]},
             # at 32^3 SwinUNETR's deepest map is one voxel: group norm (instance norm needs more than one)
             "swinunetr": {"feature_size": 12, "depths": [1, 1, 1, 1], "norm_name": ["group", {"num_groups": 4}]},
             "dynunet": {"filters": [4, 8, 16, 32]}}


def spec_tree(data: Path, name: str, *, mode: str, space: dict, model: dict) -> dict:
    """6 synthetic brain cases of 32^3, whole volumes, 2 epochs (1 for the searches of one network's arguments)."""
    parallelism = ({"mode": "data", "workers": 2, "resources_per_worker": {"cpu": 1}} if mode == "data"
                   else {"mode": "experiment", "resources_per_trial": {"cpu": 1}})
    return {
        "name": name,
        "dataset": {"path": str(data), "layout": "msd", "labels": "whole-tumour",
                    "synthetic": {"cases": 6, "shape": [32, 32, 32], "seed": 0},
                    "split": {"train": 0.5, "val": 0.25, "test": 0.25, "seed": 0}},
        "model": {"framework": "torch", **model},
        "training": {"epochs": 2 if "model.name" in space else 1, "batch_size": 2, "tile": None,
                     "optimizer": {"lr": 1.0e-3}, "seed": 0},
        "search": {"algorithm": "grid", "space": space},
        "parallelism": parallelism,
    }


def run_search(folder: Path, tree: dict) -> SearchState:
    spec = folder / "spec.yaml"
    spec.write_text(yaml.safe_dump(tree))
    assert main(["run", str(spec), "--output", str(folder / "out")]) == 0
    state = SearchState.load(folder / "out")
    assert state is not None and state.status == "finished"
    return state


@pytest.fixture(scope="module", params=["experiment", "data"])
def architecture_search(request, ray_local, tmp_path_factory) -> tuple[Path, SearchState]:
    folder = tmp_path_factory.mktemp(f"architectures-{request.param}")
    model = {"name": "unet3d", "params": {"base_filters": 4, "levels": 4, "norm": "group"}, "per_model": PER_MODEL}
    tree = spec_tree(folder / "data", f"architectures-{request.param}", mode=request.param,
                     space={"model.name": {"grid": SEARCHED[request.param]}}, model=model)
    return folder, run_search(folder, tree)


def trial_runs(state: SearchState) -> list[mlflow.entities.Run]:
    client = mlflow.MlflowClient(state.tracking_store)
    search_run = client.get_run(state.run_id)
    return client.search_runs([search_run.info.experiment_id],
                              filter_string=f"tags.mlflow.parentRunId = '{state.run_id}'")


def logged_params(run: mlflow.entities.Run) -> dict[str, object]:
    """The trial's ``model.params.*`` as logged (strings), read back as Python values."""
    return {key.removeprefix("model.params."): None if text == "None" else yaml.safe_load(text)
            for key, text in run.data.params.items() if key.startswith("model.params.")}


def constructor_parameters(name: str, params: dict[str, object], *, in_channels: int, out_channels: int,
                           tile: tuple[int, int, int]) -> int:
    """``sum(p.numel())`` of the library's own constructor called with the logged params (the U-Net: distmis's)."""
    entry = model_entry(name)
    if entry.constructor is None:
        from distmis.models.registry import NetworkInput
        from distmis.networks import build_network

        network = build_network(entry, entry.params.model_validate(params),
                                NetworkInput(in_channels, out_channels, tile))
        return sum(p.numel() for p in network.parameters())
    module, _, attribute = entry.constructor.partition(":")
    cls = getattr(importlib.import_module(module), attribute)
    arguments = {key: tuple(value) if isinstance(value, list) else value for key, value in params.items()}
    if name == "dynunet":  # the kernels and strides distmis plans from the tile (isotropic synthetic spacing)
        from distmis.models.monai_nets import dynunet_arguments
        from distmis.models.registry import NetworkInput

        arguments = dynunet_arguments(entry.params.model_validate(params),
                                      NetworkInput(in_channels, out_channels, tile))
    accepted = inspect.signature(cls).parameters
    arguments.update({key: value for key, value in (("spatial_dims", 3), ("in_channels", in_channels),
                                                    ("out_channels", out_channels), ("img_size", tile))
                      if key in accepted})
    network = cls(**arguments)
    return sum(p.numel() for p in network.parameters())


@pytest.mark.slow  # two searches of 4 and 2 networks x 2 epochs on 32^3 volumes (one per mode), a prediction each
def test_an_architecture_search_trains_every_network_and_registers_the_best(architecture_search, tmp_path: Path):
    folder, state = architecture_search
    runs = trial_runs(state)
    client = mlflow.MlflowClient(state.tracking_store)

    # every network trained to the end, and says which it is and how many parameters it has
    searched = SEARCHED[client.get_run(state.run_id).data.params["parallelism.mode"]]
    assert sorted(run.data.params["model.name"] for run in runs) == sorted(searched)
    assert {run.info.status for run in runs} == {"FINISHED"}
    for run in runs:
        name = run.data.params["model.name"]
        expected = constructor_parameters(name, logged_params(run), in_channels=4, out_channels=1, tile=(32, 32, 32))
        assert int(run.data.params["model.num_parameters"]) == expected, name
        assert [m.step for m in client.get_metric_history(run.info.run_id, "val_dice")] == [1, 2]

    # the best network is registered, and segments new scans
    version = client.get_model_version_by_alias(state_name(folder), "best")
    best = next(run for run in runs if run.info.run_id == version.run_id)
    assert best.data.params["model.name"] in ARCHITECTURES
    synthesize_dataset(folder / "new", "msd", cases=2, shape=(40, 36, 28), seed=5, progress=False)
    images = folder / "new" / "imagesTr"
    out = tmp_path / "segs"
    assert main(["predict", str(folder / "out"), str(images), "--output", str(out), "--quiet"]) == 0
    for scan in sorted(images.glob("*.nii.gz")):
        segmentation = nib.load(out / scan.name.replace(".nii.gz", "_seg.nii.gz"))
        assert segmentation.shape == nib.load(scan).shape[:3]
        assert set(np.unique(np.asarray(segmentation.dataobj))) <= {0, 1}


@pytest.mark.slow  # reads back the searches of the test above
def test_every_run_records_its_data_and_each_trial_its_system_use(architecture_search):
    """MLflow's own features, read back through its client: the data set's parts as dataset inputs (the UI's
    "Dataset" column) and each trial's CPU and memory use as system metrics (its "System metrics" tab), every rank's
    in a data-parallel trial."""
    folder, state = architecture_search
    client = mlflow.MlflowClient(state.tracking_store)
    search = client.get_run(state.run_id)
    manifest = json.loads(Path(client.download_artifacts(state.run_id, "tfrecord_manifest.json")).read_text())
    digests = {part: hashlib.sha256("".join(shard["sha256"] for shard in info["shards"]).encode()).hexdigest()[:10]
               for part, info in manifest["splits"].items()}  # the content of each part's shards
    assert dataset_inputs(search) == {part: (part, "BRATS", digests[part]) for part in ("train", "val", "test")}
    ranks = [0, 1] if search.data.params["parallelism.mode"] == "data" else [0]  # 2 Ray Train workers a trial
    for run in trial_runs(state):
        scored = {"test": ("test", "BRATS", digests["test"])} if "test_dice_WT" in run.data.metrics else {}
        assert dataset_inputs(run) == {"train": ("train", "BRATS", digests["train"]),
                                       "val": ("val", "BRATS", digests["val"]), **scored}
        system = sorted(key for key in run.data.metrics if key.startswith("system/"))
        assert system == sorted(["system/cpu_utilization_percentage", "system/system_memory_usage_megabytes",
                                 "system/system_memory_usage_percentage",
                                 *(f"system/rank{r}_{figure}" for r in ranks
                                   for figure in ("cpu_utilization_percentage", "memory_usage_megabytes"))])
        for key in system:
            history = client.get_metric_history(run.info.run_id, key)
            assert {m.step for m in history} == {1, 2}  # at least one sample with each epoch's report
            assert all(run.info.start_time <= m.timestamp <= run.info.end_time for m in history)
            assert all(m.value >= 0 for m in history)
        for r in ranks:  # each rank's process holds a network and its data: well over 50 MB
            assert min(m.value for m in client.get_metric_history(run.info.run_id,
                                                                  f"system/rank{r}_memory_usage_megabytes")) > 50


def dataset_inputs(run: mlflow.entities.Run) -> dict[str, tuple[str, str, str]]:
    """A run's MLflow dataset inputs, ``{part: (context, data set name, digest)}``."""
    out = {}
    for item in run.inputs.dataset_inputs:
        tags = {tag.key: tag.value for tag in item.tags}
        out[tags["distmis.part"]] = (tags["mlflow.data.context"], item.dataset.name, item.dataset.digest)
    return out


def state_name(folder: Path) -> str:
    """The registered model's name: the spec's ``name``."""
    return yaml.safe_load((folder / "spec.yaml").read_text())["name"]


@pytest.mark.slow  # a search of 2 one-epoch trials
def test_a_network_s_own_constructor_arguments_are_searched(ray_local, tmp_path: Path):
    """SegResNet's ``init_filters``: a MONAI network's own argument, searched as ``model.params.init_filters``
    (each entry's params as its constructor's arguments, with MONAI's defaults: tests/models/test_registry.py)."""
    name, field, values = "segresnet", "init_filters", [8, 16]
    params = {key: value for key, value in PER_MODEL[name].items() if key != field}
    tree = spec_tree(tmp_path / "data", f"{name}-{field}", mode="experiment",
                     space={f"model.params.{field}": {"grid": values}}, model={"name": name, "params": params})
    state = run_search(tmp_path, tree)
    runs = trial_runs(state)
    assert sorted(int(run.data.params[f"model.params.{field}"]) for run in runs) == values
    assert {run.info.status for run in runs} == {"FINISHED"}
    counts = {int(run.data.params[f"model.params.{field}"]): int(run.data.params["model.num_parameters"])
              for run in runs}
    assert counts[values[0]] < counts[values[1]]  # a wider network has more parameters
