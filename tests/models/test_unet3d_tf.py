from __future__ import annotations

import numpy as np
import pytest

from distmis.models.unet3d_tf import build_unet3d, count_trainable_parameters


def expected_parameters(in_channels: int, num_classes: int, base: int, levels: int, norm_params: int) -> int:
    """Hand count: conv weights+biases, transposed convs, and ``norm_params`` per normalized channel."""
    def conv(cin: int, cout: int) -> int:
        return 27 * cin * cout + cout

    total, cin = 0, in_channels
    filters = [base * 2 ** s for s in range(levels)]
    for f in filters:  # encoder levels and bottleneck: two convs + two norms each
        total += conv(cin, f) + conv(f, f) + 2 * norm_params * f
        cin = f
    for f in reversed(filters[:-1]):  # decoder: transposed conv, then two convs on [up, skip]
        total += conv(cin, f) + conv(2 * f, f) + conv(f, f) + 2 * norm_params * f
        cin = f
    return total + conv(cin, num_classes)


def test_paper_configuration_parameter_count():
    model = build_unet3d(in_channels=4, num_classes=1)  # 8, 16, 32 filters, 64 bottleneck, batch norm
    assert model.count_params() == expected_parameters(4, 1, 8, 4, norm_params=4) == 403_793
    # Batch norm's moving mean and variance are not trainable: 2 of its 4 values per channel.
    assert count_trainable_parameters(model) == expected_parameters(4, 1, 8, 4, norm_params=2)


def test_group_norm_and_regions_parameter_count():
    model = build_unet3d(in_channels=4, num_classes=3, norm="group", norm_groups=4)
    assert model.count_params() == expected_parameters(4, 3, 8, 4, norm_params=2)


@pytest.mark.parametrize("norm", ["batch", "group"])
def test_output_shape_and_range(norm):
    model = build_unet3d(in_channels=4, num_classes=3, base_filters=4, levels=3, norm=norm)
    x = np.random.default_rng(0).normal(size=(2, 16, 8, 24, 4)).astype("float32")
    y = model(x, training=False).numpy()
    assert y.shape == (2, 16, 8, 24, 3)
    assert y.min() >= 0.0 and y.max() <= 1.0  # sigmoid


def test_layout_is_the_papers():
    model = build_unet3d()
    convs = [layer for layer in model.layers if type(layer).__name__ == "Conv3D"]
    assert [c.filters for c in convs] == [8, 8, 16, 16, 32, 32, 64, 64, 32, 32, 16, 16, 8, 8, 1]
    transposed = [layer for layer in model.layers if type(layer).__name__ == "Conv3DTranspose"]
    assert [(t.filters, t.strides) for t in transposed] == [(32, (2, 2, 2)), (16, (2, 2, 2)), (8, (2, 2, 2))]
    assert sum(type(layer).__name__ == "MaxPooling3D" for layer in model.layers) == 3


def test_bad_arguments():
    with pytest.raises(ValueError, match="levels"):
        build_unet3d(levels=1)
    with pytest.raises(ValueError, match="norm"):
        build_unet3d(norm="instance")  # type: ignore[arg-type]


def test_a_softmax_head_gives_class_probabilities_that_sum_to_one():
    sigmoid = build_unet3d(in_channels=1, num_classes=4, base_filters=4, levels=3)
    softmax = build_unet3d(in_channels=1, num_classes=4, base_filters=4, levels=3, activation="softmax")
    assert softmax.count_params() == sigmoid.count_params()
    softmax.set_weights(sigmoid.get_weights())
    x = np.random.default_rng(0).normal(size=(2, 8, 16, 8, 1)).astype("float32")
    prob = softmax(x, training=False).numpy()
    p = sigmoid(x, training=False).numpy().astype("float64")
    logits = np.log(p) - np.log1p(-p)  # the sigmoid head's logits, recovered
    expected = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    assert prob.shape == (2, 8, 16, 8, 4) and prob.min() >= 0
    np.testing.assert_allclose(prob.sum(axis=-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(prob, expected, atol=1e-5)
    with pytest.raises(ValueError, match="activation must be one of .* got 'relu'"):
        build_unet3d(activation="relu")  # type: ignore[arg-type]
