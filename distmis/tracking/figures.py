"""Pictures for the MLflow UI: learning curves of a search, a segmentation overlay, the speedup table, the memory
plan, the schedule that ran and the front of score against cost."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def segmentation_overlay_figure(image: np.ndarray, target: np.ndarray, prob: np.ndarray, *, title: str = "",
                                targets: dict | None = None):
    """The first channel's slices through the foreground with the ground truth (green) and the prediction (red)
    outlined.

    ``image`` (H, W, D, C), ``target`` and ``prob`` (H, W, D, K); ``targets``: the target scheme (None: sigmoid
    channels). The foreground drawn is channel 0 of a sigmoid scheme (the whole tumour) or every class but the
    background of a softmax one (the argmax), on the axial, coronal and sagittal slices through its centre of mass.
    """
    plt = _pyplot()
    if targets is not None and targets.get("activation") == "softmax":
        winner = np.argmax(prob, axis=-1)
        truth, pred = np.argmax(target, axis=-1) > 0, winner > 0
    else:
        truth, pred = target[..., 0] > 0.5, prob[..., 0] >= 0.5
    mask = truth if truth.any() else pred
    centre = [int(round(c)) for c in np.argwhere(mask).mean(axis=0)] if mask.any() else [s // 2 for s in truth.shape]
    views = [
        ("axial", lambda a: a[:, :, centre[2]]),
        ("coronal", lambda a: a[:, centre[1], :]),
        ("sagittal", lambda a: a[centre[0], :, :]),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.6))
    for ax, (name, cut) in zip(axes, views):
        ax.imshow(cut(image[..., 0]).T, cmap="gray", origin="lower")
        for mask_2d, colour in ((cut(truth), "lime"), (cut(pred), "red")):
            if mask_2d.any() and not mask_2d.all():
                ax.contour(mask_2d.T.astype(float), levels=[0.5], colors=colour, linewidths=1.2)
        ax.set_title(name)
        ax.axis("off")
    fig.suptitle(f"{title}  (green: ground truth, red: prediction)", fontsize=9)
    fig.tight_layout()
    return fig


MAX_LEGEND_ENTRIES = 16


def learning_curves_figure(client: MlflowClient, parent: Run, metric: str = "val_dice"):
    """A matplotlib figure of ``metric`` per epoch for every trial of the search, labelled by run name
    (which already names the trial's values: ``00003 lr=0.005 norm=group``; a cross-validation fold's its fold too:
    the folds' runs are under their configurations')."""
    from distmis.tracking.mlflow_tracking import CONFIGURATION_ROLE, ROLE_TAG
    from distmis.tracking.results import trial_runs

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    runs = []
    for run in trial_runs(client, parent):
        runs += trial_runs(client, run) if run.data.tags.get(ROLE_TAG) == CONFIGURATION_ROLE else [run]
    for run in runs:
        history = sorted(client.get_metric_history(run.info.run_id, metric), key=lambda m: m.step)
        if history:
            ax.plot([m.step for m in history], [m.value for m in history], marker="o", ms=3,
                    label=f"{run.info.run_name} ({run.info.status.lower()})")
    ax.set_xlabel("epoch")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} per trial")
    ax.grid(alpha=0.3)
    lines = len(ax.get_lines())
    if 0 < lines <= MAX_LEGEND_ENTRIES:
        ax.legend(fontsize=7, loc="best")
    elif lines:  # a legend of many trials would hide the curves: the trials are in the results table
        ax.set_title(f"{metric} per trial ({lines} trials)")
    fig.tight_layout()
    return fig


def speedup_figure(table: "pd.DataFrame", *, title: str = ""):
    """Elapsed time and speedup against workers for each mode compared, with the ideal (linear) speedup; a repeated
    comparison's means with error bars of ± one standard deviation where more than one repeat finished."""
    from distmis.tracking.results import MODES

    plt = _pyplot()
    fig, (ax_time, ax_speed) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, marker in zip(MODES, ("o", "s", "^")):
        rows = table[table["mode"] == mode]
        if rows.empty:
            continue
        for ax, column in ((ax_time, "elapsed_s"), (ax_speed, "speedup")):
            (line,) = ax.plot(rows["workers"], rows[column], marker=marker, label=f"{mode}-parallel")
            if f"{column}_std" in rows:
                spread = rows[rows[f"{column}_std"].notna() & rows[column].notna()]
                if not spread.empty:
                    ax.errorbar(spread["workers"], spread[column], yerr=spread[f"{column}_std"], fmt="none",
                                ecolor=line.get_color(), capsize=4, elinewidth=1)
    workers = sorted(table["workers"].unique())
    ax_speed.plot(workers, workers, "k--", lw=1, label="ideal")
    spread = " (mean ± std over repeats)" if "elapsed_s_std" in table else ""
    ax_time.set(xlabel="workers", ylabel="elapsed seconds", title=f"elapsed time{spread}")
    ax_speed.set(xlabel="workers", ylabel="speedup (T1 / TN)", title=f"speedup{spread}")
    for ax in (ax_time, ax_speed):
        ax.set_xticks(workers)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plan_figure(rows: list, *, memory_per_rank: float, title: str = ""):
    """The planner's predictions (:func:`distmis.parallel.planner.plan_layouts`): per-rank peak memory and step
    time against the SP degree, a line per patch size and attention strategy, the memory per rank as a limit.

    ValueError, naming the quantity, when a value it would draw on its log axes is not finite and positive or lies
    beyond :data:`distmis.perf.model.MAGNITUDES` (in GiB and seconds; matplotlib overflows near there)."""
    import math

    from distmis.perf.model import MAGNITUDES

    low, high = MAGNITUDES
    drawn = {"predicted peak memory per rank (GiB)": [r.memory.peak / 2**30 for r in rows] + [memory_per_rank / 2**30],
             "predicted step time (s)": [r.step_seconds for r in rows]}
    for quantity, values in drawn.items():
        bad = [v for v in values if not (math.isfinite(v) and low <= v <= high)]
        if bad:
            raise ValueError(f"the plan's figure cannot draw a {quantity} of {bad[0]:g}: it draws finite positive "
                             f"values from {low:g} to {high:g}")
    plt = _pyplot()
    fig, (ax_memory, ax_time) = plt.subplots(1, 2, figsize=(10, 4))
    series: dict[tuple[int, str], list] = {}
    for row in rows:
        series.setdefault((row.patch, row.attention), []).append(row)
    for (patch, attention), points in sorted(series.items()):
        points = sorted(points, key=lambda r: r.sp)
        degrees = [r.sp for r in points]
        style = "-" if attention == "ulysses" else "--"
        label = f"patch {patch}, {attention}"
        ax_memory.plot(degrees, [r.memory.peak / 2**30 for r in points], style, marker="o", label=label)
        ax_time.plot(degrees, [r.step_seconds for r in points], style, marker="o", label=label)
    ax_memory.axhline(memory_per_rank / 2**30, color="k", lw=1, label="usable memory per rank")
    ax_memory.set(xlabel="sequence-parallel degree", ylabel="predicted peak GiB per rank", yscale="log",
                  title="memory")
    ax_time.set(xlabel="sequence-parallel degree", ylabel="predicted step seconds", yscale="log", title="step time")
    degrees = sorted({row.sp for row in rows})
    for ax in (ax_memory, ax_time):
        ax.set_xscale("log", base=2)
        ax.set_xticks(degrees, [str(d) for d in degrees])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def gantt_figure(schedules: list, *, title: str = ""):
    """One row of bars per worker for each :class:`~distmis.perf.makespan.Schedule` (a panel each, one time axis):
    what ran where and when, a trial's bar on every worker it held, labelled with its name; minutes on the axis
    (hours past two hours)."""
    plt = _pyplot()
    if not schedules:
        raise ValueError("no schedule to draw")
    longest = max(s.makespan for s in schedules)
    scale, unit = (3600, "hours") if longest > 7200 else (60, "minutes")
    end = longest / scale or 1.0
    fig, axes = plt.subplots(len(schedules), 1, figsize=(8, 1.0 + 0.45 * sum(s.workers for s in schedules)),
                             sharex=True, squeeze=False)
    colours = plt.get_cmap("tab20")
    for ax, schedule in zip(axes[:, 0], schedules):
        for index, p in enumerate(sorted(schedule.placements, key=lambda p: p.trial)):
            for worker in p.workers:
                ax.barh(worker, (p.end - p.start) / scale, left=p.start / scale, height=0.8,
                        color=colours(index % 20), edgecolor="black", linewidth=0.5)
            middle = (p.start + p.end) / 2 / scale
            ax.text(middle, sum(p.workers) / len(p.workers), p.trial.split()[0], ha="center", va="center", fontsize=7)
        ax.set_yticks(range(schedule.workers))
        ax.set_yticklabels([f"w{w}" for w in range(schedule.workers)])
        ax.set_ylim(schedule.workers - 0.5, -0.5)
        ax.set_xlim(0, end * 1.02)
        ax.set_title(f"{schedule.mode}: {schedule.makespan / scale:.3g} {unit}, {schedule.idle_fraction:.0%} idle",
                     fontsize=9)
    axes[-1, 0].set_xlabel(unit)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def pareto_figure(frame: "pd.DataFrame", metric: str, *, title: str = ""):
    """The search's trials as points of ``metric`` against worker-hours (the table of
    :func:`~distmis.tracking.pareto.pareto_frame`): the front's in colour, joined cheapest first and labelled, the
    dominated ones grey."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    label = "trial" if "trial" in frame else "configuration"
    dominated, front = frame[~frame["pareto"]], frame[frame["pareto"]].sort_values("worker_h")
    ax.scatter(dominated["worker_h"], dominated[metric], color="0.7", label="dominated", zorder=2)
    ax.plot(front["worker_h"], front[metric], marker="o", color="tab:blue", label="Pareto front", zorder=3,
            drawstyle="steps-post" if len(front) > 1 else "default")
    for _, row in front.iterrows():
        ax.annotate(str(row[label]).split(" ", 1)[-1], (row["worker_h"], row[metric]), fontsize=7,
                    textcoords="offset points", xytext=(4, 4))
    ax.set(xlabel="worker-hours (the workers a trial held x its wall time)", ylabel=metric, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
