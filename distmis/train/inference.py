"""Whole-volume prediction by sliding windows, for every model and framework in distmis.

A segmentation network takes inputs of one size (the *window*, i.e. the training tile). To predict a larger
volume, windows that overlap by ``overlap`` of their size are cut out of it, predicted, and stitched back;
where windows overlap their predictions are averaged, every voxel weighted by 1 (``mode="constant"``) or by a
Gaussian centred on its window (``mode="gaussian"``, sigma ``sigma_scale`` times the window per axis), so that
a window's borders, where context is missing, count less. The window arithmetic, the weighting and the
padding of a volume smaller than the window are MONAI's :func:`monai.inferers.sliding_window_inference`.

* :func:`sliding_window` works on torch tensors, channels-first ``(B, C, *spatial)`` (the PyTorch U-Net and ViT).
* :func:`predict_channels_last` works on one numpy volume, channels-last ``(H, W, D, C)`` (the TensorFlow
  U-Net, and the ``_predict`` of the torch trainers), with the settings of an :class:`InferenceSpec`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch

    from distmis.spec.schema import InferenceSpec

__all__ = ["predict_channels_last", "sliding_window"]

MODES = ("gaussian", "constant")


def _window(window: int | Sequence[int]) -> tuple[int, int, int]:
    triple = (window,) * 3 if isinstance(window, int) else tuple(window)
    if len(triple) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in triple):
        raise ValueError(f"window must be a positive int or three positive ints, got {window!r}")
    return triple  # type: ignore[return-value]


def sliding_window(
    predictor: Callable[[torch.Tensor], torch.Tensor],
    volume: torch.Tensor,
    window: int | Sequence[int],
    *,
    overlap: float = 0.5,
    mode: str = "gaussian",
    sigma_scale: float = 0.125,
    batch_size: int = 1,
) -> torch.Tensor:
    """Float32 predictions ``(B, K, *spatial)`` of a ``(B, C, *spatial)`` volume from ``window``-sized windows.

    ``predictor`` maps windows ``(n, C, *window)`` to ``(n, K, *window)`` (logits or probabilities; they are
    averaged as given); it runs under ``torch.no_grad()`` on up to ``batch_size`` windows at a time (windows of
    different volumes of the batch may share a call). A volume smaller than the window along an axis is
    zero-padded on both sides (MONAI's centred padding) and the prediction cropped back to its shape. When
    ``window`` equals the volume's shape the result is ``predictor(volume)`` (one window; the weights cancel).

    Windows are visited in a fixed order that depends only on the shapes and the arguments (volume by volume,
    row-major over window positions, last axis fastest), so the ranks of a sequence-parallel group calling
    this with a collective-running predictor run the same windows in the same order.
    """
    import torch  # here, not at the top: a TensorFlow trial that predicts whole volumes never loads it

    if not isinstance(volume, torch.Tensor) or volume.dim() != 5:
        raise ValueError(f"volume must be a 5-D tensor (B, C, *3 spatial), got shape {tuple(np.shape(volume))}")
    window = _window(window)
    if not 0.0 <= overlap < 1.0:
        raise ValueError(f"overlap must lie in [0, 1), got {overlap!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not (math.isfinite(sigma_scale) and sigma_scale > 0):
        raise ValueError(f"sigma_scale must be a positive number, got {sigma_scale!r}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")

    def checked(windows: torch.Tensor) -> torch.Tensor:
        out = predictor(windows)
        if not isinstance(out, torch.Tensor) or out.dim() != 5 or out.shape[0] != windows.shape[0] \
                or tuple(out.shape[2:]) != window:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"predictor must map windows {tuple(windows.shape)} to (n, K, *window) = "
                             f"({windows.shape[0]}, K, {', '.join(map(str, window))}), got {shape}")
        # MONAI weights the output in place: never let that write into the input (a predictor returning a view)
        if out.untyped_storage().data_ptr() == windows.untyped_storage().data_ptr():
            out = out.clone()
        return out

    from monai.inferers import sliding_window_inference  # imported here: importing MONAI takes seconds

    # MONAI accumulates in the input's dtype and returns the input's type (a MetaTensor for a MetaTensor)
    inputs = volume.as_subclass(torch.Tensor).to(torch.float32)
    with torch.no_grad():
        out = sliding_window_inference(inputs, roi_size=window, sw_batch_size=batch_size, predictor=checked,
                                       overlap=overlap, mode=mode, sigma_scale=sigma_scale)
    return out.as_subclass(torch.Tensor).to(torch.float32)


def predict_channels_last(
    predict: Callable[[np.ndarray], np.ndarray],
    image: np.ndarray,
    window: int | Sequence[int] | None,
    *,
    inference: InferenceSpec,
    batch_size: int,
) -> np.ndarray:
    """Float32 probabilities ``(H, W, D, K)`` of ONE channels-last volume ``image`` ``(H, W, D, C)``.

    ``predict`` maps a numpy batch of channels-last windows ``(n, h, w, d, C)`` to ``(n, h, w, d, K)``;
    ``batch_size`` windows go through it at once, and ``inference`` sets overlap, mode and sigma_scale of
    :func:`sliding_window`. ``window=None`` means the whole volume is the network input: one ``predict`` call.
    """
    image = np.asarray(image)
    if image.ndim != 4:
        raise ValueError(f"image must be one channels-last volume (H, W, D, C), got shape {image.shape}")
    if window is None:
        return np.asarray(predict(image[None])[0], dtype=np.float32)
    import torch

    def predictor(windows: torch.Tensor) -> torch.Tensor:
        out = np.asarray(predict(np.ascontiguousarray(windows.cpu().numpy().transpose(0, 2, 3, 4, 1))))
        if out.ndim != 5:
            raise ValueError(f"predict must return (n, h, w, d, K) windows, got shape {out.shape}")
        return torch.from_numpy(np.array(np.moveaxis(out, -1, 1), dtype=np.float32, order="C"))  # a writable copy

    volume = torch.from_numpy(np.ascontiguousarray(np.moveaxis(image, -1, 0)[None], dtype=np.float32))
    prob = sliding_window(predictor, volume, window, overlap=inference.overlap, mode=inference.mode,
                          sigma_scale=inference.sigma_scale, batch_size=batch_size)
    return np.ascontiguousarray(prob[0].numpy().transpose(1, 2, 3, 0))
