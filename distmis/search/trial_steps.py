"""The training step of every trial a search can run, predicted before anything runs (:func:`trial_steps`).

The trials differ in what the search space sets. Only the fields that change a rank's training step matter here:
the network and its params (``model.*``), the tile, the batch, the precision and the loss. For each combination of
their values (every grid or choice value, a range's ends), the trial's spec is made
(:func:`~distmis.spec.load.apply_config`), and each of its training stages (a curriculum's, or the one) is
predicted: a torch network by :func:`~distmis.estimate.memory.predict_step_memory`, the Keras U-Net by
:func:`~distmis.estimate.keras_step.trace_keras_step`. Stages of the same input and batch are traced once.

What the spec alone cannot tell is taken as the performance model takes it: the channels in and out from
``dataset.in_channels`` and ``dataset.num_classes``, a softmax for ``dataset.labels: classes``, and a whole-volume
stage at the spec's volume shape (a stage whose volume is unknown is left out, and :attr:`TrialStep.reason` says so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from distmis.models.registry import NetworkInput
from distmis.spec.curriculum import training_stages
from distmis.spec.load import MODEL_NAME_PATH, apply_config, searched_combinations, values_to_check, volume_shape
from distmis.spec.schema import Spec

if TYPE_CHECKING:  # the estimate imports torch: a driver that checks no step never loads it
    from distmis.estimate.memory import StepMemory

__all__ = ["STEP_FIELDS", "TrialStep", "predict_step", "trial_steps"]

#: The searched fields, besides ``model.*``, that change a rank's training step.
STEP_FIELDS = ("training.tile", "training.batch_size", "training.precision", "training.loss.name",
               "training.curriculum")


@dataclass(frozen=True)
class TrialStep:
    """One trial configuration's training step at one stage: ``config`` (the searched values that set it), the
    network, input and batch, and the prediction (None with the ``reason`` it could not be made)."""

    config: dict[str, Any]
    network: str
    tile: tuple[int, int, int] | None
    batch: int
    precision: str
    memory: StepMemory | None
    reason: str = ""


def _step_paths(spec: Spec) -> dict[str, list[Any]]:
    return {path: values_to_check(domain) for path, domain in spec.search.space.items()
            if path.startswith("model.") or path in STEP_FIELDS}


def _activation(spec: Spec) -> Literal["sigmoid", "softmax"]:
    return "softmax" if spec.dataset.labels == "classes" else "sigmoid"


#: The steps already traced in this process (the planner's, then the driver's check of the same search's steps),
#: by everything :func:`predict_step` reads.
_TRACED: dict[tuple, StepMemory] = {}


def predict_step(trial: Spec, tile: tuple[int, int, int], batch: int, device: Literal["cpu", "cuda"], threads: int,
                 *, channels: tuple[int, int] | None = None,
                 activation: Literal["sigmoid", "softmax"] | None = None) -> StepMemory:
    """One stage's step of ``trial``: its network built for ``tile``, on ``batch`` inputs of ``channels`` (in,
    out; default: as far as the spec tells, ``dataset.in_channels`` and ``num_classes``) and ``activation``
    (default: softmax for ``dataset.labels: classes``). Each distinct step is traced once per process."""
    training = trial.training
    inputs, outputs = channels or (trial.dataset.in_channels, trial.dataset.num_classes)
    network = NetworkInput(inputs, outputs, tuple(int(t) for t in tile), activation=activation or _activation(trial),
                           precision=training.planned_precision)
    key = (trial.model.name, trial.model.framework, trial.model.params.model_dump_json(), network, batch, device,
           threads, training.loss.model_dump_json())
    if key not in _TRACED:
        _TRACED[key] = _trace(trial, network, batch, device, threads)
    return _TRACED[key]


def _trace(trial: Spec, network: NetworkInput, batch: int, device: Literal["cpu", "cuda"], threads: int) -> StepMemory:
    from distmis.estimate.keras_step import trace_keras_step
    from distmis.estimate.memory import StepMemory, cpu_overhead, predict_step_memory

    entry = trial.model.entry
    training = trial.training
    if trial.model.framework == "tensorflow":
        from distmis.train.losses import make_loss as keras_loss

        loss = keras_loss(training.loss.name, smooth=training.loss.smooth, activation=network.activation)
        trace = trace_keras_step(entry, trial.model.params, network, loss, batch=batch, precision=training.planned_precision)
        tensors = trace.optimizer_bytes + trace.peak_bytes
        return StepMemory(trace, 0.0 if device == "cuda" else cpu_overhead(tensors))
    from distmis.train.torch_losses import make_loss

    loss = make_loss(training.loss.name, training.loss.smooth, from_logits=entry.output == "logits",
                     activation=network.activation)
    return predict_step_memory(entry, trial.model.params, network, loss, batch=batch, precision=training.planned_precision,
                               device=device, threads=threads)


def trial_steps(spec: Spec, *, device: Literal["cpu", "cuda"] = "cuda", threads: int = 1,
                precision: str | None = None, channels: tuple[int, int] | None = None,
                activation: Literal["sigmoid", "softmax"] | None = None) -> list[TrialStep]:
    """Every distinct training step the search of ``spec`` can take (see the module's docstring), in ``precision``
    (default: each trial's ``training.precision``), with ``device``'s rules (a GPU's: no CPU overhead); ``channels``
    and ``activation``: the data set's, where it is known (see :func:`predict_step`)."""
    searched = _step_paths(spec)
    configs = list(searched_combinations(searched)) if searched else [{}]
    done: dict[tuple, StepMemory] = {}
    steps: list[TrialStep] = []
    for config in configs:
        trial = apply_config(spec, config)
        if precision is not None:
            trial = apply_config(trial, {"training.precision": precision})
        shown = {k: v for k, v in config.items() if k != MODEL_NAME_PATH or len(searched.get(k, [])) > 1}
        for stage in training_stages(trial.training):
            tile = stage.tile if stage.tile is not None else volume_shape(trial)
            name = trial.model.name
            if tile is None:
                steps.append(TrialStep(shown, name, None, stage.batch_size, trial.training.planned_precision, None,
                                       "a whole-volume stage of a volume the spec does not size"))
                continue
            tile = tuple(int(t) for t in tile)
            key = (name, trial.model.framework, trial.model.params.model_dump_json(), tile, stage.batch_size,
                   trial.training.planned_precision, trial.training.loss.name, trial.dataset.labels)
            if key not in done:
                done[key] = predict_step(trial, tile, stage.batch_size, device, threads,  # type: ignore[arg-type]
                                         channels=channels, activation=activation)
            steps.append(TrialStep(shown, name, tile, stage.batch_size, trial.training.planned_precision,  # type: ignore[arg-type]
                                   done[key]))
    return steps
