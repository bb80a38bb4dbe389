"""Mixed precision against fp32: per-rank memory of one training step at a 96^3 tile on a CPU (issue 37).

Each (network, precision) runs in a fresh process, one training step as a distmis trial takes it
(``distmis.train.precision.TorchPrecision``: the forward under autocast, the loss in fp32, the backward, Adam on the
fp32 weights): a warm-up step, then

- the **resident peak** of a step: the process's high-water mark (``ru_maxrss``) over the warm-up and a measured
  step, less the resident set before them (as ``perf_model.py``), against ``vit_memory(...).step``;
- the **activation memory**: what autograd holds for the backward at the forward's end (a
  ``saved_tensors_hooks`` step: every saved tensor's storage, once), less the parameters and their 16-bit copies
  (a saved tensor whose autograd history is a cast of a parameter), the network's input included (in fp32 the
  batch itself, under bf16 the copy autocast makes of it): the seed's "inputs and activations", against
  ``vit_memory(...).activation_memory``, the "activations MiB" column of ``distmis plan --precision``;
- the **tensor peak** of a step: the largest sum of live allocations in ``torch.profiler``'s events (Adam's moments,
  made before it, added), against ``vit_memory(...).tensors`` less the parameters.

The ViT-seg is ``perf_model.py``'s (4 channels, one class, L=2, E=96, 4 heads, a decoder of 16 features, batch 1),
trained on the soft dice of its sigmoid (``training.loss``'s default), at patches 16, 8 and 4 with the fused
attention kernel (the default ``attention_kernel``) and at patches 16 and 8 with the math kernel, whose
probabilities torch computes in fp32 whatever the inputs' dtype. The torch U-Net (the paper's: 8 base filters, 4
levels, batch normalization, batch 1) is measured too; the performance model does not describe it.

    python benchmarks/precision_memory.py                        # all of it: 2 to 7 minutes on 2 cores
    python benchmarks/precision_memory.py --patches 16,8 --no-unet --kernels fused   # about a minute
    python benchmarks/precision_memory.py --onednn-max-isa AVX512_CORE_BF16          # oneDNN without AMX
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import multiprocessing
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 2**20
TILE, LAYERS, EMBED, HEADS, FEATURES = 96, 2, 96, 4, 16
#: autograd nodes that pass a tensor through as a view: a parameter's 16-bit copy is saved through them
_VIEWS = ("TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0", "UnsqueezeBackward0",
          "ExpandBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0")


def parameter_copy(tensor, parameters: set[int]) -> bool:
    """Whether ``tensor`` is (a view of) autocast's cast of one of the ``parameters`` (by ``id``)."""
    node = tensor.grad_fn
    while node is not None and type(node).__name__ in _VIEWS:
        node = node.next_functions[0][0]
    if node is None or type(node).__name__ != "ToCopyBackward0":
        return False
    source = node.next_functions[0][0]
    return source is not None and id(getattr(source, "variable", None)) in parameters


def tensor_peak(prof) -> float:
    """The largest sum of live CPU allocations in a profile (``perf_model.py``'s)."""
    from perf_model import tensor_peak as peak

    return peak(prof)


