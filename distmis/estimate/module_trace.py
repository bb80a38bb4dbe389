"""One part of a network, one micro-batch through it and back, run on fake tensors: what a pipeline stage holds per
rank (:func:`trace_module_step`).

A pipeline stage (:mod:`distmis.parallel.pipeline`) receives tensors from the stage before it, runs its cells, sends
its outputs on, and later receives their gradients and runs its backward; Adam then steps its own parameters.
This traces exactly that on fake tensors, as :func:`~distmis.estimate.step_trace.trace_step` traces a whole
network: the received inputs and the gradients of the outputs are made inside the trace (a rank's receive
buffers), the forward runs under ``torch.autocast`` for a mixed precision, the backward from gradients of the
outputs' shapes, then Adam. The second of two such steps is counted (:class:`ModuleTrace`). The caller adds what the
rank holds beside the stage: the rest of the model's weights, the batch, and the other micro-batches in flight.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from distmis.estimate.live_bytes import LiveBytes
from distmis.estimate.step_trace import COMPUTE_DTYPES
from distmis.estimate.workspace import workspace_rule

__all__ = ["ModuleTrace", "trace_module_step"]


@dataclass(frozen=True)
class ModuleTrace:
    """A module's step on one micro-batch, in bytes (per rank) and FLOPs."""

    parameter_bytes: int  # the module's own weights and buffers
    optimizer_bytes: int  # Adam's state for its parameters
    gradient_bytes: int
    saved_bytes: int  # held at the forward's end: the inputs received, the activations kept, the outputs sent
    peak_bytes: int  # the most held at once besides the weights and Adam's state, the kernel's workspace included
    flops: float
    moment: str = ""  # the operation running at the peak
    workspace_bytes: int = 0  # its kernel's workspace


def trace_module_step(module: torch.nn.Module, inputs: Sequence[torch.Tensor], *,
                      precision: Literal["fp32", "bf16", "fp16"] = "fp32", device: Literal["cpu", "cuda"] = "cpu",
                      threads: int = 1) -> ModuleTrace:
    """Trace ``module`` (copied, not touched) on inputs shaped like ``inputs`` (any device, meta included: their
    shapes, dtypes and ``requires_grad``), its backward from gradients shaped like its outputs, and Adam's step
    (see the module's docstring). ``device``: whose kernels' workspace to count and which Adam runs."""
    fake_mode = FakeTensorMode()
    with FakeCopyMode(fake_mode):
        module = copy.deepcopy(module)
    dtype = COMPUTE_DTYPES.get(precision)
    with fake_mode:
        optimizer = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=1e-3,
                                     foreach=device == "cuda")

        def step(live: LiveBytes | None = None) -> int:
            optimizer.zero_grad(set_to_none=True)
            received = [torch.empty(t.shape, dtype=t.dtype).requires_grad_(t.requires_grad) for t in inputs]
            if dtype is None:
                out = module(*received)
            else:
                with torch.autocast("cpu", dtype=dtype):
                    out = module(*received)
            outputs = [t for t in (out if isinstance(out, tuple) else (out,)) if t.requires_grad]
            saved = live.mark() if live is not None else 0
            torch.autograd.backward(outputs, [torch.empty_like(t) for t in outputs])
            del out, outputs, received
            optimizer.step()
            return saved

        step()  # Adam's moments come into being
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        weights = [*module.parameters(), *module.buffers()]
        live = LiveBytes(workspace_rule(device, threads=threads))
        live.hold([*weights, *state])
        with FlopCounterMode(display=False) as counter:
            with live:
                saved = step(live)
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        return ModuleTrace(
            parameter_bytes=sum(int(t.untyped_storage().nbytes()) for t in weights),
            optimizer_bytes=sum(int(t.untyped_storage().nbytes()) for t in state),
            gradient_bytes=sum(int(t.untyped_storage().nbytes()) for t in grads),
            saved_bytes=saved, peak_bytes=live.peak, flops=float(counter.get_total_flops()), moment=live.moment,
            workspace_bytes=live.peak_workspace)
