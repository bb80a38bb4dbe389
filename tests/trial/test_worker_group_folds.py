"""Cross-validation on the kept TensorFlow worker group of a data-mode search, for real (two Ray actors joined
into one MultiWorkerMirroredStrategy): a trial of another fold restarts the kept trainer (the same graphs) and
trains and validates on its own fold's cases, never on the previous trial's."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from distmis.search.prepare import prepare_data
from distmis.trial.worker_group import WorkerGroup, release_groups
from distmis.spec import validate_spec
from distmis.spec.layout import resolve_trial
from tests.conftest import small_spec_tree


def cases_of(worker: Any) -> dict[str, Any]:
    """What a worker's current trainer reads (run inside the actor by ``__ray_call__``)."""
    trainer = worker.trainer
    return {"rank": worker.rank, "train": trainer.parts.train, "val": trainer.val_cases.case_ids,
            "num_train": trainer._num_train, "steps": trainer.steps_per_epoch, "trainers": len(worker.trainers)}


def test_a_trial_of_another_fold_restarts_the_trainer_on_its_own_cases(ray_local, tmp_path: Path):
    import ray

    tree = small_spec_tree(tmp_path / "data", parallelism={"mode": "data", "workers": 2})
    tree["dataset"]["synthetic"]["cases"] = 8
    tree["dataset"]["split"] = {"test": 0.25, "seed": 0, "folds": 3}
    spec = validate_spec(tree)
    data = prepare_data(spec, tmp_path / "out", progress=False)
    folds = data.split["folds"]
    tfrecords = str(data.tfrecord_dir)
    first, layout = resolve_trial(spec, {"training.optimizer.lr": 1.0e-3, "dataset.split.fold": 0})
    group = WorkerGroup(layout, "distmis-workers-test-folds-1", "tensorflow")
    try:
        reports = list(group.epochs(first, layout, tfrecords, [], time.time()))
        assert [m["epoch"] for m, _ in reports] == [1, 2] and reports[0][0]["startup_graphs_reused"] == 0.0
        for found in ray.get([w.__ray_call__.remote(cases_of) for w in group.workers]):
            assert found["train"] == ("fold1", "fold2") and found["val"] == folds[0]
            assert found["num_train"] == 4 and found["steps"] == 1  # 2 cases a worker, batches of 2

        second, second_layout = resolve_trial(spec, {"training.optimizer.lr": 1.0e-3, "dataset.split.fold": 2})
        reports = list(group.epochs(second, second_layout, tfrecords, [], time.time()))
        assert [m["epoch"] for m, _ in reports] == [1, 2]
        assert reports[0][0]["startup_graphs_reused"] == 1.0  # the same graphs: the kept trainer, restarted
        for found in ray.get([w.__ray_call__.remote(cases_of) for w in group.workers]):
            assert found["trainers"] == 1
            assert found["train"] == ("fold0", "fold1") and found["val"] == folds[2]
    finally:
        group.shutdown()
    assert release_groups("test-folds") == []
