"""The traced memory model against a real training step, for every registered torch network (issue 48).

For each network, tile and precision, a fresh process builds the network as the trainer does (4 channels in, 3
sigmoid channels out, batch 2, the soft dice loss, Adam), trains one step to make Adam's moments, then measures a
second step as a trial's ``StepMeter`` does (:mod:`distmis.train.metering`): the C heap trimmed, the resident
set's high-water mark (``VmHWM``) reset through ``/proc/self/clear_refs``, the step, then the high-water mark less
the resident set before the step, plus the training state the step starts with (Adam's moments and the previous
step's gradients, which a trial's first epoch counts). The same process reports what it held before the step
(the libraries, the weights, the batch and Adam's state): the process itself.

Every configuration is measured twice: with glibc's defaults, as a trial runs, and with its mmap threshold fixed
at 64 KiB (``MALLOC_MMAP_THRESHOLD_=65536``), where every tensor's pages go back to the system when it is freed and
the resident peak is the tensors' and the kernels' own: the second checks the traced tensors and workspaces alone,
the first the whole prediction, the C heap's retention included.

The prediction is :func:`distmis.estimate.memory.predict_step_memory` (the step traced on fake tensors, the CPU's
convolution workspaces, the process's overhead) for the same configuration and thread count.

    python benchmarks/step_memory.py                                   # every network, tiles 32,64,96, fp32 and bf16
    # (a tile a network cannot train on, SwinUNETR's 32^3, has its first two axes doubled: 64x64x32)
    python benchmarks/step_memory.py --networks unet3d,segresnet --tiles 32,64 --precisions fp32
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 2**20
KERAS = "unet3d-tf"  # the TensorFlow U-Net's rows
BATCH = 2
IN_CHANNELS, OUT_CHANNELS = 4, 3


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(config: dict) -> dict:
    """One configuration, in this (fresh) process: the measured step and the prediction."""
    if config["network"] == KERAS:
        return measure_keras(config)
    import ctypes

    import torch

    torch.set_num_threads(config["threads"])
    from distmis.estimate.memory import predict_step_memory
    from distmis.estimate.step_trace import TrainingStep
    from distmis.models.registry import NetworkInput, model_entry
    from distmis.networks import build_network
    from distmis.train.torch_losses import make_loss

    entry = model_entry(config["network"])
    params = entry.params()
    network = NetworkInput(IN_CHANNELS, OUT_CHANNELS, tuple(config["tile"]))
    torch.manual_seed(0)
    model = build_network(entry, params, network)
    loss_fn = make_loss("dice", from_logits=entry.output == "logits", activation=network.activation)
    step = TrainingStep(model, network, loss_fn, batch=BATCH, precision=config["precision"])
    started = time.perf_counter()
    step()
    first = time.perf_counter() - started
    ctypes.CDLL("libc.so.6").malloc_trim(ctypes.c_size_t(0))
    held = sum(t.untyped_storage().nbytes() for t in step.optimizer_state())
    held += sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    step()
    peak = _status("VmHWM")
    prediction = predict_step_memory(entry, params, network, loss_fn, batch=BATCH, precision=config["precision"],
                                     threads=config["threads"])
    return {**config, "measured_mib": (peak - before + held) / MIB, "process_mib": before / MIB,
            "first_step_s": first, "predicted_mib": prediction.step / MIB,
            "parts": {k: v / MIB for k, v in prediction.parts().items()}, "moment": prediction.trace.moment}


def _measured_step(step, held: int) -> tuple[float, float, float]:
    """``(the step's measured peak, what the process held before it, the first step's seconds)``: ``step`` run
    twice, the second measured (see the module's docstring); ``held``: bytes of Adam's state and of gradients that
    the first step leaves, counted as the step's (as ``StepMeter`` counts them)."""
    import ctypes

    started = time.perf_counter()
    step()
    first = time.perf_counter() - started
    ctypes.CDLL("libc.so.6").malloc_trim(ctypes.c_size_t(0))
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    step()
    return _status("VmHWM") - before + held, before, first


def measure_keras(config: dict) -> dict:
    """The TensorFlow U-Net's step, as the TensorFlow trainer takes it (a ``tf.function`` of the loss under a
    gradient tape, its gradients and Adam's update), against :func:`distmis.estimate.keras_step.trace_keras_step`.
    Measured by TensorFlow's CPU allocator (its peak over the step less what it held before, Adam's moments
    counted), not by the resident set: TensorFlow's allocator keeps the pages a step freed for the next."""
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(config["threads"])
    tf.config.threading.set_inter_op_parallelism_threads(config["threads"])
    import keras

    from distmis.estimate.keras_step import trace_keras_step
    from distmis.models.registry import NetworkInput, model_entry
    from distmis.networks import build_network
    from distmis.train.losses import make_loss

    entry = model_entry("unet3d")
    network = NetworkInput(IN_CHANNELS, OUT_CHANNELS, tuple(config["tile"]), precision=config["precision"])
    keras.utils.set_random_seed(0)
    model = build_network(entry, entry.params(), network, "tensorflow")
    optimizer = keras.optimizers.Adam()
    loss_fn = make_loss("dice")

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((BATCH, *network.tile, IN_CHANNELS), dtype=np.float32))
    y = tf.constant((rng.random((BATCH, *network.tile, OUT_CHANNELS)) > 0.5).astype(np.float32))
    started = time.perf_counter()
    train_step(x, y)  # traced and run once: Adam's moments exist
    first = time.perf_counter() - started
    # TensorFlow's CPU allocator keeps what a step freed (the resident set does not fall after it), but counts
    # what is in use: the step's peak in its statistics, as CUDA's allocator reports a GPU's
    held = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in optimizer.variables)
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    float(train_step(x, y))
    measured = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before + held
    before = _status("VmRSS")
    trace = trace_keras_step(entry, entry.params(), network, loss_fn, batch=BATCH, precision=config["precision"])
    tensors = trace.optimizer_bytes + trace.peak_bytes
    overhead = 0.0  # the allocator's count: tensors only
    parts = {"weights": trace.parameter_bytes, "batch": trace.batch_bytes, "optimizer": trace.optimizer_bytes,
             "gradients": trace.gradient_bytes, "workspace": 0, "overhead": overhead,
             "activations": trace.peak_bytes - trace.gradient_bytes}
    return {**config, "measured_mib": measured / MIB, "process_mib": before / MIB, "first_step_s": first,
            "predicted_mib": (tensors + overhead) / MIB, "parts": {k: v / MIB for k, v in parts.items()},
            "moment": trace.moment}


