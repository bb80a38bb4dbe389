"""The trainer factory: the framework's trainer for one process of a trial (:func:`build_trainer`), over its
:class:`~distmis.parallel.mesh.TrialMesh` and on the device Ray gave it. The trial processes call it
(:mod:`distmis.trial.trainables`, :mod:`distmis.trial.worker_group`), and the driver too, to load a trained trial's
best weights for the test split (:mod:`distmis.search.evaluate`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from distmis.spec.layout import TrialLayout
from distmis.spec.schema import Spec
from distmis.train.startup import StartupClock

if TYPE_CHECKING:
    from distmis.parallel.mesh import TrialMesh
    from distmis.train.protocol import Trainer

__all__ = ["build_trainer", "resolve_precision", "trial_frameworks"]


def build_trainer(spec: Spec, layout: TrialLayout, tfrecord_dir: str | Path, clock: StartupClock | None = None,
                  *, mesh: TrialMesh | None = None, device: str | None = None) -> Trainer:
    """The framework's trainer for this process; inside a Ray Train worker group when ``layout.distributed``.

    ``mesh``: this process's place in the trial. By default it is built over Ray Train's worker group
    (:meth:`TrialMesh.build`: every worker calls it) when the layout is distributed, else the process is alone
    (:meth:`TrialMesh.local`). A local mesh given for a distributed layout rebuilds the trial on one device (the
    driver's evaluation of a trained trial), its layout and so its learning rate unchanged. The worker group must
    be what the layout says: a mismatch raises rather than training silently otherwise. ``clock`` marks the end of
    the strategy's set-up (TensorFlow) and of the trainer's (model and data). ``device``: a torch trainer's device,
    where the caller chose it (a rank of a kept worker group, :mod:`distmis.trial.worker_group`); by default the GPU
    Ray gave this process, or the CPU.
    """
    trainer = _build_trainer(spec, layout, tfrecord_dir, clock, mesh, device)
    if clock is not None:
        clock.mark("data")
    return trainer


def _build_trainer(spec: Spec, layout: TrialLayout, tfrecord_dir: str | Path, clock: StartupClock | None,
                   mesh: TrialMesh | None, device: str | None) -> Trainer:
    if spec.model.framework == "tensorflow":
        from distmis.train.tf_unet import UNetTrainer

        strategy = None
        if layout.distributed and (mesh is None or not mesh.is_local):
            import tensorflow as tf

            from distmis.parallel.tensorflow_cluster import multi_worker_strategy

            tf.get_logger().setLevel("ERROR")
            strategy = multi_worker_strategy()  # the cluster from TF_CONFIG (set by Ray Train)
            _check_world(strategy.num_replicas_in_sync, layout, "MultiWorkerMirroredStrategy replicas (TF_CONFIG?)")
            if clock is not None:
                clock.mark("strategy")
        return UNetTrainer(resolve_precision(spec), tfrecord_dir, layout=layout, strategy=strategy)
    from distmis.parallel.mesh import TrialMesh
    from distmis.train.torch_trainer import TorchTrainer

    if mesh is None and layout.distributed:
        import ray.train

        _check_world(ray.train.get_context().get_world_size(), layout, "Ray Train workers")
        mesh = TrialMesh.build(layout)  # every rank calls it
        device = device or _worker_device()
    elif mesh is None:
        mesh, device = TrialMesh.local(layout), device or _trial_device()
    elif device is None:
        device = _trial_device() if mesh.is_local else _worker_device()
    return TorchTrainer(resolve_precision(spec, device), tfrecord_dir, layout=layout, mesh=mesh, device=device)


def resolve_precision(spec: Spec, device: str | None = None) -> Spec:
    """``spec`` with ``training.precision: auto`` resolved for the device this process trains on
    (:func:`~distmis.train.auto_precision.auto_precision`): a torch trial's ``device`` (default the CPU), a
    TensorFlow trial's first GPU, else the CPU. Any other precision as it is."""
    if spec.training.precision != "auto":
        return spec
    from distmis.spec.load import apply_config
    from distmis.train.auto_precision import auto_precision

    device_type, capability = (_tensorflow_device() if spec.model.framework == "tensorflow"
                               else _torch_device(device or "cpu"))
    return apply_config(spec, {"training.precision": auto_precision(device_type, cuda_capability=capability)},
                        source="training.precision auto")


def _torch_device(device: str) -> tuple[str, tuple[int, int] | None]:
    import torch

    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        return "cuda", tuple(torch.cuda.get_device_capability(torch_device))  # type: ignore[return-value]
    return torch_device.type, None


def _tensorflow_device() -> tuple[str, tuple[int, int] | None]:
    """The device a TensorFlow trial computes on: its first GPU (with its compute capability), else the CPU."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return "cpu", None
    capability = tf.config.experimental.get_device_details(gpus[0]).get("compute_capability")
    return "cuda", tuple(capability) if capability else None  # type: ignore[return-value]


def _check_world(actual: int, layout: TrialLayout, what: str) -> None:
    if actual != layout.world_size:
        raise RuntimeError(f"the trial's layout has {layout.world_size} rank(s) ({layout.describe()}), "
                           f"but there are {actual} {what}")


def trial_frameworks(spec: Spec) -> dict[str, bool]:
    """Which frameworks a trial's process pins (and so imports): only the one it trains with. A torch trial
    reads its cases without TensorFlow (:mod:`distmis.data.records`), which saves each of its processes the
    seconds of importing it."""
    return {"tensorflow": spec.model.framework == "tensorflow", "torch": spec.model.framework == "torch"}


def _trial_device() -> str:
    """A single-process torch trial's device: the GPU Ray gave this process (CUDA_VISIBLE_DEVICES holds it), else
    the CPU. A process given a GPU that torch cannot see is refused (GpuUnavailableError), never put on the CPU."""
    from distmis.parallel.devices import check_process_gpus

    return "cuda" if check_process_gpus(torch=True) else "cpu"


def _worker_device() -> str:
    """A Ray Train worker's torch device (its GPU, or the CPU); refused as :func:`_trial_device` is."""
    import ray.train.torch

    from distmis.parallel.devices import check_process_gpus

    check_process_gpus(torch=True)
    return str(ray.train.torch.get_device())
