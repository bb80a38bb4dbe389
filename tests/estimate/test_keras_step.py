"""The TensorFlow U-Net's training step, counted from its traced graph, against TensorFlow's own allocator."""

import numpy as np
import pytest

from distmis.estimate.keras_step import graph_memory, trace_keras_step
from distmis.models.registry import NetworkInput, model_entry

tf = pytest.importorskip("tensorflow")


def test_a_graphs_tensors_live_from_their_operation_to_their_last_reader():
    @tf.function
    def f(x):
        a = x * 2.0  # 4 KiB
        b = a + 1.0  # 4 KiB, a freed after
        c = tf.reshape(b, (32, 32))  # b's buffer, seen anew
        d = tf.reduce_sum(c * c)  # 4 KiB for the square, freed after the sum
        return d + tf.reduce_sum(a[:1])

    graph = f.get_concrete_function(tf.TensorSpec((1024,), tf.float32)).graph
    operations = graph.get_operations()
    mark = next(i for i, op in enumerate(operations) if op.type == "Reshape")
    peak, marked, moment, _ = graph_memory(operations, {t.name for t in graph.inputs}, mark=mark)
    # a lives until its slice is read (after the square's sum): a, b and the square at once
    assert peak == 3 * 4096 and moment.startswith("Mul")
    assert marked == 2 * 4096  # a and b at the reshape


@pytest.mark.slow  # traces and runs a Keras U-Net step (about 10 s)
def test_the_traced_step_is_tensorflows_own_count():
    """Feature maps of 512 KiB and more: a CPU's allocator statistics leave out blocks under 256 KiB."""
    import keras

    from distmis.networks import build_network
    from distmis.train.losses import make_loss

    entry = model_entry("unet3d")
    params = entry.params(base_filters=8, levels=2)
    network = NetworkInput(2, 2, (32, 32, 32))
    loss_fn = make_loss("dice")
    trace = trace_keras_step(entry, params, network, loss_fn, batch=2)
    keras.utils.set_random_seed(0)
    model = build_network(entry, params, network, "tensorflow")
    optimizer = keras.optimizers.Adam()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    x, y = tf.ones((2, 32, 32, 32, 2)), tf.ones((2, 32, 32, 32, 2))
    step(x, y)
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    step(x, y)
    measured = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    assert trace.peak_bytes == pytest.approx(measured, rel=0.15)
    assert trace.parameters == model.count_params() - sum(int(np.prod(v.shape)) for v in model.non_trainable_variables)
    assert trace.optimizer_bytes >= 2 * 4 * trace.parameters and trace.flops > 2 * trace.forward_flops > 0
    # the torch U-Net is the same network: the same forward arithmetic, counted by torch
    from distmis.estimate.step_trace import trace_step
    from distmis.train.torch_losses import make_loss as torch_loss

    assert trace_step(entry, params, network, torch_loss("dice"), batch=2).forward_flops == trace.forward_flops


def test_the_keras_estimate_and_trainer_import_no_torch():
    """A TensorFlow trial predicts its step without torch (its record is framework-free)."""
    import subprocess
    import sys

    code = "import sys, distmis.estimate.keras_step, distmis.train.tf_unet; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
