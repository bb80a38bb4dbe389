"""The optimizers a trial may train with (``training.optimizer.name``), each built the same way in both frameworks.

One :class:`OptimizerEntry` per name: it builds the torch optimizer of the torch trainer
(:class:`~distmis.train.torch_trainer.TorchTrainer`) and the Keras optimizer of the TensorFlow trainer
(:class:`~distmis.train.tf_unet.UNetTrainer`), and says what the TensorFlow step adds to the gradients itself. The
spec side (the names, the fields each takes, the default weight decay) is :class:`~distmis.spec.schema.OptimizerSpec`
and its tables, which import no trainer code; a test keeps the names here and there equal. torch and Keras are
imported inside the builders only. Adding an optimizer is one entry here, its name and fields in the schema, and its
test.

The update rules, the same in both frameworks:

- ``adam``: Adam; ``weight_decay`` is L2 added to the gradient (``g + wd * w``) before the moments see it (torch's
  ``Adam(weight_decay=)``). The frameworks place ``epsilon`` differently (as distmis always had them): torch divides
  by ``sqrt(v_hat) + eps``, Keras by ``sqrt(v) + eps`` before the bias correction (Kingma and Ba's "epsilon hat"),
  so Keras's epsilon acts as ``eps / sqrt(1 - beta2^t)`` in torch's formula: larger in the first steps, which
  shows only where gradients are that small.
- ``adamw``: Adam with decoupled weight decay, ``w -= lr * wd * w`` at each step beside Adam's update of the plain
  gradient (torch's ``AdamW``; Keras's ``AdamW`` does the same, before the update).
- ``sgd``: SGD with momentum ``mu``, dampening 0, Nesterov's momentum by default (nnU-Net v2's); ``weight_decay`` is
  L2 added to the gradient, so it goes through the momentum (torch's ``SGD(weight_decay=)``). torch keeps the
  buffer ``b = mu b + g`` and steps ``w -= lr (g + mu b)`` (Nesterov) or ``w -= lr b``; Keras keeps ``m = mu m -
  lr g`` and steps ``w += mu m - lr g`` (or ``w += m``). At a constant learning rate ``m = -lr b`` and the two
  are the same; at a step where the learning rate changes, Keras's ``m`` carries the old rate in its past
  gradients and torch's ``b`` does not, so the two differ slightly there (a schedule stepped every epoch: at each
  epoch's first step).

Keras's own ``weight_decay`` is decoupled for every optimizer, so coupled L2 (``adam``, ``sgd``) is not given to
Keras: :meth:`OptimizerEntry.gradient_l2` is the factor the TensorFlow step adds times each weight to its gradient
before ``apply_gradients`` (:func:`with_l2`, which also takes care of the replicas and of fp16's loss scale).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

from distmis.spec.schema import OptimizerSpec

if TYPE_CHECKING:
    import keras
    import tensorflow as tf
    import torch

__all__ = ["OptimizerEntry", "OPTIMIZERS", "optimizer_entry", "torch_optimizer", "keras_optimizer", "with_l2"]

#: How an optimizer's ``weight_decay`` acts: added to the gradient (L2), or on the weights apart from the update.
Decay = Literal["coupled", "decoupled"]


@dataclass(frozen=True)
class OptimizerEntry:
    """One optimizer: ``torch(params, spec, lr)`` builds torch's, ``keras(spec, lr)`` Keras's, both at the trial's
    learning rate ``lr`` (the layout's ``effective_lr``; a schedule moves it later); ``decay`` says how its weight
    decay acts (``coupled``: L2 on the gradient, which the TensorFlow step adds itself)."""

    name: str
    decay: Decay
    torch: Callable[[Iterable[torch.nn.Parameter], OptimizerSpec, float], torch.optim.Optimizer]
    keras: Callable[[OptimizerSpec, float], keras.optimizers.Optimizer]
    summary: str

    def gradient_l2(self, spec: OptimizerSpec) -> float:
        """The factor ``c`` of the L2 term ``c * w`` the TensorFlow step adds to each weight's gradient: the weight
        decay of a coupled optimizer, 0 for a decoupled one (Keras applies its decay itself)."""
        return spec.effective_weight_decay if self.decay == "coupled" else 0.0


# --------------------------------------------------------------------------- torch
def _torch_adam(params: Iterable[torch.nn.Parameter], spec: OptimizerSpec, lr: float) -> torch.optim.Optimizer:
    import torch

    return torch.optim.Adam(params, lr=lr, betas=(spec.beta1, spec.beta2), eps=spec.epsilon, amsgrad=spec.amsgrad,
                            weight_decay=spec.effective_weight_decay)


def _torch_adamw(params: Iterable[torch.nn.Parameter], spec: OptimizerSpec, lr: float) -> torch.optim.Optimizer:
    import torch

    return torch.optim.AdamW(params, lr=lr, betas=(spec.beta1, spec.beta2), eps=spec.epsilon, amsgrad=spec.amsgrad,
                             weight_decay=spec.effective_weight_decay)


def _torch_sgd(params: Iterable[torch.nn.Parameter], spec: OptimizerSpec, lr: float) -> torch.optim.Optimizer:
    import torch

    return torch.optim.SGD(params, lr=lr, momentum=spec.momentum, dampening=0.0, nesterov=spec.effective_nesterov,
                           weight_decay=spec.effective_weight_decay)


# --------------------------------------------------------------------------- Keras
def _keras_adam(spec: OptimizerSpec, lr: float) -> keras.optimizers.Optimizer:
    import keras

    # no weight_decay: Keras's is decoupled; the step adds the L2 term (gradient_l2)
    return keras.optimizers.Adam(learning_rate=lr, beta_1=spec.beta1, beta_2=spec.beta2, epsilon=spec.epsilon,
                                 amsgrad=spec.amsgrad)


def _keras_adamw(spec: OptimizerSpec, lr: float) -> keras.optimizers.Optimizer:
    import keras

    return keras.optimizers.AdamW(learning_rate=lr, weight_decay=spec.effective_weight_decay, beta_1=spec.beta1,
                                  beta_2=spec.beta2, epsilon=spec.epsilon, amsgrad=spec.amsgrad)


def _keras_sgd(spec: OptimizerSpec, lr: float) -> keras.optimizers.Optimizer:
    import keras

    # Keras takes momentum as a float only (not 0 as an int); no weight_decay: the step adds the L2 term
    return keras.optimizers.SGD(learning_rate=lr, momentum=float(spec.momentum), nesterov=spec.effective_nesterov)


OPTIMIZERS: dict[str, OptimizerEntry] = {
    entry.name: entry
    for entry in (
        OptimizerEntry("adam", "coupled", _torch_adam, _keras_adam,
                       summary="Adam; weight_decay: L2 added to the gradient (default 0)"),
        OptimizerEntry("adamw", "decoupled", _torch_adamw, _keras_adamw,
                       summary="Adam with decoupled weight decay, w -= lr * wd * w (default 0.01)"),
        OptimizerEntry("sgd", "coupled", _torch_sgd, _keras_sgd,
                       summary="SGD with (Nesterov) momentum, nnU-Net v2's; weight_decay: L2 through the momentum"),
    )
}


def optimizer_entry(name: str) -> OptimizerEntry:
    """The entry of ``name``; ValueError naming the registered optimizers."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"no optimizer {name!r}; registered: {', '.join(OPTIMIZERS)}") from None


def torch_optimizer(params: Iterable[torch.nn.Parameter], spec: OptimizerSpec, lr: float) -> torch.optim.Optimizer:
    """The torch optimizer ``spec`` names over ``params`` at learning rate ``lr``."""
    return optimizer_entry(spec.name).torch(params, spec, lr)


def keras_optimizer(spec: OptimizerSpec, lr: float) -> keras.optimizers.Optimizer:
    """The Keras optimizer ``spec`` names at learning rate ``lr`` (without its coupled L2: :func:`with_l2`)."""
    return optimizer_entry(spec.name).keras(spec, lr)


def with_l2(grads: Sequence[tf.Tensor | None], variables: Sequence[keras.Variable], l2: float, *,
            optimizer: keras.optimizers.Optimizer, replicas: int = 1) -> list[tf.Tensor | None]:
    """Keras's gradients with the coupled L2 term of ``adam`` and ``sgd`` added, ``g + c * w`` for each weight ``w``
    (a None gradient stays None), in TensorFlow ops so that it traces into the training step's graph; what the
    TensorFlow step calls between the tape's gradients and ``apply_gradients``.

    ``l2``: :meth:`OptimizerEntry.gradient_l2` (``wd``). Each of ``replicas`` replicas adds ``wd / replicas``, as its
    loss is divided by them: ``apply_gradients`` sums the replicas' gradients. Under fp16's ``LossScaleOptimizer``
    (``optimizer``) the gradients are still scaled here, so the term is multiplied by the loss scale, which
    ``apply_gradients`` divides out with the rest (the scale is a power of 2: exactly); a step it skips for an
    overflow skips the term too."""
    import keras
    import tensorflow as tf

    factor: float | tf.Tensor = l2 / replicas
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        factor = optimizer.scale_loss(factor)
    out: list[tf.Tensor | None] = []
    for grad, variable in zip(grads, variables):
        if grad is None:
            out.append(None)
            continue
        weight = tf.cast(tf.convert_to_tensor(variable), grad.dtype)
        # a Python float straight in the gradient's dtype (tf.cast would round it to float32 first)
        coefficient = tf.cast(factor, grad.dtype) if tf.is_tensor(factor) else tf.constant(factor, grad.dtype)
        out.append(grad + coefficient * weight)
    return out
