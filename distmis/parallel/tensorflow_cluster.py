"""``TF_CONFIG`` for a Ray Train worker group, without importing TensorFlow where it is not used.

A TensorFlow data-parallel trial is a Ray Train run whose workers build a ``MultiWorkerMirroredStrategy`` from
``TF_CONFIG``: the address of every worker and this worker's index. Ray's own ``TensorflowTrainer`` and
``TensorflowConfig`` do exactly this, but their package (``ray.train.tensorflow``) imports TensorFlow when it is
imported, and it is imported in three processes per trial: the Tune trial that starts the run, the Ray Train
controller that unpickles the backend, and each worker. Only the workers train. On a 2-core machine each
of the other two imports cost about 6 s a trial (benchmarks/history.md, "start-up").

:class:`TensorflowClusterConfig` is that backend again, in a module that imports no framework: the workers
get ``TF_CONFIG`` before the training function starts, and import TensorFlow themselves when they build their
trainer. It runs under Ray Train's ``DataParallelTrainer`` (the base class of ``TensorflowTrainer``).
"""

from __future__ import annotations

import json
import os
import socket
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

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
# a 2-worker epoch on CPU took 2.5-2.8 s against 2.8-3.1 s (benchmarks/history.md, "tf_collectives.py"). The size
# of PyTorch DDP's buckets (25 MiB) in spirit: large enough for the models distmis trains to fit in a few packs.
GRADIENT_PACK_BYTES = 32 * 1024 * 1024


def multi_worker_strategy() -> Any:
    """This worker's ``MultiWorkerMirroredStrategy`` over the cluster in ``TF_CONFIG``, gradients packed
    (:data:`GRADIENT_PACK_BYTES`); the implementation (ring or NCCL) left to TensorFlow."""
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=GRADIENT_PACK_BYTES)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


@contextmanager
def variables_without_broadcast(strategy: Any) -> Iterator[None]:
    """Variables created under ``strategy``'s scope in this block take this worker's own initial values.

    ``MultiWorkerMirroredStrategy`` broadcasts the first worker's initial value of every variable as it is
    created, one eager collective each: the U-Net of benchmarks/speedup.yaml and its Adam state make 222,
    and the two 2-worker trainers of issue 12's compare took 2.5 and 1.7 s to build with them, 1.2 and 0.8 s
    without (one worker: 0.7 and 0.4 s; benchmarks/history.md). Follow the block with
    :func:`broadcast_from_first_replica`, which sends them all in one collective. Any other
    strategy is left as it is. (The per-variable broadcast is in ``CollectiveAllReduceExtended``; its parent,
    ``MirroredExtended``, takes the given initial value on a worker's first replica, as here.)
    """
    try:
        from tensorflow.python.distribute.collective_all_reduce_strategy import CollectiveAllReduceExtended
        from tensorflow.python.distribute.mirrored_strategy import MirroredExtended
    except ImportError:  # another TensorFlow layout: its own broadcasts are slower, not wrong
        yield
        return
    extended = strategy.extended
    if not isinstance(extended, CollectiveAllReduceExtended):
        yield
        return
    extended._get_variable_creator_initial_value = types.MethodType(
        MirroredExtended._get_variable_creator_initial_value, extended)
    try:
        yield
    finally:
        del extended._get_variable_creator_initial_value  # the class's own again


def broadcast_from_first_replica(strategy: Any, variables: Sequence[Any]) -> None:
    """Give every replica of ``strategy`` the first replica's values of ``variables`` (floating point), in one
    all-reduce per dtype to which the other replicas add zeros: equal replicas whatever the initializers drew."""
    import tensorflow as tf

    if int(strategy.num_replicas_in_sync) == 1:
        return
    by_dtype: dict[Any, list[Any]] = {}
    for variable in variables:
        dtype = tf.as_dtype(variable.dtype)  # a Keras variable's is a name
        if not dtype.is_floating:
            raise ValueError(f"broadcast_from_first_replica takes floating-point variables; {variable.name} "
                             f"is {dtype.name}")
        by_dtype.setdefault(dtype, []).append(variable)
    for group in by_dtype.values():
        flat = tf.concat([tf.reshape(tf.convert_to_tensor(v), [-1]) for v in group], axis=0)
        contributions = strategy.experimental_distribute_values_from_function(
            lambda context: flat if context.replica_id_in_sync_group == 0 else tf.zeros_like(flat))
        first = strategy.reduce(tf.distribute.ReduceOp.SUM, contributions, axis=None)
        for variable, value in zip(group, tf.split(first, [int(tf.size(v)) for v in group])):
            variable.assign(tf.reshape(value, variable.shape))


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
