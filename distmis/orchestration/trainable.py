"""What runs for one trial of a search, as Ray Tune function trainables.

Tune calls a trainable with the trial's config (dotted paths into the spec, e.g.
``{"training.optimizer.lr": 0.001}``). The trial rebuilds its full spec and then either

- trains in its own process (:func:`single_process_trial`, experiment-parallel), or
- drives a Ray Train run over several workers (:func:`data_parallel_trial`): a ``TensorflowTrainer``
  (``MultiWorkerMirroredStrategy``) or a ``TorchTrainer`` (DDP), each worker running
  :func:`data_parallel_worker`; ``TuneReportCallback`` forwards rank 0's reports to Tune.

Either way every epoch is reported with the same metrics, and the epoch with the best metric so far
also saves a checkpoint. Every process pins its thread pools to the CPUs Ray gave it.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

from distmis.spec.load import with_overrides
from distmis.spec.schema import Spec


def trial_spec(base_spec: Mapping[str, Any], config: Mapping[str, Any]) -> Spec:
    """The spec of one trial: the search's resolved spec with the trial's values applied."""
    return Spec.model_validate(with_overrides(base_spec, config))


def scaled_spec(spec: Spec, workers: int) -> Spec:
    """The trial's spec with the learning rate it trains with over ``workers`` workers."""
    tree = spec.model_dump(mode="json")
    tree["training"]["optimizer"]["lr"] = spec.effective_lr(workers)
    return Spec.model_validate(tree)


def is_better(value: float, best: float | None, mode: str) -> bool:
    if not math.isfinite(value):
        return False
    return best is None or (value > best if mode == "max" else value < best)


def build_trainer(spec: Spec, tfrecord_dir: str | Path, *, distributed: bool = False) -> Any:
    """The framework's trainer for this process. ``distributed``: inside a Ray Train worker group."""
    if spec.model.framework == "tensorflow":
        from distmis.train.tf_unet import UNetTrainer

        strategy = None
        if distributed:
            import tensorflow as tf

            import ray.train

            tf.get_logger().setLevel("ERROR")
            strategy = tf.distribute.MultiWorkerMirroredStrategy()  # cluster from TF_CONFIG (set by Ray Train)
            world = ray.train.get_context().get_world_size()
            if strategy.num_replicas_in_sync != world:  # never fall back to one worker silently
                raise RuntimeError(f"MultiWorkerMirroredStrategy has {strategy.num_replicas_in_sync} replica(s), "
                                   f"the Ray Train worker group {world}; is TF_CONFIG set?")
        return UNetTrainer(spec, tfrecord_dir, strategy=strategy)
    if spec.model.name == "vit-seg":
        return _vit_trainer(spec, tfrecord_dir, distributed=distributed)
    if spec.model.framework == "torch":
        from distmis.train.torch_unet import TorchUNetTrainer

        if not distributed:
            return TorchUNetTrainer(spec, tfrecord_dir, device=_trial_device())
        import ray.train
        import ray.train.torch

        context = ray.train.get_context()
        return TorchUNetTrainer(
            spec, tfrecord_dir, rank=context.get_world_rank(), world_size=context.get_world_size(),
            wrap_model=ray.train.torch.prepare_model, device=str(ray.train.torch.get_device()),
        )
    raise ValueError(f"model.framework must be 'tensorflow' or 'torch', got {spec.model.framework!r}")


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


def _vit_trainer(spec: Spec, tfrecord_dir: str | Path, *, distributed: bool) -> Any:
    """The ViT trainer; in a Ray Train worker group, with this rank's sequence- and data-parallel groups."""
    from distmis.train.torch_vit import TorchViTTrainer

    if not distributed:
        return TorchViTTrainer(spec, tfrecord_dir, device=_trial_device())
    import ray.train.torch

    from distmis.parallel.groups import build_parallel_groups

    groups = build_parallel_groups(spec.parallelism.sequence_parallel.degree)  # every rank calls it
    return TorchViTTrainer(spec, tfrecord_dir, groups=groups, device=str(ray.train.torch.get_device()))


