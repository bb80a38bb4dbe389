"""A vit-seg search whose trials are sequence-parallel, end to end through ``distmis run``: Ray Tune drives
Ray Train worker groups of 2 gloo ranks that split each tile's tokens; MLflow records the SP configuration."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from mlflow.tracking import MlflowClient

from distmis.cli.main import main
from tests.conftest import small_spec_tree


def run_spec(tree: dict, tmp_path: Path, capsys) -> tuple[MlflowClient, list]:
    """``distmis run`` on ``tree`` (two trials, none failed); the MLflow client of its store and its runs."""
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(tree))
    assert main(["run", str(tmp_path / "spec.yaml"), "--output", str(tmp_path / "out"), "--quiet"]) == 0
    assert "2 trial(s), 0 failed" in capsys.readouterr().out
    client = MlflowClient(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    return client, client.search_runs([client.get_experiment_by_name(tree["name"]).experiment_id])


def trial_runs(runs: list) -> list:
    return [r for r in runs if r.data.tags.get("distmis.role") == "trial"]


def curve(client: MlflowClient, run, metric: str) -> list[float]:
    """A run's metric, epoch by epoch."""
    return [m.value for m in sorted(client.get_metric_history(run.info.run_id, metric), key=lambda m: m.step)]


def test_sp1_and_sp2_trials_follow_the_same_loss_curve(ray_local, tmp_path: Path, capsys):
    tree = small_spec_tree(tmp_path / "data", model={
        "name": "vit-seg", "framework": "torch",
        "params": {"layers": 2, "embed_dim": 32, "heads": 4, "patch": 4, "decoder_features": 16}})
    tree["name"] = "tiny-vit"
    tree["training"].update(epochs=2, tile=[16, 16, 16])
    tree["search"] = {"algorithm": "grid", "space": {"parallelism.sequence_parallel.degree": {"grid": [1, 2]}}}
    tree["parallelism"] = {"sequence_parallel": {"attention": "ulysses", "split": "spatial"}}
    client, runs = run_spec(tree, tmp_path, capsys)
    by_degree = {int(r.data.params["parallelism.sequence_parallel.degree"]): r for r in trial_runs(runs)}
    assert sorted(by_degree) == [1, 2]
    for degree, run in by_degree.items():
        assert run.info.status == "FINISHED"
        assert run.data.params["trial.workers"] == str(degree)
        assert run.data.params["parallelism.sequence_parallel.attention"] == "ulysses"
        assert run.data.params["parallelism.sequence_parallel.split"] == "spatial"

    # Same seed, no dropout: the same data order, tiles and initial weights whatever the degree, and exact
    # sequence parallelism (gather) gives the same gradients, so the same curves.
    for metric in ("train_loss", "val_loss", "val_dice"):
        one, two = curve(client, by_degree[1], metric), curve(client, by_degree[2], metric)
        assert len(one) == len(two) == 2
        np.testing.assert_allclose(two, one, rtol=1e-4, atol=1e-5, err_msg=metric)
    assert curve(client, by_degree[1], "train_loss")[1] < curve(client, by_degree[1], "train_loss")[0]


