"""The trial layout takes effect where it matters: inside the real trial processes, Ray Train workers and the
workers of a data-mode search's worker group.

Each probe runs the real set-up of a trial (the trainer the search would train), writes down what it finds
in its own process (the optimizer's learning rate, the process group, the model wrapper, the SP group), then
trains as usual. The assertions read those records, not what was logged to MLflow.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from distmis.search.run import run_search
from distmis.trial.trainables import (
    data_parallel_trial,
    resolve_trial,
    runs_on_worker_group,
    train_and_report,
    worker_trainer,
)
from distmis.spec import validate_spec
from distmis.spec.layout import SP_DEGREE_PATH
from distmis.tracking.results import trial_runs as child_runs
from distmis.tracking.predicted import predict_trial
from tests.conftest import small_spec_tree
from tests.search.test_curriculum_search import CURRICULUM, check_curricula
from tests.search.test_sequence_parallel_search import curve, trial_runs

pytestmark = pytest.mark.slow


def dp_tree(data: Path, framework: str, **parallelism) -> dict:
    tree = small_spec_tree(data)
    tree["model"]["framework"] = framework
    tree["training"]["epochs"] = 2
    tree["search"]["space"] = {"training.optimizer.lr": {"grid": [1.0e-3]}}
    tree["parallelism"] = parallelism
    return tree


def assert_a_data_parallel_run(outcome: Any, output: Path, framework: str) -> None:
    """What a data-mode search of one 2-epoch trial on 2 workers records."""
    assert outcome.failed == 0, list(outcome.results.get("error", []))  # whole, not pandas' cut
    client = MlflowClient(outcome.tracking_uri)
    [child] = child_runs(client, client.get_run(outcome.parent_run_id))
    assert child.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(child.info.run_id, "val_dice")) == [1, 2]
    assert child.data.params["trial.workers"] == "2"
    assert float(child.data.params["training.optimizer.effective_lr"]) == pytest.approx(2e-3)  # linear scaling
    # Rank 0 kept a checkpoint of the best epoch: on the search's worker group, in the Tune trial's storage.
    name = "model.weights.h5" if framework == "tensorflow" else "model.pt"
    assert list((output / "ray_results").rglob(name)) and not list((output / "ray_train").rglob(name))
    assert (Path(child.data.tags["distmis.checkpoint"]) / name).is_file()  # the latest, tagged on the trial's run
    assert 0 <= outcome.best["best_val_dice"] <= 1
    # Its start-up, part by part, logged once with the first epoch.
    parts = ["workers", "data"]  # the group (started, or kept), then the trainer's model and data
    startup = {part: client.get_metric_history(child.info.run_id, f"startup_{part}_s") for part in parts + ["total"]}
    assert all(len(points) == 1 and points[0].step == 1 and points[0].value >= 0 for points in startup.values())
    assert startup["workers"][0].value > 0  # a worker group does not start in no time
    assert sum(startup[p][0].value for p in parts) == pytest.approx(startup["total"][0].value, abs=0.01)
    # each epoch: the traced model's prediction of a rank's step, beside its measurement (Keras: by its allocator)
    for key in ("predicted_step_memory_mb", "predicted_peak_memory_mb", "peak_memory_mb"):
        points = client.get_metric_history(child.info.run_id, key)
        assert [p.step for p in points] == [1, 2] and all(p.value > 0 for p in points), key


def optimizer_lr(trainer: Any) -> float:
    if hasattr(trainer.optimizer, "param_groups"):  # torch
        return float(trainer.optimizer.param_groups[0]["lr"])
    return float(trainer.optimizer.learning_rate.numpy())  # Keras


def frameworks_imported() -> list[str]:
    import sys

    return sorted(name for name in ("tensorflow", "torch") if name in sys.modules)


def weights_sum(trainer: Any) -> float:
    """The sum of the absolute values of this rank's model's weights (torch): what training moves."""
    return float(sum(p.detach().abs().sum() for p in trainer.model.parameters()))


def record(out_dir: str, spec: Any, layout: Any, trainer: Any, rank: int = 0,
           before: dict[str, Any] | None = None) -> dict[str, Any]:
    """What this process really holds, written to ``out_dir/<world size>-<rank>.json``; ``before``: what it
    held when the worker loop began."""
    import torch.distributed as dist

    found: dict[str, Any] = {"rank": rank, **(before or {}),
        "layout_world_size": layout.world_size, "layout_dp": layout.dp, "layout_sp": layout.sp,
        "lr": optimizer_lr(trainer), "spec_lr": spec.training.optimizer.lr,
        "degree": spec.parallelism.sequence_parallel.degree,
        "train_model": type(getattr(trainer, "train_model", trainer.model)).__name__,
        "world_size": dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1,
    }
    if hasattr(trainer, "strategy"):  # TensorFlow
        found["replicas"] = int(trainer.strategy.num_replicas_in_sync)
    mesh = getattr(trainer, "mesh", None)  # torch: the trial's TrialMesh
    if mesh is not None:
        found.update(sp_size=mesh.sp_size, dp_size=mesh.dp_size, sp_ranks=list(mesh.sp_ranks))
        if mesh.pp_size > 1:
            found.update(pp_size=mesh.pp_size, pp_ranks=list(mesh.pp_ranks))
    pipeline = getattr(getattr(trainer, "parallelism", None), "pipeline", None)
    if pipeline is not None:  # this rank's stage: its cells, and the parameters its optimizer updates
        found["stage_index"] = pipeline.stage_index
        found["stage_cells"] = [type(c).__name__ for c in pipeline.stage_module.cells]
        found["optimizer_parameters"] = sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"])
        found["stage_parameters"] = sum(p.numel() for p in pipeline.stage_module.parameters())
        found["model_parameters"] = trainer.num_parameters
    model = getattr(trainer, "train_model", None)
    if type(model).__name__ == "DistributedDataParallel":
        found["wrapped_model"] = type(model.module).__name__
    if type(model).__name__ == "SequenceParallelViTSeg":
        found["wrapper_sp_size"] = model.sp_size
        found["attention_cores"] = sorted({type(m.core).__name__ for m in model.model.modules() if hasattr(m, "core")})
        found["dsp_switches"] = [(block, stage, repr(switch)) for block, stage, switch in model.switches]
        found["output_boxes"] = [[[s.start, s.stop] for s in c.box] for c in model.output_chunks]
    Path(out_dir, f"{layout.world_size}-{found['rank']}.json").write_text(json.dumps(found))
    return found


def probe_worker(out_dir: str, loop_config: dict[str, Any]) -> None:
    import os

    import ray.train

    from distmis.train.startup import StartupClock

    clock = StartupClock(since=loop_config.get("submitted_at"))  # as distmis's own worker loop times its start
    clock.mark("workers")
    before = {"imported_at_start": frameworks_imported(), "tf_config": json.loads(os.environ.get("TF_CONFIG", "null"))}
    spec, layout, trainer = worker_trainer(loop_config, clock)
    rank = ray.train.get_context().get_world_rank()
    found = record(out_dir, spec, layout, trainer, rank=rank, before=before)
    found["weights_before"] = weights_sum(trainer)
    train_and_report(trainer, spec, ray.train.report, ray.train.Checkpoint, rank=rank, primary=rank == 0,
                     startup=clock.seconds())
    found["lr_after"] = optimizer_lr(trainer)  # the rate of the last epoch (training.lr_schedule)
    found["weights_after"] = weights_sum(trainer)
    Path(out_dir, f"{layout.world_size}-{rank}.json").write_text(json.dumps(found))


def probe_single(out_dir: str, config: dict[str, Any], *, spec: Any, tfrecord_dir: str) -> None:
    from ray import tune

    from distmis.trial.trainers import build_trainer

    trial, layout = resolve_trial(spec, config)
    trainer = build_trainer(trial, layout, tfrecord_dir)
    record(out_dir, trial, layout, trainer)
    train_and_report(trainer, trial, tune.report, tune.Checkpoint)


def probed_epochs(out_dir: str, epoch_reports: Any, trainer: Any, spec: Any, **kwargs: Any) -> Any:
    """A worker group's epoch loop, recorded before and after the trial's training (in the worker's process)."""
    import os

    rank = kwargs.get("rank", 0)
    layout = trainer.layout if hasattr(trainer, "layout") else trainer.mesh.layout
    before = {"imported_at_start": frameworks_imported(), "tf_config": json.loads(os.environ.get("TF_CONFIG", "null"))}
    found = record(out_dir, spec, layout, trainer, rank=rank, before=before)
    torch = hasattr(trainer.model, "parameters")
    if torch:
        found["weights_before"] = weights_sum(trainer)
    yield from epoch_reports(trainer, spec, **kwargs)
    found["lr_after"] = optimizer_lr(trainer)  # the rate of the last epoch (training.lr_schedule)
    if torch:
        found["weights_after"] = weights_sum(trainer)
    Path(out_dir, f"{layout.world_size}-{rank}.json").write_text(json.dumps(found))


def install_probe(worker: Any, out_dir: str) -> None:
    """Record the next trials this worker of a data-mode search's worker group trains (run inside it by
    ``__ray_call__``): its epoch loop, wrapped."""
    import distmis.train.loop as loop

    original = getattr(loop.epoch_reports, "unprobed", loop.epoch_reports)
    loop.epoch_reports = functools.partial(probed_epochs, out_dir, original)
    loop.epoch_reports.unprobed = original


def probe_trial(out_dir: str, config: dict[str, Any], **kwargs: Any) -> None:
    if "parallelism.sequence_parallel.attention" in config:  # records are named by world size and rank: a folder
        out_dir = str(Path(out_dir, str(config["parallelism.sequence_parallel.attention"])))  # per searched value
        Path(out_dir).mkdir(exist_ok=True)
    if "storage_path" in kwargs and runs_on_worker_group(kwargs["spec"]):
        import ray

        from distmis.trial import worker_group

        # the search's worker group, as the trial will find it, its workers' epoch loop probed
        trial, layout = resolve_trial(kwargs["spec"], config)
        group = worker_group.group_for(layout, Path(kwargs["storage_path"]).name, trial.model.framework)
        ray.get([w.__ray_call__.remote(install_probe, out_dir) for w in group.workers])
        data_parallel_trial(config, **kwargs)  # on that group: no worker loop to replace
        Path(out_dir, "trial-process.json").write_text(json.dumps({"imported": frameworks_imported()}))
        return None
    if "storage_path" in kwargs:
        data_parallel_trial(config, worker_loop=functools.partial(probe_worker, out_dir), **kwargs)
        # the trial's own process, which only drove the Ray Train run
        Path(out_dir, "trial-process.json").write_text(json.dumps({"imported": frameworks_imported()}))
        return None
    return probe_single(out_dir, config, **kwargs)


def run_probed(tree: dict, tmp_path: Path) -> dict[str, dict[str, Any]]:
    return run_probed_search(tree, tmp_path)[1]


def run_probed_search(tree: dict, tmp_path: Path) -> tuple[Any, dict[str, dict[str, Any]]]:
    """The search's outcome and the probes' records."""
    probes = tmp_path / "probes"
    probes.mkdir()
    outcome = run_search(validate_spec(tree), tmp_path / "out", progress=False,
                         trainable=functools.partial(probe_trial, str(probes)))
    assert outcome.failed == 0, list(outcome.results.get("error", []))  # whole, not pandas' cut
    return outcome, {p.stem: json.loads(p.read_text()) for p in probes.glob("*.json")}


def run_probed_command(tree: dict, tmp_path: Path, capsys: Any, monkeypatch: Any) -> tuple[Any, list, Path]:
    """``distmis run`` on ``tree`` (two trials, none failed) with the probe as every trial's function: the MLflow
    client of its store, its runs, and the folder of the probes' records."""
    import yaml
    from mlflow.tracking import MlflowClient

    import distmis.search.run as run_module
    from distmis.cli.main import main

    probes = tmp_path / "probes"
    probes.mkdir()
    monkeypatch.setattr(run_module, "run_search", functools.partial(
        run_module.run_search, trainable=functools.partial(probe_trial, str(probes))))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(tree))
    assert main(["run", str(tmp_path / "spec.yaml"), "--output", str(tmp_path / "out"), "--quiet"]) == 0
    assert "2 trial(s), 0 failed" in capsys.readouterr().out
    client = MlflowClient(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    return client, client.search_runs([client.get_experiment_by_name(tree["name"]).experiment_id]), probes


def history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def records(folder: Path) -> dict[str, dict[str, Any]]:
    """The workers' records in ``folder`` by ``<world size>-<rank>`` (the trial processes' left out)."""
    return {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json") if p.stem != "trial-process"}


def assert_same_curves(client: Any, first: Any, second: Any, epochs: int = 2) -> None:
    """Two trial runs logged the same training and validation curves, ``epochs`` epochs each."""
    for metric in ("train_loss", "val_loss", "val_dice"):
        one, two = curve(client, first, metric), curve(client, second, metric)
        assert len(one) == len(two) == epochs
        np.testing.assert_allclose(two, one, rtol=1e-4, atol=1e-5, err_msg=metric)


def assert_trained(ranks: Any) -> None:
    """Every rank's weights moved in training (equal curves of two trials are then two trainings' alike)."""
    ranks = list(ranks)
    assert ranks and all(rank["weights_after"] != pytest.approx(rank["weights_before"], rel=1e-6) for rank in ranks)


def worker_records(found: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: rank for name, rank in found.items() if name != "trial-process"}


def one_epoch_tree(data: Path, framework: str = "torch", **parallelism: Any) -> dict:
    tree = dp_tree(data, framework, **parallelism)
    tree["training"]["epochs"] = 1
    return tree


def test_single_process_trial_trains_at_the_spec_lr(ray_local, tmp_path: Path):
    found = run_probed(one_epoch_tree(tmp_path / "data", "torch"), tmp_path)
    assert list(found) == ["1-0"]
    assert found["1-0"]["lr"] == pytest.approx(1e-3) and found["1-0"]["world_size"] == 1
    assert found["1-0"]["train_model"] == "UNet3D"


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_data_parallel_workers_train_at_the_effective_lr_and_follow_its_schedule(ray_local, tmp_path: Path,
                                                                                   framework: str):
    tree = one_epoch_tree(tmp_path / "data", framework, mode="data", workers=2, resources_per_worker={"cpu": 1})
    tree["training"].update(epochs=2, lr_schedule={"name": "poly", "power": 1.0})
    outcome, found = run_probed_search(tree, tmp_path)
    assert_a_data_parallel_run(outcome, tmp_path / "out", framework)  # the run, its checkpoint and start-up
    # Only the workers import the framework, and only the trial's own one (the search's worker group,
    # distmis.trial.worker_group)
    assert "tensorflow" not in found.pop("trial-process")["imported"]
    assert sorted(found) == ["2-0", "2-1"]  # two workers, one record each
    for rank in found.values():
        assert rank["layout_world_size"] == 2 and rank["layout_dp"] == 2
        # epoch 2 of 2 trains at (1 - 1/2) of the peak (training.lr_schedule), in each worker's optimizer: 1e-3 of
        # the peak 2e-3 that linear scaling gives 2 replicas (unscaled, 5e-4)
        assert rank["lr_after"] == pytest.approx(1e-3)
        if framework == "torch":
            assert rank["lr"] == pytest.approx(2e-3)  # as the worker set up: the scaled peak, in the optimizer
            assert "tensorflow" not in rank["imported_at_start"]
            assert rank["world_size"] == 2 and rank["train_model"] == "DistributedDataParallel"
            assert rank["tf_config"] is None
        else:
            assert rank["replicas"] == 2
            assert rank["tf_config"]["task"] == {"type": "worker", "index": rank["rank"]}
    if framework == "tensorflow":  # both workers hold the same cluster of two addresses
        clusters = {json.dumps(rank["tf_config"]["cluster"]) for rank in found.values()}
        assert len(clusters) == 1 and len(set(found["2-0"]["tf_config"]["cluster"]["worker"])) == 2


def test_sequence_parallel_hybrid_trials_hold_the_groups_their_layout_says_and_follow_one_loss_curve(
        ray_local, tmp_path: Path, capsys, monkeypatch):
    """Degree 1 and 2 searched through ``distmis run``, two data-parallel replicas each: 2 and 4 ranks, the two
    trials at once (a hybrid search: several multi-worker trials side by side); the lr scales with DP only; both
    trials train the same weights (MLflow's curves); each logs the performance model's predictions for its layout
    and its measured steps."""
    tree = small_spec_tree(tmp_path / "data", model={
        "name": "vit-seg", "framework": "torch",
        "params": {"layers": 1, "embed_dim": 16, "heads": 4, "patch": 4, "decoder_features": 8}})
    tree["name"] = "tiny-vit"
    tree["training"].update(epochs=2, tile=[8, 8, 8], batch_size=1)
    tree["search"] = {"algorithm": "grid", "space": {"parallelism.sequence_parallel.degree": {"grid": [1, 2]}}}
    # A quarter CPU per worker: both trials (2 and 4 workers) run at once on the 2-CPU test cluster.
    tree["parallelism"] = {"workers_per_trial": 2, "resources_per_worker": {"cpu": 0.25},
                           "sequence_parallel": {"attention": "ulysses", "split": "spatial"}}
    client, runs, probes = run_probed_command(tree, tmp_path, capsys, monkeypatch)
    found = records(probes)
    assert sorted(found) == ["2-0", "2-1", "4-0", "4-1", "4-2", "4-3"]
    for name, rank in found.items():
        degree = rank["degree"]
        assert rank["world_size"] == rank["layout_world_size"] == 2 * degree
        assert rank["lr"] == pytest.approx(2e-3)  # dp=2 whatever the degree
        assert (rank["sp_size"], rank["dp_size"]) == (degree, 2)
        if degree == 1:
            # no SP wrapper when there is nothing to split: the two replicas in DDP, as any network's
            assert rank["train_model"] == "DistributedDataParallel" and rank["wrapped_model"] == "ViTSeg"
        else:
            assert rank["train_model"] == "SequenceParallelViTSeg" and rank["wrapper_sp_size"] == 2
            assert rank["attention_cores"] == ["UlyssesAttention"]
            r = rank["rank"]
            assert rank["sp_ranks"] == [r - r % 2, r - r % 2 + 1]  # SP groups of consecutive ranks

    by_degree = {int(r.data.params["parallelism.sequence_parallel.degree"]): r for r in trial_runs(runs)}
    assert sorted(by_degree) == [1, 2]
    parent = next(r for r in runs if r.data.tags.get("distmis.role") == "search")
    assert "hybrid" in parent.data.tags["distmis.layout"]
    trials = list(by_degree.values())
    assert max(r.info.start_time for r in trials) < min(r.info.end_time for r in trials)  # they overlapped
    for degree, run in by_degree.items():
        assert run.info.status == "FINISHED"
        assert run.data.params["trial.workers"] == str(2 * degree)
        assert run.data.params["parallelism.sequence_parallel.attention"] == "ulysses"
        assert run.data.params["parallelism.sequence_parallel.split"] == "spatial"
    # Same seed, no dropout: the same data order, tiles and initial weights whatever the degree, and exact
    # sequence parallelism (gather) gives the same gradients, so the same curves.
    assert_same_curves(client, by_degree[1], by_degree[2])
    assert_trained(found.values())  # the curves agree because both trained alike, not because neither did
    # The performance model against measurement: each trial's predictions for its own layout (step 0), and its
    # workers' steps reported through Tune to the driver, per epoch.
    spec = validate_spec(tree)
    for degree, run in by_degree.items():
        expected = predict_trial(*resolve_trial(spec, {SP_DEGREE_PATH: degree}))
        assert {k: v for k, v in run.data.metrics.items() if k.startswith("predicted_")} == pytest.approx(expected)
        seconds = history(client, run.info.run_id, "step_seconds")
        assert [step for step, _ in seconds] == [1, 2] and all(value > 0 for _, value in seconds)
        assert all(value >= 0 for _, value in history(client, run.info.run_id, "peak_memory_mb"))
        # fom = b L s^2 d / step_seconds: 1 sample per rank, 1 layer, (8/4)^3 = 8 tokens of width 16
        assert [value for _, value in history(client, run.info.run_id, "fom")] == pytest.approx(
            [1 * 1 * 8**2 * 16 / value for _, value in seconds])


def test_pipelined_trials_hold_their_stage_and_groups_and_follow_one_loss_curve(ray_local, tmp_path: Path, capsys,
                                                                                 monkeypatch):
    """stages [1, 2] with two data-parallel replicas, through ``distmis run`` in data mode: 2 and 4 ranks (the
    search's worker group of 2 made again with 4 for the second trial); each rank of a pipelined trial holds one
    stage (its optimizer only that stage's parameters), pipelines of consecutive ranks, the lr scaled by DP only;
    both trials train the same weights (MLflow's curves) on a curriculum (the stage's input changes, and the
    pipeline with it) and the search ends in a scored model, applied to the whole volume as it was trained last;
    each trial's best model is timed and scored by whole-volume and by sliding-window inference. (Ray Train's
    workers build the same trainer over the same mesh: the hybrid SP test above runs them.)"""
    tree = small_spec_tree(tmp_path / "data", model={
        "name": "unet3d", "framework": "torch", "params": {"base_filters": 4, "levels": 3, "norm": "group",
                                                           "norm_groups": 2}})
    tree["name"] = "tiny-pipeline"
    tree["dataset"]["synthetic"]["cases"] = 8  # 4 training cases: a full batch of 2 for each replica
    tree["training"].pop("epochs")
    tree["training"].update(batch_size=2, curriculum=CURRICULUM, inference={"compare": True})
    tree["search"] = {"algorithm": "grid", "space": {"parallelism.pipeline.stages": {"grid": [1, 2]}}}
    tree["parallelism"] = {"mode": "data", "workers": 2, "resources_per_worker": {"cpu": 0.5},
                           "pipeline": {"microbatches": 2, "schedule": "1f1b"}}
    client, runs, probes = run_probed_command(tree, tmp_path, capsys, monkeypatch)
    found = records(probes)
    assert sorted(found) == ["2-0", "2-1", "4-0", "4-1", "4-2", "4-3"]
    for name in ("2-0", "2-1"):  # stages 1: plain data parallelism
        assert found[name]["train_model"] == "DistributedDataParallel" and "pp_size" not in found[name]
    stages = [found[f"4-{r}"] for r in range(4)]
    for r, rank in enumerate(stages):
        assert rank["world_size"] == rank["layout_world_size"] == 4
        assert rank["lr"] == pytest.approx(2e-3)  # dp=2: the two stages of a pipeline share one sample
        assert (rank["pp_size"], rank["dp_size"]) == (2, 2)
        assert rank["pp_ranks"] == [r - r % 2, r - r % 2 + 1] and rank["stage_index"] == r % 2
        assert rank["train_model"] == "StageCells"
        assert 0 < rank["optimizer_parameters"] == rank["stage_parameters"] < rank["model_parameters"]
    assert stages[0]["stage_cells"][0] == "EncoderCell" and stages[1]["stage_cells"][-1] == "DecoderCell"
    # the two stages of a pipeline hold the whole model between them, each parameter once
    assert stages[0]["stage_parameters"] + stages[1]["stage_parameters"] == stages[0]["model_parameters"]

    by_stages = {int(r.data.params["parallelism.pipeline.stages"]): r for r in trial_runs(runs)}
    assert sorted(by_stages) == [1, 2]
    for stage_count, run in by_stages.items():
        assert run.info.status == "FINISHED"
        assert run.data.params["trial.workers"] == str(2 * stage_count)
        assert run.data.params["parallelism.pipeline.schedule"] == "1f1b"
        assert run.data.metrics["step_seconds"] > 0 and run.data.metrics["peak_memory_mb"] > 0
    # Same seed and data order, group norm and full batches: the pipeline's micro-batches give the batch's own
    # gradients, so both trials train the same weights.
    assert_same_curves(client, by_stages[1], by_stages[2], epochs=3)
    assert_trained(found.values())  # the curves agree because both trained alike, not because neither did
    # the search ends in a registered model with test metrics, whichever trial won
    parent = next(r for r in runs if r.data.tags.get("distmis.role") == "search")
    assert any(key.startswith("test_") for key in parent.data.metrics)
    # each epoch's curriculum stage and tile; the model applied to the whole volume, as trained last
    check_curricula(client, runs, tmp_path)
    # the best model of each trial, timed and scored by whole-volume and by sliding-window inference (8^3 windows)
    for run in by_stages.values():
        for way in ("whole_volume", "sliding_window"):
            assert 0 <= run.data.metrics[f"{way}_dice"] <= 1 and run.data.metrics[f"{way}_seconds"] > 0
    table = pd.read_csv(client.download_artifacts(parent.info.run_id, "inference.csv", str(tmp_path)))
    assert sorted(table["stages"]) == [1, 2] and {"whole_volume_seconds", "sliding_window_dice"} <= set(table)


def test_axial_trials_hold_the_dsp_switches_or_the_ulysses_cores_and_follow_one_loss_curve(ray_local, tmp_path: Path,
                                                                                            capsys, monkeypatch):
    """attention: [ulysses, dsp] on an axial vit-seg at degree 2, through ``distmis run``: each worker's model has
    what its trial asked; both are exact against one device, so both trials train the same weights and log the same
    curves; the performance model's bytes for each are logged."""
    from distmis.perf.partition import AXES, dsp_schedule

    tree = small_spec_tree(tmp_path / "data", model={
        "name": "vit-seg", "framework": "torch",
        "params": {"layers": 2, "embed_dim": 32, "heads": 4, "patch": 4, "decoder_features": 16,
                   "attention": "axial"}})
    tree["name"] = "axial-vit"
    tree["training"].update(epochs=2, tile=[16, 8, 16])  # a (4, 2, 4) grid
    tree["search"] = {"algorithm": "grid",
                      "space": {"parallelism.sequence_parallel.attention": {"grid": ["ulysses", "dsp"]}}}
    tree["parallelism"] = {"mode": "data", "workers": 1, "resources_per_worker": {"cpu": 0.5},
                           "sequence_parallel": {"degree": 2}}
    client, runs, probes = run_probed_command(tree, tmp_path, capsys, monkeypatch)
    found = {attention: [records(probes / attention)[name] for name in ("2-0", "2-1")]
             for attention in ("ulysses", "dsp")}
    schedule = dsp_schedule((4, 2, 4), 2, 2)
    expected_switches = [[s // 3, s % 3, f"SplitSwitch({AXES[schedule.splits[s - 1]]} -> {AXES[schedule.splits[s]]})"]
                         for s in schedule.switch_stages]
    for rank in found["dsp"]:
        assert rank["train_model"] == "SequenceParallelViTSeg" and rank["world_size"] == 2
        assert rank["attention_cores"] == ["LineAttention"]  # DSP leaves every stage's attention local
        assert rank["dsp_switches"] == expected_switches and len(expected_switches) == schedule.switches > 0
        last = schedule.last  # the encoder's output: slabs along the schedule's last axis
        half = (4, 2, 4)[last] // 2
        assert [box[last] for box in rank["output_boxes"]] == [[0, half], [half, 2 * half]]
    for rank in found["ulysses"]:
        assert rank["attention_cores"] == ["UlyssesAxialAttention"] and rank["dsp_switches"] == []

    trials = {r.data.params["parallelism.sequence_parallel.attention"]: r for r in trial_runs(runs)}
    assert sorted(trials) == ["dsp", "ulysses"]
    for run in trials.values():
        assert run.info.status == "FINISHED"
        assert run.data.params["model.params.attention"] == "axial" and run.data.params["trial.workers"] == "2"
    # the performance model's bytes for each: DSP's switches against Ulysses' all-to-alls at every stage
    assert 0 < trials["dsp"].data.metrics["predicted_sent_mb"] < trials["ulysses"].data.metrics["predicted_sent_mb"]
    assert_same_curves(client, trials["ulysses"], trials["dsp"])
    assert_trained([*found["ulysses"], *found["dsp"]])  # alike, not untrained alike