def worker_count(spec: Spec, data_parallel: int) -> int:
    """Ray Train workers of one trial: its data-parallel replicas times its sequence-parallel degree."""
    return data_parallel * spec.parallelism.sequence_parallel.degree


# --------------------------------------------------------------------------- experiment-parallel
def single_process_trial(config: dict[str, Any], *, base_spec: dict[str, Any], tfrecord_dir: str, cpus: float) -> None:
    """One trial in this Tune actor's process, on ``cpus`` CPUs."""
    from ray import tune

    from distmis.train.threads import pin_threads

    _quiet_worker()
    spec = trial_spec(base_spec, config)
    pin_threads(cpus, torch=spec.model.framework == "torch")
    trainer = build_trainer(spec, tfrecord_dir)
    train_and_report(trainer, spec, tune.report, tune.Checkpoint)


# --------------------------------------------------------------------------- data-parallel
def data_parallel_worker(loop_config: dict[str, Any]) -> None:
    """One Ray Train worker of a data-parallel trial (every worker runs this)."""
    import ray.train

    from distmis.train.threads import pin_threads

    _quiet_worker()
    context = ray.train.get_context()
    spec = trial_spec(loop_config["base_spec"], loop_config["config"])
    # The learning rate scales with the data-parallel replicas, not with the ranks that share one sample (SP).
    spec = scaled_spec(spec, context.get_world_size() // spec.parallelism.sequence_parallel.degree)
    pin_threads(loop_config["cpus"], torch=spec.model.framework == "torch")
    trainer = build_trainer(spec, loop_config["tfrecord_dir"], distributed=True)
    # Rank 0 keeps the checkpoints; the model is the same on every rank.
    train_and_report(trainer, spec, ray.train.report, ray.train.Checkpoint,
                     saves_checkpoints=context.get_world_rank() == 0)


def data_parallel_trial(
    config: dict[str, Any],
    *,
    base_spec: dict[str, Any],
    tfrecord_dir: str,
    workers: int,
    worker_resources: dict[str, float],
    storage_path: str,
    worker_loop: Callable[[dict[str, Any]], None] = data_parallel_worker,
) -> None:
    """One trial as a Ray Train run running ``worker_loop``; rank 0's reports reach Tune.

    ``workers`` data-parallel replicas, each of the trial's sequence-parallel degree (1 but for vit-seg) ranks.
    """
    from ray import tune
    from ray.train import RunConfig, ScalingConfig
    from ray.tune.integration.ray_train import TuneReportCallback

    spec = trial_spec(base_spec, config)
    scaling = ScalingConfig(
        num_workers=worker_count(spec, workers),
        use_gpu=worker_resources.get("gpu", 0) > 0,
        resources_per_worker={"CPU": worker_resources.get("cpu", 1), "GPU": worker_resources.get("gpu", 0)},
    )
    run_config = RunConfig(
        name=f"{tune.get_context().get_trial_id()}",
        storage_path=storage_path,
        callbacks=[TuneReportCallback()],
    )
    loop_config = {"base_spec": base_spec, "config": dict(config), "tfrecord_dir": tfrecord_dir,
                   "cpus": worker_resources.get("cpu", 1)}
    if spec.model.framework == "tensorflow":
        from ray.train.tensorflow import TensorflowTrainer

        trainer = TensorflowTrainer(worker_loop, train_loop_config=loop_config,
                                    scaling_config=scaling, run_config=run_config)
    else:
        from ray.train.torch import TorchConfig, TorchTrainer

        backend = "nccl" if scaling.use_gpu else "gloo"
        trainer = TorchTrainer(worker_loop, train_loop_config=loop_config, scaling_config=scaling,
                               run_config=run_config, torch_config=TorchConfig(backend=backend))
    trainer.fit()
