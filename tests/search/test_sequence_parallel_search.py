"""A vit-seg search whose trials are sequence-parallel, end to end through ``distmis run``: Ray Tune drives
Ray Train worker groups of 2 gloo ranks that split each tile's tokens; MLflow records the SP configuration.

Here: ``degree: auto``. The searches over the degree and over the attention (their loss curves, and what each
worker holds) are in ``tests/search/test_layout_in_workers.py``, one search each."""

from __future__ import annotations

from pathlib import Path

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
