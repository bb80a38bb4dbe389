"""The Ray Tune function trainable: one trial of an experiment-parallel search.

Tune calls :func:`unet_trial` in a worker process with the trial's config (dotted paths into the
spec, e.g. ``{"training.optimizer.lr": 0.001}``). The trial rebuilds its full spec, pins its
threads to the CPUs Ray gave it, trains, and reports every epoch with ``ray.tune.report``; the
epoch with the best metric so far also hands Tune a checkpoint.
"""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any, Mapping

from ray import tune

from distmis.spec.load import with_overrides
from distmis.spec.schema import Spec


def trial_spec(base_spec: Mapping[str, Any], config: Mapping[str, Any]) -> Spec:
    """The spec of one trial: the search's resolved spec with the trial's values applied."""
    return Spec.model_validate(with_overrides(base_spec, config))


def is_better(value: float, best: float | None, mode: str) -> bool:
    if not math.isfinite(value):
        return False
    return best is None or (value > best if mode == "max" else value < best)


def unet_trial(config: dict[str, Any], *, base_spec: dict[str, Any], tfrecord_dir: str) -> None:
    """Train the TensorFlow U-Net for one trial and report each epoch to Tune."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    spec = trial_spec(base_spec, config)

    from distmis.train.threads import pin_threads

    pin_threads(spec.parallelism.resources_per_trial.cpu, torch=False)

    from distmis.train.tf_unet import UNetTrainer

    trainer = UNetTrainer(spec, tfrecord_dir)
    metric, mode = spec.search.metric, spec.search.mode
    best: float | None = None
    for epoch in range(1, spec.training.epochs + 1):
        metrics: dict[str, Any] = trainer.run_epoch(epoch).as_dict()
        metrics["num_parameters"] = trainer.num_parameters
        if is_better(metrics[metric], best, mode):
            best = metrics[metric]
            with tempfile.TemporaryDirectory() as tmp:
                trainer.save(tmp)
                tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(tmp))
        else:
            tune.report(metrics)
