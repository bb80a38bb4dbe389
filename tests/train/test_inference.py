"""Sliding-window inference: distmis's wrappers against MONAI's ``sliding_window_inference`` called directly."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from monai.inferers import sliding_window_inference as monai_swi

from distmis.spec.schema import InferenceSpec
from distmis.train.inference import predict_channels_last, sliding_window


def window_dependent(w: torch.Tensor) -> torch.Tensor:
    """Channels-first, not translation-invariant: two channels scaled by each window's own mean."""
    mean = w.mean(dim=(1, 2, 3, 4), keepdim=True)
    return torch.cat([w[:, :1] * mean, w.sum(1, keepdim=True) - mean], dim=1)


def reference(volume: torch.Tensor, window, predictor=window_dependent, **kwargs) -> torch.Tensor:
    kwargs = {"overlap": 0.5, "mode": "gaussian", "sigma_scale": 0.125, "batch_size": 1} | kwargs
    return monai_swi(volume, roi_size=window, sw_batch_size=kwargs.pop("batch_size"), predictor=predictor,
                     **kwargs).as_subclass(torch.Tensor)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual), torch.as_tensor(expected), atol=atol, rtol=1e-5)


@pytest.mark.parametrize("mode", ["constant", "gaussian"])
@pytest.mark.parametrize("overlap", [0.0, 0.25, 0.5])
def test_matches_monai(mode, overlap):
    volume = torch.rand(1, 2, 16, 12, 20, generator=torch.Generator().manual_seed(0))
    out = sliding_window(window_dependent, volume, 8, overlap=overlap, mode=mode, batch_size=3)
    assert type(out) is torch.Tensor and out.dtype == torch.float32
    assert out.shape == (1, 2, 16, 12, 20)
    close(out, reference(volume, (8, 8, 8), overlap=overlap, mode=mode, batch_size=3))
    # the windows' predictions differ, so the result is not the predictor on the whole volume
    assert not torch.allclose(out, window_dependent(volume), atol=1e-3)


@pytest.mark.parametrize("shape", [(5, 12, 12), (5, 6, 7)])
def test_volume_smaller_than_window_is_padded_and_cropped_back(shape):
    volume = torch.rand(1, 2, *shape, generator=torch.Generator().manual_seed(1)) + 0.5
    out = sliding_window(window_dependent, volume, 8, overlap=0.25, mode="gaussian")
    assert out.shape == (1, 2, *shape)
    close(out, reference(volume, (8, 8, 8), overlap=0.25))


def test_anisotropic_window_and_a_batch_of_volumes():
    volume = torch.rand(2, 3, 20, 24, 28, generator=torch.Generator().manual_seed(2))
    out = sliding_window(window_dependent, volume, (8, 12, 16), overlap=0.5, mode="gaussian", batch_size=4)
    assert out.shape == (2, 2, 20, 24, 28)
    close(out, reference(volume, (8, 12, 16), batch_size=4))
    # each volume of the batch is predicted on its own
    close(out[1:], sliding_window(window_dependent, volume[1:], (8, 12, 16), overlap=0.5, batch_size=4))


def test_window_equal_to_volume_is_one_prediction():
    volume = torch.rand(2, 2, 6, 8, 10, generator=torch.Generator().manual_seed(3))
    for mode in ("gaussian", "constant"):
        out = sliding_window(window_dependent, volume, (6, 8, 10), mode=mode, batch_size=2)
        close(out, window_dependent(volume), atol=1e-6)


def test_windows_run_in_the_same_order_every_call():
    volume = torch.rand(2, 1, 12, 10, 14, generator=torch.Generator().manual_seed(4))
    calls: list[list[torch.Tensor]] = [[], []]
    for seen in calls:
        def predictor(w, seen=seen):
            seen.append(w.clone())
            return w * 2

        sliding_window(predictor, volume, (6, 6, 8), overlap=0.5, batch_size=3)
    assert len(calls[0]) > 2 and len(calls[0]) == len(calls[1])
    assert all(torch.equal(a, b) for a, b in zip(*calls))
    assert {w.shape[0] for w in calls[0][:-1]} == {3}  # batch_size windows per call