def measure(config: dict) -> dict:
    """One (network, precision) in this fresh process: see the module docstring."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from distmis.train.precision import TorchPrecision
    from distmis.train.torch_losses import make_loss

    torch.set_num_threads(config["threads"])
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, TILE, TILE, TILE, generator=generator)
    y = (torch.rand(1, 1, TILE, TILE, TILE, generator=generator) > 0.9).float()
    if config["network"] == "vit-seg":
        from distmis.models.vit_seg import ViTSeg

        model = ViTSeg(4, 1, TILE, patch=config["patch"], layers=LAYERS, embed_dim=EMBED, heads=HEADS,
                       decoder_features=FEATURES, attention_kernel=config["kernel"])
        loss_fn = make_loss("dice", from_logits=True)  # training.loss's default
    else:
        from distmis.models.unet3d_torch import UNet3D

        model = UNet3D(in_channels=4, num_classes=1, base_filters=8, levels=4, norm="batch")
        loss_fn = make_loss("dice")
    precision = TorchPrecision(config["precision"], "cpu")
    loss_fn = precision.fp32_loss(loss_fn)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    parameters = {id(p) for p in model.parameters()}
    kernel = SDPBackend.MATH if config["kernel"] == "math" else SDPBackend.FLASH_ATTENTION

    def step(hooks=None) -> float:
        optimizer.zero_grad(set_to_none=True)
        with hooks or contextlib.nullcontext():
            with precision.autocast():
                output = model(x)
            loss = loss_fn(output, y)
        del output
        precision.backward(loss)
        precision.step(optimizer)
        return float(loss.detach())

    from sp_scaling import rss_bytes

    with sdpa_kernel([kernel]):
        before = rss_bytes()
        step()  # warm-up: Adam's moments are made
        start = time.perf_counter()
        loss = step()
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before

        given = {t.untyped_storage().data_ptr() for t in (*model.parameters(), y)}
        saved: dict[int, int] = {}
        copies: dict[int, int] = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in given:
                (copies if parameter_copy(tensor, parameters) else saved)[storage.data_ptr()] = storage.nbytes()
            return tensor

        step(torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor))
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    moments = sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
                  if torch.is_tensor(t) and t.dim() > 0)
    return {**config, "loss": loss, "seconds": seconds, "resident": float(peak),
            "activations": float(sum(saved.values())), "copies": float(sum(copies.values())),
            "tensors": tensor_peak(prof) + moments, "parameters": sum(p.numel() for p in model.parameters())}


def run(config: dict) -> dict:
    """:func:`measure` in a process of its own (spawned: nothing of this one's memory in its peak)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(measure, config).result(timeout=config["timeout"])


def pct(predicted: float, measured: float) -> str:
    return f"{100 * (predicted / measured - 1):+.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patches", default="16,8,4", help="ViT-seg patches (fused kernel)")
    parser.add_argument("--kernels", default="fused,math", help="attention kernels; math runs at patches 16 and 8")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--no-unet", action="store_true", help="skip the torch U-Net")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per configuration")
    parser.add_argument("--onednn-max-isa", help="ONEDNN_MAX_CPU_ISA for the measured processes, e.g. "
                                                 "AVX512_CORE_BF16: oneDNN without AMX, whose bfloat16 weight-gradient "
                                                 "kernels take large scratch buffers")
    args = parser.parse_args()
    if args.onednn_max_isa:
        os.environ["ONEDNN_MAX_CPU_ISA"] = args.onednn_max_isa  # read by oneDNN in the spawned processes
    import torch

    from distmis.perf.model import ViTShape, vit_memory

    precisions = args.precisions.split(",")
    networks = [("vit-seg", patch, kernel) for kernel in args.kernels.split(",")
                for patch in (int(p) for p in args.patches.split(",")) if kernel == "fused" or patch >= 8]
    if not args.no_unet:
        networks.append(("unet3d", 0, "-"))
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "default")
    print(f"tile {TILE}^3, batch 1, {args.threads} thread(s), torch {torch.__version__}, {os.cpu_count()} cores, "
          f"oneDNN ISA {isa}\n", flush=True)
    started = time.perf_counter()
    results: dict[tuple, dict] = {}
    for network, patch, kernel in networks:
        for precision in precisions:
            config = {"network": network, "patch": patch, "kernel": kernel, "precision": precision,
                      "threads": args.threads, "timeout": args.timeout}
            t0 = time.perf_counter()
            results[(network, patch, kernel, precision)] = run(config)
            print(f"  ran {network} patch {patch} {kernel} {precision} in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)

    def predicted(patch: int, kernel: str, precision: str):
        shape = ViTShape((TILE,) * 3, patch, LAYERS, EMBED, HEADS, 4.0, FEATURES, 4, 1)
        return vit_memory(shape, kernel=kernel, threads=args.threads, precision=precision)  # type: ignore[arg-type]

    print("Per precision (MiB): activation memory (saved for the backward, the input included, the parameters and "
          "their 16-bit copies aside) measured and predicted (`vit_memory(...).activation_memory`, `distmis plan`'s "
          "activations column); the 16-bit parameter copies autograd kept; the tensor peak (profiler) and the "
          "resident peak, each against the model:\n")
    print("| network | patch | kernel | precision | activations | predicted | error | copies | tensor peak | "
          "predicted | error | resident peak | predicted | error | step s | loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (network, patch, kernel, precision), r in results.items():
        row = f"| {network} | {patch or '-'} | {kernel} | {precision} | {r['activations'] / MIB:.1f} | "
        if network == "vit-seg":
            m = predicted(patch, kernel, precision)
            tensors = m.tensors - m.parameters
            row += (f"{m.activation_memory / MIB:.1f} | {pct(m.activation_memory, r['activations'])} | "
                    f"{r['copies'] / MIB:.2f} | {r['tensors'] / MIB:.0f} | {tensors / MIB:.0f} | "
                    f"{pct(tensors, r['tensors'])} | {r['resident'] / MIB:.0f} | {m.step / MIB:.0f} | "
                    f"{pct(m.step, r['resident'])} |")
        else:
            row += (f"- | - | {r['copies'] / MIB:.2f} | {r['tensors'] / MIB:.0f} | - | - | {r['resident'] / MIB:.0f} "
                    "| - | - |")
        print(row + f" {r['seconds']:.2f} | {r['loss']:.4f} |")

    if "fp32" in precisions:
        print("\nActivation memory of each mixed precision against fp32's, measured and as `distmis plan "
              "--precision` predicts it:\n")
        print("| network | patch | kernel | precision | measured ratio | predicted ratio | predicted activations "
              "against measured | tensor peak ratio | resident peak ratio |")
        print("|---|---|---|---|---|---|---|---|---|")
        for (network, patch, kernel, precision), r in results.items():
            base = results.get((network, patch, kernel, "fp32"))
            if precision == "fp32" or base is None:
                continue
            ratio = r["activations"] / base["activations"]
            cells = "- | -"
            if network == "vit-seg":
                m, m32 = predicted(patch, kernel, precision), predicted(patch, kernel, "fp32")
                cells = (f"{m.activation_memory / m32.activation_memory:.3f} | "
                         f"{pct(m.activation_memory, r['activations'])}")
            print(f"| {network} | {patch or '-'} | {kernel} | {precision} | {ratio:.3f} | {cells} | "
                  f"{r['tensors'] / base['tensors']:.2f} | {r['resident'] / base['resident']:.2f} |")
    print(f"\n{time.perf_counter() - started:.0f} s in all", file=sys.stderr)


if __name__ == "__main__":
    main()
