"""The TensorFlow allocator's meter on the CPU: the peak of what was made between start and stop, plus what the
caller says is held."""

from __future__ import annotations

from distmis.train.tf_metering import AllocatorMeter, allocator_device

MIB = 2**20


def test_the_peak_is_what_was_made_after_start_plus_what_is_held():
    import tensorflow as tf

    device = allocator_device()
    kept = tf.ones((MIB,), tf.float32)  # 4 MiB in use before the meter starts: not the steps'
    meter = AllocatorMeter(device)
    meter.start()
    with tf.device(device):
        made = tf.ones((2 * MIB,), tf.float32) + 1.0  # 8 MiB for the sum, its operand freed or not
        total = float(tf.reduce_sum(made))
    del made
    measured = meter.stop()
    assert total == 2 * 2 * MIB
    assert measured is not None and 8 * MIB <= measured <= 16 * MIB + MIB  # the sum, and its operand at most
    meter.start(held=3 * MIB)  # a second epoch: the peak reset, the held bytes counted as the first made them
    with tf.device(device):
        small = tf.ones((MIB // 2,), tf.float32) * 2.0
        float(tf.reduce_sum(small))
    del small
    again = meter.stop()
    # The allocator is the process's: another test's TensorFlow thread (a data pipeline still prefetching) may make
    # a little beside these steps. Not reset, the peak would be the first epoch's, at least 8 MiB above the start.
    assert again is not None and 3 * MIB + 2 * MIB <= again < 3 * MIB + 8 * MIB
    assert float(tf.reduce_sum(kept)) == MIB


def test_a_device_without_statistics_reports_nothing():
    meter = AllocatorMeter("CPU:7")  # no such device: no statistics to read
    meter.start(held=MIB)
    assert meter.stop() is None
