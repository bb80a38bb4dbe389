"""What the performance model (:mod:`distmis.perf.model`) predicts for one trial, as MLflow metrics.

The driver's MLflow callback (:mod:`distmis.tracking.mlflow_tracking`) logs :func:`predict_trial`'s numbers on the
run of every trial whose network the performance model describes (a registry entry with a ``perf_shape``: the
ViT-seg) at step 0, next to what the trial measures per epoch (``step_seconds``, ``peak_memory_mb``, ``fom``), so
a search shows model against measurement trial by trial. Everything is per rank and per training step, with the
trial's own layout (``TrialLayout.sp``, ``dp``), SP attention and decoder, batch (``training.batch_size`` samples
per rank and step), attention kernel (``model.params.attention_kernel``) and precision (``training.precision``).
Pure arithmetic: no torch, and
nothing of distmis's training or parallel runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from distmis.perf.model import SequenceLayout, ViTShape, communication_bytes, vit_flops, vit_memory

if TYPE_CHECKING:  # pragma: no cover
    from distmis.spec.layout import TrialLayout
    from distmis.spec.schema import Spec

__all__ = ["MIB", "PREDICTED_METRICS", "trial_shape", "predict_trial"]

MIB = float(2**20)

PREDICTED_METRICS = ("predicted_flops_per_step", "predicted_forward_flops", "predicted_peak_memory_mb",
                     "predicted_step_memory_mb", "predicted_sent_mb")


def trial_shape(spec: Spec, *, volume: Sequence[int] | None = None) -> ViTShape | None:
    """The arithmetic shape of a trial's network: its registry entry's ``perf_shape`` of its ``model.params`` on
    its network input (the tile, or the whole volume: the spec's, else ``volume``); None for a network the
    performance model does not describe (no ``perf_shape``) or when the input is unknown."""
    from distmis.spec.load import network_input

    perf_shape = spec.model.entry.perf_shape
    if perf_shape is None:
        return None
    tile = network_input(spec)
    if tile is None and volume is not None:
        tile = tuple(int(v) for v in volume[:3])  # type: ignore[assignment]
    if tile is None:
        return None
    return perf_shape(spec.model.params, tile, spec.dataset.in_channels, spec.dataset.num_classes)


def predict_trial(spec: Spec, layout: TrialLayout, *, volume: Sequence[int] | None = None) -> dict[str, float]:
    """The performance model's numbers for a trial of ``spec`` (a trial's spec) laid out as ``layout``.

    Per rank and training step of ``training.batch_size`` samples:

    - ``predicted_flops_per_step``: forward and backward matmul and convolution FLOPs (:attr:`FlopCount.matmul`);
    - ``predicted_forward_flops``: the forward's (:attr:`FlopCount.forward`);
    - ``predicted_peak_memory_mb``: the peak, parameters included (:attr:`MemoryEstimate.peak`), MiB;
    - ``predicted_step_memory_mb``: the peak above the parameters (:attr:`MemoryEstimate.step`), MiB: what the
      measured ``peak_memory_mb`` compares with;
    - ``predicted_sent_mb``: bytes sent, gloo's reduce-scatter counted as it measurably sends
      (:func:`communication_bytes` with ``cost="gloo"``), MiB.

    ``{}`` for a network the performance model does not describe (see :func:`trial_shape`), or when the network
    input is unknown (no tile, and a volume that neither the spec nor ``volume`` gives). ValueError when the shapes do not suit the layout (tokens that do
    not divide by the SP degree).
    """
    shape = trial_shape(spec, volume=volume)
    if shape is None:
        return {}
    sp = spec.parallelism.sequence_parallel
    sequence = SequenceLayout(sp=layout.sp, attention=sp.attention, decoder=sp.decoder)
    batch = spec.training.batch_size
    flops = vit_flops(shape, sequence, batch)
    kernel = spec.model.params.attention_kernel  # type: ignore[union-attr]
    precision = spec.training.precision  # mixed precision: 16-bit activations and weight copies (the seed's terms)
    memory = vit_memory(shape, sequence, batch=batch, kernel=kernel, precision=precision)
    sent = communication_bytes(shape, sequence, batch=batch, dp=layout.dp, cost="gloo", precision=precision)
    return {
        "predicted_flops_per_step": flops.matmul,
        "predicted_forward_flops": flops.forward,
        "predicted_peak_memory_mb": memory.peak / MIB,
        "predicted_step_memory_mb": memory.step / MIB,
        "predicted_sent_mb": sent.total / MIB,
    }
