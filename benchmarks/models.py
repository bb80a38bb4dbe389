"""Every registered network on one tile: its parameters, a training step's mean time and its peak memory.

For each entry of :data:`distmis.models.registry.MODELS` that has a torch builder, a fresh process builds the
network with the entry's builder for 4 input channels, 3 output channels (sigmoid, the BraTS regions) and a
``--tile`` cube, batch 1, on the CPU with one thread (``torch.set_num_threads(1)``), and runs
``--warmup`` training steps, then ``--steps`` timed ones. A step is forward, loss (soft Dice on the sigmoid
of the output: of the logits for a network that returns logits, the network's own probabilities otherwise),
backward and an Adam step, on one random batch drawn once.

- ``parameters``: ``sum(p.numel())`` of the built network;
- ``step s``: the mean wall time of the timed steps;
- ``peak MiB``: how far the process's resident set rose above what it held just before the first step (the
  network, the batch, Adam, torch's libraries): ``/proc/self/status``'s ``VmHWM``, reset just before the first
  step through ``/proc/self/clear_refs`` (else ``getrusage``'s ``ru_maxrss``), less ``VmRSS`` then. It takes in
  the gradients and Adam's moments the first step creates, and the activations kept for the backward.

Each network's ``model.params`` are its params class's defaults, but for those in :data:`DEFAULT_PARAMS` (too
large for a CPU benchmark: the table says so), and ``--params '{"vit-seg": {...}}'`` overrides them per network.

    python benchmarks/models.py --tile 96 --steps 3 --output runs/models

writes ``models.md`` and ``models.json`` to ``--output`` and prints the table. No part of it runs in the test
suite.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: Params that differ from a network's defaults, and why: none so far. Every registered network's defaults
#: (vit-seg's ViT-B, 12 layers of 768 with patch 16; swinunetr's feature_size 24) run a 96^3 step on one core in
#: seconds, so the table is of the defaults; a network whose defaults cannot gets a row here, named in the table.
DEFAULT_PARAMS: dict[str, tuple[dict[str, Any], str]] = {}

IN_CHANNELS, OUT_CHANNELS, BATCH = 4, 3, 1


def torch_models() -> list[str]:
    from distmis.models.registry import MODELS

    return [name for name, entry in MODELS.items() if "torch" in entry.frameworks]


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _trim_heap() -> None:
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):
        pass


def measure(name: str, params: dict[str, Any], tile: int, warmup: int, steps: int) -> dict[str, Any]:
    """One network, in this (fresh) process."""
    import resource

    import torch

    from distmis.models.registry import NetworkInput, model_entry

    from distmis.networks import build_network

    torch.set_num_threads(1)
    torch.manual_seed(0)
    entry = model_entry(name)
    network_params = entry.params(**params)
    shape = (tile, tile, tile)
    network = build_network(entry, network_params,
                            NetworkInput(IN_CHANNELS, OUT_CHANNELS, shape, "sigmoid", (1.0, 1.0, 1.0)))
    network.train()
    optimizer = torch.optim.Adam(network.parameters(), lr=1e-4)
    image = torch.randn(BATCH, IN_CHANNELS, *shape)
    target = (torch.rand(BATCH, OUT_CHANNELS, *shape) > 0.9).float()

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        output = network(image)
        if isinstance(output, (list, tuple)):  # deep supervision: the full-resolution head
            output = output[0]
        if output.dim() == image.dim() + 1:  # MONAI's DynUNet stacks its deep-supervision heads on dim 1
            output = output[:, 0]
        probabilities = torch.sigmoid(output) if entry.output == "logits" else output
        overlap = (probabilities * target).sum(dim=(2, 3, 4))
        total = probabilities.sum(dim=(2, 3, 4)) + target.sum(dim=(2, 3, 4))
        loss = 1 - ((2 * overlap + 1e-5) / (total + 1e-5)).mean()
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    _trim_heap()
    before_kib = _status_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # VmHWM := VmRSS
        resettable = _status_kib("VmHWM") is not None
    except OSError:
        resettable = False
    seconds = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        step()
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
    peak_kib = _status_kib("VmHWM") if resettable else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "model": name, "params": network_params.model_dump(), "tile": list(shape),
        "parameters": sum(p.numel() for p in network.parameters()),
        "step_s": sum(seconds) / len(seconds), "steps": steps, "warmup": warmup,
        "peak_mib": None if before_kib is None or peak_kib is None else (peak_kib - before_kib) / 1024,
        "rss_before_mib": None if before_kib is None else before_kib / 1024,
        "torch": torch.__version__,
    }


def table(rows: list[dict[str, Any]], notes: dict[str, str]) -> str:
    lines = ["| model | params used | parameters | step s | peak MiB | note |", "|---|---|---|---|---|---|"]
    for row in rows:
        asked = json.dumps(row["params_asked"]) if row["params_asked"] else "defaults"
        if "error" in row:
            lines.append(f"| {row['model']} | {asked} | | | | failed: {row['error']} |")
            continue
        lines.append(f"| {row['model']} | {asked} | {row['parameters']:,} | {row['step_s']:.2f} | "
                     f"{row['peak_mib']:.0f} | {notes.get(row['model'], '')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tile", type=int, default=96, help="the cube's side (default 96)")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per network (default 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--models", default="", help="comma-separated registry names (default: every torch one)")
    parser.add_argument("--params", default="{}",
                        help='JSON: per network, the model.params to use, e.g. \'{"vit-seg": {"layers": 2}}\'')
    parser.add_argument("--output", default="runs/models", help="folder for models.md and models.json")
    parser.add_argument("--child", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        job = json.loads(args.child)
        print(json.dumps(measure(job["model"], job["params"], args.tile, args.warmup, args.steps)))
        return
    names = [n for n in args.models.split(",") if n] or torch_models()
    overrides = json.loads(args.params)
    notes = {name: f"not the defaults: {why}" for name, (_, why) in DEFAULT_PARAMS.items()
             if name in names and name not in overrides}
    rows = []
    for name in names:
        params = overrides.get(name, DEFAULT_PARAMS.get(name, ({}, ""))[0])
        command = [sys.executable, __file__, "--child", json.dumps({"model": name, "params": params}),
                   "--tile", str(args.tile), "--steps", str(args.steps), "--warmup", str(args.warmup)]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode:
            error = (done.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append({"model": name, "params_asked": params, "error": error})
        else:
            rows.append({**json.loads(done.stdout.strip().splitlines()[-1]), "params_asked": params,
                         "process_s": round(time.perf_counter() - started, 1)})
        print(f"{name}: {rows[-1].get('step_s', rows[-1].get('error'))}", file=sys.stderr, flush=True)
    text = table(rows, notes)
    print(text)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    header = (f"{args.tile}^3 tile, {IN_CHANNELS} input and {OUT_CHANNELS} output channels, batch {BATCH}, one "
              f"thread, {args.warmup} warm-up and {args.steps} timed steps; {platform.processor() or platform.machine()}")
    (output / "models.md").write_text(f"{header}\n\n{text}\n")
    (output / "models.json").write_text(json.dumps({"tile": args.tile, "steps": args.steps, "warmup": args.warmup,
                                                    "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
