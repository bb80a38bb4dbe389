"""Pipeline-parallel U-Net (LAMP): per-rank peak memory, step time and bytes between stages against the number
of stages K, and a per-rank memory cap under which the U-Net does not train on one rank and trains on K.

Each K runs in fresh processes (a real gloo group of K ranks on loopback, a file store; the U-Net cut into K stages
by `distmis.parallel.pipeline.pipeline_unet`, GPipe or 1F1B over `--microbatches` micro-batches); K=1 is the plain
model in one process (ordinary forward and backward, no pipeline: the baseline). `--steps` training steps of
forward, backward (with group norm the gradients equal one device's) and Adam on each rank's stage, on the same
seeded batch; the first is a warm-up. Each rank runs `--threads` threads (0: the cores / K, at least 1). Measured:
- peak memory: the peak resident set of the rank's process during its steps (ru_maxrss) minus its resident set
  before them, as benchmarks/sp_scaling.py measures (CPU has no allocator statistics like CUDA's): the warm-up
  counts (Adam's moments, gloo's buffers, first-call allocations); per stage and the largest over the ranks;
- step peak: the same over the measured steps only, after the warm-up and with the C heap's free pages given
  back (VmHWM reset; the trainers' StepMeter measures so): what one more step needs; and the resident peak
  itself (code, parameters, moments included), the largest over the ranks;
- step time: rank 0's mean wall time of the steps after the warm-up (with more processes than cores, as K=4 on
  2 cores, this measures total work and the pipeline's bubble (K-1)/(M+K-1), not a speed-up);
- each stage's cells (`UNetPipeline.bounds`, what the run used) and its share of the U-Net's forward convolution
  multiply-accumulates (`cell_macs`), by which the cut is balanced;
- bytes between stages, computed from the boundary tensors (`stage_examples`), not sniffed from the network:
  forward, what crosses a boundary is the activation and every skip not yet consumed (LAMP's duplicated encoder
  outputs); backward, the gradient of each, the same size; fp32, per micro-batch, times M per step;
- the loss of the first step, the same for every K (the pipeline is exact with group norm).

The memory-cap table (`--cap-mb`, 0: none) gives every rank RLIMIT_AS = its address space before its steps plus
the cap, as benchmarks/sp_scaling.py does: a rank whose steps need more fails to allocate ("can't allocate
memory", "out of memory"), and the table says so. With the defaults one rank exceeds the 3000 MB cap and two
and four stages train.

    python benchmarks/pipeline_unet.py                 # the tables in benchmarks/history.md, about 6 minutes
    python benchmarks/pipeline_unet.py --cap-mb 0      # the memory table only
    python benchmarks/pipeline_unet.py --cap-only      # the memory-cap table only
    python benchmarks/pipeline_unet.py --quick         # a smoke run (32^3, 8 filters, 3 levels), under a minute
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import sys
import tempfile
import time
from datetime import timedelta
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
from distmis.train.metering import (  # noqa: E402 - StepMeter's own measurement of a step's peak
    _proc_status_bytes,
    _reset_resident_peak,
    _trim_heap,
)
from distmis.train.torch_losses import make_loss  # noqa: E402

IN_CHANNELS, CLASSES = 4, 3
OUT_OF_MEMORY = ("out of memory", "can't allocate", "cannot allocate", "bad_alloc", "MemoryError")


def build(config: dict) -> UNet3D:
    torch.manual_seed(0)
    return UNet3D(in_channels=IN_CHANNELS, num_classes=CLASSES, base_filters=config["base_filters"],
                  levels=config["levels"], norm="group", norm_groups=4)


def cell_names(model: UNet3D) -> list[str]:
    return [type(c).__name__.replace("Cell", "")[:3].lower() for c in unet_cells(model)]


def boundaries(config: dict, bounds: list[tuple[int, int]]) -> list[dict]:
    """What crosses each stage boundary (the outputs of the stage before it) per micro-batch: the tensors' shapes
    (activation first, then the skips still travelling) and their fp32 bytes; the same again backward."""
    micro = config["batch"] // config["microbatches"]
    examples = stage_examples(build(config), bounds, (micro, IN_CHANNELS, *(config["tile"],) * 3))
    rows = []
    for _, outputs in examples[:-1]:  # the last stage's output is the prediction: it goes to the loss, not a rank
        shapes = [f"{t.shape[1]}x{t.shape[2]}^3" if len(set(t.shape[2:])) == 1 else "x".join(map(str, t.shape[1:]))
                  for t in outputs]
        rows.append({"tensors": shapes, "bytes": sum(t.numel() * t.element_size() for t in outputs)})
    return rows


def describe(exc: BaseException) -> str:
    """The error's first line; an allocation failure in its chain first (the pipeline's schedule raises its own
    RuntimeError "Failed to run stage backward" from the allocator's)."""
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    chosen = next((e for e in chain if out_of_memory(f"{type(e).__name__}: {e}")), chain[0])
    lines = [line.strip() for line in str(chosen).splitlines() if line.strip()] or [""]
    tried = re.search(r"can't allocate memory: you tried to allocate (\d+) bytes", lines[0])
    if tried:  # the CPU allocator's message, shortened
        return f"{type(chosen).__name__}: can't allocate memory ({int(tried.group(1)) / 2**20:.0f} MB asked)"
    return f"{type(chosen).__name__}: {lines[0][:160]}"


