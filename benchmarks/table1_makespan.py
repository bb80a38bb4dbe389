"""The makespan model (distmis/perf/makespan.py) against DistMIS's Table I.

Berral et al. (IPDPSW 2022), Table I: the 32-configuration grid of search_spaces/distmis_grid.yaml (the 3D U-Net on
MSD Task01, 250 epochs, batch 2 a replica) run data-parallel (one trial after another on all the GPUs) and
experiment-parallel (one GPU a trial) on 1 to 32 V100s, 4 a node (MareNostrum CTE-Power: NVLink inside a node,
InfiniBand EDR between nodes), each the mean of three runs.

The model is given the setting and calibrated on the rows for 1, 2 and 4 GPUs only:
- experiment-parallel: one trial's time on one GPU, the least-squares fit of ``waves(k) x t`` to those rows
  (``waves(k)``: the packing's, ``ceil(32 / k)`` rounds of equal trials);
- data-parallel: a trial's time at degree k is ``A / k + B + all-reduce(k)`` (the epoch's training compute over
  k, and what does not shrink with k: the validation every worker runs whole, the start-up, the fixed cost of a
  step times the steps of one worker when the steps are many), ``A`` and ``B`` the least-squares fit to those rows
  after the all-reduce of the U-Net's gradients (its parameters counted from the network itself) over the
  published links is taken off.
Then it predicts the rows for 8, 12, 16 and 32 GPUs, and auto's makespan beside them.

    python benchmarks/table1_makespan.py            # prints the markdown table (seconds to h:mm:ss)
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distmis.perf.makespan import Cluster, TrialCost, pack  # noqa: E402

CONFIGURATIONS, EPOCHS, PER_NODE = 32, 250, 4
TRAIN_CASES, BATCH = 339, 2  # 70% of MSD Task01's 484 training cases (distmis_grid.yaml's split), 2 a replica
NVLINK, INFINIBAND = 75e9, 12.5e9  # bytes/s one way: NVLink 2.0 between two V100s of a node; EDR InfiniBand


def hms(text: str) -> float:
    h, m, s = (int(v) for v in text.split(":"))
    return 3600 * h + 60 * m + s


#: Table I: GPUs -> (data-parallel elapsed, experiment-parallel elapsed)
TABLE = {1: ("44:18:02", "44:20:19"), 2: ("23:09:28", "22:24:39"), 4: ("15:09:35", "11:32:20"),
         8: ("7:41:12", "7:03:17"), 12: ("5:59:59", "5:35:22"), 16: ("4:26:50", "4:11:54"),
         32: ("3:21:44", "2:55:06")}
CALIBRATION, PREDICTED = (1, 2, 4), (8, 12, 16, 32)


def unet_parameters() -> int:
    """The trained parameters of distmis_grid.yaml's U-Net (base 8 filters, 4 levels, batch norm; 4 channels in,
    1 out), counted from the network."""
    from distmis.models.registry import NetworkInput, model_entry
    from distmis.networks import build_network

    entry = model_entry("unet3d")
    params = entry.params(base_filters=8, levels=4, norm="batch")
    model = build_network(entry, params, NetworkInput(4, 1, (32, 32, 32)), "torch")
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def cluster(gpus: int) -> Cluster:
    return Cluster(workers=gpus, per_node=min(PER_NODE, gpus), bandwidth=NVLINK, inter_node_bandwidth=INFINIBAND)


def steps() -> int:
    return math.ceil(TRAIN_CASES / BATCH)


def fit_experiment() -> float:
    """One trial's seconds on one GPU: least squares of ``waves x t`` on the calibration rows."""
    waves = [math.ceil(CONFIGURATIONS / k) for k in CALIBRATION]
    measured = [hms(TABLE[k][1]) for k in CALIBRATION]
    return sum(w * m for w, m in zip(waves, measured)) / sum(w * w for w in waves)


def fit_data(gradient_bytes: float, rows: tuple[int, ...] = CALIBRATION) -> tuple[float, float]:
    """``A`` and ``B`` of a trial's ``A / k + B`` (its all-reduce taken off) on the calibration rows."""
    xs, ys = [], []
    for k in rows:
        per_trial = hms(TABLE[k][0]) / CONFIGURATIONS
        comm = EPOCHS * math.ceil(steps() / k) * cluster(k).allreduce_seconds(gradient_bytes, k)
        xs.append(1 / k)
        ys.append(per_trial - comm)
    n, sx, sy = len(xs), sum(xs), sum(ys)
    sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys))
    a = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return a, (sy - a * sx) / n


