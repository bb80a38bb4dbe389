"""A trial's parallel layout, resolved once from its spec (in the spirit of torchtitan's ``ParallelDims``).

Every question of the form "how many workers does this trial hold, how are they grouped, what learning rate
does it train with" is answered here, by :func:`resolve_layout`, and nowhere else: the search plan, the
trainables, the Ray Train workers, the trainers, the MLflow callback and the comparison all read the
:class:`TrialLayout` they are given. Pure arithmetic: no torch, no Ray.

A trial of ``dp`` data-parallel replicas, each split over ``sp`` sequence-parallel ranks (the ViT) or ``pp``
pipeline stages (the torch U-Net), holds ``dp * sp * pp`` Ray Train workers. The learning rate scales with the
replicas that each see their own samples (``dp``), not with ranks that share one sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from distmis.spec.load import SpecError, apply_config, network_input
from distmis.spec.schema import ResourcesSpec, Spec
from distmis.spec.sizing import SP_DEGREE_PATH, auto_sp_degree, memory_configs



@dataclass(frozen=True)
class TrialLayout:
    """Where one trial runs and how it divides its work."""

    dp: int  # data-parallel replicas: each trains on its own share of the batches
    sp: int  # sequence-parallel degree: ranks that split the tokens of one sample
    pp: int  # pipeline stages: ranks that each hold a part of the model and pass one sample's activations on
    distributed: bool  # a Ray Train worker group (even of one worker), else one process in Tune's actor
    cpu: float  # CPUs of each worker (of the trial's one process when not distributed)
    gpu: float  # GPUs of each worker (likewise)
    lr: float  # the spec's training.optimizer.lr
    lr_scaling: Literal["linear", "none"]

    def __post_init__(self) -> None:
        for name in ("dp", "sp", "pp"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.sp > 1 and self.pp > 1:
            raise ValueError(f"a trial is sequence-parallel (the ViT) or pipelined (the U-Net), not both: "
                             f"sp={self.sp}, pp={self.pp}")
        if not self.distributed and self.world_size != 1:
            raise ValueError(f"a trial of {self.world_size} ranks (dp={self.dp}, sp={self.sp}, pp={self.pp}) "
                             "must run as a Ray Train worker group (distributed=True)")

    @classmethod
    def for_ranks(cls, ranks: int, *, sp: int = 1, pp: int = 1, cpu: float = 1.0, gpu: float = 0.0, lr: float = 0.0,
                  lr_scaling: Literal["linear", "none"] = "none") -> TrialLayout:
        """The layout of a trial of ``ranks`` workers split ``sp`` x ``pp`` ways, the rest data-parallel (a
        candidate the planner predicts); ValueError when ``sp * pp`` does not divide ``ranks``."""
        if not isinstance(ranks, int) or ranks < 1 or ranks % (sp * pp):
            raise ValueError(f"{ranks!r} rank(s) do not divide into sp={sp} x pp={pp}")
        return cls(dp=ranks // (sp * pp), sp=sp, pp=pp, distributed=ranks > 1, cpu=cpu, gpu=gpu, lr=lr,
                   lr_scaling=lr_scaling)

    @property
    def world_size(self) -> int:
        """Ray Train workers (ranks) of the trial."""
        return self.dp * self.sp * self.pp

    @property
    def effective_lr(self) -> float:
        """The learning rate the trial's optimizer uses: scaled linearly with ``dp`` (the paper's rule) or not."""
        return self.lr * (self.dp if self.lr_scaling == "linear" else 1)

    @property
    def worker_resources(self) -> dict[str, float]:
        """What each worker (or the trial's one process) reserves, as Ray names it."""
        return {"CPU": self.cpu, "GPU": self.gpu}

    def describe(self) -> str:
        """``"2 workers: dp=2 x sp=1, 1 CPU each"``."""
        gpu = f" + {self.gpu:g} GPU" if self.gpu else ""
        where = f"{self.world_size} worker(s): dp={self.dp} x sp={self.sp}" + (f" x pp={self.pp}" if self.pp > 1 else "")
        return f"{where}, {self.cpu:g} CPU{gpu} each" if self.distributed else f"1 process, {self.cpu:g} CPU{gpu}"


def sp_degree(spec: Spec) -> int:
    """The trial's sequence-parallel degree: the spec's, or what ``degree: auto`` chooses for it (ValueError,
    naming the tile, patch and memory, when no degree fits)."""
    degree = spec.parallelism.sequence_parallel.degree
    if degree != "auto":
        return int(degree)
    tile = network_input(spec)
    if tile is None:
        raise ValueError("degree 'auto' needs the network input: set training.tile (or dataset.crop / resize)")
    choice = auto_sp_degree(spec, tile)
    if choice.degree is None:
        raise ValueError(f"degree 'auto': {choice.reason()}")
    return choice.degree


def searched_sp_degrees(spec: Spec) -> list[int]:
    """The sequence-parallel degrees the search's trials may use: the spec's, every searched value, and what
    ``degree: auto`` chooses for every combination of the searched shapes (combinations where no degree fits
    are left out: :func:`distmis.spec.load.check_spec` refuses them)."""
    domain = spec.search.space.get(SP_DEGREE_PATH)
    declared = [spec.parallelism.sequence_parallel.degree] if domain is None else list(domain.values)
    if "auto" not in declared:
        return sorted({int(v) for v in declared})
    degrees: set[int] = set()
    for config in memory_configs(spec):
        try:
            degrees.add(sp_degree(apply_config(spec, config)))
        except ValueError:  # SpecError included: check_spec reports it
            continue
    return sorted(degrees) or [1]


PP_STAGES_PATH = "parallelism.pipeline.stages"


def searched_pp_stages(spec: Spec) -> list[int]:
    """The pipeline stage counts the search's trials may use: the spec's, or every searched value."""
    domain = spec.search.space.get(PP_STAGES_PATH)
    declared = [spec.parallelism.pipeline.stages] if domain is None else domain.values
    return sorted({int(v) for v in declared})


def resolve_layout(spec: Spec) -> TrialLayout:
    """The layout of a trial of ``spec`` (a trial's spec: the search's with its config applied).

    ``experiment`` mode: ``workers_per_trial`` replicas (1: one process per trial; more: hybrid). ``data`` mode:
    ``workers`` replicas. ``auto`` mode: one replica, a worker group that the search's worker pool may grow (the
    trial replaces ``dp`` by the workers it is given: :mod:`distmis.trial.auto_trial`). Either way times the
    sequence-parallel degree (``auto``: chosen here, by the performance model) and the pipeline's stages. A search
    whose trials may hold more than one rank (a searched or chosen degree, or a searched stage count, above 1
    included) runs every trial as a Ray Train worker group, so that all its trials are laid out, reserved and timed
    alike.
    """
    par = spec.parallelism
    if par.mode == "compare":
        raise ValueError("a comparison has no single trial layout: each of its cells is a search of its own "
                         "(distmis.search.compare.cell_spec)")
    dp = par.worker_counts[0] if par.mode == "data" else par.workers_per_trial
    distributed = (par.mode in ("data", "auto")
                   or dp * max(searched_sp_degrees(spec)) * max(searched_pp_stages(spec)) > 1)
    resources: ResourcesSpec = par.resources_per_worker if distributed else par.resources_per_trial
    return TrialLayout(
        dp=dp, sp=sp_degree(spec), pp=par.pipeline.stages, distributed=distributed, cpu=resources.cpu, gpu=resources.gpu,
        lr=spec.training.optimizer.lr, lr_scaling=par.lr_scaling,
    )


def resolve_trial(spec: Spec, config: Mapping[str, Any]) -> tuple[Spec, TrialLayout]:
    """A trial's spec (the search's with the trial's config applied, ``degree: auto`` replaced by the degree
    chosen) and its layout: what a trial process, its workers and the driver's MLflow callback all work from.
    SpecError when the trial's values are invalid or no degree fits it."""
    trial = apply_config(spec, config)
    try:
        layout = resolve_layout(trial)
    except SpecError:
        raise
    except ValueError as exc:  # degree 'auto' found no degree that fits this trial
        raise SpecError("trial", [(SP_DEGREE_PATH, str(exc))]) from None
    if trial.parallelism.sequence_parallel.degree == "auto":
        trial = apply_config(trial, {SP_DEGREE_PATH: layout.sp})
    return trial, layout
