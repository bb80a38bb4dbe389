"""The TensorFlow U-Net's training step, from its graph: its bytes and FLOPs (:func:`trace_keras_step`).

The Keras network is built by its registry entry's TensorFlow builder, and the TensorFlow trainer's step
(:mod:`distmis.train.tf_unet`: the loss under a ``GradientTape``, its gradients, Adam's update) is traced by
``tf.function`` for a batch of the given shape, without running it. The traced graph holds every tensor the step
makes, with its shape and dtype; the step's memory is counted by running through the graph's operations in the
order they were made (the forward, the backward in reverse, the optimizer), each operation's outputs made when it
runs and freed after the last operation that reads them:

- the variables (weights, Adam's moments) and the batch exist before and are not counted; reading a variable
  makes nothing, and operations that give their input a new shape (``Identity``, ``Reshape``, ``Squeeze``, ...)
  share its buffer;
- FLOPs are those of the convolutions and matrix products, counted from their shapes as torch's
  ``FlopCounterMode`` counts them (two per multiply-add; a convolution's two backward products each as many as
  its forward).

TensorFlow's executor may run independent operations in another order than the one they were made in, and its
graph optimizer (Grappler) fuses and rewrites some; the count is of the graph as traced.
"""

from __future__ import annotations

import os
from math import prod
from typing import Any, Callable, Literal

from distmis.estimate.record import StepTrace
from distmis.models.params import NetworkParams
from distmis.models.registry import ModelEntry, NetworkInput

__all__ = ["ALIASING_OPS", "trace_keras_step", "graph_memory", "operation_flops"]

#: Operations whose output is their first input's buffer, seen anew (or nothing at all).
ALIASING_OPS = frozenset({"Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient", "Snapshot",
                          "ReadVariableOp", "EnsureShape", "PreventGradient"})


def _nbytes(tensor: Any) -> int:
    """A tensor's bytes from its static shape and dtype (0 for handles and unknown shapes)."""
    import tensorflow as tf

    if tensor.dtype in (tf.resource, tf.variant, tf.string) or not tensor.shape.is_fully_defined():
        return 0
    return int(prod(tensor.shape.as_list())) * tensor.dtype.size


def _variable_bytes(variable: Any) -> int:
    import numpy as np

    return int(prod(variable.shape)) * np.dtype(variable.dtype).itemsize


def operation_flops(op: Any) -> float:
    """FLOPs of one graph operation: convolutions (and their backward products) and matrix products, else 0."""
    kind = op.type
    if kind == "Conv3D":
        return 2.0 * prod(op.outputs[0].shape.as_list()[:-1]) * prod(op.inputs[1].shape.as_list())
    if kind == "Conv3DBackpropInputV2":
        return 2.0 * prod(op.inputs[2].shape.as_list()[:-1]) * prod(op.inputs[1].shape.as_list())
    if kind == "Conv3DBackpropFilterV2":
        return 2.0 * prod(op.inputs[2].shape.as_list()[:-1]) * prod(op.outputs[0].shape.as_list())
    if kind in ("MatMul", "BatchMatMulV2"):
        a, out = op.inputs[0].shape.as_list(), op.outputs[0].shape.as_list()
        transposed = op.get_attr("transpose_a") if kind == "MatMul" else op.get_attr("adj_x")
        return 2.0 * prod(out) * (a[-2] if transposed else a[-1])
    return 0.0


