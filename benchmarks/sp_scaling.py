"""Sequence-parallel ViT-seg: per-rank peak memory, step time and bytes sent per training step, against the
SP degree, the patch size and the attention strategy, with the analytic communication volume beside the
measured one; and a configuration that exceeds a per-rank memory cap at SP=1 but trains at SP=4.

Each configuration runs in fresh processes (a real gloo group of SP ranks on loopback): one warm-up step,
then one measured step of forward, backward (`gather` decoder: gradients equal one device's), gradient
sync and Adam. Measured:
- peak memory: the peak resident set of the rank's process during the steps minus its size before them
  (CPU has no allocator statistics like CUDA's), the largest over the ranks;
- step time: rank 0's wall time of the measured step (on a machine with fewer cores than ranks this
  measures total work, not speed-up);
- bytes: what all processes sent over the loopback interface during the measured step (/proc/net/dev),
  divided by the ranks; the analytic volume assumes ring all-gather / reduce-scatter / all-reduce and
  pairwise all-to-all, fp32, batch 1 (the perf-model paper's section 5):
    allgather-kv, per layer: all-gather K, V forward and reduce-scatter dK, dV backward: 4 (SP-1) T E
    ulysses, per layer: 4 all-to-alls forward (Q, K, V, output) and 4 backward: 8 (SP-1)/SP T E
    gather decoder input: (SP-1) T E;  gradient sum over the SP group: 2 (SP-1)/SP P
  with T = N/SP tokens per rank, E the embedding, P the parameters.

Attention runs torch's math kernel by default, which holds the (T x N) score matrices as the paper's
setting does; `--kernel flash` uses the fused CPU kernel (memory linear in N, where SP saves much less).

Axial rows (after the tables above; `--axial-patches`, default 4,2; empty to leave them out): the same model
sizes built with `attention="axial"` (each block attends along H, then W, then D of the token grid, three
stages each with its own QKV and projection, then the MLP), for the attentions `dsp`, `ulysses` and
`allgather-kv` (`--axial-attentions`) at each SP degree; SP=1 runs once per patch (every attention is the one
device's model there). Measured as above; beside it the perf model's prediction, not formulas of this script:
`vit_memory(...).step` (kernel "math", or "fused" under `--kernel flash`) against the peak, and
`communication_bytes(...)` with cost "ring" (`.total`; `.attention` alone) and cost "gloo" against the bytes.
With T = N/SP tokens per rank and the axial model's 3 stages per block, per layer:
    allgather-kv: 3 x 4 (SP-1) T E (ring; gloo's reduce-scatter sends an all-reduce's volume: 3 x 6 (SP-1) T E)
    ulysses: 3 x 8 (SP-1)/SP T E
    dsp (dynamic sequence parallelism): no communication inside a stage; the tokens are split in slabs along one
      grid axis, and one all-to-all of the stream switches the split before a stage that attends along it:
      2 (SP-1)/SP T E per switch (forward and backward), ceil(3L/2) - 1 switches for L blocks when all three grid
      axes divide by SP (`net.schedule.switches`, printed per row);
plus the gather decoder's input and the gradient sum as above. So with all axes divisible DSP's attention
traffic is (ceil(3L/2) - 1) x 2 / (24 L) of Ulysses': 1/12 at L=2, tending to 1/8 as L grows. A summary table
per (patch, SP) then gives the measured DSP/Ulysses ratio of the bytes sent, in total and for attention alone:
the measured attention bytes are the bytes sent less the perf model's ring count of the rest (decoder_gather +
sp_gradients, which gloo's all-gather and all-reduce send exactly), beside the analytic attention-only ratio.

    python benchmarks/sp_scaling.py                                    # the table in benchmarks/history.md
    python benchmarks/sp_scaling.py --patches 16,8 --degrees 1,2       # a quick look
    python benchmarks/sp_scaling.py --skip-full --cap-mb 0             # the axial rows only (patches 4 and 2)
    python benchmarks/sp_scaling.py --skip-full --cap-mb 0 --tile 32 --axial-patches 4 --degrees 1,2,4  # quick
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

from distmis.models.vit_seg import ViTSeg  # noqa: E402
from distmis.service.net import free_port  # noqa: E402
from distmis.parallel.sequence import parallelize_vit_seg, sync_sp_gradients  # noqa: E402
from distmis.perf.partition import check_sequence_parallel  # noqa: E402
from distmis.perf.model import CommBytes, SequenceLayout, ViTShape, communication_bytes, vit_memory  # noqa: E402


def loopback_tx_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def analytic_bytes(sp: int, tokens: int, embed: int, layers: int, params: int, attention: str) -> float:
    """Bytes one rank sends in one training step (see the module docstring)."""
    t = tokens / sp
    per_layer = 4 * (sp - 1) * t * embed if attention == "allgather-kv" else 8 * (sp - 1) / sp * t * embed
    elements = layers * per_layer + (sp - 1) * t * embed + 2 * (sp - 1) / sp * params
    return 4.0 * elements


def worker(rank: int, sp: int, port: int, config: dict, out: str) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // sp))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=sp)
    result: dict = {"rank": rank}
    try:
        torch.manual_seed(0)
        tile = config["tile"]
        model = ViTSeg(4, 1, tile, patch=config["patch"], layers=config["layers"], embed_dim=config["embed_dim"],
                       heads=config["heads"], decoder_features=config["decoder_features"],
                       attention=config.get("model_attention", "full"))
        params = sum(p.numel() for p in model.parameters())
        net = parallelize_vit_seg(model, dist.group.WORLD, attention=config["attention"]) if sp > 1 else model
        # DSP's all-to-alls of the stream in one forward (the schedule's count, and the hooks installed)
        switches = (net.schedule.switches, len(net.switches)) if sp > 1 and config["attention"] == "dsp" else (0, 0)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(1, 4, tile, tile, tile, generator=generator)
        y = (torch.rand(1, 1, tile, tile, tile, generator=generator) > 0.9).float()
        kernel = SDPBackend.MATH if config["kernel"] == "math" else SDPBackend.FLASH_ATTENTION

        def step() -> float:
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(net(x), y)
            loss.backward()
            if sp > 1:
                sync_sp_gradients(net)
            optimizer.step()
            return float(loss.detach())

        if config["cap_mb"]:  # a per-rank memory cap: the address space may grow by cap_mb from here
            import psutil

            limit = psutil.Process().memory_info().vms + config["cap_mb"] * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        before = rss_bytes()
        with sdpa_kernel([kernel]):
            step()  # warm-up
            dist.barrier()
            tx0, t0 = loopback_tx_bytes(), time.perf_counter()
            loss = step()
            seconds = time.perf_counter() - t0
            dist.barrier()
            tx1 = loopback_tx_bytes()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        result.update(ok=True, loss=loss, seconds=seconds, tx=tx1 - tx0, peak=peak - before, params=params,
                      switches=switches, threads=torch.get_num_threads())
    except (RuntimeError, MemoryError) as exc:  # an allocation over the cap
        result.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    torch.save(result, Path(out) / f"rank{rank}.pt")
    try:
        dist.destroy_process_group()
    except Exception:  # a rank that failed may leave its peers in a collective
        pass


def run(config: dict, sp: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(worker, args=(sp, free_port(), config, out), nprocs=sp, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + config["timeout"]
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                return {"ok": False, "error": f"timed out after {config['timeout']} s"}
        results = [torch.load(Path(out) / f"rank{r}.pt") for r in range(sp) if (Path(out) / f"rank{r}.pt").exists()]
    failed = [r for r in results if not r["ok"]]
    if failed or len(results) < sp:
        return {"ok": False, "error": failed[0]["error"] if failed else "a rank died"}
    tokens = (config["tile"] // config["patch"]) ** 3
    return {"ok": True, "tokens": tokens, "seconds": results[0]["seconds"],
            "peak_mb": max(r["peak"] for r in results) / 2**20,
            "sent_mb": results[0]["tx"] / sp / 2**20,  # loopback traffic of all ranks (one counter), per rank
            "analytic_mb": analytic_bytes(sp, tokens, config["embed_dim"], config["layers"], results[0]["params"],
                                          config["attention"]) / 2**20,
            "loss": results[0]["loss"], "switches": results[0]["switches"], "threads": results[0]["threads"]}


def axial_shape(config: dict) -> ViTShape:
    """The perf model's view of the worker's axial ViTSeg (4 channels in, 1 class, MLP ratio 4)."""
    return ViTShape((config["tile"],) * 3, config["patch"], config["layers"], config["embed_dim"], config["heads"],
                    4.0, config["decoder_features"], 4, 1, "axial")


def axial_table(args: argparse.Namespace, base: dict) -> None:
    """The axial model's rows (see the module docstring) and the DSP / Ulysses summary."""
    kernel = "fused" if args.kernel == "flash" else "math"
    attentions = args.axial_attentions.split(",")
    degrees = [int(d) for d in args.degrees.split(",")]
    if not args.skip_full or args.cap_mb:
        print()  # a table above: a blank line between
    print(f"Axial attention (H, then W, then D per block), the same sizes; predicted step MB: vit_memory(...).step "
          f"(kernel {kernel}); analytic: communication_bytes(...).total with the ring and the gloo cost, and its "
          f".attention alone (ring):\n")
    print("| patch | tokens | grid | attention | SP | step s | peak MB per rank | predicted step MB | sent MB per rank "
          "| analytic MB (ring) | analytic MB (gloo) | sent / analytic (gloo) | analytic attention MB | "
          "switches per forward |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    sent: dict[tuple[int, int, str], tuple[float, CommBytes]] = {}  # (patch, sp, attention): measured MB, ring
    for patch in (int(p) for p in args.axial_patches.split(",") if p):
        config = {**base, "patch": patch, "model_attention": "axial"}
        shape = axial_shape(config)
        grid = "x".join(map(str, shape.grid))
        runs = [("ulysses", 1, "- (one device)")] if 1 in degrees else []
        runs += [(attention, sp, attention) for attention in attentions for sp in degrees if sp > 1]
        for attention, sp, label in runs:
            head = f"| {patch} | {shape.tokens} | {grid} | {label} | {sp} |"
            try:
                check_sequence_parallel(shape.grid, shape.heads, sp, attention=attention,  # type: ignore[arg-type]
                                        model_attention="axial")
            except ValueError as exc:
                print(f"{head} not run: {str(exc)[:100]} | | | | | | | | |", flush=True)
                continue
            r = run({**config, "attention": attention}, sp)
            if not r["ok"]:
                print(f"{head} failed: {r['error']} | | | | | | | | |", flush=True)
                continue
            layout = SequenceLayout(sp, attention)  # type: ignore[arg-type]
            ring = communication_bytes(shape, layout, cost="ring")
            gloo = communication_bytes(shape, layout, cost="gloo").total / 2**20
            predicted = f"{vit_memory(shape, layout, kernel=kernel, threads=r['threads']).step / 2**20:.0f}"
            ratio = f"{r['sent_mb'] / gloo:.3f}" if gloo else "-"
            schedule, hooks = r["switches"]
            switches = (f"{schedule}" if schedule == hooks else f"{schedule} (hooks {hooks})") \
                if attention == "dsp" and sp > 1 else "-"
            sent[(patch, sp, attention)] = (r["sent_mb"], ring)
            print(f"{head} {r['seconds']:.2f} | {r['peak_mb']:.0f} | {predicted} | {r['sent_mb']:.2f} | "
                  f"{ring.total / 2**20:.2f} | {gloo:.2f} | {ratio} | {ring.attention / 2**20:.2f} | {switches} |",
                  flush=True)
    pairs = sorted({(p, sp) for p, sp, a in sent if a == "dsp"} & {(p, sp) for p, sp, a in sent if a == "ulysses"},
                   key=lambda k: (-k[0], k[1]))
    if not pairs:
        return
    print("\nDSP against Ulysses, bytes sent per rank. Attention MB (measured) = sent MB less the ring model's "
          "decoder_gather + sp_gradients (gloo's all-gather and all-reduce send exactly that); analytic = "
          "communication_bytes(...).attention (ring):\n")
    print("| patch | SP | DSP sent MB | Ulysses sent MB | measured DSP/Ulysses (total) | DSP attention MB | "
          "Ulysses attention MB | measured DSP/Ulysses (attention) | analytic DSP/Ulysses (attention) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for patch, sp in pairs:
        (dsp_mb, dsp), (uly_mb, uly) = sent[(patch, sp, "dsp")], sent[(patch, sp, "ulysses")]
        dsp_att = dsp_mb - (dsp.decoder_gather + dsp.sp_gradients) / 2**20
        uly_att = uly_mb - (uly.decoder_gather + uly.sp_gradients) / 2**20
        print(f"| {patch} | {sp} | {dsp_mb:.2f} | {uly_mb:.2f} | {dsp_mb / uly_mb:.3f} | {dsp_att:.2f} | "
              f"{uly_att:.2f} | {dsp_att / uly_att:.3f} | {dsp.attention / uly.attention:.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tile", type=int, default=96)
    parser.add_argument("--patches", default="16,8,4")
    parser.add_argument("--degrees", default="1,2,4")
    parser.add_argument("--attentions", default="allgather-kv,ulysses")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--embed-dim", type=int, default=96)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--decoder-features", type=int, default=16)
    parser.add_argument("--kernel", choices=["math", "flash"], default="math")
    parser.add_argument("--axial-patches", default="4,2", help="patches of the axial table (empty: none)")
    parser.add_argument("--axial-attentions", default="dsp,ulysses,allgather-kv")
    parser.add_argument("--skip-full", action="store_true", help="leave out the full-attention table")
    parser.add_argument("--cap-mb", type=int, default=6144, help="per-rank memory cap of the memory-cap table "
                        "(full attention; 0: none)")
    parser.add_argument("--cap-patch", type=int, default=4)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per configuration")
    args = parser.parse_args()

    base = {"tile": args.tile, "layers": args.layers, "embed_dim": args.embed_dim, "heads": args.heads,
            "decoder_features": args.decoder_features, "kernel": args.kernel, "cap_mb": 0, "timeout": args.timeout}
    print(f"tile {args.tile}^3, ViT L={args.layers} E={args.embed_dim} A={args.heads}, attention kernel "
          f"{args.kernel}, {os.cpu_count()} cores\n")
    if not args.skip_full:
        full_table(args, base)
    if args.cap_mb:
        cap_table(args, base)
    if args.axial_patches:
        axial_table(args, base)


def full_table(args: argparse.Namespace, base: dict) -> None:
    print("| patch | tokens | attention | SP | step s | peak MB per rank | sent MB per rank | analytic MB | sent / analytic |")
    print("|---|---|---|---|---|---|---|---|---|")
    for patch in (int(p) for p in args.patches.split(",")):
        for attention in args.attentions.split(","):
            for sp in (int(d) for d in args.degrees.split(",")):
                r = run({**base, "patch": patch, "attention": attention}, sp)
                if not r["ok"]:
                    print(f"| {patch} | | {attention} | {sp} | failed: {r['error']} | | | | |", flush=True)
                    continue
                ratio = f"{r['sent_mb'] / r['analytic_mb']:.2f}" if r["analytic_mb"] else "-"
                print(f"| {patch} | {r['tokens']} | {attention} | {sp} | {r['seconds']:.2f} | {r['peak_mb']:.0f} | "
                      f"{r['sent_mb']:.1f} | {r['analytic_mb']:.1f} | {ratio} |", flush=True)


def cap_table(args: argparse.Namespace, base: dict) -> None:
    print(f"\nPer-rank memory cap {args.cap_mb} MB (RLIMIT_AS above each rank's size before its steps), "
          f"patch {args.cap_patch}, allgather-kv:\n")
    print("| SP | result | step s | peak MB per rank |")
    print("|---|---|---|---|")
    for sp in (1, 4):
        r = run({**base, "patch": args.cap_patch, "attention": "allgather-kv", "cap_mb": args.cap_mb}, sp)
        if r["ok"]:
            print(f"| {sp} | trains (loss {r['loss']:.4f}) | {r['seconds']:.2f} | {r['peak_mb']:.0f} |", flush=True)
        else:
            print(f"| {sp} | exceeds the cap: {r['error']} | | |", flush=True)


if __name__ == "__main__":
    main()
