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

    python benchmarks/sp_scaling.py                                    # the table in benchmarks/README.md
    python benchmarks/sp_scaling.py --patches 16,8 --degrees 1,2       # a quick look
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
                       heads=config["heads"], decoder_features=config["decoder_features"])
        params = sum(p.numel() for p in model.parameters())
        net = parallelize_vit_seg(model, dist.group.WORLD, attention=config["attention"]) if sp > 1 else model
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
        result.update(ok=True, loss=loss, seconds=seconds, tx=tx1 - tx0, peak=peak - before, params=params)
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
            "loss": results[0]["loss"]}


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
    parser.add_argument("--cap-mb", type=int, default=6144, help="per-rank memory cap of the last table")
    parser.add_argument("--cap-patch", type=int, default=4)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per configuration")
    args = parser.parse_args()

    base = {"tile": args.tile, "layers": args.layers, "embed_dim": args.embed_dim, "heads": args.heads,
            "decoder_features": args.decoder_features, "kernel": args.kernel, "cap_mb": 0, "timeout": args.timeout}
    print(f"tile {args.tile}^3, ViT L={args.layers} E={args.embed_dim} A={args.heads}, attention kernel "
          f"{args.kernel}, {os.cpu_count()} cores\n")
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
    if args.cap_mb:
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
