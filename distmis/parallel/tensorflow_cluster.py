"""``TF_CONFIG`` for a Ray Train worker group, without importing TensorFlow where it is not used.

A TensorFlow data-parallel trial is a Ray Train run whose workers build a ``MultiWorkerMirroredStrategy`` from
``TF_CONFIG``: the address of every worker and this worker's index. Ray's own ``TensorflowTrainer`` and
``TensorflowConfig`` do exactly this, but their package (``ray.train.tensorflow``) imports TensorFlow when it is
imported, and it is imported in three processes per trial: the Tune trial that starts the run, the Ray Train
controller that unpickles the backend, and each worker. Only the workers train. On a 2-core machine each
of the other two imports cost about 6 s a trial (benchmarks/README.md, "start-up").

:class:`TensorflowClusterConfig` is that backend again, in a module that imports no framework: the workers
get ``TF_CONFIG`` before the training function starts, and import TensorFlow themselves when they build their
trainer. It runs under Ray Train's ``DataParallelTrainer`` (the base class of ``TensorflowTrainer``).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from typing import Any

from ray.train.backend import Backend, BackendConfig


def worker_address() -> str:
    """``host:port`` of this worker: the node's IP and a free port for the worker's gRPC server."""
    import ray

    host = ray.util.get_node_ip_address()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"


def tf_config(addresses: list[str], index: int) -> dict[str, Any]:
    """The ``TF_CONFIG`` of worker ``index`` in a cluster of ``addresses`` (all workers, in rank order)."""
    if not 0 <= index < len(addresses):
        raise ValueError(f"worker index {index} is outside the cluster of {len(addresses)} worker(s)")
    return {"cluster": {"worker": list(addresses)}, "task": {"type": "worker", "index": index}}


def set_tf_config(addresses: list[str], index: int) -> None:
    os.environ["TF_CONFIG"] = json.dumps(tf_config(addresses, index))


# Gradients are all-reduced in packs of up to this many bytes (flattened and concatenated), not one collective
# per variable: the U-Net of benchmarks/speedup.yaml (1.6 MB of gradients) then makes one all-reduce a step, and
# a 2-worker epoch on CPU took 2.5-2.8 s against 2.8-3.1 s (benchmarks/README.md, "tf_collectives.py"). The size
# of PyTorch DDP's buckets (25 MiB) in spirit: large enough for the models distmis trains to fit in a few packs.
GRADIENT_PACK_BYTES = 32 * 1024 * 1024


def multi_worker_strategy() -> Any:
    """This worker's ``MultiWorkerMirroredStrategy`` over the cluster in ``TF_CONFIG``, gradients packed
    (:data:`GRADIENT_PACK_BYTES`); the implementation (ring or NCCL) left to TensorFlow."""
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=GRADIENT_PACK_BYTES)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


class _TensorflowClusterBackend(Backend):
    def on_start(self, worker_group: Any, backend_config: BackendConfig) -> None:
        import ray

        addresses = worker_group.execute(worker_address)
        ray.get([worker_group.execute_single_async(rank, set_tf_config, addresses, rank)
                 for rank in range(len(addresses))])


@dataclass
class TensorflowClusterConfig(BackendConfig):
    """Ray Train backend: every worker gets ``TF_CONFIG`` for a ``MultiWorkerMirroredStrategy``."""

    @property
    def backend_cls(self) -> type[Backend]:
        return _TensorflowClusterBackend
