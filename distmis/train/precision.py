"""Mixed precision in the torch trainer (``training.precision``): autocast, fp32 master weights, fp16 loss scaling.

``fp32`` trains as ever. ``bf16`` and ``fp16`` are mixed precision as PyTorch's automatic mixed precision does it:

- the network stays fp32: its parameters (the *master weights*), their gradients and Adam's moments are fp32, and
  the optimizer updates the fp32 weights. The forward runs under ``torch.autocast(device, dtype)``, which casts
  the weights and inputs of the operations on its list (convolutions, matrix products, attention) to the compute
  dtype, the rest following their inputs' dtype; the casts' backward returns fp32 gradients to the parameters;
- the backward runs outside autocast (each operation's backward in its forward's dtype), the loss is computed
  in fp32 from the network's output cast to fp32 (:meth:`TorchPrecision.fp32_loss`), and the probabilities that
  validation and prediction read are fp32;
- ``fp16``, whose range is narrow, scales the loss (``torch.amp.GradScaler``): the backward runs on the scaled
  loss, the gradients are unscaled before anything reads them (a clipping would come after
  ``unscale_``), a step whose gradients overflowed is skipped and the scale backed off. Every rank of a trial
  takes the same decision: the overflow is agreed over the trial's groups (:meth:`TorchPrecision.step`), since a
  pipeline's stages hold different parameters. The scaler's state is part of a trial's checkpoint.

Where it runs: fp16 on a CPU needs its float16 instructions (oneDNN's float16 kernels: AVX512-FP16 or AMX-FP16);
without them torch emulates float16, slower than fp32, and the trainer refuses it
(:func:`check_precision_device`). bf16 runs on any CPU (natively with AVX512-BF16 or AMX) and on GPUs that have
bfloat16.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist

__all__ = ["COMPUTE_DTYPES", "Loss", "TorchPrecision", "check_precision_device", "cpu_float16_supported"]

#: The dtype each ``training.precision`` computes in.
COMPUTE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cpu_float16_supported() -> bool:
    """Whether this CPU computes float16 natively: oneDNN's float16 kernels (AVX512-FP16 or AMX-FP16)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_fp16_supported())


def check_precision_device(precision: str, device_type: str, *, cpu_float16: bool | None = None,
                           cuda_bfloat16: bool | None = None) -> None:
    """ValueError, with the reason and what to do, when ``precision`` cannot train on a ``device_type`` device
    here: fp16 on a CPU without float16 instructions (``cpu_float16``: whether it has them; default: this CPU's),
    bf16 on a GPU without bfloat16 (``cuda_bfloat16``; default: the current GPU's)."""
    if precision not in COMPUTE_DTYPES:
        raise ValueError(f"training.precision must be one of {', '.join(COMPUTE_DTYPES)}, got {precision!r}")
    if precision == "fp16" and device_type == "cpu":
        supported = cpu_float16_supported() if cpu_float16 is None else cpu_float16
        if not supported:
            raise ValueError("training.precision 'fp16' on a CPU needs the CPU's float16 instructions (AVX512-FP16 "
                             "or AMX-FP16, which oneDNN's float16 kernels use), and this CPU has none: torch would "
                             "emulate float16, slower than fp32. Use 'bf16' on this CPU, or give the trial a GPU")
    if precision == "bf16" and device_type == "cuda":
        supported = (torch.cuda.is_bf16_supported(including_emulation=False) if cuda_bfloat16 is None
                     else cuda_bfloat16)
        if not supported:
            raise ValueError("training.precision 'bf16' needs a GPU with bfloat16 arithmetic (compute capability "
                             "8.0 or later), and this one has none: use 'fp16' (loss-scaled) on it")


