"""Pipeline-parallel U-Net (LAMP): per-rank peak memory, step time and bytes between stages against the number
of stages K, and a per-rank memory cap under which one rank fails and a pipeline trains.

Each K runs in fresh processes (a real gloo group of K ranks on loopback, the U-Net cut by
`distmis.parallel.pipeline.pipeline_unet`); K=1 is the plain model in one process. One warm-up step, then
`--steps` measured steps of forward, backward (GPipe or 1F1B over `--microbatches` micro-batches; with group norm
the gradients equal one device's) and Adam on each rank's stage. Measured:
- step peak memory: the peak resident set of the rank's process during the measured steps minus its size before
  them, after the warm-up and with the C heap's free pages given back (CPU has no allocator statistics like
  CUDA's; the trainers' StepMeter measures the same way), per stage and the largest over the ranks; and the
  resident peak itself (code, parameters, Adam's moments, gloo's buffers included), which a memory cap meets;
- step time: rank 0's mean wall time of the measured steps (with more processes than cores, as K=4 on 2 cores,
  this measures total work and the pipeline's bubble, not a speed-up);
- bytes between stages, computed (not sniffed) from the shapes each stage sends: forward, its outputs (the
  activation and every skip not yet used) per micro-batch; backward, the gradients of its inputs; fp32;
- each stage's cells and its share of the U-Net's forward convolution cost (`cell_macs`), by which the cut is
  balanced;
- the loss of the first step, the same for every K (the pipeline is exact with group norm).

The memory cap (`--cap-mb`, 0: none) gives every rank RLIMIT_AS = its address space before the steps plus the cap,
as benchmarks/sp_scaling.py does: a rank whose steps need more fails to allocate, and is reported so.

    python benchmarks/pipeline_unet.py                 # the tables in benchmarks/README.md
    python benchmarks/pipeline_unet.py --quick         # a small look (32^3, 8 filters), about a minute
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distmis.models.unet3d_torch import UNet3D  # noqa: E402
from distmis.parallel.pipeline import (  # noqa: E402
    balanced_partition,
    cell_macs,
    pipeline_unet,
    stage_examples,
    unet_cells,
)
from distmis.service.net import free_port  # noqa: E402
from distmis.train.torch_unet import (  # noqa: E402 - StepMeter's own measurement of a step's peak
    _proc_status_bytes,
    _reset_resident_peak,
    _trim_heap,
    make_loss,
)

IN_CHANNELS, CLASSES = 4, 3


def build(config: dict) -> UNet3D:
    torch.manual_seed(0)
    return UNet3D(in_channels=IN_CHANNELS, num_classes=CLASSES, base_filters=config["base_filters"],
                  levels=config["levels"], norm="group", norm_groups=4)


def cut(config: dict, stages: int) -> dict:
    """Each stage's cells, cost share and bytes sent per step (forward outputs, backward input gradients)."""
    model = build(config)
    costs = cell_macs(model, (config["tile"],) * 3)
    bounds = balanced_partition(costs, stages)
    names = [type(c).__name__.replace("Cell", "")[:3].lower() for c in unet_cells(model)]
    micro = config["batch"] // config["microbatches"]
    examples = stage_examples(model, bounds, (micro, IN_CHANNELS, *(config["tile"],) * 3))
    rows = []
    for index, ((start, stop), (inputs, outputs)) in enumerate(zip(bounds, examples)):
        forward = sum(t.numel() for t in outputs) * 4 if index < stages - 1 else 0
        backward = sum(t.numel() for t in inputs) * 4 if index > 0 else 0
        rows.append({"cells": "+".join(names[start:stop]), "share": sum(costs[start:stop]) / sum(costs),
                     "sent_mb": (forward + backward) * config["microbatches"] / 2**20})
    return {"stages": rows, "parameters": sum(p.numel() for p in model.parameters())}