def data_makespan(a: float, b: float, gradient_bytes: float, k: int) -> float:
    trial = dict(epochs=EPOCHS, train_seconds=a / EPOCHS, steps=steps(), gradient_bytes=gradient_bytes,
                 validate_seconds=b / EPOCHS)
    return pack([TrialCost(f"t{i}", **trial) for i in range(CONFIGURATIONS)], cluster(k), "data", degree=k).makespan


def missing_terms(one: float, gradient_bytes: float) -> None:
    """What the calibration rows cannot show: the experiment-parallel rows' excess over the model on more than one
    node, and the data-parallel rows predicted from the 1- and 2-GPU rows alone."""
    print()
    print("Experiment-parallel, paper less model (a constant would be a fixed cost of a search on several nodes):")
    for k in PREDICTED:
        model = math.ceil(CONFIGURATIONS / k) * one
        print(f"  {k} GPUs: {clock(hms(TABLE[k][1]) - model)}")
    a, b = fit_data(gradient_bytes, rows=(1, 2))
    print(f"Data-parallel calibrated on 1 and 2 GPUs alone (A = {a:.0f} s, B = {b:.0f} s a trial):")
    for k in (4, *PREDICTED):
        model = data_makespan(a, b, gradient_bytes, k)
        print(f"  {k} GPUs: paper {TABLE[k][0]}, model {clock(model)}, {model / hms(TABLE[k][0]) - 1:+.1%}")


def main() -> None:
    parameters = unet_parameters()
    gradient_bytes = 4.0 * parameters
    one = fit_experiment()
    a, b = fit_data(gradient_bytes)
    # one trial's cost, both fits in the model's terms: the compute that shrinks with k, the rest as validation
    data_trial = TrialCost("data", EPOCHS, a / EPOCHS, steps(), gradient_bytes=gradient_bytes,
                           validate_seconds=b / EPOCHS)
    experiment_trial = TrialCost("exp", EPOCHS, one / EPOCHS, steps(), gradient_bytes=gradient_bytes)
    print(f"U-Net of distmis_grid.yaml: {parameters:,} parameters ({gradient_bytes / 1e6:.1f} MB of gradients a "
          f"step); {steps()} steps an epoch on one GPU, {EPOCHS} epochs")
    print(f"calibrated on {list(CALIBRATION)} GPUs: experiment t = {one:.0f} s a trial on one GPU; data-parallel "
          f"A = {a:.0f} s, B = {b:.0f} s a trial")
    print()
    print("| GPUs | data, paper | data, model | error | experiment, paper | experiment, model | error | auto, model |")
    print("|---|---|---|---|---|---|---|---|")
    for k in sorted(TABLE):
        c = cluster(k)
        data_costs = [TrialCost(f"t{i}", **{f: getattr(data_trial, f) for f in (
            "epochs", "train_seconds", "steps", "gradient_bytes", "validate_seconds")}) for i in range(CONFIGURATIONS)]
        exp_costs = [TrialCost(f"t{i}", EPOCHS, experiment_trial.train_seconds, steps(),
                               gradient_bytes=gradient_bytes) for i in range(CONFIGURATIONS)]
        data = pack(data_costs, c, "data", degree=k).makespan
        experiment = pack(exp_costs, c, "experiment").makespan
        auto = pack(data_costs, c, "auto").makespan  # the data fit's trial: it holds both terms
        paper_data, paper_exp = hms(TABLE[k][0]), hms(TABLE[k][1])
        mark = " (calibration)" if k in CALIBRATION else ""
        print(f"| {k}{mark} | {TABLE[k][0]} | {clock(data)} | {data / paper_data - 1:+.1%} | {TABLE[k][1]} | "
              f"{clock(experiment)} | {experiment / paper_exp - 1:+.1%} | {clock(auto)} |")
    missing_terms(one, gradient_bytes)


def clock(seconds: float) -> str:
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


if __name__ == "__main__":
    main()