def test_a_predictor_returning_its_input_leaves_the_volume_alone():
    # MONAI multiplies the predictor's output by the weights in place: with a view this corrupted the input
    volume = torch.rand(1, 1, 8, 8, 8, generator=torch.Generator().manual_seed(5))
    before = volume.clone()
    out = sliding_window(lambda w: w, volume, 4, overlap=0.5, mode="gaussian")
    assert torch.equal(volume, before)
    close(out, before)


def test_real_conv3d_model():
    torch.manual_seed(0)
    model = torch.nn.Conv3d(2, 3, kernel_size=3, padding=1).eval()
    volume = torch.rand(1, 2, 12, 14, 10)
    out = sliding_window(model, volume, 8, overlap=0.5, mode="gaussian", batch_size=2)
    assert not out.requires_grad and out.shape == (1, 3, 12, 14, 10)
    with torch.no_grad():
        expected = reference(volume, (8, 8, 8), predictor=model, batch_size=2)
        close(out, expected)
        # zero padding at window borders makes the stitched result differ from one whole-volume pass
        assert not torch.allclose(out, model(volume), atol=1e-4)


def test_double_input_gives_float32():
    volume = torch.rand(1, 1, 6, 6, 6, dtype=torch.float64)
    out = sliding_window(lambda w: w * 3, volume, 4, overlap=0.5)
    assert out.dtype == torch.float32
    close(out, 3 * volume.float())


# ---------------------------------------------------------------- channels-last numpy side
WEIGHTS = np.random.default_rng(0).normal(size=(3, 2)).astype(np.float32)  # a fixed 1x1x1 conv, C_in=3 -> K=2


def predict_last(w: np.ndarray) -> np.ndarray:
    """Channels-last windows (n, h, w, d, 3) -> (n, h, w, d, 2): 1x1x1 conv, per-window scale, position ramps."""
    out = np.einsum("nhwdc,ck->nhwdk", w, WEIGHTS) * (1.0 + w.mean(axis=(1, 2, 3, 4)))[:, None, None, None, None]
    h, wd, d = w.shape[1:4]
    ramp = np.arange(h)[:, None, None] + 10 * np.arange(wd)[None, :, None] + 100 * np.arange(d)[None, None, :]
    return (out + 1e-3 * ramp[None, ..., None]).astype(np.float32)


def predict_first(w: torch.Tensor) -> torch.Tensor:
    """The same function written channels-first, independently of ``predict_last``."""
    out = torch.einsum("nchwd,ck->nkhwd", w, torch.from_numpy(WEIGHTS))
    out = out * (1.0 + w.mean(dim=(1, 2, 3, 4)))[:, None, None, None, None]
    h, wd, d = w.shape[2:]
    ramp = (torch.arange(h)[:, None, None] + 10 * torch.arange(wd)[None, :, None]
            + 100 * torch.arange(d)[None, None, :])
    return out + 1e-3 * ramp.float()


@pytest.mark.parametrize("mode", ["constant", "gaussian"])
def test_predict_channels_last_matches_monai_channels_first(mode):
    image = np.random.default_rng(1).random((10, 12, 14, 3), dtype=np.float32)
    spec = InferenceSpec(overlap=0.25, mode=mode, sigma_scale=0.2)
    sizes: list[int] = []

    def predict(w):
        sizes.append(w.shape[0])
        return predict_last(w)

    out = predict_channels_last(predict, image, (6, 8, 10), inference=spec, batch_size=2)
    assert out.dtype == np.float32 and out.shape == (10, 12, 14, 2)
    expected = reference(torch.from_numpy(image).permute(3, 0, 1, 2)[None], (6, 8, 10), predict_first,
                         overlap=0.25, mode=mode, sigma_scale=0.2, batch_size=2)
    close(out, expected[0].permute(1, 2, 3, 0))
    assert max(sizes) == 2


