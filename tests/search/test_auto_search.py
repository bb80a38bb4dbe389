"""``parallelism.mode: auto`` searches on a real local Ray, recorded in a real sqlite MLflow store: a trial grown onto
an idle worker is one run whose epochs go on, with its workers per epoch; folds, ASHA and a killed trial's retry keep
working under the pool."""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from distmis.search.makespan_plan import calibrate, check_calibration
from distmis.search.run import run_search
from distmis.spec import validate_spec
from distmis.spec.load import FOLD_KEY
from distmis.tracking.mlflow_tracking import ATTEMPTS_TAG
from distmis.tracking.accounting import trial_spans
from distmis.tracking.results import trial_runs
from distmis.trial.trainables import auto_trial
from distmis.trial.worker_group import GROUP_NAME_PREFIX
from tests.conftest import small_spec_tree

UNET = {"name": "unet3d", "framework": "torch", "params": {"base_filters": 4, "levels": 3, "norm": "group",
                                                           "norm_groups": 2}}


def auto_tree(data: Path, **parallelism: Any) -> dict[str, Any]:
    return small_spec_tree(data, model=dict(UNET), parallelism={"mode": "auto", "workers": 2,
                                                                "resources_per_worker": {"cpu": 1}, **parallelism})


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_a_trial_is_grown_onto_the_worker_a_finished_trial_left_idle(ray_local, tmp_path: Path):
    tree = auto_tree(tmp_path / "data")
    # 24 volumes of 32^3, 19 of them training (10 steps an epoch, about a second on one worker, contiguous) and 2
    # validating (what more workers do not divide): the long trial's 59 epochs left when the short one ends save
    # about twice what a restart on two workers costs (the pool measures that at the trials' first starts, about
    # 14 s with the imports on a 2-core machine). With 4 training volumes and channels-last steps an epoch was a
    # quarter of a second, and the pool rightly kept the trial on one worker.
    tree["dataset"]["synthetic"].update(cases=24, shape=[32, 32, 32])
    tree["dataset"]["split"] = {"train": 0.8, "val": 0.1, "test": 0.1, "seed": 0}
    tree["training"]["performance"] = {"memory_format": "contiguous"}
    tree["search"]["space"] = {"training.epochs": {"grid": [1, 60]}}
    outcome = run_search(validate_spec(tree), tmp_path / "out", progress=False)

    assert outcome.failed == 0
    client = MlflowClient(outcome.tracking_uri)
    parent = client.get_run(outcome.parent_run_id)
    runs = {int(run.data.params["training.epochs"]): run for run in trial_runs(client, parent)}
    assert sorted(runs) == [1, 60] and all(run.info.status == "FINISHED" for run in runs.values())
    short, long = runs[1], runs[60]
    assert history(client, short.info.run_id, "workers") == [(1, 1.0)]
    # The long trial: one run, every epoch once, the workers it ran each on; it began on one worker (two trials for
    # two workers) and was grown to two once the short one had ended, restarting from its checkpoint.
    run_id = long.info.run_id
    assert [step for step, _ in history(client, run_id, "val_dice")] == list(range(1, 61))
    workers = [value for _, value in history(client, run_id, "workers")]
    assert len(workers) == 60 and workers[0] == 1 and workers[-1] == 2 and workers == sorted(workers)
    assert long.data.tags[ATTEMPTS_TAG] == "1"  # a growth is not a retry
    assert long.data.params["trial.workers"] == "1"  # the layout it began with; the metric holds the rest
    # the pool's prediction of each epoch but the first, logged beside what it measured
    assert [step for step, _ in history(client, run_id, "predicted_epoch_seconds")] == list(range(2, 61))
    grown = workers.index(2.0) + 1  # the first epoch on two workers
    assert history(client, run_id, "learning_rate")[grown - 1][1] == pytest.approx(2e-3)  # lr_scaling: linear
    # what it cost: two workers' time for the epochs on two
    metrics = long.data.metrics
    assert metrics["elapsed_seconds"] < metrics["worker_seconds"] < 2 * metrics["elapsed_seconds"]
    assert short.data.metrics["worker_seconds"] == pytest.approx(short.data.metrics["elapsed_seconds"])
    assert 0 <= parent.data.metrics["idle_fraction"] < 1
    # the search's schedule draws the long trial stretch by stretch: on one worker, then on two
    spans = {span.name: span for span in trial_spans(client, parent.info.run_id)}
    [(_, degree)] = spans[long.info.run_name].grown
    assert degree == 2 and [k for _, _, k in spans[long.info.run_name].stretches()] == [1, 2]
    assert outcome.results["worker_h"].max() == pytest.approx(metrics["worker_seconds"] / 3600, abs=1e-4)
    # distmis plan --calibrate on it: the search itself predicted by its pool's rule on its two workers
    calibration = calibrate(tmp_path / "out", device="cpu")
    predicted, measured = check_calibration(tmp_path / "out", calibration, device="cpu")
    assert predicted > 0 and measured == pytest.approx(parent.data.metrics["span_seconds"])