def worker(rank: int, stages: int, config: dict, out: str) -> None:
    torch.set_num_threads(config["threads"] or max(1, (os.cpu_count() or 1) // stages))
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=stages,
                            timeout=timedelta(seconds=config["gloo_timeout"]))
    result: dict = {"rank": rank, "threads": torch.get_num_threads()}
    try:
        model = build(config)
        loss_fn = make_loss("dice-bce")
        tile = (config["tile"],) * 3
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(config["batch"], IN_CHANNELS, *tile, generator=generator)
        y = (torch.rand(config["batch"], CLASSES, *tile, generator=generator) > 0.9).float()
        if stages == 1:  # the baseline: the plain model, no pipeline
            parameters = list(model.parameters())
            result["bounds"] = [(0, len(unet_cells(model)))]

            def forward_backward() -> float:
                loss = loss_fn(model(x), y)
                loss.backward()
                return float(loss.detach())
        else:
            pipe = pipeline_unet(model, tile=tile, microbatches=config["microbatches"], schedule=config["schedule"],
                                 batch_size=config["batch"], loss_fn=loss_fn)
            parameters = pipe.parameters()
            result["bounds"] = list(pipe.bounds)

            def forward_backward() -> float:
                return float(pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None))
        model.train()
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
        before = _proc_status_bytes("VmRSS")
        first_loss = step()  # warm-up: lazy initialization, kernel choices, Adam's moments
        dist.barrier()
        _trim_heap()  # the resident set holds what is in use, then its high-water mark restarts from it
        _reset_resident_peak()
        before_steps = _proc_status_bytes("VmRSS")
        start = time.perf_counter()
        for _ in range(config["steps"] - 1):
            step()
        seconds = (time.perf_counter() - start) / (config["steps"] - 1)
        dist.barrier()
        high = _proc_status_bytes("VmHWM")
        lifetime = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        result.update(ok=True, loss=first_loss, seconds=seconds, peak=lifetime - before, step_peak=high - before_steps,
                      resident=max(high, lifetime))
    except (RuntimeError, MemoryError) as exc:  # an allocation over the cap (or a peer's, seen as a closed link)
        result.update(ok=False, error=describe(exc))
    torch.save(result, Path(out) / f"rank{rank}.tmp")
    os.replace(Path(out) / f"rank{rank}.tmp", Path(out) / f"rank{rank}.pt")  # whole, for run() to read
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a rank that failed may leave its peers in a collective
        pass


def out_of_memory(error: str) -> bool:
    return any(s.lower() in error.lower() for s in OUT_OF_MEMORY)


