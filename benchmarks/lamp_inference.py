"""Whole-volume against sliding-window inference of the torch U-Net, timed with repeats (LAMP's inference question).

`search_spaces/lamp.yaml` answers it once per trial (`training.inference.compare`), inside a search where two
trials share the machine: one timing per way and trial, so a ratio read from it carries that run's noise. This
times the same prediction path on its own, in one process, `--repeats` times:

- the network: `distmis.models.unet3d_torch.UNet3D` as lamp.yaml builds it (4 input channels, one class, 4 levels,
  group norm of 4 groups), for each width of `--widths` (`base_filters`); weights seeded, untrained (the time of
  a forward pass does not depend on the weights' values);
- the input: one random channels-last volume of `--volume` (64^3, lamp.yaml's synthetic cases);
- the ways: `whole` (one pass of the whole volume) and a sliding window of each size in `--windows` (lamp.yaml's
  tiles: 32^3 and 48^3), all through `distmis.train.inference.predict_channels_last`, the function the torch
  trainers predict with (MONAI's sliding windows, overlap `--overlap`, Gaussian weights, `--batch` windows per
  forward pass: lamp.yaml's training batch of 2), under `torch.no_grad()` as the trainer's `_predict` is;
- threads: `--threads` (1: as each of lamp.yaml's trials ran, one CPU per trial).

Each way is predicted once untimed first (oneDNN's kernel choice, first-call allocations). Then each repeat times
every width and way once, in turn, so that a slow spell of the machine falls on all of them rather than on one.
Two clocks: the wall time, and the process's CPU time (`time.process_time`, all its threads). With one thread the
CPU time is the work itself, and it moves far less than the wall time when other processes share the cores;
with more threads than free cores the two differ. Per width and way the table gives each clock's median, the
CPU time's minimum, maximum and interquartile range over the repeats; per sliding window, the ratio of its
median to the whole volume's (CPU and wall), and the range of the per-repeat CPU ratios (window time over the
same repeat's whole-volume time).

    python benchmarks/lamp_inference.py                       # lamp.yaml's sizes, 9 repeats: ~100 CPU-seconds
    python benchmarks/lamp_inference.py --volume 128 --windows 64 --widths 8 --repeats 5   # LAMP's 64^3 windows
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distmis.models.unet3d_torch import UNet3D  # noqa: E402
from distmis.spec.schema import InferenceSpec  # noqa: E402
from distmis.train.inference import predict_channels_last  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def windows_per_volume(volume: int, window: int, overlap: float) -> int:
    """MONAI's count of windows along one axis, cubed (the scan interval is window x (1 - overlap))."""
    step = max(1, int(window * (1 - overlap)))
    per_axis = 1 if window >= volume else -(-(volume - window) // step) + 1
    return per_axis ** 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=ints, default=[8, 16], help="U-Net base_filters, comma-separated")
    parser.add_argument("--volume", type=int, default=64, help="edge of the cubic volume predicted")
    parser.add_argument("--windows", type=ints, default=[32, 48], help="sliding-window edges, comma-separated")
    parser.add_argument("--overlap", type=float, default=0.5)
    parser.add_argument("--batch", type=int, default=2, help="windows per forward pass")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=9, help="timed repeats of every width and way (>= 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    inference = InferenceSpec(overlap=args.overlap, mode="gaussian")
    rng = np.random.default_rng(args.seed)
    image = rng.normal(size=(args.volume,) * 3 + (4,)).astype(np.float32)

    models = {}
    for width in args.widths:
        torch.manual_seed(args.seed)
        model = UNet3D(in_channels=4, num_classes=1, base_filters=width, levels=4, norm="group", norm_groups=4)
        models[width] = model.eval()

    def predictor(model):
        @torch.no_grad()
        def predict(images_hwdc: np.ndarray) -> np.ndarray:
            x = torch.from_numpy(np.ascontiguousarray(np.moveaxis(images_hwdc, -1, 1), dtype=np.float32))
            return model(x).numpy().transpose(0, 2, 3, 4, 1)
        return predict

    ways: list[tuple[str, tuple[int, int, int] | None]] = [("whole", None)]
    ways += [(f"window {w}^3", (w, w, w)) for w in args.windows]

    def run(width: int, window) -> tuple[float, float]:
        """(wall seconds, CPU seconds) of one prediction."""
        wall, cpu = time.perf_counter(), time.process_time()
        predict_channels_last(predictor(models[width]), image, window, inference=inference, batch_size=args.batch)
        return time.perf_counter() - wall, time.process_time() - cpu

    print(f"torch {torch.__version__}, {args.threads} thread(s), volume {args.volume}^3, overlap {args.overlap}, "
          f"{args.batch} windows a pass, {args.repeats} repeats", flush=True)
    for width in args.widths:
        for _, window in ways:
            run(width, window)  # warm-up, not timed

    wall: dict[tuple[int, str], list[float]] = {(w, name): [] for w in args.widths for name, _ in ways}
    cpu: dict[tuple[int, str], list[float]] = {(w, name): [] for w in args.widths for name, _ in ways}
    for repeat in range(args.repeats):
        for width in args.widths:
            for name, window in ways:
                w_s, c_s = run(width, window)
                wall[(width, name)].append(w_s)
                cpu[(width, name)].append(c_s)
        print(f"repeat {repeat + 1}/{args.repeats} (wall / CPU s): " + ", ".join(
            f"w{w} {n} {wall[(w, n)][-1]:.3f}/{cpu[(w, n)][-1]:.3f}" for w in args.widths for n, _ in ways),
            flush=True)

    med = statistics.median
    print("\n| base_filters | parameters | way | windows | CPU s median | CPU s min-max | CPU s IQR | wall s median | "
          "wall s min-max | CPU median / whole | per-repeat CPU ratio min-max | wall median / whole |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for width in args.widths:
        params = sum(p.numel() for p in models[width].parameters())
        whole_cpu, whole_wall = cpu[(width, "whole")], wall[(width, "whole")]
        for name, window in ways:
            c, w = cpu[(width, name)], wall[(width, name)]
            q1, q3 = quartiles(c)
            count = 1 if window is None else windows_per_volume(args.volume, window[0], args.overlap)
            if window is None:
                ratio, spread, wall_ratio = "1.00", "-", "1.00"
            else:
                per_repeat = [v / x for v, x in zip(c, whole_cpu)]
                ratio = f"{med(c) / med(whole_cpu):.2f}"
                spread = f"{min(per_repeat):.2f}-{max(per_repeat):.2f}"
                wall_ratio = f"{med(w) / med(whole_wall):.2f}"
            print(f"| {width} | {params:,} | {name} | {count} | {med(c):.3f} | {min(c):.3f}-{max(c):.3f} | "
                  f"{q3 - q1:.3f} | {med(w):.3f} | {min(w):.3f}-{max(w):.3f} | {ratio} | {spread} | {wall_ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
