"""How close each network's training step runs to the device (issue 52): counted FLOPs over measured seconds, as a
fraction of the device's own matrix-product rate, in each memory format and precision.

For every registered torch network (its default params) and the TensorFlow U-Net, in a fresh process of its own
with ``--threads`` threads: a training step as the trainers take it (batch 2, 4 channels in, 3 sigmoid channels
out, the soft dice loss, Adam; torch's forward under autocast for bf16) at a ``--tile`` cube, timed as the median of
``--repeats`` steps after a warm-up. Its FLOPs are counted by torch's ``FlopCounterMode`` on one real step (the
Keras step: :func:`distmis.estimate.keras_step.operation_flops` over its traced graph); the device's rate is a
2048^3 matrix product in fp32 (and bf16 where the CPU computes it natively), measured in the same process.

Rows per torch network: ``contiguous fp32`` (what distmis trained before issue 52), ``channels_last fp32``,
``contiguous bf16``, ``channels_last bf16``, the step compiled by ``torch.compile`` (TorchInductor) in the format
``training.performance.memory_format: auto`` chose at fp32 (:func:`distmis.train.step_settings.choose_memory_format`,
measured in the same process), in fp32 and bf16, and what ``auto`` chose, compilation included
(:func:`~distmis.train.step_settings.choose_compile` for a trial of :data:`LONG_TRIAL_STEPS` steps). The TensorFlow U-Net:
eager ``tf.function`` against XLA (``jit_compile=True``).

    .venv/bin/python benchmarks/step_efficiency.py [--tile 64] [--threads 2] [--networks unet3d,segresnet]
                                                   [--device cpu|cuda] [--output runs/step_efficiency.json]

On a GPU (``--device cuda``) the fraction is the model-FLOPs utilisation against the GPU's own measured matmul rate;
the script imports torch, MONAI and distmis's torch modules only (no Ray, MLflow or TensorFlow), as the GPU machines
have them.

Run on an otherwise idle machine; one network at a time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KERAS = "unet3d-tf"
BATCH, IN_CHANNELS, OUT_CHANNELS = 2, 4, 3
#: the planned steps ``compile: auto`` decides for here: a long trial (nnU-Net's 250 steps an epoch, 100 epochs)
LONG_TRIAL_STEPS = 25_000


def _torch_row(config: dict) -> dict:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    device = torch.device(config.get("device", "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(config["threads"])
    from distmis.models.registry import NetworkInput, model_entry
    from distmis.networks import build_network
    from distmis.train.precision import cpu_float16_supported  # noqa: F401 - the precision module's checks
    from distmis.train.step_settings import (
        apply_memory_format, choose_compile, choose_memory_format, compile_error, compile_model, in_memory_format,
        matmul_rate, median_seconds,
    )
    from distmis.train.torch_losses import make_loss

    entry = model_entry(config["network"])
    tile = tuple(config["tile"])
    network = NetworkInput(IN_CHANNELS, OUT_CHANNELS, tile)
    loss_fn = make_loss("dice", from_logits=entry.output == "logits", activation="sigmoid")
    generator = torch.Generator().manual_seed(0)
    x = torch.rand((BATCH, IN_CHANNELS, *tile), generator=generator).to(device)
    y = (torch.rand((BATCH, OUT_CHANNELS, *tile), generator=generator) > 0.5).float().to(device)
    bf16 = bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if device.type == "cuda":
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    bf16 = bf16 and "bf16" in config.get("precisions", ("fp32", "bf16"))
    rates = {"fp32": matmul_rate(device, torch.float32)}
    if bf16:
        rates["bf16"] = matmul_rate(device, torch.bfloat16)

    def make_step(memory_format: str, precision: str, compiled: bool = False):
        torch.manual_seed(0)
        model = apply_memory_format(build_network(entry, entry.params(), network).to(device), memory_format).train()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        inputs = in_memory_format(x, memory_format)
        forward = compile_model(model) if compiled else model

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                output = forward(inputs)
            loss_fn(output.float(), y).backward()
            optimizer.step()

        return model, step

    model, step = make_step("contiguous", "fp32")
    step()  # Adam's moments exist: the counted step is a steady one
    with FlopCounterMode(display=False) as counter:
        step()
    flops = float(counter.get_total_flops())
    settings = {}
    for memory_format in ("contiguous", "channels_last"):
        for precision in ("fp32", "bf16") if bf16 else ("fp32",):
            _, step = make_step(memory_format, precision)
            seconds = median_seconds(step, repeats=config["repeats"], warmup=1, device=device)
            settings[f"{memory_format} {precision}"] = {
                "seconds": seconds, "flop_rate": flops / seconds,
                "fraction": flops / seconds / rates[precision]}
    torch.manual_seed(0)
    chosen = choose_memory_format(build_network(entry, entry.params(), network).to(device), loss_fn, x, y,
                                  repeats=config["repeats"])
    fmt = chosen.memory_format
    errors = {}
    for precision in ("fp32", "bf16") if bf16 else ("fp32",):  # compiled, in the format auto chose
        model, step = make_step(fmt, precision, compiled=True)
        try:
            step()  # the compilation
            seconds = median_seconds(step, repeats=config["repeats"], warmup=1, device=device)
        except Exception as exc:  # noqa: BLE001 - a network that does not compile is reported as such
            errors[f"compiled {fmt} {precision}"] = compile_error(exc)
            continue
        settings[f"compiled {fmt} {precision}"] = {"seconds": seconds, "flop_rate": flops / seconds,
                                                   "fraction": flops / seconds / rates[precision]}
    torch.manual_seed(0)
    compiled = choose_compile(build_network(entry, entry.params(), network).to(device), loss_fn, x, y,
                              eager_seconds=chosen.seconds[fmt], planned_steps=LONG_TRIAL_STEPS,
                              memory_format=fmt, repeats=config["repeats"])
    return {**config, "flops": flops, "matmul_rates": rates, "settings": settings, "errors": errors,
            "auto": {"memory_format": fmt, "seconds": chosen.seconds, "compiled": compiled.compiled,
                     "compile_seconds": compiled.seconds, "compile_reason": compiled.reason}}


def _keras_row(config: dict) -> dict:
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
    tile = tuple(config["tile"])
    network = NetworkInput(IN_CHANNELS, OUT_CHANNELS, tile)
    loss_fn = make_loss("dice")
    flops = trace_keras_step(entry, entry.params(), network, loss_fn, batch=BATCH, precision="fp32").flops
    rng = np.random.default_rng(0)
    x = tf.constant(rng.random((BATCH, *tile, IN_CHANNELS), dtype=np.float32))
    y = tf.constant((rng.random((BATCH, *tile, OUT_CHANNELS)) > 0.5).astype(np.float32))
    a = tf.constant(rng.random((2048, 2048), dtype=np.float32))
    matmul = tf.function(lambda: tf.matmul(a, a))
    matmul()
    started = time.perf_counter()
    for _ in range(3):
        matmul().numpy()
    rate = 3 * 2 * 2048**3 / (time.perf_counter() - started)
    settings = {}
    for jit in (False, True):
        keras.utils.set_random_seed(0)
        model = build_network(entry, entry.params(), network, "tensorflow")
        optimizer = keras.optimizers.Adam()

        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        step = tf.function(train_step, jit_compile=jit)
        float(step(x, y))
        times = []
        for _ in range(config["repeats"]):
            started = time.perf_counter()
            float(step(x, y))
            times.append(time.perf_counter() - started)
        seconds = sorted(times)[len(times) // 2]
        settings["xla fp32" if jit else "graph fp32"] = {"seconds": seconds, "flop_rate": flops / seconds,
                                                         "fraction": flops / seconds / rate}
    return {**config, "flops": flops, "matmul_rates": {"fp32": rate}, "settings": settings}


def measure(config: dict) -> dict:
    return _keras_row(config) if config["network"] == KERAS else _torch_row(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--networks", default=f"unet3d,segresnet,basicunet,dynunet,swinunetr,unetr,vit-seg,{KERAS}")
    parser.add_argument("--tile", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path)
    parser.add_argument("--precisions", default="fp32,bf16",
                        help="fp32, and bf16 where the device computes it (mixed precision: fp32 weights)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: the torch networks on this machine's GPU (the TensorFlow U-Net is left out)")
    parser.add_argument("--table", type=Path, help="print the table of an earlier run's --output JSON, measuring "
                                                   "nothing")
    args = parser.parse_args()
    if args.table:
        rows = json.loads(args.table.read_text())
        print_table(rows, tile=rows[0]["tile"][0], threads=rows[0]["threads"], heading=f"(from {args.table})")
        return
    names = args.networks.split(",")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("--device cuda: torch sees no GPU here")
        names = [name for name in names if name != KERAS]  # TensorFlow does not travel to the GPU machines
    context = multiprocessing.get_context("spawn")
    rows = []
    for name in names:
        config = {"network": name, "tile": [args.tile] * 3, "threads": args.threads, "repeats": args.repeats,
                  "precisions": args.precisions.split(","),
                  "device": args.device}
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
            row = pool.submit(measure, config).result()
        rows.append(row)
        print(f"  {name}: " + ", ".join(f"{k} {v['seconds']:.3f} s ({v['fraction']:.2f})"
                                        for k, v in row["settings"].items()), file=sys.stderr, flush=True)
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    where = (torch.cuda.get_device_name(0) if args.device == "cuda"
             else platform.processor() or platform.machine())
    print_table(rows, tile=args.tile, threads=args.threads,
                heading=f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}, {where}, "
                        f"torch {torch.__version__}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(rows, indent=2))


def print_table(rows: list[dict], *, tile: int, threads: int, heading: str) -> None:
    """The markdown table of ``rows``: each setting's step, its rate, its fraction of the matmul rate of its own
    dtype and of fp32's (bf16 with fp32 weights against the fp32 rate), its speed against contiguous fp32."""
    rates = rows[0]["matmul_rates"]
    print(f"{heading}, {threads} thread(s), batch {BATCH}, {tile}^3, matmul fp32 {rates['fp32'] / 1e9:.0f} GFLOP/s"
          + (f", bf16 {rates['bf16'] / 1e9:.0f} GFLOP/s" if "bf16" in rates else "") + "\n")
    print("| network | GFLOP a step | setting | step (s) | GFLOP/s | of its dtype's matmul rate | of the fp32 matmul "
          "rate | vs contiguous fp32 |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        base = next(iter(row["settings"].values()))["seconds"]
        for name, setting in row["settings"].items():
            print(f"| {row['network']} | {row['flops'] / 1e9:.1f} | {name} | {setting['seconds']:.3f} | "
                  f"{setting['flop_rate'] / 1e9:.1f} | {setting['fraction']:.2f} | "
                  f"{setting['flop_rate'] / row['matmul_rates']['fp32']:.2f} | {base / setting['seconds']:.2f}x |")
        for name, error in row.get("errors", {}).items():
            print(f"| {row['network']} | | {name} | did not compile: {error} | | | | |")
        if "auto" in row:
            auto = row["auto"]
            compiled = "compiled" if auto["compiled"] else f"eager ({auto['compile_reason']})"
            print(f"| {row['network']} | | auto chose (fp32, {LONG_TRIAL_STEPS} steps) | {auto['memory_format']}, "
                  f"{compiled} | | | | |")


if __name__ == "__main__":
    main()
