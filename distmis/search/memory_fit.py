"""Before any work: with ``parallelism.memory_per_worker`` set, every training step the search can take is predicted
(:func:`~distmis.search.trial_steps.trial_steps`, with the data set's own channels and volume), and a search with a
step that does not fit is refused, naming the trial, its tile and batch, and the largest tile that fits
(:func:`check_trials_fit`). ``distmis validate`` prints the steps (:func:`format_steps`).

A trial split over ranks (a sequence-parallel degree or pipeline stages other than 1) holds a part of the network
per rank, which the trace of the whole does not describe: such a search is not checked here (the ViT's
``degree: auto`` sizes its split with the performance model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from distmis.perf.sizing import PROCESS_RESERVE
from distmis.search.data_shape import DataShape, Tile, data_shape, trial_device
from distmis.search.trial_steps import TrialStep, trial_steps
from distmis.spec.load import SpecError, with_volume
from distmis.spec.schema import Spec

__all__ = ["StepsFit", "check_trials_fit", "format_steps", "step_rules"]


@dataclass(frozen=True)
class StepsFit:
    """The search's predicted steps against ``usable`` bytes per worker, with the ``device``'s rules."""

    steps: list[TrialStep]
    usable: float
    device: Literal["cpu", "cuda"]


def _sequence_parallel(spec: Spec) -> bool:
    searched = any(path.startswith("parallelism.sequence_parallel.") for path in spec.search.space)
    return searched or spec.parallelism.sequence_parallel.degree != 1


def _pipelined(spec: Spec) -> bool:
    from distmis.spec.layout import searched_pp_stages

    return max(searched_pp_stages(spec)) > 1


def check_trials_fit(spec: Spec) -> StepsFit | None:
    """The search's steps (None when ``parallelism.memory_per_worker`` is unset, a trial is split over ranks, or
    the data cannot be read yet); SpecError, for ``training.tile`` (or the search space's field that sets it),
    when a step's predicted peak exceeds the memory per worker less the process's own
    (:data:`~distmis.perf.sizing.PROCESS_RESERVE`); for ``parallelism.pipeline.stages``, when a pipelined trial's
    busiest rank does."""
    memory = spec.parallelism.memory_per_worker
    whole = {"parallelism", "parallelism.pipeline"} & set(spec.search.space)  # a section searched: not told apart
    if memory is None or _sequence_parallel(spec) or whole:
        return None
    try:
        data = data_shape(spec)
    except ValueError:
        return None  # preparing the data reports it
    if _pipelined(spec):
        from distmis.search.stage_plan import check_staged_trials

        problems = check_staged_trials(with_volume(spec, data.volume, "the data set"), data, memory - PROCESS_RESERVE)
        if problems:
            raise SpecError(spec.name, problems[:5])
        return None
    device, threads = trial_device(spec)
    usable = memory - PROCESS_RESERVE
    known = with_volume(spec, data.volume, "the data set")
    steps = trial_steps(known, device=device, threads=threads, channels=data.channels, activation=data.activation)
    over = [step for step in steps if step.memory is not None and step.memory.peak > usable]
    if over:
        raise SpecError(spec.name, [_refusal(known, step, usable, data, device, threads) for step in over[:5]])
    return StepsFit(steps, usable, device)


def step_rules(trials: Sequence[Spec], data: DataShape, device: Literal["cpu", "cuda"], threads: int
               ) -> tuple[Callable[[Tile, int], bool], Callable[[Tile, int], float]]:
    """What the planner's search (:func:`~distmis.search.tile_search.plan_inputs`) asks of a tile at a batch, for
    ``trials`` (each a network the search can pick): whether every one of them takes it (the spec's input rules
    against the data set's volume), and the largest of their predicted step peaks."""
    from distmis.search.trial_steps import predict_step
    from distmis.spec.load import apply_config, check_input_shape

    def at(trial: Spec, tile: Tile, batch: int) -> Spec:
        return apply_config(trial, {"training.curriculum": None, "training.tile": list(tile),
                                    "training.batch_size": batch}, source="a planned tile")

    def valid(tile: Tile, batch: int) -> bool:
        try:
            return not any(check_input_shape(at(trial, tile, batch), data.volume) for trial in trials)
        except SpecError:
            return False

    def peak(tile: Tile, batch: int) -> float:
        return max(predict_step(at(trial, tile, batch), tile, batch, device, threads, channels=data.channels,
                                activation=data.activation).peak for trial in trials)

    return valid, peak


def _refusal(spec: Spec, step: TrialStep, usable: float, data: DataShape, device: Literal["cpu", "cuda"],
             threads: int) -> tuple[str, str]:
    """The message for one step that does not fit: its trial, its need, and the largest tile that fits at its
    batch (by the planner's rule)."""
    from distmis.search.tile_search import NothingFits, mib, plan_inputs
    from distmis.spec.load import apply_config

    assert step.memory is not None and step.tile is not None
    trial = apply_config(spec, step.config)
    where = next((f"search.space.{path}" for path in step.config if path.startswith("training.")), "training.tile")
    valid, peak = step_rules([trial], data, device, threads)
    try:
        largest, _, _ = plan_inputs(data.volume, trial.model.input_multiple, peak, usable, batch=step.batch,
                                    valid=valid)
        advice = f"the largest tile that fits at batch {step.batch} is {list(largest)}"
    except NothingFits:
        advice = f"no tile fits at batch {step.batch}: a smaller batch, bf16, or more memory"
    except ValueError as exc:
        advice = str(exc)
    trial_name = ", ".join(f"{k}={v}" for k, v in step.config.items()) or "every trial"
    return (where, f"{trial_name}: {step.network} on tile {list(step.tile)} at batch {step.batch} "
                   f"({step.precision}) is predicted to need {mib(step.memory.peak)} MiB per step, and a "
                   f"worker has {mib(usable)} MiB (parallelism.memory_per_worker less "
                   f"{mib(PROCESS_RESERVE)} MiB for the process, {device} rules); {advice}")


def format_steps(fit: StepsFit) -> list[str]:
    """The steps as a markdown table, one row each: trial, network, tile, batch, precision, predicted step and
    peak (MiB), GFLOP per step, whether it fits."""
    lines = ["| trial | network | tile | batch | precision | step MiB | peak MiB | GFLOP per step | fits |",
             "|---|---|---|---|---|---|---|---|---|"]
    for step in fit.steps:
        trial = ", ".join(f"{k}={v}" for k, v in step.config.items()) or "-"
        tile = "x".join(map(str, step.tile)) if step.tile else "whole volume"
        if step.memory is None:
            lines.append(f"| {trial} | {step.network} | {tile} | {step.batch} | {step.precision} | | | | "
                         f"{step.reason} |")
            continue
        lines.append(f"| {trial} | {step.network} | {tile} | {step.batch} | {step.precision} | "
                     f"{step.memory.step / 2**20:.0f} | {step.memory.peak / 2**20:.0f} | "
                     f"{step.memory.trace.flops / 1e9:.1f} | {'yes' if step.memory.peak <= fit.usable else 'no'} |")
    return lines
