"""The predicted makespan of a search on W workers, by mode, before anything runs (``distmis plan SPEC --workers W``).

Each trial's cost (:class:`~distmis.perf.makespan.TrialCost`) comes from its traced training step
(:func:`~distmis.search.trial_steps.trial_steps`: the FLOPs of a step of its network, tile and batch) at the
worker's rate (``device_flops``, the rate a worker reaches on these steps: a GPU's or CPU's peak times the share a
convolution reaches of it):

* an epoch's training: ``ceil(train cases / batch)`` steps (or ``training.steps_per_epoch``) of the step's FLOPs;
* its validation: every validation case by sliding windows of the tile (overlap ``training.inference.overlap``),
  each window the forward FLOPs of one sample, run whole by every worker of a data-parallel trial;
* the gradients all-reduced each step: 4 bytes a trained parameter;
* the epochs: ``training.epochs``, or what the scheduler's registry entry expects each trial to train
  (``planned_epochs``: under ASHA, :func:`~distmis.perf.makespan.asha_epochs`; under a scheduler without one,
  such as hyperband or median, every epoch, an upper bound);
* the start-up and a fixed cost per step: given (``startup_seconds``, ``step_overhead``).

Or calibrated on an earlier search of the same data and networks (:func:`calibrate`): the rate its workers reached
on their epochs, and its trials' start-up; :func:`check_calibration` then predicts that search itself, to set beside
the span it measured.

The search's trials (:func:`~distmis.search.search_space.num_trials`, folds included) take the distinct steps the
search can take in turn. The schedules are then those of :func:`~distmis.perf.makespan.pack`: experiment-parallel,
data-parallel at every degree up to W, and auto.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from distmis.perf.makespan import Cluster, Schedule, TrialCost, pack
from distmis.spec.schema import Spec
from distmis.spec.searchers import scheduler_entry

__all__ = ["Hardware", "MakespanPlan", "Calibration", "split_sizes", "validation_windows", "search_costs",
           "plan_makespan", "format_makespan", "calibrate", "calibrate_run", "check_calibration", "predicted_makespan"]


@dataclass(frozen=True)
class Hardware:
    """A worker's rate on the search's steps (FLOP/s), a trial's start-up (s), the fixed cost of a step (s), and
    what a trial costs more as the first on a worker (s: its process, imports and graphs made anew)."""

    device_flops: float
    startup_seconds: float = 10.0
    step_overhead: float = 0.0
    cold_start_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.device_flops) and self.device_flops > 0):
            raise ValueError(f"device_flops must be a positive rate, got {self.device_flops!r}")
        for name in ("startup_seconds", "step_overhead", "cold_start_seconds"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be a non-negative number of seconds, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class MakespanPlan:
    """The search's trials' costs and their schedules: the fixed modes' (experiment, then data at each degree), the
    best moldable plan (:func:`~distmis.perf.makespan.pack`'s auto: each trial's degree chosen ahead and kept), and
    what ``parallelism.mode: auto`` does (its pool's rule, simulated: :func:`~distmis.perf.pool.simulate`)."""

    cluster: Cluster
    costs: tuple[TrialCost, ...]
    fixed: tuple[Schedule, ...]
    moldable: Schedule
    auto: Schedule

    @property
    def schedules(self) -> tuple[Schedule, ...]:
        return (*self.fixed, self.moldable, self.auto)


def split_sizes(spec: Spec) -> tuple[int, int]:
    """(training, validation) cases of one trial: the split's, or with folds one fold's validation and the other
    folds' training, from the data set's cases (or, not generated yet, ``dataset.synthetic.cases``)."""
    from distmis.data.layouts import Layout, discover_cases
    from distmis.data.split import make_split

    root = Path(spec.dataset.path)
    if root.exists():
        count = len(discover_cases(root, Layout(spec.dataset.layout)))
    elif spec.dataset.synthetic is not None:
        count = spec.dataset.synthetic.cases
    else:
        raise ValueError(f"dataset.path {str(root)!r} does not exist: its cases cannot be counted")
    ids = [f"case{i:05d}" for i in range(count)]
    s = spec.dataset.split
    if s.folds is not None:
        split = make_split(ids, test=s.test, seed=s.seed, folds=s.folds)
        val = len(split["folds"][0])
        return sum(len(fold) for fold in split["folds"]) - val, val
    split = make_split(ids, train=s.train, val=s.val, test=s.test, seed=s.seed)
    return len(split["train"]), len(split["val"])


def validation_windows(volume: tuple[int, ...], tile: tuple[int, ...], overlap: float) -> int:
    """The sliding windows of ``tile`` over ``volume`` at ``overlap`` (MONAI's: a step of ``tile * (1 - overlap)``
    voxels, at least one)."""
    count = 1
    for v, t in zip(volume, tile):
        if v > t:
            step = max(1, int(t * (1 - overlap)))
            count *= math.ceil((v - t) / step) + 1
    return count


def search_costs(spec: Spec, hardware: Hardware, *, device: Literal["cpu", "cuda"] = "cuda",
                 threads: int = 1) -> list[TrialCost]:
    """Each trial of the search, costed as the module docstring says."""
    from distmis.search.data_shape import data_shape
    from distmis.search.search_space import num_trials
    from distmis.search.trial_steps import trial_steps

    from distmis.spec.load import with_volume

    train, val = split_sizes(spec)
    channels = activation = volume = None
    try:  # the data set's own channels, activation and volume, where it can be read
        data = data_shape(spec)
        volume, channels, activation = data.volume, data.channels, data.activation
        spec = with_volume(spec, data.volume, "the data set")
    except (ValueError, OSError):  # DataError too: not there yet, and the spec's guess is used
        pass
    traced = trial_steps(spec, device=device, threads=threads, channels=channels, activation=activation)
    steps = [step for step in traced if step.memory is not None]
    if not steps:
        reasons = "; ".join(sorted({step.reason for step in traced if step.reason})) or "no step"
        raise ValueError(f"no training step of {spec.name} can be traced ({reasons}): the search's trials cannot "
                         "be costed")
    trials = num_trials(spec)
    search = spec.search
    planned = scheduler_entry(search.scheduler).planned_epochs  # None: every trial all its epochs (an upper bound)
    epochs = planned(trials, spec) if planned is not None else [float(spec.training.epochs)] * trials
    costs = []
    for index in range(trials):
        step = steps[index % len(steps)]
        trace = step.memory.trace  # type: ignore[union-attr]
        batches = spec.training.epoch_steps(train, step.batch)
        tile = step.tile or volume
        windows = validation_windows(volume, tile, spec.training.inference.overlap) if volume and tile else 1
        forward = trace.forward_flops / max(1, step.batch)
        costs.append(TrialCost(
            name=f"t{index:03d}", epochs=epochs[index],
            train_seconds=batches * trace.flops / hardware.device_flops, steps=batches,
            step_overhead=hardware.step_overhead, gradient_bytes=4.0 * trace.parameters,
            validate_seconds=val * windows * forward / hardware.device_flops,
            startup_seconds=hardware.startup_seconds, max_degree=None, cold_start_seconds=hardware.cold_start_seconds))
    return costs


def plan_makespan(spec: Spec, cluster: Cluster, hardware: Hardware, *, device: Literal["cpu", "cuda"] = "cuda",
                  threads: int = 1) -> MakespanPlan:
    """The search's schedules on ``cluster``: experiment, data at each degree up to its workers, the best moldable
    plan, and mode auto's."""
    from distmis.perf.pool import simulate

    costs = search_costs(spec, hardware, device=device, threads=threads)
    fixed = [pack(costs, cluster, "experiment")]
    fixed += [pack(costs, cluster, "data", degree=d) for d in range(2, cluster.workers + 1)]
    moldable = dataclasses.replace(pack(costs, cluster, "auto"), mode="moldable plan")
    return MakespanPlan(cluster, tuple(costs), tuple(fixed), moldable, dataclasses.replace(simulate(costs, cluster),
                                                                                           mode="auto"))


def _duration(seconds: float) -> str:
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def format_makespan(plan: MakespanPlan) -> str:
    """The predicted makespans, by mode, and auto's schedule, as the console prints them."""
    cluster = plan.cluster
    nodes = f", {cluster.node_size} per node" if cluster.per_node else ""
    lines = [f"{len(plan.costs)} trial(s) on {cluster.workers} worker(s){nodes}: predicted makespan by mode",
             "| mode | makespan | speedup | idle |", "|---|---|---|---|"]
    serial = sum(cost.seconds(1, cluster) for cost in plan.costs)
    best = min(s.makespan for s in plan.fixed)
    for schedule in plan.schedules:
        mark = " (best fixed)" if schedule.makespan == best and schedule in plan.fixed else ""
        lines.append(f"| {schedule.mode}{mark} | {_duration(schedule.makespan)} | "
                     f"{serial / schedule.makespan if schedule.makespan else 0:.2f} | {schedule.idle_fraction:.0%} |")
    lines.append("")
    lines.append("(moldable plan: each trial's workers chosen ahead and kept; auto: parallelism.mode auto, which "
                 "starts each trial on its share of the free workers and grows running ones onto idle workers)")
    lines.append("auto's schedule (trial: workers, start - end; a grown trial has a line per stretch):")
    for p in sorted(plan.auto.placements, key=lambda p: (p.start, p.workers)):
        lines.append(f"  {p.trial}: {p.degree} worker(s) {list(p.workers)}, {_duration(p.start)} - {_duration(p.end)}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Calibration:
    """A worker's rate and a trial's start-up as an earlier search measured them (:func:`calibrate`), and that
    search's own schedule: its mode's degree, the workers its trials could hold at once, and its measured span."""

    source: str
    trials: int
    device_flops: float
    startup_seconds: float
    cold_start_seconds: float
    degree: int
    capacity: int
    span_seconds: float | None

    def hardware(self, step_overhead: float = 0.0) -> Hardware:
        return Hardware(self.device_flops, self.startup_seconds, step_overhead, self.cold_start_seconds)


def calibrate(output: str | Path, *, device: Literal["cpu", "cuda"] = "cuda", threads: int = 1) -> Calibration:
    """Calibrate the model on the search whose output folder is ``output`` (``distmis run --output``):
    :func:`calibrate_run` of its search run. ValueError naming the folder when it holds no search whose trials
    ran."""
    from mlflow.tracking import MlflowClient

    from distmis.search.state import SearchState
    from distmis.spec import validate_spec
    from distmis.tracking.mlflow_tracking import default_tracking_uri
    from distmis.tracking.uri import is_redacted

    folder = Path(output)
    state = SearchState.load(folder) if folder.is_dir() else None
    if state is None or state.kind != "search":
        raise ValueError(f"--calibrate {str(folder)!r}: not the output folder of a distmis search (it holds no "
                         "search_state.json of a search; a comparison's cells are searches of their own)")
    uri = state.tracking_store or default_tracking_uri(folder)
    if is_redacted(uri):
        raise ValueError(f"--calibrate {str(folder)!r}: its store {uri} needs a password distmis does not keep")
    earlier = validate_spec(state.spec, source=str(folder / "search_state.json"))
    try:
        return calibrate_run(MlflowClient(uri), state.run_id, earlier, str(folder), device=device, threads=threads)
    except ValueError as exc:
        raise ValueError(f"--calibrate {str(folder)!r}: {exc}") from None


def calibrate_run(client: Any, run_id: str, earlier: Spec, source: str, *, device: Literal["cpu", "cuda"] = "cuda",
                  threads: int = 1) -> Calibration:
    """Calibrate the model on the search run ``run_id`` (of the spec ``earlier``) in ``client``'s store.

    Its trials that began before any had ended started their workers cold (a new process, its imports, traced
    graphs); the later ones found them warm. From the warm trials (or all, when none was): a worker's rate is the
    median over them of the model's FLOPs of an epoch at the trial's degree (training over the degree, and
    validation) over the trial's median measured ``epoch_seconds``, and a trial's start-up the median of their runs'
    time beyond their epochs at that median (the data, the checkpoints, the records, the first epoch's warm-up). The
    cold start is how much more the cold trials' runs took beyond theirs (medians): set against each run's own
    epochs, so that a search whose warm trials ASHA stopped early does not count their missing epochs as the cold
    trials' start. The fixed cost of a step and the all-reduce are in the rate. ValueError when no trial of it logged
    an epoch."""
    import statistics

    from distmis.tracking.mlflow_tracking import ROLE_TAG, SEARCH_RUN_TAG, run_workers

    parent = client.get_run(run_id)
    runs = [run for run in client.search_runs([parent.info.experiment_id], max_results=10_000,
                                              filter_string=f"tags.`{SEARCH_RUN_TAG}` = '{run_id}'")
            if run.data.tags.get(ROLE_TAG) == "trial"]
    costs = search_costs(earlier, Hardware(device_flops=1.0), device=device, threads=threads)  # seconds = FLOPs
    measured = []  # (run, epoch seconds, degree) of each trial that logged an epoch
    for run in runs:
        epochs = [m.value for m in client.get_metric_history(run.info.run_id, "epoch_seconds") if m.value > 0]
        if epochs:
            measured.append((run, epochs, run_workers(run)))
    if not measured:
        raise ValueError("no trial of that search logged an epoch's time")
    metrics = parent.data.metrics
    span, hours, idle = (metrics.get(k) for k in ("span_seconds", "worker_hours", "idle_fraction"))
    capacity = round(hours * 3600 / ((1 - idle) * span)) if span and hours and idle is not None and idle < 1 else 0
    degrees = [degree for _, _, degree in measured]
    degree = max(set(degrees), key=degrees.count)
    # The first trials on the workers (those that began before any ended) start cold; the others find a warm one
    ended = [run.info.end_time for run, _, _ in measured if run.info.end_time]
    first_end = min(ended) if ended else math.inf
    cold = [m for m in measured if m[0].info.start_time < first_end]
    warm = [m for m in measured if m[0].info.start_time >= first_end] or cold
    rates = [statistics.mean(c.train_seconds / d + c.validate_seconds for c in costs) / statistics.median(epochs)
             for _, epochs, d in warm]

    def overhead(group: list) -> list[float]:
        """Each run's time beyond its epochs at their steady (median) time: its start-up and its first epoch's
        warm-up. Set against each run's own epochs, so that trials ASHA stopped early weigh as the others."""
        return [max(0.0, (run.info.end_time - run.info.start_time) / 1000 - len(epochs) * statistics.median(epochs))
                for run, epochs, _ in group if run.info.end_time and run.info.start_time]

    startup = statistics.median(overhead(warm)) if overhead(warm) else 0.0
    extra = (statistics.median(overhead(cold)) - startup if warm is not cold and overhead(cold) and overhead(warm)
             else 0.0)
    return Calibration(source, len(measured), statistics.median(rates), startup, max(0.0, extra), degree,
                       max(capacity, 1), span)


def check_calibration(output: str | Path, calibration: Calibration, *, device: Literal["cpu", "cuda"] = "cuda",
                      threads: int = 1) -> tuple[float, float] | None:
    """The calibrated model's makespan of the earlier search itself, in its own mode and on its own workers (an auto
    search: its pool's rule, simulated), and the span it measured: (predicted, measured); None when it recorded no
    span."""
    from distmis.search.state import SearchState
    from distmis.spec import validate_spec

    if not calibration.span_seconds:
        return None
    state = SearchState.load(Path(output))
    assert state is not None
    earlier = validate_spec(state.spec, source=str(Path(output) / "search_state.json"))
    if earlier.parallelism.mode == "auto":  # its pool's rule on its own workers
        workers = earlier.parallelism.worker_counts[0]
        return predicted_makespan(earlier, "auto", workers, calibration.hardware(), device=device,
                                  threads=threads), calibration.span_seconds
    costs = search_costs(earlier, calibration.hardware(), device=device, threads=threads)
    cluster = Cluster(workers=max(calibration.capacity, calibration.degree))
    mode: Literal["experiment", "data"] = "experiment" if calibration.degree == 1 else "data"
    schedule = pack(costs, cluster, mode, degree=calibration.degree)
    return schedule.makespan, calibration.span_seconds


def predicted_makespan(spec: Spec, mode: Literal["experiment", "data", "auto"], workers: int, hardware: Hardware, *,
                       device: Literal["cpu", "cuda"] = "cuda", threads: int = 1) -> float:
    """The model's makespan of ``spec``'s search on ``workers`` workers (one node) in ``mode``: experiment (a trial a
    worker), data (every trial on all of them) or auto (its pool's rule, simulated)."""
    from distmis.perf.pool import simulate

    costs = search_costs(spec, hardware, device=device, threads=threads)
    cluster = Cluster(workers=workers)
    if mode == "auto":
        return simulate(costs, cluster).makespan
    return pack(costs, cluster, mode, degree=workers if mode == "data" else 1).makespan