def run(config: dict, stages: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(worker, args=(stages, config, out), nprocs=stages, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + config["timeout"]
        failed_at = None
        try:
            while not context.join(timeout=5):
                now = time.monotonic()
                if failed_at is None and any(not torch.load(p)["ok"] for p in Path(out).glob("rank*.pt")):
                    failed_at = now  # a rank failed: its peers get a moment to see it, then go
                if now > deadline or (failed_at is not None and now > failed_at + 30):
                    for process in context.processes:
                        if process.is_alive():
                            process.kill()
                    if failed_at is None:
                        return {"ok": False, "error": f"timed out after {config['timeout']} s"}
                    break
        except mp.ProcessRaisedException as exc:  # an exception other than the allocation errors caught
            return {"ok": False, "error": str(exc).strip().splitlines()[-1][:160]}
        except mp.ProcessExitedException as exc:  # a rank killed (by the kernel's OOM killer, say) or crashed
            return {"ok": False, "error": f"a rank died ({getattr(exc, 'exit_code', exc)})"}
        results = [torch.load(Path(out) / f"rank{r}.pt") for r in range(stages)
                   if (Path(out) / f"rank{r}.pt").exists()]
    failed = [r for r in results if not r["ok"]]
    if failed or len(results) < stages:
        # the rank that ran out of memory first, not a peer that only saw it leave
        failed.sort(key=lambda r: not out_of_memory(r["error"]))
        error = f"rank {failed[0]['rank']}: {failed[0]['error']}" if failed else "a rank died"
        return {"ok": False, "error": error, "oom": bool(failed) and out_of_memory(failed[0]["error"])}
    return {"ok": True, "seconds": results[0]["seconds"], "loss": results[0]["loss"], "bounds": results[0]["bounds"],
            "peaks_mb": [r["peak"] / 2**20 for r in results], "step_peaks_mb": [r["step_peak"] / 2**20 for r in results],
            "resident_mb": max(r["resident"] for r in results) / 2**20, "threads": results[0]["threads"]}


def memory_table(config: dict, stage_counts: list[int]) -> dict[int, dict]:
    print(f"\nU-Net base_filters {config['base_filters']}, levels {config['levels']}, group norm, {IN_CHANNELS} "
          f"channels in, {CLASSES} classes, on {config['tile']}^3 x batch {config['batch']} "
          f"({config['microbatches']} micro-batches, {config['schedule']}); {config['steps']} steps, the first a "
          f"warm-up; peaks in MB per rank\n")
    print("| stages | threads/rank | peak above pre-step RSS (max rank) | per stage | step peak after warm-up (max rank) "
          "| per stage | resident peak (max rank) | step s | loss (step 1) | cells per stage | conv share per stage |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    model = build(config)
    names, costs = cell_names(model), cell_macs(model, (config["tile"],) * 3)
    found = {}
    for k in stage_counts:
        result = run(config, k)
        found[k] = result
        bounds = result["bounds"] if result["ok"] else balanced_partition(costs, k)
        cells = " / ".join("+".join(names[a:b]) for a, b in bounds)
        shares = " / ".join(f"{sum(costs[a:b]) / sum(costs):.0%}" for a, b in bounds)
        if result["ok"]:
            peaks = " / ".join(f"{p:.0f}" for p in result["peaks_mb"])
            step_peaks = " / ".join(f"{p:.0f}" for p in result["step_peaks_mb"])
            print(f"| {k} | {result['threads']} | {max(result['peaks_mb']):.0f} | {peaks} | "
                  f"{max(result['step_peaks_mb']):.0f} | {step_peaks} | {result['resident_mb']:.0f} | "
                  f"{result['seconds']:.2f} | {result['loss']:.6f} | {cells} | {shares} |", flush=True)
        else:
            print(f"| {k} | | failed: {result['error']} | | | | | | | {cells} | {shares} |", flush=True)
    return found


def bytes_table(config: dict, stage_counts: list[int], found: dict[int, dict]) -> None:
    costs = cell_macs(build(config), (config["tile"],) * 3)
    m = config["microbatches"]
    print(f"\nBytes between stages (computed from the boundary tensors, fp32; channels x size; the activation first, "
          f"then the skips; backward sends each one's gradient, the same size), {m} micro-batches a step:\n")
    print("| stages | boundary | tensors crossing | MB per micro-batch, each way | MB per step, forward + backward |")
    print("|---|---|---|---|---|")
    for k in (k for k in stage_counts if k > 1):
        bounds = found[k]["bounds"] if found.get(k, {}).get("ok") else balanced_partition(costs, k)
        rows = boundaries(config, bounds)
        for b, row in enumerate(rows):
            print(f"| {k} | {b} -> {b + 1} | {' + '.join(row['tensors'])} | {row['bytes'] / 2**20:.1f} | "
                  f"{2 * m * row['bytes'] / 2**20:.0f} |")
        print(f"| {k} | all | | {sum(r['bytes'] for r in rows) / 2**20:.1f} | "
              f"{2 * m * sum(r['bytes'] for r in rows) / 2**20:.0f} |", flush=True)


def cap_table(config: dict, stage_counts: list[int]) -> None:
    print(f"\nPer-rank memory cap {config['cap_mb']} MB (RLIMIT_AS = each rank's address space before its steps + the "
          f"cap), {config['steps']} steps, the first a warm-up:\n")
    print("| stages | threads/rank | result | peak MB above pre-step RSS (max rank) | resident peak MB (max rank) |")
    print("|---|---|---|---|---|")
    for k in stage_counts:
        result = run(config, k)
        if result["ok"]:
            print(f"| {k} | {result['threads']} | trains (loss {result['loss']:.6f}) | {max(result['peaks_mb']):.0f} | "
                  f"{result['resident_mb']:.0f} |", flush=True)
        elif result.get("oom"):
            print(f"| {k} | | exceeds the cap: {result['error']} | | |", flush=True)
        else:
            print(f"| {k} | | failed: {result['error']} | | |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tile", type=int, default=96, help="the input is tile^3 voxels")
    parser.add_argument("--base-filters", type=int, default=32)
    parser.add_argument("--levels", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    parser.add_argument("--stages", default="1,2,4", help="the numbers of stages K (1: the plain model)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per run, the first a warm-up (>= 2)")
    parser.add_argument("--threads", type=int, default=0, help="threads per rank (0: the cores / K, at least 1)")
    parser.add_argument("--cap-mb", type=int, default=3000, help="per-rank memory cap of the cap table (0: none)")
    parser.add_argument("--cap-steps", type=int, default=2, help="steps of each run under the cap (>= 2)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--cap-only", action="store_true", help="only the memory-cap table")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 32^3, 8 filters, 3 levels, no cap table")
    args = parser.parse_args()
    if args.quick:
        args.tile, args.base_filters, args.levels, args.cap_mb = 32, 8, 3, 0
    stage_counts = [int(k) for k in args.stages.split(",")]
    if args.tile % 2 ** (args.levels - 1):
        parser.error(f"--tile {args.tile} must divide by 2**(levels-1) = {2 ** (args.levels - 1)}")
    if args.steps < 2 or args.cap_steps < 2:
        parser.error("--steps and --cap-steps need a warm-up and at least one measured step: 2 or more")
    if args.batch % args.microbatches:
        parser.error(f"--batch {args.batch} must divide into {args.microbatches} micro-batches")
    if any(not 1 <= k <= 2 * args.levels - 1 for k in stage_counts):
        parser.error(f"a U-Net of {args.levels} levels has {2 * args.levels - 1} cells: --stages from 1 to that")
    if args.schedule == "1f1b" and any(k > args.microbatches for k in stage_counts):
        parser.error("the 1f1b schedule needs at least as many micro-batches as stages")
    config = {"tile": args.tile, "base_filters": args.base_filters, "levels": args.levels, "batch": args.batch,
              "microbatches": args.microbatches, "schedule": args.schedule, "steps": args.steps,
              "threads": args.threads, "timeout": args.timeout, "gloo_timeout": min(args.timeout, 300), "cap_mb": 0}
    model = build(config)
    print(f"{os.cpu_count()} CPU(s); U-Net parameters: {sum(p.numel() for p in model.parameters()):,}; "
          f"GPipe's bubble (K-1)/(M+K-1) at M={args.microbatches}: "
          + ", ".join(f"K={k}: {(k - 1) / (args.microbatches + k - 1):.0%}" for k in stage_counts))
    started = time.monotonic()
    if not args.cap_only:
        found = memory_table(config, stage_counts)
        bytes_table(config, stage_counts, found)
    if args.cap_mb:
        cap_table({**config, "cap_mb": args.cap_mb, "steps": args.cap_steps}, stage_counts)
    print(f"\n({time.monotonic() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
