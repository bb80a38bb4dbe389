"""Gradient clipping by the global norm (``training.clip_grad_norm``), the same rule in both frameworks: before each
step the trial's whole gradient ``g`` (every parameter's, over every rank that holds a part of the model) is scaled
by ``min(1, c / (||g|| + 1e-6))``, torch's ``clip_grad_norm_``'s rule (nnU-Net v2 clips at ``c = 12``).

- torch (:func:`clip_torch_gradients`): after the data-parallel (and sequence-parallel) all-reduce every rank holds
  the gradient of its parameters; a pipeline's stages hold different parameters, so the squares are summed over the
  pipeline's group before the root. Under fp16 the gradients are clipped once unscaled
  (:meth:`~distmis.train.precision.TorchPrecision.step`).
- TensorFlow (:func:`clip_tf_gradients`): each replica's gradients are its share of the trial's (its loss divided by
  the replicas), which ``apply_gradients`` sums. The norm is that of their sum, so with several replicas the
  shares are summed first (one more all-reduce a step); each replica scales its own share by the factor, so the sum
  ``apply_gradients`` makes is the clipped gradient. Under fp16 the norm is taken of the unscaled gradients.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tensorflow as tf
    import torch

__all__ = ["EPSILON", "clip_factor", "clip_torch_gradients", "clip_tf_gradients"]

EPSILON = 1e-6  # torch's clip_grad_norm_: max_norm / (total_norm + 1e-6)


def clip_factor(norm: float, max_norm: float) -> float:
    """The factor the gradients are multiplied by: 1 at or under ``max_norm``, ``max_norm / (norm + 1e-6)`` over."""
    return min(1.0, max_norm / (norm + EPSILON))


def clip_torch_gradients(parameters: Iterable[torch.nn.Parameter], max_norm: float,
                         groups: Sequence[Any] = ()) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so that the trial's global norm is at most ``max_norm``;
    returns that norm (before clipping). ``groups``: the process groups whose ranks hold other parameters of the
    same model (a pipeline's stages), over which the squared norms are summed."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in parameters if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    squares = (torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads
               else torch.zeros((), device=device))
    for group in groups:  # every rank joins, with gradients or without
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
    norm = squares.sqrt()
    factor = torch.clamp(max_norm / (norm + EPSILON), max=1.0)
    for grad in grads:
        grad.mul_(factor.to(grad.dtype))
    return norm


def clip_tf_gradients(grads: Sequence[tf.Tensor | None], max_norm: float, *, replicas: int = 1,
                      loss_scale: tf.Tensor | float = 1.0) -> list[tf.Tensor | None]:
    """A replica's gradients (its share of the trial's, as the TensorFlow step computes them) scaled by the factor
    of the trial's global norm, in TensorFlow ops (it traces into the step). ``replicas``: the replicas whose shares
    ``apply_gradients`` sums (more than one: summed here first to take the norm, inside ``strategy.run``);
    ``loss_scale``: fp16's current loss scale, which the gradients still carry."""
    import tensorflow as tf

    present = [g for g in grads if g is not None]
    if not present:
        return list(grads)
    whole = present
    if replicas > 1:
        whole = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, present)
    squares = tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in whole])
    norm = tf.sqrt(squares) / tf.cast(loss_scale, tf.float32)
    factor = tf.minimum(1.0, max_norm / (norm + EPSILON))
    return [None if g is None else g * tf.cast(factor, g.dtype) for g in grads]
