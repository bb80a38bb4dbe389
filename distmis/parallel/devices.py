"""The GPUs of a trial's process: what Ray gave it, what its framework sees, and the set-up that goes with them.

A trial (or a Ray Train worker, or a worker of a data-mode search's TensorFlow group) whose Ray resources include a
GPU is given that GPU by Ray: its ids (``ray.get_gpu_ids()``) and ``CUDA_VISIBLE_DEVICES``. Whether torch or
TensorFlow can use it is another matter: a CPU build of either (``torch 2.13.0+cpu``, ``tensorflow-cpu``) sees no
CUDA device on any machine, and Ray's GPU resource is only a number, which a node may declare without having the
hardware (``ray start --num-gpus``, ``ray.init(num_gpus=1)``). A framework that sees no GPU would quietly train on
the CPU. :func:`check_process_gpus` refuses that at the process's start, before any training, with
:class:`GpuUnavailableError`: what Ray gave, what the framework saw, and what to do.

The refusal is a pure function (:func:`gpu_refusal`) of what Ray gave and a :class:`FrameworkGpus` (what one
framework saw), so that it is tested with the real frameworks on a machine without a GPU; :func:`torch_gpus`,
:func:`tensorflow_gpus` and :func:`ray_gpu_ids` read them.

The set-up of a process that has GPUs: TensorFlow's memory growth (:func:`tensorflow_memory_growth`: a process
takes device memory as it needs it instead of all of it, so that trials with fractional ``gpu`` share a device),
and torch's ``cudnn.benchmark`` (:func:`set_cudnn_benchmark`, from ``training.cudnn_benchmark``). Nothing here
imports a framework at module level.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Literal, Sequence

logger = logging.getLogger(__name__)

__all__ = ["GpuUnavailableError", "FrameworkGpus", "gpu_refusal", "require_gpus", "ray_gpu_ids", "torch_gpus",
           "tensorflow_gpus", "check_process_gpus", "tensorflow_memory_growth", "set_cudnn_benchmark",
           "model_device", "process_node", "INSTALL_ROUTE"]

Framework = Literal["torch", "tensorflow"]

#: Where the docs say how to install each framework's CUDA build.
INSTALL_ROUTE = {
    "torch": "install torch's CUDA build (gpu-torch extra: docs/install.md, GPU nodes)",
    "tensorflow": "install TensorFlow's CUDA build (gpu-tf extra: docs/install.md, GPU nodes)",
}


class GpuUnavailableError(RuntimeError):
    """Ray gave this process a GPU that its training framework cannot see: the trial is refused rather than
    trained on the CPU."""


@dataclass(frozen=True)
class FrameworkGpus:
    """What one framework of this process sees of the GPUs."""

    framework: Framework
    version: str  # torch.__version__ or tf.__version__
    devices: tuple[str, ...]  # the CUDA devices it sees (names, or indices)
    cuda_build: str | None  # the CUDA version it was built with; None: a build without CUDA
    probe: str  # how it was asked, and its answer, for the message: "torch.cuda.is_available() False"


def _ids(given: Sequence[str | int]) -> str:
    return ", ".join(str(i) for i in given)


def gpu_refusal(given: Sequence[str | int], visible: str | None, seen: FrameworkGpus) -> str | None:
    """Why a process that Ray gave the GPU ids ``given`` (``CUDA_VISIBLE_DEVICES``: ``visible``) must not train
    with ``seen``'s framework, or None when it may: it was given no GPU, or the framework sees one (pure).

    The message names what Ray gave, what the framework saw and what to do: install the framework's CUDA build,
    or drop ``gpu`` from the trial's resources."""
    if not given or seen.devices:
        return None
    name = f"torch {seen.version}" if seen.framework == "torch" else f"TensorFlow {seen.version}"
    env = "unset" if visible is None else repr(visible)
    build = (f"built with CUDA {seen.cuda_build}: check the node's driver and devices (nvidia-smi)"
             if seen.cuda_build else "a build without CUDA")
    plural = "s" if len(given) > 1 else ""
    return (f"Ray gave this process GPU{plural} {_ids(given)} (CUDA_VISIBLE_DEVICES={env}) but {name} sees no "
            f"CUDA device ({seen.probe}: {build}). distmis does not train a GPU trial on the CPU: "
            f"{INSTALL_ROUTE[seen.framework]}, or drop gpu from parallelism.resources_per_trial / "
            "resources_per_worker.")


def require_gpus(given: Sequence[str | int], visible: str | None, seen: FrameworkGpus) -> None:
    """:func:`gpu_refusal`, raised as :class:`GpuUnavailableError`."""
    reason = gpu_refusal(given, visible, seen)
    if reason is not None:
        raise GpuUnavailableError(reason)