def dying_auto_trial(workdir: str, config: dict[str, Any], **kwargs: Any) -> None:
    """The real auto trial; the first process to report fold 1's second epoch is SIGKILLed after that report."""
    from ray import tune

    report = tune.report

    def wrapped(metrics: dict[str, Any], *args: Any, **more: Any) -> None:
        report(metrics, *args, **more)
        marker = Path(workdir, "killed")
        if config.get(FOLD_KEY) == 1 and metrics["epoch"] == 2 and not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)

    tune.report = wrapped
    auto_trial(config, **kwargs)


def test_folds_asha_and_a_killed_trial_s_retry_under_the_pool(ray_local, tmp_path: Path):
    tree = auto_tree(tmp_path / "data", max_failures=1)
    tree["dataset"]["synthetic"]["cases"] = 8
    tree["dataset"]["split"] = {"test": 0.25, "seed": 0, "folds": 2}
    tree["training"]["epochs"] = 4
    tree["search"] = {"algorithm": "grid", "scheduler": "asha", "asha": {"grace_period": 1, "reduction_factor": 2},
                      "space": {"training.optimizer.lr": {"grid": [1.0e-3, 1.0e-2]}}}
    spec = validate_spec(tree)
    outcome = run_search(spec, tmp_path / "out", progress=False,
                         trainable=functools.partial(dying_auto_trial, str(tmp_path)))

    assert (tmp_path / "killed").exists(), "no trial was killed: the test tested nothing"
    assert outcome.failed == 0, list(outcome.results.get("error", []))
    client = MlflowClient(outcome.tracking_uri)
    parent = client.get_run(outcome.parent_run_id)
    configurations = trial_runs(client, parent)  # a run per configuration, its folds' runs under it
    assert len(configurations) == 2 and all(run.info.status == "FINISHED" for run in configurations)
    assert all("cv_val_dice" in run.data.metrics for run in configurations)
    folds = [fold for run in configurations for fold in trial_runs(client, run)]
    assert len(folds) == 4 and all(run.info.status == "FINISHED" for run in folds)
    assert sorted(run.data.tags[ATTEMPTS_TAG] for run in folds) == ["1", "1", "1", "2"]  # the killed one, retried
    for run in folds:  # every epoch it trained, once, in its one run (ASHA may have stopped it at a rung)
        steps = [step for step, _ in history(client, run.info.run_id, "epoch_seconds")]
        assert steps == list(range(1, len(steps) + 1)) and steps
        assert {value for _, value in history(client, run.info.run_id, "workers")} <= {1.0, 2.0}
    [killed] = [run for run in folds if run.data.tags[ATTEMPTS_TAG] == "2"]
    assert len(history(client, killed.info.run_id, "epoch_seconds")) >= 2
    # Four trials for two workers: the two first start cold, and a trial Tune gives a process whose trial ended (or
    # ASHA stopped) goes on with that process's kept group, warm (its workers served a trial before)
    warm = {run.info.run_name: run.data.metrics["startup_process_reused"] for run in folds}
    assert sorted(warm.values())[:2] == [0.0, 0.0] and 1.0 in warm.values(), warm
    from ray.util.placement_group import placement_group_table

    live = [info["name"] for info in placement_group_table().values()
            if (info.get("name") or "").startswith(GROUP_NAME_PREFIX) and info.get("state") != "REMOVED"]
    assert live == []  # every group, the kept ones too, went with the search
