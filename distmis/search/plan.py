"""How the trials of one search share the cluster: what Ray Tune reserves per trial and how many run at once.

A search's trials are laid out by their :class:`~distmis.spec.layout.TrialLayout` (resolved by the spec
package); this module only reads those layouts:

- experiment-parallel: every trial is one process (a Ray Tune actor); many trials at once.
- data-parallel: every trial is a Ray Train run over N workers; one trial at a time.
- hybrid: experiment-parallel trials that are each a worker group (data- and/or sequence-parallel); as many
  at once as the cluster has room for the largest of them.
- auto: every trial a worker group of as many workers as the search's worker pool gives it, out of
  ``parallelism.workers`` (:mod:`distmis.perf.pool`); at most that many trials at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from distmis.spec.layout import (
    PP_STAGES_PATH,
    SP_DEGREE_PATH,
    TrialLayout,
    resolve_layout,
    searched_pp_stages,
    searched_sp_degrees,
)
from distmis.spec.load import SpecError, apply_config
from distmis.spec.schema import Spec

# A distributed trial's own process only drives its Ray Train run; it must not hold a CPU that a training
# worker needs. Ray refuses an empty request, so it asks for a token amount of memory.
DRIVER_RESOURCES = {"cpu": 0, "memory": 2**20}


@dataclass(frozen=True)
class SearchPlan:
    """What Ray Tune needs to lay the search's trials out."""

    mode: str  # "experiment", "data" or "auto"
    layouts: tuple[TrialLayout, ...]  # every layout a trial of the search can take (per searched SP degree or stages)
    max_concurrent_trials: int | None
    pool_workers: int = 0  # auto: the workers the search's pool shares among its trials

    @property
    def distributed(self) -> bool:
        """Every trial is a Ray Train worker group (the layouts of one search agree on it)."""
        return self.layouts[0].distributed

    @property
    def largest(self) -> TrialLayout:
        return max(self.layouts, key=lambda layout: layout.world_size)

    @property
    def trial_resources(self) -> dict[str, float]:
        """What Tune reserves for each trial's own process (a worker group reserves its workers itself)."""
        if self.distributed:
            return dict(DRIVER_RESOURCES)
        layout = self.layouts[0]
        return {"cpu": layout.cpu, "gpu": layout.gpu}

    @property
    def label(self) -> str:
        at_once = f"{self.max_concurrent_trials} trial(s)" if self.max_concurrent_trials else "as many trials as fit"
        workers = "/".join(str(n) for n in sorted({layout.world_size for layout in self.layouts}))
        if self.mode == "data":
            return f"data-parallel, {workers} worker(s) per trial"
        if self.mode == "auto":
            return f"auto: {self.pool_workers} worker(s), each trial on its share, grown onto idle ones"
        if self.distributed:
            return f"hybrid: {at_once} x {workers} workers"
        return f"experiment-parallel, {at_once} at once"


def trial_layouts(spec: Spec) -> tuple[TrialLayout, ...]:
    """The layout of every kind of trial the search runs: one per sequence-parallel degree it may use (with
    ``degree: auto``, every degree the performance model chooses for some combination of searched shapes), or
    one per searched pipeline stage count."""
    if PP_STAGES_PATH in spec.search.space:
        return tuple(resolve_layout(apply_config(spec, {PP_STAGES_PATH: k})) for k in searched_pp_stages(spec))
    degrees = searched_sp_degrees(spec)
    if SP_DEGREE_PATH not in spec.search.space and spec.parallelism.sequence_parallel.degree != "auto":
        return (resolve_layout(spec),)
    return tuple(resolve_layout(apply_config(spec, {SP_DEGREE_PATH: d})) for d in degrees)