# --------------------------------------------------------------------------- what this process has
def ray_gpu_ids() -> list[str]:
    """The GPU ids Ray gave this process (a task, an actor, a Ray Train worker); empty outside Ray and in a
    driver, which Ray gives nothing."""
    ray = sys.modules.get("ray")  # a process Ray started has imported it; any other was given nothing by Ray
    if ray is None or not ray.is_initialized():
        return []
    return [str(i) for i in ray.get_gpu_ids()]


def process_node() -> str:
    """The node this process runs on, as a trial reports it: its Ray node id (``ray list nodes`` names its address;
    several nodes may share one host) in a process Ray started, the host's name anywhere else."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return str(ray.get_runtime_context().get_node_id())
    import socket

    return socket.gethostname()


def torch_gpus() -> FrameworkGpus:
    """What torch sees: ``torch.cuda.is_available()``, its devices and ``torch.version.cuda``."""
    import torch

    available = torch.cuda.is_available()
    devices = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) if available else ()
    return FrameworkGpus("torch", str(torch.__version__), devices, torch.version.cuda,
                         f"torch.cuda.is_available() {available}, torch.version.cuda {torch.version.cuda}")


def tensorflow_gpus() -> FrameworkGpus:
    """What TensorFlow sees: ``tf.config.list_physical_devices('GPU')`` and whether it was built with CUDA."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    built = bool(tf.test.is_built_with_cuda())
    cuda = str(tf.sysconfig.get_build_info().get("cuda_version") or "?") if built else None
    return FrameworkGpus("tensorflow", str(tf.__version__), tuple(g.name for g in gpus), cuda,
                         f"tf.config.list_physical_devices('GPU') {[g.name for g in gpus]}, "
                         f"tf.test.is_built_with_cuda() {built}")


def check_process_gpus(*, tensorflow: bool = False, torch: bool = False) -> list[str]:
    """Refuse (:class:`GpuUnavailableError`) a process that Ray gave a GPU when one of the frameworks it trains
    with sees none; the GPU ids Ray gave (empty: a CPU process, nothing to check)."""
    given = ray_gpu_ids()
    if not given:
        return given
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if torch:
        require_gpus(given, visible, torch_gpus())
    if tensorflow:
        require_gpus(given, visible, tensorflow_gpus())
    return given


# --------------------------------------------------------------------------- set-up
def tensorflow_memory_growth() -> list[str]:
    """Memory growth on every GPU TensorFlow sees (``tf.config.experimental.set_memory_growth``): the process
    takes device memory as it needs it, not all of it at its first op, so that trials with a fraction of a GPU
    (``gpu: 0.5``) share the device. Must come before TensorFlow initializes its devices; a process whose
    devices are initialized already keeps what it has (a warning if that is not growth). The GPUs' names
    (none on a CPU: nothing to do)."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError as exc:  # devices initialized already (a reused process): growth was set or not
            if not tf.config.experimental.get_memory_growth(gpu):
                logger.warning("TensorFlow's %s was initialized without memory growth: %s", gpu.name, exc)
    return [gpu.name for gpu in gpus]


def set_cudnn_benchmark(enabled: bool) -> None:
    """``torch.backends.cudnn.benchmark`` (``training.cudnn_benchmark``): cuDNN times its convolution
    algorithms for each new input shape and keeps the fastest. Faster for the fixed tiles of a trial, at the
    cost of a first step per shape and of an algorithm choice that may differ between runs (results are not
    bit-for-bit repeatable). No effect on a CPU."""
    import torch

    torch.backends.cudnn.benchmark = bool(enabled)


def model_device(model: object) -> str:
    """Where a trained network's weights are, as the trial reports it: a torch module's first parameter's device
    (``"cpu"``, ``"cuda:0 (NVIDIA H100 80GB HBM3)"``) or a Keras model's first weight's (``"CPU:0"``,
    ``"GPU:0 (NVIDIA H100 80GB HBM3)"``); ``"unknown"`` for anything else."""
    parameters = getattr(model, "parameters", None)
    if callable(parameters):  # torch
        first = next(iter(parameters()), None)
        if first is None:
            return "unknown"
        device = first.device
        if device.type == "cuda":
            import torch

            return f"{device} ({torch.cuda.get_device_name(device)})"
        return str(device)
    weights = getattr(model, "weights", None)
    if weights:  # Keras: the variable's TensorFlow device, "/job:.../device:GPU:0"
        variable = weights[0]
        where = str(getattr(getattr(variable, "value", variable), "device", "") or "")
        kind = where.rsplit("device:", 1)[-1] if "device:" in where else ""
        if not kind:
            return "unknown"
        if kind.upper().startswith("GPU"):
            return f"{kind} ({_tensorflow_gpu_name(int(kind.split(':')[-1]))})"
        return kind
    return "unknown"


def _tensorflow_gpu_name(index: int) -> str:
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if index >= len(gpus):
        return "?"
    return str(tf.config.experimental.get_device_details(gpus[index]).get("device_name", gpus[index].name))
