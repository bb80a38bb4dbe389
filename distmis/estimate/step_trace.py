"""A registered network's training step, run on fake tensors: its bytes and FLOPs (:func:`trace_step`).

The network is built by its registry entry's builder and copied into ``FakeTensorMode``, so its parameters, its
batch and everything the step makes are fake tensors: shapes, dtypes and storages of the right size, no memory and no
arithmetic. Two steps run as the torch trainer runs them (:mod:`distmis.train.torch_trainer`, on its loss): the
optimizer's gradients set to None, the forward (under ``torch.autocast`` in bf16 or fp16), the loss in fp32 on the
output, the backward and Adam's step (Adam whatever ``training.optimizer`` names: its two moments per parameter are
an upper bound for ``sgd``, whose momentum is one, and the same state as ``adamw``'s). The first makes Adam's
moments; the second is measured by
:class:`~distmis.estimate.live_bytes.LiveBytes` (every storage it makes, and each kernel's workspace) and
``torch.utils.flop_counter.FlopCounterMode`` (the FLOPs of its matrix products and convolutions). Nothing of the
network is described by hand: a network added to the registry is traced as it is.

Tracing costs what dispatching the step costs, without its arithmetic: 0.2 to 6 seconds on 2 cores for the registered
networks at their default sizes (the transformers the longest), whatever the tile.
"""

from __future__ import annotations

import copy
from typing import Callable, Literal

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeCopyMode, FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from distmis.estimate.live_bytes import LiveBytes
from distmis.estimate.record import StepTrace
from distmis.estimate.workspace import workspace_rule
from distmis.models.params import NetworkParams
from distmis.models.registry import ModelEntry, NetworkInput

__all__ = ["Loss", "StepTrace", "TrainingStep", "trace_step", "stand_in_loss", "COMPUTE_DTYPES"]