def test_predict_channels_last_whole_volume():
    image = np.random.default_rng(2).random((6, 8, 10, 3), dtype=np.float32)
    shapes: list[tuple[int, ...]] = []

    def predict(w):
        shapes.append(w.shape)
        return predict_last(w)

    whole = predict_channels_last(predict, image, None, inference=InferenceSpec(), batch_size=4)
    assert shapes == [(1, 6, 8, 10, 3)]
    np.testing.assert_allclose(whole, predict_last(image[None])[0], atol=1e-6)
    one_window = predict_channels_last(predict, image, (6, 8, 10), inference=InferenceSpec(), batch_size=4)
    np.testing.assert_allclose(one_window, whole, atol=1e-6)


# ---------------------------------------------------------------- bad arguments
@pytest.mark.parametrize(("kwargs", "match"), [
    ({"volume": torch.zeros(1, 8, 8, 8)}, "volume"),
    ({"window": (4, 4)}, "window"),
    ({"window": 0}, "window"),
    ({"window": (4, 4, -1)}, "window"),
    ({"overlap": 1.0}, "overlap"),
    ({"overlap": -0.1}, "overlap"),
    ({"mode": "linear"}, "mode"),
    ({"sigma_scale": 0.0}, "sigma_scale"),
    ({"batch_size": 0}, "batch_size"),
    ({"predictor": lambda w: w[:, :, :-1]}, "predictor"),
    ({"predictor": lambda w: torch.cat([w, w])}, "predictor"),
    ({"predictor": lambda w: w.numpy()}, "predictor"),
])
def test_bad_arguments(kwargs, match):
    args = {"predictor": lambda w: w, "volume": torch.zeros(2, 1, 8, 8, 8), "window": 4} | kwargs
    with pytest.raises(ValueError, match=match):
        sliding_window(args.pop("predictor"), args.pop("volume"), args.pop("window"), **args)


def test_bad_channels_last_image():
    with pytest.raises(ValueError, match="image"):
        predict_channels_last(predict_last, np.zeros((8, 8, 8)), 4, inference=InferenceSpec(), batch_size=1)


