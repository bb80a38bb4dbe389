"""The TensorFlow worker group of a data-mode search, for real: two Ray actors joined by TF_CONFIG into one
MultiWorkerMirroredStrategy, serving trials one after another."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from distmis.trial.worker_group import WorkerGroup, release_groups
from distmis.search.prepare import prepare_data
from distmis.spec import validate_spec
from distmis.spec.layout import resolve_trial
from distmis.trial.record import RESUME_DIR, STATE_FILE, SYSTEM_KEY, TrainingState, samples_from_json
from distmis.train.loop import BEST_DIR, SCRATCH_PREFIX
from tests.conftest import small_spec_tree


def probe(worker: Any) -> dict[str, Any]:
    """What a worker actor holds (run inside it by ``__ray_call__``)."""
    trainer = worker.trainer
    return {"rank": worker.rank, "tf_config": json.loads(os.environ["TF_CONFIG"]), "trainers": len(worker.trainers),
            "replicas": int(worker.strategy.num_replicas_in_sync),
            "lr": float(trainer.optimizer.learning_rate.numpy()) if trainer is not None else None}


def weights_sum(worker: Any, trainable: bool = False) -> float:
    import numpy as np

    model = worker.trainer.model
    weights = model.trainable_weights if trainable else model.weights
    return float(sum(np.sum(w.numpy(), dtype=np.float64) for w in weights))


def perturb_and_broadcast(worker: Any) -> tuple[float, float]:
    """Give this rank's weights values of its own, then the first replica's to all: (own sum, sum after)."""
    from distmis.parallel.tensorflow_cluster import broadcast_from_first_replica

    model = worker.trainer.model
    for variable in model.weights:
        variable.assign(variable + float(worker.rank + 1))
    own = weights_sum(worker)
    broadcast_from_first_replica(worker.strategy, model.weights)
    return own, weights_sum(worker)


def initial_values(worker: Any) -> tuple[float, float]:
    """A variable made with this rank's number as its initial value, under the strategy's scope as TensorFlow
    makes it and in :func:`variables_without_broadcast`."""
    import tensorflow as tf

    from distmis.parallel.tensorflow_cluster import variables_without_broadcast

    with worker.strategy.scope():
        broadcast = tf.Variable(float(worker.rank))
        with variables_without_broadcast(worker.strategy):
            own = tf.Variable(float(worker.rank))
    return float(broadcast.numpy()), float(own.numpy())


@pytest.fixture
def search(tmp_path: Path):
    tree = small_spec_tree(tmp_path / "data", parallelism={"mode": "data", "workers": 2})
    tree["search"]["space"] = {"training.optimizer.lr": {"grid": [1.0e-3, 5.0e-3]},
                               "model.params.norm": {"grid": ["batch", "group"]}}
    spec = validate_spec(tree)
    return spec, str(prepare_data(spec, tmp_path / "out", progress=False).tfrecord_dir)


def test_one_group_serves_the_trials_of_a_search_in_turn(ray_local, search, tmp_path: Path):
    import ray

    spec, tfrecords = search
    first, layout = resolve_trial(spec, {"training.optimizer.lr": 1.0e-3, "model.params.norm": "batch"})
    group = WorkerGroup(layout, "distmis-workers-test-a-1", "tensorflow")
    try:
        reports = list(group.epochs(first, layout, tfrecords, [], time.time()))
        assert [m["epoch"] for m, _ in reports] == [1, 2]
        metrics, files = reports[-1]
        assert "model.weights.h5" in files and f"{RESUME_DIR}/{STATE_FILE}" in files  # rank 0's checkpoint
        assert reports[0][0]["startup_graphs_reused"] == 0.0 and "startup_workers_s" in reports[0][0]
        for metrics, _ in reports:  # every rank's system samples, with rank 0's report
            figures = {key for sample in samples_from_json(metrics[SYSTEM_KEY]) for key in sample.values}
            assert {"rank0_cpu_utilization_percentage", "rank1_cpu_utilization_percentage",
                    "rank1_memory_usage_megabytes", "cpu_utilization_percentage"} <= figures
        found = sorted(ray.get([w.__ray_call__.remote(probe) for w in group.workers]), key=lambda f: f["rank"])
        assert [f["tf_config"]["task"]["index"] for f in found] == [0, 1]
        assert found[0]["tf_config"]["cluster"] == found[1]["tf_config"]["cluster"]
        assert all(f["replicas"] == 2 and f["lr"] == pytest.approx(2e-3) for f in found)  # linear scaling
        # Initial values were not broadcast one by one; the replicas start, and stay, equal all the same (their
        # batch norms' moving statistics are each worker's own).
        sums = ray.get([w.__ray_call__.remote(weights_sum, True) for w in group.workers])
        assert sums[0] == sums[1]
        (own0, after0), (own1, after1) = ray.get([w.__ray_call__.remote(perturb_and_broadcast)
                                                  for w in group.workers])
        assert own0 != own1 and after0 == after1 == own0
        assert ray.get([w.__ray_call__.remote(initial_values) for w in group.workers]) == [(0.0, 0.0), (0.0, 1.0)]

        # Another learning rate: the same graphs, restarted; its own (scaled) rate in both workers' optimizers.
        second, second_layout = resolve_trial(spec, {"training.optimizer.lr": 5.0e-3, "model.params.norm": "batch"})
        scratch = tmp_path / "trial-working-folder"
        epochs = group.epochs(second, second_layout, tfrecords, [], time.time(), scratch=str(scratch))
        reports = [next(epochs)]
        # While it runs, each rank keeps its scratch (rank 0: the best weights so far) in the trial's own working
        # folder, not the system's temporary folder (issue 46, finding 14); the trial's end removes it.
        assert (scratch / f"{SCRATCH_PREFIX}0" / BEST_DIR / "model.weights.h5").is_file()
        assert (scratch / f"{SCRATCH_PREFIX}1" / BEST_DIR).is_dir()
        reports += list(epochs)
        assert list(scratch.iterdir()) == []
        assert [m["epoch"] for m, _ in reports] == [1, 2] and reports[0][0]["startup_graphs_reused"] == 1.0
        found = ray.get([w.__ray_call__.remote(probe) for w in group.workers])
        assert all(f["trainers"] == 1 and f["lr"] == pytest.approx(1e-2) for f in found)

        # Other graphs (group norm): a trainer of its own. A trial stopped after one epoch leaves the workers idle.
        third, _ = resolve_trial(spec, {"training.optimizer.lr": 1.0e-3, "model.params.norm": "group"})
        epochs = group.epochs(third, layout, tfrecords, [], time.time())
        assert next(epochs)[0]["epoch"] == 1
        epochs.close()
        assert all(f["trainers"] == 2 for f in ray.get([w.__ray_call__.remote(probe) for w in group.workers]))

        # A third architecture: the least recently used trainer (batch norm) goes, two are kept.
        fourth, _ = resolve_trial(spec, {"training.optimizer.lr": 1.0e-3, "model.params.norm": "group",
                                         "model.params.base_filters": 8})
        epochs = group.epochs(fourth, layout, tfrecords, [], time.time())
        assert next(epochs)[0]["startup_graphs_reused"] == 0.0
        epochs.close()
        assert all(f["trainers"] == 2 for f in ray.get([w.__ray_call__.remote(probe) for w in group.workers]))

        # A restarted trial hands its checkpoint to the workers, which go on after its last epoch.
        longer = first.model_copy(update={"training": first.training.model_copy(update={"epochs": 3})})
        resumed = list(group.epochs(longer, layout, tfrecords, [files], time.time()))
        assert [m["epoch"] for m, _ in resumed] == [3]
        state = TrainingState.from_json(resumed[-1][1][f"{RESUME_DIR}/{STATE_FILE}"].decode())
        assert state.epoch == 3 and len(state.history) == 3
    finally:
        group.shutdown()
    assert release_groups("test-a") == []  # shutdown removed its placement group


def test_an_error_in_a_trial_shuts_the_group_down(ray_local, search, tmp_path: Path):
    spec, _ = search
    trial, layout = resolve_trial(spec, {"training.optimizer.lr": 1.0e-3, "model.params.norm": "batch"})
    group = WorkerGroup(layout, "distmis-workers-test-b-1", "tensorflow")
    with pytest.raises(Exception, match="manifest"):
        list(group.epochs(trial, layout, str(tmp_path / "no-records"), [], time.time()))
    assert group.workers == []
    assert release_groups("test-b") == []