def plan_search(spec: Spec, *, cluster_slots: int | None = None) -> SearchPlan:
    """The plan of a search in ``experiment`` or ``data`` mode.

    ``cluster_slots``: workers of the layouts' size the cluster holds; a hybrid search runs
    ``cluster_slots // largest world size`` trials at once (and never more than ``max_concurrent_trials``).
    """
    par = spec.parallelism
    layouts = trial_layouts(spec)
    if par.mode == "data":
        return SearchPlan("data", layouts, 1)
    if par.mode == "auto":  # a trial holds one worker at least: never more trials than workers at once
        workers = par.worker_counts[0]
        return SearchPlan("auto", layouts, min(workers, par.max_concurrent_trials or workers), pool_workers=workers)
    limit = par.max_concurrent_trials
    if layouts[0].distributed and cluster_slots:
        fit = max(1, cluster_slots // max(layout.world_size for layout in layouts))
        limit = min(limit, fit) if limit else fit
    return SearchPlan("experiment", layouts, limit)


def node_resources() -> list[dict[str, float]]:
    """CPUs and GPUs of every alive node of the connected Ray cluster."""
    import ray

    return [{"CPU": float(n["Resources"].get("CPU", 0)), "GPU": float(n["Resources"].get("GPU", 0))}
            for n in ray.nodes() if n.get("Alive")]


def worker_slots(layout: TrialLayout, nodes: list[dict[str, float]]) -> int:
    """How many workers of this layout's size the nodes hold, each worker whole on one node."""
    asked = {key: value for key, value in layout.worker_resources.items() if value > 0}
    if not asked:
        return layout.world_size
    return sum(int(min(node[key] // asked[key] for key in asked)) for node in nodes)


def trials_at_once(plan: SearchPlan, nodes: list[dict[str, float]]) -> int:
    """How many of the plan's trials run at once on these nodes: its limit (``max_concurrent_trials``) where it
    has one, else as many as the nodes hold (each trial, or each worker of a distributed trial, whole on one
    node); at least 1."""
    if plan.max_concurrent_trials:
        return plan.max_concurrent_trials
    if plan.distributed:
        return max(1, worker_slots(plan.largest, nodes) // plan.largest.world_size)
    asked = {key.upper(): value for key, value in plan.trial_resources.items() if value > 0}
    if not asked:
        return 1
    return max(1, sum(int(min(node.get(key, 0.0) // value for key, value in asked.items())) for node in nodes))


def fit_problems(layouts: tuple[TrialLayout, ...], nodes: list[dict[str, float]]) -> list[str]:
    """Why the largest trial of a search can never start on these nodes (each worker whole on one node, all
    workers at once), or nothing. Pure arithmetic, so the reasons are testable without a cluster."""
    problems: list[str] = []
    for layout in layouts:
        asked = {key: value for key, value in layout.worker_resources.items() if value > 0}
        what = (f"a trial of {layout.describe()}" if layout.distributed
                else f"a trial of {layout.cpu:g} CPU(s) and {layout.gpu:g} GPU(s)")
        biggest = {key: max((node[key] for node in nodes), default=0.0) for key in asked}
        short = [f"{asked[key]:g} {key}(s) on one node, but the largest node has {biggest[key]:g}"
                 for key in asked if asked[key] > biggest[key]]
        if short:
            problems.append(f"{what} needs {' and '.join(short)}")
            continue
        slots = worker_slots(layout, nodes)
        if slots < layout.world_size:
            problems.append(f"{what} needs {layout.world_size} worker(s) at once, but the cluster holds {slots} "
                            f"worker(s) of {layout.cpu:g} CPU(s)" + (f" and {layout.gpu:g} GPU(s)" if layout.gpu else ""))
    return list(dict.fromkeys(problems))


def search_fit_problems(spec: Spec, nodes: list[dict[str, float]]) -> list[str]:
    """:func:`fit_problems` of the search's trials; of an ``auto`` search, of a trial of all its pool's workers (a
    trial may grow onto every one of them)."""
    layouts = trial_layouts(spec)
    if spec.parallelism.mode == "auto":
        import dataclasses

        layouts = tuple(dataclasses.replace(layout, dp=spec.parallelism.worker_counts[0]) for layout in layouts)
    return fit_problems(layouts, nodes)


def check_fit(spec: Spec) -> None:
    """Refuse (SpecError, exit 2), before any data is converted, a search whose trials cannot fit the connected
    cluster: Ray would wait for them forever. ``parallelism.autoscaling: true`` skips it (nodes may come)."""
    if spec.parallelism.autoscaling:
        return
    problems = search_fit_problems(spec, node_resources())
    if problems:
        raise SpecError(spec.name, [("parallelism", f"{p}; lower the resources or the workers, add nodes, or set "
                                                   "parallelism.autoscaling: true on an autoscaling cluster")
                                    for p in problems])
