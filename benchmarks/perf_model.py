"""The performance model (distmis/perf/model.py) against measurement: FLOPs, bytes sent, peak memory
and step time of one rank's ViT-seg training step, predicted and measured in real gloo groups.

The configuration is benchmarks/sp_scaling.py's: a 96^3 tile of 4 channels, batch 1, one class; ViT L=2,
E=96, 4 heads, decoder 16 features; patches 16, 8 and 4; SP 1, 2 and 4; allgather-kv and Ulysses attention;
torch's math and fused ("flash") CPU attention kernels. Each configuration runs in fresh processes forming a
gloo group of SP ranks on loopback (each with cores // SP threads, as sp_scaling.py): one warm-up step, then
one measured step of forward, backward, gradient sync and Adam. Measured, per rank:

- peak memory: sp_scaling.py's: the peak resident set during the two steps less the resident set before
  them, the largest over the ranks; against vit_memory(...).step. Then, in a third step (after the peak is
  taken), rank 0's tensor peak from torch.profiler's allocation events (plus Adam's moments, allocated before
  that step), against the model's tensors alone (MemoryEstimate.tensors less the parameters);
- step time: rank 0's wall time of the measured step, against FLOPs over a rate calibrated once (patch 4,
  fused kernel, SP=1: the step whose time is most matmul; the math kernel's is mostly its score matrices'
  memory traffic); the ranks share the machine's cores, so the prediction is the FLOPs of all ranks over
  that rate: total work, not a speed-up;
- bytes: what the processes sent over `lo` in the measured step (/proc/net/dev), per rank; against
  communication_bytes(..., cost="gloo") and the ring cost;
- FLOPs: torch.utils.flop_counter.FlopCounterMode inside each rank over one more training step with the math
  kernel (the counter misses the fused CPU kernel), against vit_flops(...).matmul; math-kernel runs at
  patches 16 and 8, with the `no-gather` decoder too.

Then the seed's Table 2 (seed_table2) for the patch-4 configuration over 4 devices.

With ``--axial PATCHES`` the same ViT with axial attention (``attention: axial``: H, then W, then D per block) runs
at those patches too, with DSP (dynamic sequence parallelism), Ulysses and allgather-kv at every degree; its rows
read ``axial dsp``, ``axial ulysses``, ``axial allgather-kv`` in the attention column.

    python benchmarks/perf_model.py            # all of it: about 12 minutes on 2 cores
    python benchmarks/perf_model.py --quick    # patches 16 and 8 only: about 4 minutes
    python benchmarks/perf_model.py --patches 8 --axial 8,4 --kernels math    # the axial rows (and patch 8's)
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sp_scaling import loopback_tx_bytes, rss_bytes  # noqa: E402

from distmis.models.vit_seg import ViTSeg  # noqa: E402
from distmis.perf.model import (  # noqa: E402
    SequenceLayout,
    ViTShape,
    communication_bytes,
    figure_of_merit,
    seed_table2,
    vit_flops,
    vit_memory,
    vit_parameters,
)
from distmis.parallel.sequence import parallelize_vit_seg, sync_sp_gradients  # noqa: E402
from distmis.service.net import free_port  # noqa: E402

MIB = 2**20


def tensor_peak(prof) -> float:
    """The largest sum of live CPU allocations in a profile (``profile_memory=True``): frees of blocks
    allocated before it are ignored, an allocation at an address still live (its free happened on a thread
    the profiler does not record) replaces the old one."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.alloc_size, event.extra_fields.ptr))
        stack.extend(event.children)
    live: dict[int, int] = {}
    current = peak = 0
    for _, size, ptr in sorted(events, key=lambda e: e[0]):
        if ptr in live:
            current -= live.pop(ptr)
        if size > 0:
            live[ptr] = size
            current += size
        peak = max(peak, current)
    return float(peak)