#: The dtype each mixed ``training.precision`` computes in (as :mod:`distmis.train.precision`, above this layer).
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: A training loss, ``(output, target) -> scalar``.
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class TrainingStep:
    """The torch trainer's training step (:mod:`distmis.train.torch_trainer`) on one batch, for a network traced
    on fake tensors or measured on real ones: the gradients set to None, the forward (under ``torch.autocast`` in
    bf16 or fp16), the loss in fp32 on the output (``TorchPrecision.fp32_loss``), the backward and Adam's step
    (one parameter at a time on a CPU, ``foreach`` on a GPU, as Adam's defaults choose)."""

    def __init__(self, model: torch.nn.Module, network: NetworkInput, loss_fn: Loss, *, batch: int,
                 precision: str = "fp32", device: str = "cpu") -> None:
        if precision != "fp32" and precision not in COMPUTE_DTYPES:
            raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        self.model = model
        self.dtype = COMPUTE_DTYPES.get(precision)
        self.loss_fn = loss_fn
        self.activation = network.activation
        self.stand_in = False  # the loss read values of fake tensors: stand_in_loss replaces it
        self.optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=device == "cuda")
        where = next(model.parameters()).device
        self.device_type = where.type
        self.x = torch.rand((batch, network.in_channels, *network.tile), device=where)
        self.y = (torch.rand((batch, network.out_channels, *network.tile), device=where) > 0.5).float()

    def __call__(self, at_forward_end: Callable[[], object] | None = None) -> object:
        """One step; what ``at_forward_end`` returns when called between the forward and the loss."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.dtype is None:
            output = self.model(self.x)
        else:
            with torch.autocast(self.device_type, dtype=self.dtype):
                output = self.model(self.x)
        seen = at_forward_end() if at_forward_end is not None else None
        with torch.autocast(self.device_type, enabled=False):
            value = self._loss(output.float())
        del output
        value.backward()
        self.optimizer.step()
        return seen

    def _loss(self, output: torch.Tensor) -> torch.Tensor:
        """The loss of ``output``; on fake tensors, for a loss that reads values (MONAI's ``DiceCELoss`` turns a
        tensor into a list), :func:`stand_in_loss`, which holds what it holds."""
        if not self.stand_in:
            try:
                return self.loss_fn(output, self.y)
            except DataDependentOutputException:
                self.stand_in = True
        return stand_in_loss(output, self.y, self.activation)

    def held(self) -> list[torch.Tensor]:
        """What exists between steps: the parameters, buffers, the batch and Adam's state."""
        return [*self.model.parameters(), *self.model.buffers(), self.x, self.y, *self.optimizer_state()]

    def optimizer_state(self) -> list[torch.Tensor]:
        return [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def stand_in_loss(logits: torch.Tensor, target: torch.Tensor, activation: str) -> torch.Tensor:
    """Soft dice and cross-entropy on ``logits`` through ``activation``: the tensors a segmentation loss makes and
    keeps (the probabilities, their products with the target, the cross-entropy's), for a loss that cannot run
    on fake tensors."""
    if activation == "softmax":
        prob = torch.softmax(logits, dim=1)
        cross_entropy = torch.nn.functional.cross_entropy(logits, target.argmax(dim=1))
    else:
        prob = torch.sigmoid(logits)
        cross_entropy = torch.nn.functional.binary_cross_entropy_with_logits(logits, target)
    axes = tuple(range(2, logits.ndim))
    dice = (2 * (prob * target).sum(dim=axes) + 1) / (prob.sum(dim=axes) + target.sum(dim=axes) + 1)
    return cross_entropy + 1 - dice.mean()


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(int(t.untyped_storage().nbytes()) for t in tensors)


def trace_step(entry: ModelEntry, params: NetworkParams, network: NetworkInput, loss_fn: Loss, *, batch: int,
               precision: Literal["fp32", "bf16", "fp16"] = "fp32", device: Literal["cpu", "cuda"] = "cpu",
               threads: int = 1,
               model: torch.nn.Module | None = None) -> StepTrace:
    """Trace one training step of ``entry``'s torch network (``params``, built for ``network``; or ``model``, a
    network already built, which is copied and not touched) on ``batch`` inputs of ``network.tile``, trained on
    ``loss_fn`` (``(output, target) -> loss``: the trainer's, :func:`distmis.train.torch_losses.make_loss`; see the
    module's docstring). ``device``: whose kernels' workspace to count (a
    CPU's running ``threads`` threads, or a GPU's) and which Adam runs; autocast is that of the device the
    network's weights are on."""
    from distmis.networks import build_network

    if "torch" not in entry.frameworks:
        raise ValueError(f"model {entry.name!r} has no torch network to trace (frameworks: {list(entry.frameworks)})")
    # Built as the trainer builds it (its initialization reads values, which fake tensors have not), then copied
    # into fake tensors: the real weights live only as long as the copy takes.
    fake_mode = FakeTensorMode()
    with FakeCopyMode(fake_mode):
        model = copy.deepcopy(model if model is not None else build_network(entry, params, network))
    with fake_mode:
        step = TrainingStep(model, network, loss_fn, batch=batch, precision=precision, device=device)
        step()  # Adam's moments come into being
        live = LiveBytes(workspace_rule(device, threads=threads))
        live.hold(step.held())
        with FlopCounterMode(display=False) as counter:
            with live:
                saved, forward = step(lambda: (live.mark(), counter.get_total_flops()))  # type: ignore[misc]
        weights = [*model.parameters(), *model.buffers()]
        return StepTrace(
            network=entry.name, tile=tuple(network.tile), batch=batch, precision=precision, device=device,
            parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
            parameter_bytes=_bytes(weights), optimizer_bytes=_bytes(step.optimizer_state()),
            batch_bytes=_bytes([step.x, step.y]),
            gradient_bytes=_bytes([p.grad for p in model.parameters() if p.grad is not None]),
            saved_bytes=saved, peak_bytes=live.peak, workspace_bytes=live.peak_workspace, moment=live.moment,
            stand_in_loss=step.stand_in,
            flops=float(counter.get_total_flops()), forward_flops=float(forward))
