"""A cross-validated Optuna search with ASHA whose driver is killed (SIGKILL) while a fold trains, resumed with
``distmis run --resume``: real processes, real Ray, sqlite.

It ends as an uninterrupted search would: every (configuration, fold) has exactly one run, FINISHED, with one
metric point per epoch; the folds that had finished before the kill were not trained again (their runs untouched);
each configuration's ``cv_val_dice`` is the mean of its folds' best ``val_dice``; the results are ranked by it; and
the registered model is the best configuration's fold ensemble. It is killed just as a fold's trial begins: when
Tune's saved state did not hold that trial yet, its run is set aside and a new trial trains its fold.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from mlflow.tracking import MlflowClient

from distmis.tracking.results import find_search_run, trial_runs
from tests.conftest import query, small_spec_tree
from tests.faults.test_kill_and_resume import distmis, finish, kill_driver_when

pytestmark = pytest.mark.slow  # a search in its own process, killed and resumed

EPOCHS = 6


def fold_runs(db: Path) -> list[tuple[str, str, int]]:
    """(run id, status, last epoch logged) of every fold run."""
    return query(db, "SELECT r.run_uuid, r.status, (SELECT max(step) FROM metrics m WHERE m.run_uuid = r.run_uuid "
                     "AND m.key = 'epoch_seconds') FROM runs r JOIN tags t ON r.run_uuid = t.run_uuid "
                     "WHERE t.key = 'distmis.fold'")


def killable(db: Path) -> bool:
    """Two folds finished, another fold midway, and the next one just begun: Tune's state, saved every 2 s, may
    not hold that trial yet (its run is then set aside and its fold trained by a new trial)."""
    runs = fold_runs(db)
    finished = [run for run in runs if run[1] == "FINISHED"]
    midway = [run for run in runs if run[1] == "RUNNING" and (run[2] or 0) >= 1]
    begun = [run for run in runs if run[1] == "RUNNING" and run[2] is None]
    return len(finished) >= 2 and bool(midway) and bool(begun)


def test_a_killed_cross_validated_optuna_asha_search_resumes_fold_by_fold(tmp_path) -> None:
    tree = small_spec_tree(tmp_path / "data")
    tree["dataset"]["synthetic"].update({"cases": 12, "shape": [32, 32, 32]})
    tree["dataset"]["split"] = {"folds": 3, "test": 0.25, "seed": 0}
    tree["model"]["framework"] = "torch"
    tree["training"]["epochs"] = EPOCHS
    tree["search"] = {"algorithm": "optuna", "num_samples": 2, "scheduler": "asha",
                      "asha": {"grace_period": 2, "reduction_factor": 2},
                      "space": {"training.optimizer.lr": {"loguniform": [1.0e-3, 1.0e-2]}}}
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(tree))
    out = tmp_path / "out"
    db = out / "mlflow.db"

    process = distmis("run", str(spec), "--output", str(out))
    kill_driver_when(process, lambda: killable(db))
    before = {run_id: status for run_id, status, _ in fold_runs(db)}
    client = MlflowClient(f"sqlite:///{db}")
    done_before = {run_id: client.get_run(run_id).info.end_time for run_id, status in before.items()
                   if status == "FINISHED"}
    assert len(done_before) >= 2
    finish(distmis("run", str(spec), "--output", str(out), "--resume"), db=db)

    search = find_search_run(client, "tiny")
    configurations = trial_runs(client, search)
    assert len(configurations) == 2
    seen = []
    for configuration in configurations:
        assert configuration.info.status == "FINISHED"
        folds = trial_runs(client, configuration)
        best = []
        for run in folds:
            seen.append((configuration.data.tags["distmis.configuration"], int(run.data.tags["distmis.fold"])))
            assert run.info.status == "FINISHED"
            steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "epoch_seconds"))
            assert steps == list(range(1, len(steps) + 1)) and len(steps) in (2, 4, EPOCHS)  # ASHA's rungs
            best.append(max(m.value for m in client.get_metric_history(run.info.run_id, "val_dice")))
            if run.info.run_id in done_before:  # not trained again
                assert run.info.end_time == done_before[run.info.run_id]
        assert configuration.data.metrics["cv_val_dice"] == pytest.approx(np.mean(best), abs=1e-9)
    assert sorted(seen) == [(c, f) for c in ("c000", "c001") for f in range(3)]  # each fold once, none duplicated
    resumed = [run for c in configurations for run in trial_runs(client, c) if "distmis.resumes" in run.data.tags]
    assert resumed and all(run.info.run_id not in done_before for run in resumed)
    set_aside = [run_id for run_id in before if client.get_run(run_id).info.lifecycle_stage == "deleted"]
    assert all(before[run_id] != "FINISHED" and "Ray Tune" in client.get_run(run_id).data.tags["distmis.lost"]
               for run_id in set_aside)  # only the runs of trials Tune's saved state lost

    ranked = sorted(configurations, key=lambda run: -run.data.metrics["cv_val_dice"])
    assert search.data.tags["distmis.model_trial"] == ranked[0].data.tags["distmis.configuration"]
    assert search.data.metrics["cv_val_dice"] == pytest.approx(ranked[0].data.metrics["cv_val_dice"])
    assert (out / "model" / "MLmodel").is_file()
    recipe = yaml.safe_load((out / "model" / "artifacts" / "preprocessing.json").read_text())
    assert list(recipe["folds"]) == [0, 1, 2]