# ---------------------------------------------------------------- test-time mirroring
def subsets(axes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every subset of ``axes``, the empty one included: 2 ** len(axes) of them."""
    return [s for k in range(len(axes) + 1) for s in itertools.combinations(axes, k)]


def mirrored_by_hand(axes: tuple[int, ...], first: int):
    """A channels-first predictor computing, with numpy flips, the mean over every subset S of ``axes`` of
    ``flip(predict(flip(w, S)), S)``: ``predict_first`` on torch windows (``first`` 2: axis a is dimension a + 2),
    ``predict_last`` on numpy channels-last windows (``first`` 1)."""
    def predict(w):
        array = w.numpy() if isinstance(w, torch.Tensor) else w
        outs = []
        for subset in subsets(axes):
            dims = tuple(a + first for a in subset)
            flipped = np.ascontiguousarray(np.flip(array, dims))
            out = predict_first(torch.from_numpy(flipped)).numpy() if first == 2 else predict_last(flipped)
            outs.append(np.flip(out, dims))
        mean = np.mean(outs, axis=0).astype(np.float32)
        return torch.from_numpy(mean) if isinstance(w, torch.Tensor) else mean
    return predict


@pytest.mark.parametrize("axes", [(0,), (0, 2), (0, 1, 2)])
def test_mirroring_is_the_mean_of_every_flipped_windows_prediction(axes):
    """Each window's prediction is the mean of its 2^k flipped predictions, flipped back, before the windows are
    blended: MONAI's sliding windows of the hand-made mean predictor, over a volume of many windows."""
    volume = torch.rand(1, 3, 16, 12, 20, generator=torch.Generator().manual_seed(5))
    seen: list[int] = []

    def counted(w: torch.Tensor) -> torch.Tensor:
        seen.append(w.shape[0])
        return predict_first(w)

    out = sliding_window(counted, volume, 8, overlap=0.5, mode="gaussian", batch_size=3, mirror=list(axes))
    windows = sum(seen) // 2 ** len(axes)
    assert windows > 1 and sum(seen) == windows * 2 ** len(axes)  # every window predicted 2^k times
    close(out, reference(volume, (8, 8, 8), mirrored_by_hand(axes, 2), batch_size=3))
    plain = sliding_window(predict_first, volume, 8, overlap=0.5, mode="gaussian", batch_size=3)
    assert not torch.allclose(out, plain, atol=1e-3)  # the predictor is not symmetric: mirroring changes it


def test_mirror_axes_are_the_volumes_spatial_axes():
    """Axis 0 is H (tensor dimension 2 channels-first, 1 channels-last): a predictor that flipping H leaves alone
    (a ramp along W only) is unchanged by mirroring on 0, and changed by mirroring on 1."""
    def w_ramp(w: torch.Tensor) -> torch.Tensor:
        return w[:, :1] + torch.arange(w.shape[3], dtype=torch.float32)[None, None, None, :, None]

    volume = torch.rand(1, 2, 12, 10, 8, generator=torch.Generator().manual_seed(6))
    plain = sliding_window(w_ramp, volume, (8, 6, 8), overlap=0.5)
    close(sliding_window(w_ramp, volume, (8, 6, 8), overlap=0.5, mirror=[0]), plain)
    close(sliding_window(w_ramp, volume, (8, 6, 8), overlap=0.5, mirror=[2]), plain)
    assert not torch.allclose(sliding_window(w_ramp, volume, (8, 6, 8), overlap=0.5, mirror=[1]), plain, atol=1e-3)

    image = np.ascontiguousarray(volume[0].permute(1, 2, 3, 0).numpy())  # the same volume channels-last

    def w_ramp_last(w: np.ndarray) -> np.ndarray:
        return (w[..., :1] + np.arange(w.shape[2], dtype=np.float32)[None, None, :, None, None]).astype(np.float32)

    spec = InferenceSpec()
    for window in ((8, 6, 8), None):
        flat = predict_channels_last(w_ramp_last, image, window, inference=spec, batch_size=2)
        close(predict_channels_last(w_ramp_last, image, window, inference=spec, batch_size=2, mirror=[0, 2]), flat)
        assert not np.allclose(predict_channels_last(w_ramp_last, image, window, inference=spec, batch_size=2,
                                                     mirror=[1]), flat, atol=1e-3)


@pytest.mark.parametrize("axes", [(0,), (0, 2), (0, 1, 2)])
@pytest.mark.parametrize("window", [(6, 8, 10), None])
def test_channels_last_mirroring_is_the_mean_of_the_flipped_predictions(axes, window):
    """The channels-last numpy side (the Keras networks, the torch trainers' ``_predict``): windows, or the whole
    volume in one pass, mirrored on the volume's axes."""
    image = np.random.default_rng(3).random((10, 12, 14, 3), dtype=np.float32)
    spec = InferenceSpec(overlap=0.25)
    out = predict_channels_last(predict_last, image, window, inference=spec, batch_size=2, mirror=axes)
    by_hand = predict_channels_last(mirrored_by_hand(axes, 1), image, window, inference=spec, batch_size=2)
    np.testing.assert_allclose(out, by_hand, atol=1e-5)
    plain = predict_channels_last(predict_last, image, window, inference=spec, batch_size=2)
    assert not np.allclose(out, plain, atol=1e-3)


@pytest.mark.parametrize("mirror", [[3], [-1], [0, 0], ["0"], [0.0], [True], "0,1", [[0, 1]]])
def test_bad_mirror_axes_are_refused(mirror):
    with pytest.raises(ValueError, match=r"mirror .*distinct spatial axes 0, 1, 2"):
        sliding_window(lambda w: w, torch.zeros(1, 1, 8, 8, 8), 4, mirror=mirror)
    with pytest.raises(ValueError, match=r"mirror .*distinct spatial axes 0, 1, 2"):
        predict_channels_last(predict_last, np.zeros((8, 8, 8, 3), np.float32), None, inference=InferenceSpec(),
                              batch_size=1, mirror=mirror)
