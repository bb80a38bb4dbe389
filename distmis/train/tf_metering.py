"""What an epoch's training steps of the TensorFlow U-Net hold at their peak, from TensorFlow's own allocator
(:class:`AllocatorMeter`): the Keras twin of :class:`~distmis.train.metering.StepMeter`'s memory.

TensorFlow's allocator keeps the memory a step freed for the next, so the resident set does not show a step's peak;
the allocator counts what is in use, and ``tf.config.experimental.get_memory_info`` gives its current and peak
bytes on a CPU as on a GPU. An epoch's ``peak_memory_mb`` is the allocator's peak over its training steps less
what was in use before the first (the weights, Adam's moments once made, the batches its input pipeline holds),
plus Adam's moments where they were already there, so that every epoch counts them as the first does. The input
pipeline's batches in flight are in the peak too. Where the device keeps no statistics, nothing is reported.

On a CPU the statistics leave out blocks under 256 KiB, which the oneDNN build of TensorFlow serves from an
allocator of its own (measured: a 255 KiB tensor adds nothing to ``current``, a 256 KiB one its size), so a network
whose feature maps are that small (a test's 16^3 volumes of 4 filters) shows a fraction of its step: compare the
prediction with steps of larger maps, or on a GPU, whose allocator counts every block.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AllocatorMeter", "allocator_device"]


def allocator_device() -> str:
    """The device whose allocator a single-replica worker's steps use: its first GPU, else its CPU."""
    import tensorflow as tf

    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


class AllocatorMeter:
    """One epoch's training steps on ``device`` (``"CPU:0"``, ``"GPU:0"``): :meth:`start` before them,
    :meth:`stop` after."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._before: float | None = None
        self._held = 0.0

    def start(self, held: float = 0.0) -> None:
        """Reset the peak; ``held``: bytes of training state already in use that the step would make (Adam's
        moments after the first epoch)."""
        import tensorflow as tf

        try:
            self._before = float(tf.config.experimental.get_memory_info(self.device)["current"])
            tf.config.experimental.reset_memory_stats(self.device)
        except (ValueError, RuntimeError, KeyError):  # a device without allocator statistics
            self._before = None
        self._held = held

    def stop(self) -> float | None:
        """Bytes the steps held at their peak above what was in use before them, ``held`` counted; None where
        the device keeps no statistics."""
        import tensorflow as tf

        if self._before is None:
            return None
        info: Any = tf.config.experimental.get_memory_info(self.device)
        return max(0.0, float(info["peak"]) - self._before) + self._held
