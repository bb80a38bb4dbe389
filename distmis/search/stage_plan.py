"""``parallelism.pipeline.stages: auto``: the fewest pipeline stages whose every rank's predicted peak fits
``parallelism.memory_per_worker`` (:func:`plan_stages`).

One stage (no pipeline) is the whole network's traced step (:func:`~distmis.search.trial_steps.predict_step`). For
``K`` stages the U-Net is cut as a trial cuts it (:func:`~distmis.parallel.pipeline.balanced_partition` of its cells'
costs at the tile) and each stage's step is traced on one micro-batch
(:func:`~distmis.estimate.module_trace.trace_module_step`). A rank of stage ``k`` holds at its peak:

- the whole model's weights (every rank builds the whole U-Net, and gathers every stage's weights after training:
  :meth:`~distmis.parallel.pipeline.UNetPipeline.gather_weights`) and the batch;
- its stage's Adam state and gradients, and the peak of one micro-batch's backward;
- the other micro-batches in flight, each what its forward left (the inputs received, the activations kept, the
  outputs sent): all ``M`` of them under GPipe, ``min(M, K - k)`` under 1F1B;
- on a CPU, the heap's retention over those tensors (:func:`~distmis.estimate.memory.cpu_overhead`).

Stage counts the schedule cannot run (1F1B with fewer micro-batches than stages) or the U-Net cannot be cut into
(more than its ``2 * levels - 1`` cells) are skipped. Every network the search can pick must be cut the same way,
so each stage count's peak is the largest over them.

A search that gives its stages (above 1, or searched) is checked the same way before any work
(:func:`check_staged_trials`, from :func:`~distmis.search.memory_fit.check_trials_fit`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from distmis.perf.sizing import PROCESS_RESERVE
from distmis.search.data_shape import DataShape
from distmis.search.tile_search import mib
from distmis.spec.schema import Spec

__all__ = ["STAGES_PATH", "TooManyStages", "StageCount", "StagePlan", "check_staged_trials", "stage_peaks",
           "plan_stages"]

STAGES_PATH = "parallelism.pipeline.stages"


class TooManyStages(ValueError):
    """The U-Net has fewer cells than the stages asked for."""


@dataclass(frozen=True)
class StageCount:
    """A stage count and each of its ranks' predicted peak (bytes), the largest over the search's networks."""

    stages: int
    peaks: tuple[float, ...]

    @property
    def peak(self) -> float:
        return max(self.peaks)


@dataclass(frozen=True)
class StagePlan:
    """What ``stages: auto`` chose against ``usable`` bytes per rank, and the counts it predicted."""

    stages: int
    usable: float
    device: Literal["cpu", "cuda"]
    considered: tuple[StageCount, ...]

    @property
    def chosen(self) -> StageCount:
        return next(c for c in self.considered if c.stages == self.stages)

    @property
    def fewer(self) -> StageCount | None:
        """The largest count below the chosen one that was predicted: it does not fit."""
        return max((c for c in self.considered if c.stages < self.stages), key=lambda c: c.stages, default=None)

    def describe(self) -> str:
        """One line for the console."""
        line = (f"planned {STAGES_PATH}: {self.stages} ({mib(self.chosen.peak)} MiB predicted on its busiest rank, "
                f"{mib(self.usable)} MiB usable per worker, {self.device} rules")
        fewer = self.fewer
        if fewer is not None:
            line += f"; {fewer.stages} stage(s) would need {mib(fewer.peak)} MiB"
        return line + ")"


def _whole_network(trial: Spec, data: DataShape, device: Literal["cpu", "cuda"], threads: int) -> float:
    from distmis.search.trial_steps import predict_step

    tile = tuple(trial.training.tile or data.volume)
    return predict_step(trial, tile, trial.training.batch_size, device, threads,  # type: ignore[arg-type]
                        channels=data.channels, activation=data.activation).peak


def stage_peaks(trial: Spec, stages: int, data: DataShape, device: Literal["cpu", "cuda"], threads: int
                ) -> tuple[float, ...]:
    """Each rank's predicted peak (bytes) when ``trial``'s U-Net is cut into ``stages`` stages (the module's
    docstring); ValueError when it cannot be cut so."""
    if stages == 1:
        return (_whole_network(trial, data, device, threads),)
    from distmis.estimate.memory import cpu_overhead
    from distmis.estimate.module_trace import trace_module_step
    from distmis.estimate.step_trace import COMPUTE_DTYPES
    from distmis.models.registry import NetworkInput
    from distmis.networks import build_network
    from distmis.parallel.pipeline import StageCells, balanced_partition, cell_macs, stage_examples, unet_cells

    training, pipe = trial.training, trial.parallelism.pipeline
    tile = tuple(int(t) for t in (training.tile or data.volume))
    network = NetworkInput(*data.channels, tile, activation=data.activation, precision=training.planned_precision)
    model = build_network(trial.model.entry, trial.model.params, network)
    cells = unet_cells(model)  # ValueError: not a U-Net that pipelines
    if stages > len(cells):
        raise TooManyStages(f"the U-Net has {len(cells)} cells: it cannot be cut into {stages} stages")
    if pipe.schedule == "1f1b" and pipe.microbatches < stages:
        raise ValueError(f"1f1b needs at least as many micro-batches as stages ({pipe.microbatches} < {stages})")
    dtype = COMPUTE_DTYPES.get(training.planned_precision)
    bounds = balanced_partition(cell_macs(model, tile), stages)
    micro = (training.batch_size // pipe.microbatches, data.channels[0], *tile)
    examples = stage_examples(model, bounds, micro, compute_dtype=dtype)
    weights = sum(int(t.untyped_storage().nbytes()) for t in (*model.parameters(), *model.buffers()))
    batch = training.batch_size * sum(data.channels) * math.prod(tile) * 4
    peaks = []
    for index, ((start, stop), (inputs, _)) in enumerate(zip(bounds, examples)):
        trace = trace_module_step(StageCells(cells[start:stop], dtype), inputs, precision=training.planned_precision,
                                  device=device, threads=threads)
        in_flight = pipe.microbatches if pipe.schedule == "gpipe" else min(pipe.microbatches, stages - index)
        tensors = trace.optimizer_bytes + trace.peak_bytes + (in_flight - 1) * trace.saved_bytes
        peaks.append(weights + batch + tensors + (cpu_overhead(tensors) if device == "cpu" else 0.0))
    return tuple(peaks)


def plan_stages(spec: Spec, trials: list[Spec], data: DataShape) -> StagePlan:
    """The fewest stages (from 1) at which every rank of every one of ``trials`` (the networks the search can pick,
    ``spec``'s stages a placeholder) is predicted to fit. ValueError naming the most stages tried and their need
    when none fits."""
    from distmis.search.data_shape import trial_device
    from distmis.spec.load import apply_config

    assert spec.parallelism.memory_per_worker is not None
    usable = spec.parallelism.memory_per_worker - PROCESS_RESERVE
    device, threads = trial_device(apply_config(spec, {STAGES_PATH: 2}))  # a pipelined trial's workers
    considered: list[StageCount] = []
    skipped: list[str] = []
    for stages in range(1, 64):
        try:
            count = StageCount(stages, tuple(max(p) for p in zip(*(
                stage_peaks(apply_config(trial, {STAGES_PATH: stages}), stages, data, device, threads)
                for trial in trials))))
        except TooManyStages:
            break
        except ValueError as exc:  # a count the schedule cannot run
            skipped.append(f"{stages}: {exc}")
            continue
        considered.append(count)
        if count.peak <= usable:
            return StagePlan(stages, usable, device, tuple(considered))
    most = max(considered, key=lambda c: c.stages, default=None)
    need = f"{most.stages} stage(s) need {mib(most.peak)} MiB on the busiest rank" if most else "no count can run"
    raise ValueError(f"no stage count fits: {need}, and a worker has {mib(usable)} MiB "
                     f"(memory_per_worker less {mib(PROCESS_RESERVE)} MiB for the process)"
                     + (f"; skipped {'; '.join(skipped)}" if skipped else ""))


#: The searched fields, besides ``model.*``, that change a pipelined rank's step.
_STAGE_STEP_FIELDS = ("training.tile", "training.batch_size", "training.precision", "training.loss.name",
                      STAGES_PATH, "parallelism.pipeline.microbatches", "parallelism.pipeline.schedule")


def check_staged_trials(spec: Spec, data: DataShape, usable: float) -> list[tuple[str, str]]:
    """For a search whose trials are cut into pipeline stages (the spec's, or searched), every combination of the
    searched values that change a rank's step, predicted against ``usable`` bytes per rank: a problem per
    combination whose busiest rank does not fit, naming the fewest stages that would."""
    from distmis.search.data_shape import trial_device
    from distmis.spec.load import apply_config, searched_combinations, values_to_check

    paths = {path: values_to_check(domain) for path, domain in spec.search.space.items()
             if path.startswith("model.") or path in _STAGE_STEP_FIELDS}
    problems = []
    for config in (list(searched_combinations(paths)) if paths else [{}]):
        trial = apply_config(spec, config)
        stages = trial.parallelism.pipeline.stages
        device, threads = trial_device(trial)
        try:
            peak = max(stage_peaks(trial, stages, data, device, threads))
        except ValueError:
            continue  # a count the U-Net or the schedule cannot take: the spec's own checks name it
        if peak <= usable:
            continue
        try:
            fewest = plan_stages(trial, [trial], data)
            advice = f"{fewest.stages} stages fit"
        except ValueError as exc:
            advice = str(exc)
        where = f"search.space.{STAGES_PATH}" if STAGES_PATH in config else STAGES_PATH
        name = ", ".join(f"{k}={v}" for k, v in config.items()) or "every trial"
        tile = list(trial.training.tile or data.volume)
        problems.append((where, f"{name}: {trial.model.name} in {stages} stage(s) on tile {tile} at batch "
                                f"{trial.training.batch_size}: its busiest rank is predicted to need {mib(peak)} MiB, "
                                f"and a worker has {mib(usable)} MiB ({device} rules); {advice}"))
    return problems
