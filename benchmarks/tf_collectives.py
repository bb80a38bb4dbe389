"""MultiWorkerMirroredStrategy on CPU, step by step: where a 2-worker TensorFlow step stalls, and what fixes it.

Runs distmis's own TensorFlow trainer (`distmis.train.tf_unet.UNetTrainer`, the U-Net and data of
benchmarks/speedup.yaml) in N fresh processes joined by `TF_CONFIG` on loopback, without Ray, so that only
TensorFlow's collectives are measured. Every training step is timed alone (the loss is fetched, so the
step has finished on this worker). A variant changes one collective setting:

- `default`: `MultiWorkerMirroredStrategy()` as Ray Train's TF_CONFIG gives it (AUTO -> RING on CPU), each
  step driven from Python over a new distributed iterator every epoch (distmis's loop before the fix);
- `ring`: `CommunicationImplementation.RING` explicitly;
- `pack`: RING with every gradient packed into one all-reduce (`bytes_per_pack`);
- `interop2`: two inter-op threads instead of one;
- `loop`: the trainer's own loop (`UNetTrainer.train_epoch`): one persistent iterator; since commit 66979d2
  each step called from Python, before it an epoch's steps inside one `tf.function` (timed per epoch);
- `looppack`: that loop with the gradients packed as distmis's strategy packs them
  (`distmis.parallel.tensorflow_cluster.multi_worker_strategy`).

    python benchmarks/tf_collectives.py --workers 2 --variants default,ring,pack,interop2,loop,looppack --epochs 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue as queue_module
import socket
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SPEC = Path(__file__).with_name("speedup.yaml")


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def worker(rank: int, ports: list[int], variant: str, overrides: dict[str, Any], tfrecords: str, epochs: int,
           queue: Any) -> None:
    world = len(ports)
    if world > 1:
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                              "task": {"type": "worker", "index": rank}})
    from distmis.spec import load_spec
    from distmis.spec.layout import resolve_layout
    from distmis.train.threads import pin_threads

    pin_threads(1, torch=False)
    import tensorflow as tf

    if variant == "interop2":
        tf.config.threading.set_inter_op_parallelism_threads(2)
    if os.environ.get("BENCH_GRAPPLER"):
        tf.config.optimizer.set_experimental_options(json.loads(os.environ["BENCH_GRAPPLER"]))
    from distmis.train.tf_unet import UNetTrainer

    spec = load_spec(SPEC, {**overrides, "parallelism.mode": "data", "parallelism.workers": world})
    strategy = None
    if world > 1:
        impl = tf.distribute.experimental.CommunicationImplementation
        options = {
            "default": None,
            "interop2": None,
            "loop": None,
            "looppack": None,
            "ring": tf.distribute.experimental.CommunicationOptions(implementation=impl.RING),
            "pack": tf.distribute.experimental.CommunicationOptions(implementation=impl.RING,
                                                                   bytes_per_pack=64 * 1024 * 1024),
        }[variant]
        if variant == "looppack":
            from distmis.parallel.tensorflow_cluster import multi_worker_strategy

            strategy = multi_worker_strategy()
        else:
            strategy = (tf.distribute.MultiWorkerMirroredStrategy(communication_options=options) if options
                        else tf.distribute.MultiWorkerMirroredStrategy())
    trainer = UNetTrainer(spec, tfrecords, layout=resolve_layout(spec), strategy=strategy)
    steps: list[list[float]] = []
    if variant in ("loop", "looppack"):  # the trainer's own epoch over one persistent iterator
        for _epoch in range(epochs):
            start = time.perf_counter()
            trainer.train_epoch()
            steps.append([time.perf_counter() - start])
        queue.put((rank, steps))
        return
    # distmis before the fix: steps driven from Python over a new distributed iterator each epoch
    # the step as it was traced then, for whatever the iterator yields (a distributed one yields per-replica
    # values, which the trainer's own step, typed for its worker's plain pipeline, does not take)
    step = tf.function(trainer._train_step.python_function, reduce_retracing=True)
    data = trainer.train_data
    if world > 1:
        from distmis.data.tfrecord import make_dataset

        training = spec.training
        data = strategy.distribute_datasets_from_function(lambda context: make_dataset(
            tfrecords, "train", batch_size=training.batch_size, shuffle=True, seed=training.seed, repeat=True,
            shard=(context.num_input_pipelines, context.input_pipeline_id)).take(trainer.steps_per_epoch))
    for _epoch in range(epochs):
        times = []
        start = time.perf_counter()
        for x, y in data:
            float(step(x, y))
            now = time.perf_counter()
            times.append(now - start)
            start = now
        steps.append(times)
    queue.put((rank, steps))


def run_variant(variant: str, world: int, overrides: dict[str, Any], tfrecords: str, epochs: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ports = free_ports(world)
    procs = [ctx.Process(target=worker, args=(r, ports, variant, overrides, tfrecords, epochs, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    while len(results) < world:  # a worker that dies (its traceback on stderr) must not leave this waiting
        try:
            rank, steps = queue.get(timeout=5)
            results[rank] = steps
        except queue_module.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
            if dead:
                for p in procs:
                    p.terminate()
                raise RuntimeError(f"variant {variant!r}, {world} worker(s): worker(s) {dead} (rank, exit code) "
                                   "died before reporting; see their traceback above")
    for p in procs:
        p.join()
    first_epoch_s = round(sum(results[0][0]), 2)  # tracing included
    epochs_steps = results[0][1:]  # rank 0's steps, the first (tracing) epoch left out
    steps = [s for epoch in epochs_steps for s in epoch]
    median = statistics.median(steps)
    return {"variant": variant, "workers": world, "steps": len(steps), "median_step_s": round(median, 3),
            "max_step_s": round(max(steps), 3), "stalled_steps": sum(s > 2 * median for s in steps),
            "epoch_s": round(statistics.mean(sum(e) for e in epochs_steps), 2), "first_epoch_s": first_epoch_s,
            "all_steps": [round(s, 2) for s in steps]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--variants", default="default,ring,pack,interop2")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs, after one warm-up epoch")
    parser.add_argument("--output", default="runs/tf-collectives")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="spec override")
    args = parser.parse_args()

    from distmis.search.prepare import prepare_data
    from distmis.spec import load_spec
    from distmis.spec.load import parse_set_options

    overrides = parse_set_options(args.set)
    spec = load_spec(SPEC, overrides)
    tfrecords = str(prepare_data(spec, args.output).tfrecord_dir)
    rows = [run_variant("default", 1, overrides, tfrecords, args.epochs + 1)]
    for variant in filter(None, args.variants.split(",")):
        rows.append(run_variant(variant, args.workers, overrides, tfrecords, args.epochs + 1))
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