def graph_memory(operations: list[Any], held: set[str], mark: int | None = None) -> tuple[int, int, str, int]:
    """``(peak, bytes at mark, the operation at the peak, bytes left)`` of running ``operations`` in their order
    (see the module's docstring); ``held``: names of tensors that exist before (the batch); ``mark``: the index of an
    operation after which to read the bytes held (the forward's last)."""
    base: dict[str, str] = {}  # tensor -> the tensor whose buffer it is
    size: dict[str, int] = {}
    last: dict[str, int] = {}
    for index, op in enumerate(operations):
        for tensor in op.inputs:
            owner = base.get(tensor.name, tensor.name)
            last[owner] = index
        for tensor in op.outputs:
            if op.type in ALIASING_OPS and op.inputs:
                base[tensor.name] = base.get(op.inputs[0].name, op.inputs[0].name)
            elif op.type in ("Placeholder", "VarHandleOp") or tensor.name in held:
                base[tensor.name] = tensor.name
                size[tensor.name] = 0
            else:
                size[tensor.name] = _nbytes(tensor)
    live, peak, at, marked = 0, 0, "", 0
    for index, op in enumerate(operations):
        for tensor in op.outputs:
            if base.get(tensor.name, tensor.name) == tensor.name:
                live += size.get(tensor.name, 0)
        if live > peak:
            peak, at = live, f"{op.type} ({op.name})"
        for tensor in op.outputs:  # made and never read: freed at once
            if base.get(tensor.name, tensor.name) == tensor.name and tensor.name not in last:
                live -= size.get(tensor.name, 0)
        for tensor in op.inputs:
            owner = base.get(tensor.name, tensor.name)
            if last.get(owner) == index:
                live -= size.pop(owner, 0)
                last.pop(owner)
        if index == mark:
            marked = live
    return peak, marked, at, live


def trace_keras_step(entry: ModelEntry, params: NetworkParams, network: NetworkInput,
                     loss_fn: Callable[[Any, Any], Any], *, batch: int,
                     precision: Literal["fp32", "bf16", "fp16"] = "fp32", model: Any = None) -> StepTrace:
    """Trace one training step of ``entry``'s Keras network (``params``, built for ``network`` in ``precision``;
    or ``model``, a network already built, whose step is traced but not run, with an optimizer of its own) on
    ``batch`` inputs of ``network.tile``, trained on ``loss_fn`` (``(target, output) -> loss``, Keras's order:
    :func:`distmis.train.losses.make_loss`; see the module's docstring)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    from distmis.networks import build_network

    if "tensorflow" not in entry.frameworks:
        raise ValueError(f"model {entry.name!r} has no TensorFlow network to trace (frameworks: "
                         f"{list(entry.frameworks)})")
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    network = NetworkInput(network.in_channels, network.out_channels, network.tile, network.activation,
                           network.spacing, precision)
    if model is None:
        model = build_network(entry, params, network, "tensorflow")
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    forward_end: list[int] = []

    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            output = model(x, training=True)
            forward_end.append(len(tf.compat.v1.get_default_graph().get_operations()) - 1)
            loss = loss_fn(y, output)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    x_spec = tf.TensorSpec((batch, *network.tile, network.in_channels), tf.float32)
    y_spec = tf.TensorSpec((batch, *network.tile, network.out_channels), tf.float32)
    graph = tf.function(step).get_concrete_function(x_spec, y_spec).graph
    operations = graph.get_operations()
    held = {t.name for t in graph.inputs}
    peak, saved, moment, _ = graph_memory(operations, held, mark=forward_end[-1])
    flops = [operation_flops(op) for op in operations]
    weights = sum(_variable_bytes(v) for v in model.variables)
    trainable = sum(int(prod(v.shape)) for v in model.trainable_variables)
    moments = sum(_variable_bytes(v) for v in optimizer.variables)
    return StepTrace(
        network=entry.name, tile=tuple(network.tile), batch=batch, precision=precision, device="cpu",
        parameters=trainable, parameter_bytes=weights, optimizer_bytes=moments,
        batch_bytes=4 * batch * prod(network.tile) * (network.in_channels + network.out_channels),
        gradient_bytes=4 * trainable, saved_bytes=saved, peak_bytes=peak, workspace_bytes=0, moment=moment,
        stand_in_loss=False, flops=float(sum(flops)), forward_flops=float(sum(flops[:forward_end[-1] + 1])))
