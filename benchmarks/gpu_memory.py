"""The traced memory model against CUDA's allocator: one training step of every registered torch network, on a GPU.

Torch only: torch, MONAI, einops and distmis's own modules; no Ray, MLflow or TensorFlow. A GPU machine needs
nothing else installed.

For each network, two tiles (64^3 and 128^3 by default), fp32 and bf16, batch 2, 4 channels in and 3 out, the
network is built on the GPU and takes one training step, so that Adam's moments exist. Then the allocator's peak is
reset and a second step is measured: `torch.cuda.max_memory_allocated` less `memory_allocated` before the step, plus
Adam's moments and the previous step's gradients. That is what a trial's `StepMeter` reports as `peak_memory_mb`.
The prediction is `distmis.estimate.memory.predict_step_memory(device="cuda")`: the step traced on fake tensors, the
GPU's Adam (`foreach`), and no CPU overhead.

A network or tile that runs out of memory is a row that says so. The table goes to stdout, and the rows go to
`--output` as JSON. The whole run takes a few minutes on one H200.

    python benchmarks/gpu_memory.py --output gpu_memory.json
    python benchmarks/gpu_memory.py --device cpu --networks unet3d --tiles 16 --precisions fp32  # the CPU path
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 2**20
BATCH = 2
IN_CHANNELS, OUT_CHANNELS = 4, 3
NETWORKS = "unet3d,segresnet,basicunet,dynunet,swinunetr,unetr,vit-seg"


def _cpu_peak(step) -> tuple[float, float]:
    """The CPU path: the resident set's high-water mark over ``step`` less the resident set before it, and that."""
    import ctypes

    def status(field: str) -> int:
        with open("/proc/self/status") as lines:
            return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(f"{field}:"))

    ctypes.CDLL("libc.so.6").malloc_trim(ctypes.c_size_t(0))
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    step()
    return status("VmHWM") - before, before


def measure(name: str, tile: tuple[int, int, int], precision: str, device: str) -> dict:
    """One row: the measured and the predicted step (see the module's docstring)."""
    import torch

    from distmis.estimate.memory import predict_step_memory
    from distmis.estimate.step_trace import TrainingStep
    from distmis.models.registry import NetworkInput, model_entry
    from distmis.networks import build_network
    from distmis.train.torch_losses import make_loss

    entry = model_entry(name)
    params = entry.params()
    network = NetworkInput(IN_CHANNELS, OUT_CHANNELS, tile)
    loss_fn = make_loss("dice", from_logits=entry.output == "logits", activation=network.activation)
    row = {"network": name, "tile": list(tile), "precision": precision, "device": device}
    kind = "cuda" if device.startswith("cuda") else "cpu"
    prediction = predict_step_memory(entry, params, network, loss_fn, batch=BATCH, precision=precision,
                                     device=kind, threads=torch.get_num_threads())
    row.update(predicted_mib=prediction.step / MIB, moment=prediction.trace.moment,
               predicted_total_mib=prediction.peak / MIB)
    torch.manual_seed(0)
    try:
        model = build_network(entry, params, network).to(device)
        step = TrainingStep(model, network, loss_fn, batch=BATCH, precision=precision, device=kind)
        step()
        held = sum(t.untyped_storage().nbytes() for t in step.optimizer_state())
        held += sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
        if kind == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        else:
            peak, before = _cpu_peak(step)
        row.update(measured_mib=(peak + held) / MIB, before_mib=before / MIB)
    except torch.OutOfMemoryError as error:
        row["error"] = f"out of memory: {str(error).splitlines()[0]}"
    finally:
        if kind == "cuda":
            torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--networks", default=NETWORKS)
    parser.add_argument("--tiles", default="64,128")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--device", default="cuda", help="cuda (the default: refused without a GPU) or cpu")
    parser.add_argument("--output", type=Path, help="write the rows as JSON here too")
    args = parser.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_memory: torch sees no GPU here (torch.cuda.is_available() is False); --device cpu runs the "
                 "CPU path")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from step_memory import tile_for

    started = time.perf_counter()
    rows = []
    for name in args.networks.split(","):
        for side in (int(t) for t in args.tiles.split(",")):
            for precision in args.precisions.split(","):
                rows.append(measure(name, tile_for(name, side), precision, args.device))
                row = rows[-1]
                print(f"  {name} {'x'.join(map(str, row['tile']))} {precision}: "
                      f"{row.get('measured_mib', float('nan')):.0f} MiB measured, {row['predicted_mib']:.0f} "
                      f"predicted", file=sys.stderr, flush=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"{device}, torch {torch.__version__}, batch {BATCH}, {time.perf_counter() - started:.0f} s\n")
    print("| network | tile | precision | measured step (MiB) | predicted step (MiB) | error |")
    print("|---|---|---|---|---|---|")
    errors = []
    for row in rows:
        tile = "x".join(map(str, row["tile"]))
        if "error" in row:
            print(f"| {row['network']} | {tile} | {row['precision']} | {row['error']} | "
                  f"{row['predicted_mib']:.0f} | |")
            continue
        error = row["predicted_mib"] / row["measured_mib"] - 1
        errors.append(abs(error))
        print(f"| {row['network']} | {tile} | {row['precision']} | {row['measured_mib']:.0f} | "
              f"{row['predicted_mib']:.0f} | {error:+.1%} |")
    if errors:
        print(f"\nmedian |error| {statistics.median(errors):.1%}, largest {max(errors):.1%}, rows within 15%: "
              f"{sum(e <= 0.15 for e in errors)}/{len(errors)}")
    if args.output:
        args.output.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
