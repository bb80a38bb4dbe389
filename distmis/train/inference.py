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

Both are implemented once, in the code of the model a search registers (:mod:`distmis.pyfunc_model`, which does
not import distmis), so that the registered model predicts a volume exactly as validation did.
"""

from __future__ import annotations

from distmis.pyfunc_model import MODES, predict_channels_last, sliding_window

__all__ = ["predict_channels_last", "sliding_window", "MODES"]