def test_ulysses_and_dsp_trials_of_an_axial_vit_follow_the_same_loss_curve(ray_local, tmp_path: Path, capsys):
    """attention: [ulysses, dsp] on an axial vit-seg, SP=2, through ``distmis run``: both are exact against one
    device, so both trials train the same weights and log the same curves."""
    tree = small_spec_tree(tmp_path / "data", model={
        "name": "vit-seg", "framework": "torch",
        "params": {"layers": 2, "embed_dim": 32, "heads": 4, "patch": 4, "decoder_features": 16,
                   "attention": "axial"}})
    tree["name"] = "axial-vit"
    tree["training"].update(epochs=2, tile=[16, 16, 16])
    tree["search"] = {"algorithm": "grid",
                      "space": {"parallelism.sequence_parallel.attention": {"grid": ["ulysses", "dsp"]}}}
    tree["parallelism"] = {"sequence_parallel": {"degree": 2}}
    client, runs = run_spec(tree, tmp_path, capsys)
    trials = {r.data.params["parallelism.sequence_parallel.attention"]: r for r in trial_runs(runs)}
    assert sorted(trials) == ["dsp", "ulysses"]
    for run in trials.values():
        assert run.info.status == "FINISHED"
        assert run.data.params["model.params.attention"] == "axial" and run.data.params["trial.workers"] == "2"
    # the performance model's bytes for each: DSP's switches against Ulysses' all-to-alls at every stage
    assert 0 < trials["dsp"].data.metrics["predicted_sent_mb"] < trials["ulysses"].data.metrics["predicted_sent_mb"]

    for metric in ("train_loss", "val_loss", "val_dice"):
        ulysses, dsp = curve(client, trials["ulysses"], metric), curve(client, trials["dsp"], metric)
        assert len(ulysses) == len(dsp) == 2
        np.testing.assert_allclose(dsp, ulysses, rtol=1e-4, atol=1e-5, err_msg=metric)
    assert curve(client, trials["dsp"], "train_loss")[1] < curve(client, trials["dsp"], "train_loss")[0]


def test_a_degree_auto_search_gives_each_trial_the_degree_its_memory_needs(ray_local, tmp_path: Path, capsys):
    """Patch 4 fits one worker, patch 2 (8x the tokens, the math kernel's score matrices 64x) needs two."""
    from distmis.spec.load import network_input
    from distmis.spec.sizing import auto_sp_degree
    from distmis.spec import apply_config, validate_spec

    tree = small_spec_tree(tmp_path / "data", model={
        "name": "vit-seg", "framework": "torch",
        "params": {"layers": 1, "embed_dim": 32, "heads": 4, "patch": 4, "decoder_features": 8,
                   "attention_kernel": "math"}})
    tree["name"] = "auto-vit"
    tree["training"].update(epochs=1, tile=[16, 16, 16])
    tree["search"] = {"algorithm": "grid", "space": {"model.params.patch": {"grid": [4, 2]}}}
    tree["parallelism"] = {"mode": "data", "workers": 1, "resources_per_worker": {"cpu": 0.5},
                           "sequence_parallel": {"degree": "auto", "memory_per_worker": "64GB", "max_degree": 2,
                                                 "attention": "ulysses"}}
    roomy = validate_spec(tree)
    patch2 = apply_config(roomy, {"model.params.patch": 2})
    peaks = auto_sp_degree(patch2, network_input(patch2)).peaks
    tree["parallelism"]["sequence_parallel"]["memory_per_worker"] = 512 * 2**20 + (peaks[1] + peaks[2]) / 2
    _, runs = run_spec(tree, tmp_path, capsys)
    parent = next(r for r in runs if r.data.tags.get("distmis.role") == "search")
    assert parent.data.params["parallelism.sequence_parallel.degree"] == "auto"
    trials = {int(r.data.params["model.params.patch"]): r for r in trial_runs(runs)}
    assert {patch: (r.data.params["parallelism.sequence_parallel.degree"], r.data.params["trial.workers"])
            for patch, r in trials.items()} == {4: ("1", "1"), 2: ("2", "2")}
    assert all(r.info.status == "FINISHED" and r.data.metrics["epochs_completed"] == 1 for r in trials.values())
    # Each run holds the model's prediction for the degree it got, and what the trial measured.
    two, one = trials[2].data.metrics, trials[4].data.metrics
    assert two["predicted_peak_memory_mb"] * 2**20 == pytest.approx(peaks[2])
    assert two["predicted_sent_mb"] > 0 == one["predicted_sent_mb"]  # the SP collectives, none at SP=1
    for metrics in (one, two):
        assert metrics["step_seconds"] > 0 and metrics["peak_memory_mb"] > 0 and metrics["fom"] > 0