def tile_for(name: str, side: int) -> tuple[int, int, int]:
    """The cube of ``side`` voxels, or where the network cannot train on it (its registry entry's input rules:
    SwinUNETR's deepest map at 32^3 is one voxel) the cube with its first two axes doubled until it can."""
    from distmis.models.registry import model_entry

    entry = model_entry("unet3d" if name == KERAS else name)
    params = entry.params()
    tile = (side, side, side)
    while (any(t % entry.input_multiple(params) for t in tile)
           or (entry.input_check is not None and entry.input_check(params, tile, BATCH) is not None)):
        tile = (2 * tile[0], 2 * tile[1], tile[2])
    return tile


def run_all(configs: list[dict], parallel: int) -> list[dict]:
    """Each configuration in a fresh spawned process (the environment's as it is now), in ``configs``' order."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(parallel, mp_context=context, max_tasks_per_child=1) as pool:
        futures = [pool.submit(measure, c) for c in configs]
        for future in concurrent.futures.as_completed(futures):
            row = future.result()
            print(f"  {row['network']} {'x'.join(map(str, row['tile']))} {row['precision']}: "
                  f"measured {row['measured_mib']:.0f} MiB, "
                  f"predicted {row['predicted_mib']:.0f} MiB", file=sys.stderr, flush=True)
        return [future.result() for future in futures]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--networks", default=f"unet3d,segresnet,basicunet,dynunet,swinunetr,unetr,vit-seg,{KERAS}")
    parser.add_argument("--tiles", default="32,64,96")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per measured process")
    parser.add_argument("--parallel", type=int, default=2, help="processes at once (each measures its own peak)")
    parser.add_argument("--no-fixed-threshold", action="store_true",
                        help="skip the second measurement, with glibc's mmap threshold fixed at 64 KiB")
    parser.add_argument("--output", type=Path, help="write the rows as JSON here too")
    args = parser.parse_args()
    configs = [{"network": n, "tile": tile_for(n, int(t)), "precision": p, "threads": args.threads}
               for n in args.networks.split(",") for t in args.tiles.split(",") for p in args.precisions.split(",")]
    started = time.perf_counter()
    rows = run_all(configs, args.parallel)
    if not args.no_fixed_threshold:  # glibc's heap returning every tensor's pages: the tensors alone
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(65536)
        fixed = run_all(configs, args.parallel)
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
        for row, other in zip(rows, fixed):
            row["fixed_threshold_mib"] = other["measured_mib"]
    import torch

    print(f"batch {BATCH}, {IN_CHANNELS} channels in, {OUT_CHANNELS} out, {args.threads} thread(s) per process, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{time.perf_counter() - started:.0f} s\n")
    print("| network | tile | precision | process (MiB) | measured step (MiB) | predicted step (MiB) | error | "
          "tensors, measured (MiB) | tensors, predicted (MiB) | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    errors, tensor_errors = [], []
    for row in rows:
        error = row["predicted_mib"] / row["measured_mib"] - 1
        errors.append(abs(error))
        tensors = row["predicted_mib"] - row["parts"]["overhead"]
        cells = ["", "", ""]
        if "fixed_threshold_mib" in row:
            tensor_error = tensors / row["fixed_threshold_mib"] - 1
            tensor_errors.append(abs(tensor_error))
            cells = [f"{row['fixed_threshold_mib']:.0f}", f"{tensors:.0f}", f"{tensor_error:+.1%}"]
        print(f"| {row['network']} | {'x'.join(map(str, row['tile']))} | {row['precision']} | "
              f"{row['process_mib']:.0f} | "
              f"{row['measured_mib']:.0f} | {row['predicted_mib']:.0f} | {error:+.1%} | {' | '.join(cells)} |")
    print(f"\nthe step: median |error| {statistics.median(errors):.1%}, largest {max(errors):.1%}, "
          f"rows within 20%: {sum(e <= 0.2 for e in errors)}/{len(errors)}")
    if tensor_errors:
        print(f"the tensors (glibc's mmap threshold fixed at 64 KiB): median |error| "
              f"{statistics.median(tensor_errors):.1%}, largest {max(tensor_errors):.1%}")
    if args.output:
        args.output.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
