"""What runs for one trial of a search, as Ray Tune function trainables.

Tune calls a trainable with the search's :class:`~distmis.spec.schema.Spec` and the trial's config (dotted
paths into the spec, e.g. ``{"training.optimizer.lr": 0.001}``). The trial applies its config to the spec once
(:func:`~distmis.spec.load.apply_config`), resolves its :class:`~distmis.spec.layout.TrialLayout` once, and
then either

- trains in its own process (:func:`single_process_trial`, experiment-parallel), or
- drives a Ray Train run of ``layout.world_size`` workers (:func:`data_parallel_trial`): a
  ``TensorflowTrainer`` (``MultiWorkerMirroredStrategy``) or a ``TorchTrainer`` (DDP, or data x sequence
  parallel groups for vit-seg), each worker running :func:`data_parallel_worker` on the trial's spec and
  layout (typed objects, not re-validated); ``TuneReportCallback`` forwards rank 0's reports to Tune.

Either way every epoch is reported with the same metrics, and the epoch with the best metric so far
also saves a checkpoint. Every process pins its thread pools to the CPUs its layout gives it.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

from distmis.spec.layout import TrialLayout, resolve_trial
from distmis.spec.schema import Spec


def is_better(value: float, best: float | None, mode: str) -> bool:
    if not math.isfinite(value):
        return False
    return best is None or (value > best if mode == "max" else value < best)


def build_trainer(spec: Spec, layout: TrialLayout, tfrecord_dir: str | Path) -> Any:
    """The framework's trainer for this process; inside a Ray Train worker group when ``layout.distributed``.

    The worker group must be what the layout says: a mismatch raises rather than training silently otherwise.
    """
    if spec.model.framework == "tensorflow":
        from distmis.train.tf_unet import UNetTrainer

        strategy = None
        if layout.distributed:
            import tensorflow as tf

            tf.get_logger().setLevel("ERROR")
            strategy = tf.distribute.MultiWorkerMirroredStrategy()  # cluster from TF_CONFIG (set by Ray Train)
            _check_world(strategy.num_replicas_in_sync, layout, "MultiWorkerMirroredStrategy replicas (TF_CONFIG?)")
        return UNetTrainer(spec, tfrecord_dir, layout=layout, strategy=strategy)
    if spec.model.name == "vit-seg":
        return _vit_trainer(spec, layout, tfrecord_dir)
    from distmis.train.torch_unet import TorchUNetTrainer

    if not layout.distributed:
        return TorchUNetTrainer(spec, tfrecord_dir, layout=layout, device=_trial_device())
    import ray.train
    import ray.train.torch

    context = ray.train.get_context()
    _check_world(context.get_world_size(), layout, "Ray Train workers")
    return TorchUNetTrainer(
        spec, tfrecord_dir, layout=layout, rank=context.get_world_rank(), world_size=layout.dp,
        wrap_model=ray.train.torch.prepare_model, device=str(ray.train.torch.get_device()),
    )


def _check_world(actual: int, layout: TrialLayout, what: str) -> None:
    if actual != layout.world_size:
        raise RuntimeError(f"the trial's layout has {layout.world_size} rank(s) ({layout.describe()}), "
                           f"but there are {actual} {what}")


def train_and_report(
    trainer: Any, spec: Spec, report: Callable[..., None], checkpoint_type: Any, *, saves_checkpoints: bool = True
) -> None:
    """Run every epoch; ``report(metrics, checkpoint=...)`` with a checkpoint at each new best epoch."""
    metric, mode = spec.search.metric, spec.search.mode
    best: float | None = None
    for epoch in range(1, spec.training.epochs + 1):
        metrics: dict[str, Any] = trainer.run_epoch(epoch).as_dict()
        metrics["num_parameters"] = trainer.num_parameters
        if is_better(metrics[metric], best, mode):
            best = metrics[metric]
            if saves_checkpoints:
                with tempfile.TemporaryDirectory() as tmp:
                    trainer.save(tmp)
                    report(metrics, checkpoint=checkpoint_type.from_directory(tmp))
                continue
        report(metrics)


def _quiet_worker() -> None:
    """Keep a trial's log to what a user reads: no TensorFlow C++ chatter, no line per saved checkpoint."""
    import logging

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for name in ("ray.train._internal.storage", "ray.train.v2._internal.execution.storage"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:  # Ray Train 2.60 logs every report of every rank, named by its file path
        from ray.train.v2._internal.execution import context as train_context

        train_context.logger.setLevel(logging.WARNING)
    except (ImportError, AttributeError):
        pass


def _trial_device() -> str:
    """A single-process torch trial's device: a GPU only when Ray reserved one for it (and set
    CUDA_VISIBLE_DEVICES to it), else the CPU."""
    import ray
    import torch

    use_gpu = ray.is_initialized() and bool(ray.get_gpu_ids()) and torch.cuda.is_available()
    return "cuda" if use_gpu else "cpu"


def _vit_trainer(spec: Spec, layout: TrialLayout, tfrecord_dir: str | Path) -> Any:
    """The ViT trainer; in a Ray Train worker group, with this rank's sequence- and data-parallel groups."""
    from distmis.train.torch_vit import TorchViTTrainer

    if not layout.distributed:
        return TorchViTTrainer(spec, tfrecord_dir, layout=layout, device=_trial_device())
    import ray.train
    import ray.train.torch

    from distmis.parallel.groups import build_parallel_groups

    _check_world(ray.train.get_context().get_world_size(), layout, "Ray Train workers")
    groups = build_parallel_groups(layout.sp)  # every rank calls it
    return TorchViTTrainer(spec, tfrecord_dir, layout=layout, groups=groups, device=str(ray.train.torch.get_device()))


# --------------------------------------------------------------------------- experiment-parallel
def single_process_trial(config: dict[str, Any], *, spec: Spec, tfrecord_dir: str) -> None:
    """One trial in this Tune actor's process, on the CPUs its layout gives it."""
    from ray import tune

    from distmis.train.threads import pin_threads

    _quiet_worker()
    trial, layout = resolve_trial(spec, config)
    pin_threads(layout.cpu, torch=trial.model.framework == "torch")
    trainer = build_trainer(trial, layout, tfrecord_dir)
    train_and_report(trainer, trial, tune.report, tune.Checkpoint)


# --------------------------------------------------------------------------- data-parallel
def worker_trainer(loop_config: Mapping[str, Any]) -> tuple[Spec, TrialLayout, Any]:
    """Set up one Ray Train worker of a trial: pin its threads and build its trainer (and process groups)."""
    from distmis.train.threads import pin_threads

    _quiet_worker()
    spec, layout = loop_config["spec"], loop_config["layout"]
    pin_threads(layout.cpu, torch=spec.model.framework == "torch")
    return spec, layout, build_trainer(spec, layout, loop_config["tfrecord_dir"])


def data_parallel_worker(loop_config: dict[str, Any]) -> None:
    """One Ray Train worker of a distributed trial (every worker runs this)."""
    import ray.train

    spec, _layout, trainer = worker_trainer(loop_config)
    # Rank 0 keeps the checkpoints; the model is the same on every rank.
    train_and_report(trainer, spec, ray.train.report, ray.train.Checkpoint,
                     saves_checkpoints=ray.train.get_context().get_world_rank() == 0)


def data_parallel_trial(
    config: dict[str, Any],
    *,
    spec: Spec,
    tfrecord_dir: str,
    storage_path: str,
    worker_loop: Callable[[dict[str, Any]], None] = data_parallel_worker,
) -> None:
    """One trial as a Ray Train run of ``layout.world_size`` workers running ``worker_loop``; rank 0's
    reports reach Tune."""
    from ray import tune
    from ray.train import RunConfig, ScalingConfig
    from ray.tune.integration.ray_train import TuneReportCallback

    trial, layout = resolve_trial(spec, config)
    scaling = ScalingConfig(num_workers=layout.world_size, use_gpu=layout.gpu > 0,
                            resources_per_worker=layout.worker_resources)
    run_config = RunConfig(
        name=f"{tune.get_context().get_trial_id()}",
        storage_path=storage_path,
        callbacks=[TuneReportCallback()],
    )
    loop_config = {"spec": trial, "layout": layout, "tfrecord_dir": tfrecord_dir}
    if trial.model.framework == "tensorflow":
        from ray.train.tensorflow import TensorflowTrainer

        trainer = TensorflowTrainer(worker_loop, train_loop_config=loop_config,
                                    scaling_config=scaling, run_config=run_config)
    else:
        from ray.train.torch import TorchConfig, TorchTrainer

        backend = "nccl" if scaling.use_gpu else "gloo"
        trainer = TorchTrainer(worker_loop, train_loop_config=loop_config, scaling_config=scaling,
                               run_config=run_config, torch_config=TorchConfig(backend=backend))
    trainer.fit()
