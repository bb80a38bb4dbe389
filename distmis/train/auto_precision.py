"""``training.precision: auto``: bf16 where the trial's device computes bfloat16 natively, fp32 otherwise (issue 52).

Resolved once, in the trial's process, when its trainer is built (:func:`distmis.trial.trainers.build_trainer`):
the trainer, its checkpoints and its measurements see the concrete precision. Natively means:

- a CPU with bfloat16 instructions (AVX512-BF16 or AMX-BF16, which oneDNN's bfloat16 kernels use; read from the
  CPU's flags, so that a TensorFlow trial need not import torch to know);
- a GPU of compute capability 8.0 or later (Ampere on): bfloat16 tensor cores.

bf16 is mixed precision (:mod:`distmis.train.precision`): the weights, gradients and optimizer state stay fp32.
The driver plans memory for ``auto`` as for fp32 (:attr:`distmis.spec.schema.TrainingSpec.planned_precision`),
which bounds the bf16 step from above: it does not know its workers' devices.

Torch-free and TensorFlow-free: both trainers' processes import it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

__all__ = ["BF16_CPU_FLAGS", "cpu_flags", "cpu_computes_bf16", "auto_precision"]

#: the CPU flags (``/proc/cpuinfo``) of native bfloat16 arithmetic
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This CPU's feature flags (Linux's ``/proc/cpuinfo``; none where it cannot be read)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_computes_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether a CPU with ``flags`` (default: this one's) computes bfloat16 natively."""
    return bool(BF16_CPU_FLAGS & (cpu_flags() if flags is None else flags))


def auto_precision(device_type: str, *, cuda_capability: tuple[int, int] | None = None,
                   flags: frozenset[str] | None = None) -> Literal["bf16", "fp32"]:
    """``training.precision: auto`` on a ``device_type`` (``cpu`` or ``cuda``) device: bf16 on a GPU of compute
    capability ``cuda_capability`` 8.0 or later and on a CPU with bfloat16 instructions (``flags``: its flags,
    default this CPU's), fp32 otherwise."""
    if device_type == "cuda":
        return "bf16" if cuda_capability is not None and tuple(cuda_capability) >= (8, 0) else "fp32"
    if device_type != "cpu":
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    return "bf16" if cpu_computes_bf16(flags) else "fp32"
