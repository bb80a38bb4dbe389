"""Run searches on a Ray cluster of several nodes simulated on this machine; print where trials ran.

Not a test module: ``test_multinode.py`` runs it in a subprocess, because ``ray.cluster_utils.Cluster``
needs a process with no Ray of its own (the test session already has one). Usage:
    python -m tests.search.multinode_search WORKDIR
prints one JSON line: the worker nodes, and per search the node of every trial / Ray Train worker, as the trials'
MLflow runs record them (the ``distmis.nodes`` tag; Ray's state API listed none under load, the trial's own report
does not depend on it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def trial_nodes(outcome) -> list[list[str]]:
    """Each trial's nodes, one per process (rank 0 first), as its MLflow run's ``distmis.nodes`` tag says: what
    the trial's own processes reported (their Ray node ids)."""
    from mlflow import MlflowClient

    from distmis.tracking.mlflow_tracking import NODES_TAG
    from distmis.tracking.results import trial_runs

    client = MlflowClient(outcome.tracking_uri)
    runs = trial_runs(client, client.get_run(outcome.parent_run_id))
    return [run.data.tags.get(NODES_TAG, "").split(",") for run in runs]


def main(workdir: Path) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from distmis.service.net import free_port
    from distmis.search.ray_session import TRIAL_ENV
    from distmis.search.run import run_search
    from distmis.spec import validate_spec
    from tests.conftest import small_spec_tree

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": free_port()})
    try:
        workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, runtime_env={"env_vars": TRIAL_ENV}, logging_level="WARNING")
        report: dict = {"worker_nodes": [n.node_id for n in workers]}

        # Experiment-parallel: two trials of one CPU each; one worker node fits one trial. (No logical GPU: a trial
        # given a GPU that its framework cannot see is refused, tests/search/test_gpu_refusal.py.)
        tree = small_spec_tree(workdir / "data", parallelism={"resources_per_trial": {"cpu": 1}})
        tree["training"]["epochs"] = 1
        outcome = run_search(validate_spec(tree), workdir / "experiment", progress=False)
        report["experiment"] = {"failed": outcome.failed, "trials": len(outcome.results),
                                "trial_nodes": [node for nodes in trial_nodes(outcome) for node in nodes]}

        # Data-parallel: one trial over two one-CPU workers: more than any node holds.
        tree["name"] = "tiny-data"
        tree["model"]["framework"] = "torch"
        tree["search"] = {"algorithm": "grid", "space": {"training.optimizer.lr": {"grid": [1.0e-3]}}}
        tree["parallelism"] = {"mode": "data", "workers": 2, "resources_per_worker": {"cpu": 1, "gpu": 0}}
        outcome = run_search(validate_spec(tree), workdir / "data-parallel", progress=False)
        report["data"] = {"failed": outcome.failed, "trials": len(outcome.results),
                          "train_worker_nodes": trial_nodes(outcome)[0]}
        return report
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    print("MULTINODE " + json.dumps(main(Path(sys.argv[1]))), flush=True)
