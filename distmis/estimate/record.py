"""What a traced training step holds and computes (:class:`StepTrace`), for torch's trace and Keras's alike: no
framework is imported here, so that a TensorFlow trial reads it without torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["StepTrace"]


@dataclass(frozen=True)
class StepTrace:
    """One training step of ``network`` on a batch of ``batch`` inputs of ``tile`` voxels, in ``precision``, as
    traced (bytes are per rank; FLOPs counted by torch)."""

    network: str
    tile: tuple[int, int, int]
    batch: int
    precision: str
    device: str
    parameters: int  # trainable values
    parameter_bytes: int  # the fp32 weights (and buffers)
    optimizer_bytes: int  # Adam's state: two fp32 moments per parameter and its step counters (Adam whatever the
    # spec's optimizer: adamw keeps as much, sgd one moment, so this is an upper bound for it)
    batch_bytes: int  # the image and target batch the step reads (fp32)
    gradient_bytes: int  # the parameters' gradients, which outlive the step
    saved_bytes: int  # what the step holds at its forward's end: the activations autograd keeps for the backward
    peak_bytes: int  # the most the step holds at once besides the parameters, Adam's state and the batch,
    # the workspace of the kernel running at that moment included
    workspace_bytes: int  # that kernel's workspace
    moment: str  # the operation running at the peak
    stand_in_loss: bool  # the loss read values, and stand_in_loss took its place
    flops: float  # forward and backward
    forward_flops: float

    def to_dict(self) -> dict:
        return asdict(self)
