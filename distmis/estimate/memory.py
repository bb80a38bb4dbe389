"""A trial's memory per rank, predicted from its traced training step (:func:`predict_step_memory`).

The trace (:func:`~distmis.estimate.step_trace.trace_step`) gives the tensors; this adds what is not a tensor:

- on a CPU, what the process adds to a step's tensors (:func:`cpu_overhead`): the freed blocks glibc's heap keeps
  resident. glibc serves
  blocks under its mmap threshold (which rises to 32 MiB as large blocks are freed) from its heap and gives freed
  heap memory back only from the heap's top, so a step's resident peak exceeds its tensors' by a share of them:
  :data:`RETAINED_SHARE` of the tensors, at most :data:`~distmis.perf.model.HEAP_RETENTION`. Both figures are
  measured (``benchmarks/step_memory.py``, which also measures each step with the threshold fixed at 64 KiB, where
  the resident peak is the tensors' and the kernels' alone). What a process's first step adds once (the code pages it
  first touches, its threads' stacks and buffers: :data:`~distmis.perf.model.CODE_PAGES` and
  :data:`~distmis.perf.model.RUNTIME_BUFFERS`) is not counted, since it is there before every later step;
- on a GPU, nothing yet: CUDA's allocator holds the tensors and cuDNN's workspace, and its peak is what
  ``torch.cuda.max_memory_allocated`` reports; the context (a few hundred MiB) is the process's, outside it.

:attr:`StepMemory.step` is what a trial measures as ``peak_memory_mb`` (:class:`~distmis.train.metering.StepMeter`:
the step's peak above the weights and the batch, Adam's state counted); :attr:`StepMemory.peak` adds the weights
and the batch, what a worker's memory must hold besides the process's own.

The trace steps Adam whatever ``training.optimizer`` names: ``adamw`` keeps the same two moments per parameter,
``sgd`` one (its momentum; none without momentum), so for ``sgd`` the prediction is an upper bound, by one fp32 copy
of the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch.nn import Module

from distmis.estimate.step_trace import Loss, StepTrace, trace_step
from distmis.models.params import NetworkParams
from distmis.models.registry import ModelEntry, NetworkInput
from distmis.perf.model import HEAP_RETENTION

__all__ = ["RETAINED_SHARE", "StepMemory", "cpu_overhead", "predict_step_memory"]

#: The share of a CPU step's tensors that glibc's heap keeps resident beyond them, fitted to
#: ``benchmarks/step_memory.py``'s U-Nets at 32^3 and 64^3: the resident peak with glibc's defaults less the same
#: with a fixed mmap threshold was 4-77 MiB for steps of 23-1150 MiB of tensors.
RETAINED_SHARE = 0.3


def cpu_overhead(tensors: float) -> float:
    """Bytes a CPU process holds at a step's peak besides its ``tensors`` (bytes; the module's docstring)."""
    return min(HEAP_RETENTION, RETAINED_SHARE * max(0.0, tensors))


@dataclass(frozen=True)
class StepMemory:
    """A training step's predicted memory per rank, in bytes (see the module's docstring)."""

    trace: StepTrace
    overhead: float  # what the process adds to the step's tensors (CPU), not a tensor

    @property
    def step(self) -> float:
        """The step's peak above the weights and the batch: Adam's state, the gradients, the activations, the
        temporaries and the running kernel's workspace, and the overhead."""
        return self.trace.optimizer_bytes + self.trace.peak_bytes + self.overhead

    @property
    def peak(self) -> float:
        """All a rank holds at the step's peak but the process's libraries: the weights and the batch too."""
        return self.trace.parameter_bytes + self.trace.batch_bytes + self.step

    def parts(self) -> dict[str, float]:
        """The peak by part, in bytes (the activations and temporaries: the step's peak less its gradients and
        the kernel's workspace)."""
        t = self.trace
        return {"weights": t.parameter_bytes, "batch": t.batch_bytes, "optimizer": t.optimizer_bytes,
                "gradients": t.gradient_bytes, "workspace": t.workspace_bytes,
                "activations": t.peak_bytes - t.gradient_bytes - t.workspace_bytes, "overhead": self.overhead}


def predict_step_memory(entry: ModelEntry, params: NetworkParams, network: NetworkInput, loss_fn: Loss, *,
                        batch: int, precision: Literal["fp32", "bf16", "fp16"] = "fp32",
                        device: Literal["cpu", "cuda"] = "cpu", threads: int = 1,
                        model: Module | None = None) -> StepMemory:
    """The predicted memory of one rank's training step of ``entry``'s network (see :func:`trace_step`)."""
    trace = trace_step(entry, params, network, loss_fn, batch=batch, precision=precision, device=device,
                       threads=threads, model=model)
    tensors = trace.optimizer_bytes + trace.peak_bytes
    overhead = 0.0 if device == "cuda" else cpu_overhead(tensors)
    return StepMemory(trace, overhead)