def worker(rank: int, stages: int, port: int, config: dict, out: str) -> None:
    torch.set_num_threads(config["threads"] or max(1, (os.cpu_count() or 1) // stages))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=stages)
    result: dict = {"rank": rank, "threads": torch.get_num_threads()}
    try:
        model = build(config)
        loss_fn = make_loss("dice-bce")
        tile = (config["tile"],) * 3
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(config["batch"], IN_CHANNELS, *tile, generator=generator)
        y = (torch.rand(config["batch"], CLASSES, *tile, generator=generator) > 0.9).float()
        if stages == 1:
            parameters = list(model.parameters())

            def forward_backward() -> float:
                loss = loss_fn(model(x), y)
                loss.backward()
                return float(loss.detach())
        else:
            pipe = pipeline_unet(model, tile=tile, microbatches=config["microbatches"], schedule=config["schedule"],
                                 batch_size=config["batch"], loss_fn=loss_fn)
            parameters = pipe.parameters()

            def forward_backward() -> float:
                return float(pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None))
        optimizer = torch.optim.Adam(parameters, lr=1e-4)

        def step() -> float:
            optimizer.zero_grad(set_to_none=True)
            loss = forward_backward()
            optimizer.step()
            return loss

        if config["cap_mb"]:  # a per-rank memory cap: the address space may grow by cap_mb from here
            import psutil

            limit = psutil.Process().memory_info().vms + config["cap_mb"] * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        first_loss = step()  # warm-up: lazy imports, kernel choices, Adam's moments
        dist.barrier()
        _trim_heap()  # the resident set holds what is in use, then its high-water mark restarts from it
        _reset_resident_peak()
        before = _proc_status_bytes("VmRSS")
        start = time.perf_counter()
        for _ in range(config["steps"]):
            step()
        seconds = (time.perf_counter() - start) / config["steps"]
        dist.barrier()
        high = _proc_status_bytes("VmHWM")
        result.update(ok=True, loss=first_loss, seconds=seconds, peak=high - before, resident=high)
    except (RuntimeError, MemoryError) as exc:  # an allocation over the cap
        result.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    torch.save(result, Path(out) / f"rank{rank}.pt")
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a rank that failed may leave its peers in a collective
        pass


def run(config: dict, stages: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(worker, args=(stages, free_port(), config, out), nprocs=stages, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + config["timeout"]
        try:
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        process.kill()
                    return {"ok": False, "error": f"timed out after {config['timeout']} s"}
        except mp.ProcessRaisedException as exc:  # a rank killed by the kernel (out of memory) or crashed
            return {"ok": False, "error": str(exc).strip().splitlines()[-1][:120]}
        except mp.ProcessExitedException as exc:
            return {"ok": False, "error": f"a rank died ({exc.exit_code if hasattr(exc, 'exit_code') else exc})"}
        results = [torch.load(Path(out) / f"rank{r}.pt") for r in range(stages)
                   if (Path(out) / f"rank{r}.pt").exists()]
    failed = [r for r in results if not r["ok"]]
    if failed or len(results) < stages:
        return {"ok": False, "error": failed[0]["error"] if failed else "a rank died"}
    return {"ok": True, "seconds": results[0]["seconds"], "loss": results[0]["loss"],
            "peaks_mb": [r["peak"] / 2**20 for r in results], "resident_mb": max(r["resident"] for r in results) / 2**20,
            "threads": results[0]["threads"]}


def memory_table(config: dict, stage_counts: list[int]) -> dict[int, dict]:
    print(f"\nU-Net base_filters {config['base_filters']}, levels {config['levels']}, group norm, on "
          f"{config['tile']}^3 x batch {config['batch']} ({config['microbatches']} micro-batches, "
          f"{config['schedule']}); {config['steps']} measured step(s) after a warm-up\n")
    print("| stages | threads/rank | step peak MB (max rank) | step peak MB per stage | resident peak MB (max rank) "
          "| step s | loss (step 1) | cells per stage | conv share per stage | sent MB/step per stage |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    found = {}
    for k in stage_counts:
        result = run(config, k)
        layout = cut(config, k)
        found[k] = result
        cells = " / ".join(s["cells"] for s in layout["stages"])
        shares = " / ".join(f"{s['share']:.0%}" for s in layout["stages"])
        sent = " / ".join(f"{s['sent_mb']:.0f}" for s in layout["stages"])
        if result["ok"]:
            per = " / ".join(f"{p:.0f}" for p in result["peaks_mb"])
            print(f"| {k} | {result['threads']} | {max(result['peaks_mb']):.0f} | {per} | {result['resident_mb']:.0f} "
                  f"| {result['seconds']:.2f} | {result['loss']:.6f} | {cells} | {shares} | {sent} |", flush=True)
        else:
            print(f"| {k} | | failed: {result['error']} | | | | | {cells} | {shares} | {sent} |", flush=True)
    return found


def cap_table(config: dict, stage_counts: list[int]) -> None:
    print(f"\nPer-rank memory cap {config['cap_mb']} MB (RLIMIT_AS above each rank's address space before its "
          "steps)\n")
    print("| stages | trains? | resident peak MB (max rank) |")
    print("|---|---|---|")
    for k in stage_counts:
        result = run(config, k)
        if result["ok"]:
            print(f"| {k} | yes | {result['resident_mb']:.0f} |", flush=True)
        else:
            print(f"| {k} | no: {result['error']} | |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tile", type=int, default=64)
    parser.add_argument("--base-filters", type=int, default=32)
    parser.add_argument("--levels", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    parser.add_argument("--stages", default="1,2,4")
    parser.add_argument("--steps", type=int, default=1, help="measured steps after the warm-up")
    parser.add_argument("--threads", type=int, default=0, help="threads per rank (0: the cores / stages, >= 1)")
    parser.add_argument("--cap-mb", type=int, default=1000, help="per-rank memory cap of the cap table (0: none)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per configuration")
    parser.add_argument("--cap-only", action="store_true", help="only the memory-cap table")
    parser.add_argument("--quick", action="store_true", help="32^3, 8 filters, 3 levels, no cap table")
    args = parser.parse_args()
    if args.quick:
        args.tile, args.base_filters, args.levels, args.cap_mb = 32, 8, 3, 0
    config = {"tile": args.tile, "base_filters": args.base_filters, "levels": args.levels, "batch": args.batch,
              "microbatches": args.microbatches, "schedule": args.schedule, "steps": args.steps,
              "threads": args.threads, "timeout": args.timeout, "cap_mb": 0}
    if args.tile % 2 ** (args.levels - 1):
        parser.error(f"--tile {args.tile} must divide by 2**(levels-1) = {2 ** (args.levels - 1)}")
    stage_counts = [int(k) for k in args.stages.split(",")]
    print(f"{os.cpu_count()} CPU(s); U-Net parameters: {cut(config, 1)['parameters']:,}; "
          f"GPipe's bubble (K-1)/(M+K-1) at M={args.microbatches}: "
          + ", ".join(f"K={k}: {(k - 1) / (args.microbatches + k - 1):.0%}" for k in stage_counts))
    if not args.cap_only:
        memory_table(config, stage_counts)
    if args.cap_mb:
        cap_table({**config, "cap_mb": args.cap_mb}, stage_counts)


if __name__ == "__main__":
    main()