class TorchPrecision:
    """One trainer's ``training.precision`` on its device: the autocast of its forward, the fp32 loss, the backward
    (scaled for fp16) and the optimizer's step (unscaled, skipped on overflow)."""

    def __init__(self, precision: str, device: torch.device | str) -> None:
        device = torch.device(device)
        check_precision_device(precision, device.type)
        self.name = precision
        self.device = device
        self.device_type = device.type
        self.dtype = COMPUTE_DTYPES[precision]
        #: fp16's loss scaler (None otherwise)
        self.scaler: torch.amp.GradScaler | None = (torch.amp.GradScaler(device.type) if precision == "fp16"
                                                    else None)

    @property
    def mixed(self) -> bool:
        """Whether the forward computes in a 16-bit dtype."""
        return self.name != "fp32"

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The autocast dtype, or None for fp32."""
        return self.dtype if self.mixed else None

    def autocast(self) -> ContextManager[Any]:
        """The context a forward runs in: ``torch.autocast`` to the compute dtype (nothing for fp32)."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def fp32_loss(self, loss_fn: Loss) -> Loss:
        """``loss_fn`` computed in fp32, outside autocast, on the output and target cast to fp32 (fp32: itself)."""
        if not self.mixed:
            return loss_fn
        device_type = self.device_type

        def in_fp32(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device_type, enabled=False):
                return loss_fn(output.float(), target.float())

        return in_fp32

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss the backward starts from: ``loss`` times fp16's current scale (itself otherwise)."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale_loss(self, scaled: torch.Tensor) -> torch.Tensor:
        """A loss :meth:`scale` scaled at the current scale, back to its value."""
        return scaled if self.scaler is None else scaled / self.scaler.get_scale()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward from ``loss`` (scaled for fp16), outside autocast."""
        self.scale(loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, groups: Sequence[Any] = (), *, clip_norm: float | None = None,
             norm_groups: Sequence[Any] = ()) -> bool:
        """The optimizer's step on the fp32 gradients; False when fp16 found an overflow and skipped it.

        ``clip_norm``: the gradients are first clipped to that global norm (:mod:`distmis.train.clipping`; the
        squares summed over ``norm_groups``, whose ranks hold the model's other parameters).

        fp16: the overflow is agreed first over ``groups`` (the groups that together span the trial's ranks): a
        rank whose own gradients are finite while another's are not marks one of its gradients non-finite, so that
        every rank's scaler skips the step and backs off the same scale. Then the gradients are unscaled
        (``unscale_``, before the clipping reads them), the step taken unless they overflowed, and the scale
        updated."""
        if self.scaler is None:
            self._clip(optimizer, clip_norm, norm_groups)
            optimizer.step()
            return True
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if groups:  # every rank joins the all-reduces, with gradients or without
            local = (torch.stack([torch.logical_not(torch.isfinite(g)).any() for g in grads]).any() if grads
                     else torch.zeros((), dtype=torch.bool, device=self.device))
            overflow = local.to(torch.float32).reshape(1)
            for group in groups:
                dist.all_reduce(overflow, op=dist.ReduceOp.MAX, group=group)
            if bool(overflow.item()) and not bool(local.item()) and grads:
                grads[0].view(-1)[0] = float("inf")  # seen by unscale_ as an overflow, as on the other ranks
        # the scale is made where a loss is first scaled: on a pipeline's other stages no loss ever is
        self.scaler.scale(torch.ones((), device=self.device))
        scale = self.scaler.get_scale()
        self.scaler.unscale_(optimizer)
        self._clip(optimizer, clip_norm, norm_groups)
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= scale  # an overflow backs the scale off

    @staticmethod
    def _clip(optimizer: torch.optim.Optimizer, clip_norm: float | None, norm_groups: Sequence[Any]) -> None:
        if clip_norm is not None:
            from distmis.train.clipping import clip_torch_gradients

            clip_torch_gradients((p for group in optimizer.param_groups for p in group["params"]), clip_norm,
                                 norm_groups)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: fp16's scaler state (``{}`` otherwise)."""
        return {} if self.scaler is None else {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state (a state without a scaler's leaves fp16's at its start)."""
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