def worker(rank: int, sp: int, port: int, config: dict, out: str) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // sp))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=sp)
    torch.manual_seed(0)
    tile = config["tile"]
    model = ViTSeg(4, 1, tile, patch=config["patch"], layers=config["layers"], embed_dim=config["embed_dim"],
                   heads=config["heads"], decoder_features=config["decoder_features"],
                   attention=config["model_attention"])
    params = sum(p.numel() for p in model.parameters())
    net = (parallelize_vit_seg(model, dist.group.WORLD, attention=config["attention"], decoder=config["decoder"])
           if sp > 1 else model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, tile, tile, tile, generator=generator)
    y = (torch.rand(1, 1, tile, tile, tile, generator=generator) > 0.9).float()
    if sp > 1:
        y = net.local_target(y)
    kernel = SDPBackend.MATH if config["kernel"] == "math" else SDPBackend.FLASH_ATTENTION

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(net(x), y)
        loss.backward()
        if sp > 1:
            sync_sp_gradients(net)
        optimizer.step()
        return float(loss.detach())

    before = rss_bytes()
    with sdpa_kernel([kernel]):
        step()  # warm-up
        dist.barrier()
        tx0, t0 = loopback_tx_bytes(), time.perf_counter()
        step()
        seconds = time.perf_counter() - t0
        dist.barrier()
        tx1 = loopback_tx_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    result = {"rank": rank, "seconds": seconds, "tx": tx1 - tx0, "peak": peak, "params": params,
              "threads": torch.get_num_threads()}
    if config["tensors"]:  # after the resident peak is taken: the profiler's own records would add to it
        from torch.profiler import ProfilerActivity, profile

        with sdpa_kernel([kernel]):
            if rank == 0:
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    step()
                result["tensors"] = tensor_peak(prof) + 8.0 * params  # Adam's moments were allocated before
            else:
                step()
    if config["flops"]:
        with sdpa_kernel([SDPBackend.MATH]), FlopCounterMode(display=False) as counter:
            step()
        result["flops"] = float(counter.get_total_flops())
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def run(config: dict, sp: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(worker, args=(sp, free_port(), config, out), nprocs=sp, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + config["timeout"]
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise RuntimeError(f"timed out after {config['timeout']} s: {config}, SP={sp}")
        return [torch.load(Path(out) / f"rank{r}.pt") for r in range(sp)]


def configurations(patches: list[int], kernels: list[str], degrees: list[int],
                   axial: list[int] = ()) -> list[tuple]:
    """(model attention, patch, kernel, attention, decoder, SP): every patch, kernel and degree, both attentions
    (one run at SP=1, where they are the same), the gather decoder; the no-gather decoder at patch 8, math
    kernel; and the axial model at the ``axial`` patches with DSP, Ulysses and allgather-kv."""
    rows = []
    for patch in patches:
        for kernel in kernels:
            for sp in degrees:
                for attention in ("allgather-kv", "ulysses") if sp > 1 else ("allgather-kv",):
                    rows.append(("full", patch, kernel, attention, "gather", sp))
            if patch == 8 and kernel == "math":
                rows += [("full", 8, "math", attention, "no-gather", sp) for sp in degrees if sp > 1
                         for attention in ("allgather-kv", "ulysses")]
    for patch in axial:
        for kernel in kernels:
            for sp in degrees:
                for attention in ("dsp", "ulysses", "allgather-kv") if sp > 1 else ("dsp",):
                    rows.append(("axial", patch, kernel, attention, "gather", sp))
    return rows


def label(model_attention: str, attention: str) -> str:
    """The attention column: the SP strategy, prefixed ``axial`` for the axial model."""
    return attention if model_attention == "full" else f"axial {attention}"


def pct(predicted: float, measured: float) -> str:
    return f"{100 * (predicted / measured - 1):+.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="patches 16 and 8 only (no time calibration)")
    parser.add_argument("--patches", default="16,8,4")
    parser.add_argument("--kernels", default="math,flash")
    parser.add_argument("--degrees", default="1,2,4")
    parser.add_argument("--no-tensors", action="store_true", help="skip the profiled step (the tensor peaks)")
    parser.add_argument("--axial", default="", help="patches of the axial-attention model to run too, e.g. 8,4")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per configuration")
    args = parser.parse_args()
    patches = [16, 8] if args.quick else [int(p) for p in args.patches.split(",") if p]
    kernels = args.kernels.split(",")
    degrees = [int(d) for d in args.degrees.split(",")]
    axial = [int(p) for p in args.axial.split(",") if p]
    tile, layers, embed, heads, features = 96, 2, 96, 4, 16
    start = time.perf_counter()
    print(f"tile {tile}^3, ViT L={layers} E={embed} A={heads}, decoder {features} features, batch 1, "
          f"{os.cpu_count()} cores, torch {torch.__version__}\n", flush=True)

    results = {}
    worst: dict[str, float] = {}  # what the summary reports: the largest error by quantity

    def note(key: str, error: float) -> None:
        if abs(error) >= abs(worst.get(key, 0.0)):
            worst[key] = error

    for model_attention, patch, kernel, attention, decoder, sp in configurations(patches, kernels, degrees, axial):
        config = {"tile": tile, "patch": patch, "layers": layers, "embed_dim": embed, "heads": heads,
                  "decoder_features": features, "kernel": kernel, "attention": attention, "decoder": decoder,
                  "model_attention": model_attention, "tensors": not args.no_tensors,
                  "flops": kernel == "math" and (patch >= 8 or model_attention == "axial"), "timeout": args.timeout}
        t0 = time.perf_counter()
        results[(model_attention, patch, kernel, attention, decoder, sp)] = run(config, sp)
        print(f"  ran {model_attention} patch {patch} {kernel} {attention} {decoder} SP={sp} in "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    def shape_of(patch: int, model_attention: str = "full") -> ViTShape:
        return ViTShape((tile,) * 3, patch, layers, embed, heads, 4.0, features, 4, 1, model_attention)

    def layout_of(attention: str, decoder: str, sp: int) -> SequenceLayout:
        return SequenceLayout(sp=sp, attention=attention, decoder=decoder)  # type: ignore[arg-type]

    # ---- FLOPs
    print("FLOPs per rank and step (FlopCounterMode inside every rank, math kernel) against vit_flops().matmul:\n")
    print("| patch | decoder | attention | SP | measured GFLOP (rank 0) | predicted GFLOP | error, worst rank |")
    print("|---|---|---|---|---|---|---|")
    for (model_attention, patch, kernel, attention, decoder, sp), ranks in results.items():
        if "flops" not in ranks[0]:
            continue
        predicted = vit_flops(shape_of(patch, model_attention), layout_of(attention, decoder, sp)).matmul
        farthest = max((r["flops"] for r in ranks), key=lambda f: abs(f / predicted - 1))
        note("FLOPs", predicted / farthest - 1)
        print(f"| {patch} | {decoder} | {label(model_attention, attention)} | {sp} | {ranks[0]['flops'] / 1e9:.3f} | "
              f"{predicted / 1e9:.3f} | {pct(predicted, farthest)} |")

    # ---- bytes
    print("\nBytes sent per rank and step (all processes' `lo` traffic over the ranks) against "
          "communication_bytes(cost=\"gloo\") and the ring cost:\n")
    print("| patch | kernel | decoder | attention | SP | sent MiB | gloo MiB | gloo error | ring MiB | sent / ring |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (model_attention, patch, kernel, attention, decoder, sp), ranks in results.items():
        if sp == 1:
            continue
        sent = ranks[0]["tx"] / sp
        shape, layout = shape_of(patch, model_attention), layout_of(attention, decoder, sp)
        gloo = communication_bytes(shape, layout, cost="gloo").total
        ring = communication_bytes(shape, layout, cost="ring").total
        note(f"bytes, {label(model_attention, attention)} (gloo cost)", gloo / sent - 1)
        print(f"| {patch} | {kernel} | {decoder} | {label(model_attention, attention)} | {sp} | {sent / MIB:.2f} | "
              f"{gloo / MIB:.2f} | "
              f"{pct(gloo, sent)} | {ring / MIB:.2f} | {sent / ring:.2f} |")

    # ---- memory
    print("\nPeak memory per rank (MiB): measured resident peak above the process before its steps (largest "
          "over the ranks) against vit_memory().step; the profiler's tensor peak (rank 0) against the model's "
          "tensors:\n")
    print("| patch | kernel | decoder | attention | SP | measured | predicted | error | profiler tensors | "
          "model tensors | error | predicted peak moment |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (model_attention, patch, kernel, attention, decoder, sp), ranks in results.items():
        memory = vit_memory(shape_of(patch, model_attention), layout_of(attention, decoder, sp),
                            kernel="math" if kernel == "math" else "fused", threads=ranks[0]["threads"])
        measured = max(r["peak"] for r in ranks)
        model_tensors = memory.tensors - memory.parameters
        tensors = ranks[0].get("tensors")
        axial_note = "axial, " if model_attention == "axial" else ""
        note(f"memory, {axial_note}patch {patch}, {kernel}, {decoder}", memory.step / measured - 1)
        if tensors:
            note(f"tensors, {axial_note}patch {patch}", model_tensors / tensors - 1)
        profiled = (f"{tensors / MIB:.0f} | {model_tensors / MIB:.0f} | {pct(model_tensors, tensors)}"
                    if tensors else f"- | {model_tensors / MIB:.0f} | -")
        print(f"| {patch} | {kernel} | {decoder} | {label(model_attention, attention)} | {sp} | {measured / MIB:.0f} | "
              f"{memory.step / MIB:.0f} | {pct(memory.step, measured)} | {profiled} | {memory.moment} |")

    # ---- step time
    reference = ("full", 4, "flash", "allgather-kv", "gather", 1)
    if reference in results:
        rate = vit_flops(shape_of(4)).matmul / results[reference][0]["seconds"]
        print(f"\nStep time (rank 0's measured step) against the FLOPs of all SP ranks over one rate, "
              f"{rate / 1e9:.1f} GFLOP/s, calibrated on patch 4, fused kernel, SP=1 (the ranks share the "
              f"{os.cpu_count()} cores: total work, not speed-up):\n")
        print("| patch | kernel | decoder | attention | SP | GFLOP, all ranks | predicted s | measured s | "
              "predicted / measured |")
        print("|---|---|---|---|---|---|---|---|---|")
        for (model_attention, patch, kernel, attention, decoder, sp), ranks in results.items():
            total = sp * vit_flops(shape_of(patch, model_attention), layout_of(attention, decoder, sp)).matmul
            seconds = ranks[0]["seconds"]
            print(f"| {patch} | {kernel} | {decoder} | {label(model_attention, attention)} | {sp} | "
                  f"{total / 1e9:.1f} | "
                  f"{total / rate:.2f} | {seconds:.2f} | {total / rate / seconds:.2f} |")
        seconds = results[reference][0]["seconds"]
        print(f"\nThe seed's figure of merit (eq. 27) of the reference step: "
              f"{figure_of_merit(shape_of(4), batch=1, seconds=seconds):.3g} per second.")

    # ---- the seed's Table 2
    shape, n = shape_of(4), 4
    print(f"\nThe seed's Table 2 (seed_table2) for one block of the patch-4 model (s={shape.tokens}, "
          f"d={shape.embed_dim}, batch 1) over N={n} devices; elements, and bytes in fp32:\n")
    print("| strategy | parameter comm | activation comm | P+G memory | optimizer memory | activation memory |")
    print("|---|---|---|---|---|---|")
    for name, row in seed_table2(shape, n=n).items():
        cells = [f"{row[key]:.4g} ({4 * row[key] / MIB:.2f} MiB)" for key in
                 ("param_comm", "activation_comm", "pg_memory", "optimizer_memory")]
        print(f"| {name} | {' | '.join(cells)} | A/{round(1 / row['activation_memory_fraction'])} |")
    print(f"\n(the whole model has {vit_parameters(shape):,} parameters; the seed's block 12 d^2 = "
          f"{12 * shape.embed_dim ** 2:,})")
    print("\nLargest errors, predicted against measured:\n")
    for key, error in worst.items():
        print(f"- {key}: {100 * error:+.1f}%")
    print(f"\n{time.perf_counter() - start:.0f} s in all", file=sys.stderr)


if __name__ == "__main__":
    main()
