"""The PyTorch U-Net against its Keras twin: same layers, same trainable parameters, same outputs' shape."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distmis.models import unet3d_tf
from distmis.models.unet3d_torch import UNet3D, count_trainable_parameters


@pytest.mark.parametrize(
    "kwargs",
    [
        {"in_channels": 4, "num_classes": 1},  # the paper's: 8, 16, 32 filters, 64 bottleneck, batch norm
        {"in_channels": 4, "num_classes": 3, "norm": "group", "norm_groups": 4},
        {"in_channels": 2, "num_classes": 2, "base_filters": 4, "levels": 3},
    ],
)
def test_trainable_parameters_equal_the_keras_models(kwargs):
    keras_model = unet3d_tf.build_unet3d(**kwargs)
    torch_model = UNet3D(**kwargs)
    assert count_trainable_parameters(torch_model) == unet3d_tf.count_trainable_parameters(keras_model)


def test_paper_configuration_counts():
    model = UNet3D()
    assert count_trainable_parameters(model) == 403_089
    # Keras' count_params adds batch norm's moving mean and variance: torch keeps them as buffers.
    running = sum(b.numel() for name, b in model.named_buffers() if name.endswith(("running_mean", "running_var")))
    assert count_trainable_parameters(model) + running == 403_793


def test_layer_by_layer_like_keras():
    model = UNet3D()
    convs = [m for m in model.modules() if type(m) is nn.Conv3d]
    assert [c.out_channels for c in convs] == [8, 8, 16, 16, 32, 32, 64, 64, 32, 32, 16, 16, 8, 8, 1]
    transposed = [m for m in model.modules() if isinstance(m, nn.ConvTranspose3d)]
    assert [(t.out_channels, t.stride) for t in transposed] == [(32, (2, 2, 2)), (16, (2, 2, 2)), (8, (2, 2, 2))]
    assert sum(isinstance(m, nn.BatchNorm3d) for m in model.modules()) == 14

    keras_model = unet3d_tf.build_unet3d()
    keras_counts = [
        layer.count_params() for layer in keras_model.layers if type(layer).__name__ in ("Conv3D", "Conv3DTranspose")
    ]
    # Keras orders layers as built: per decoder level, the transposed conv before its two convs.
    torch_counts = [
        sum(p.numel() for p in m.parameters())
        for m in model.modules()
        if isinstance(m, (nn.Conv3d, nn.ConvTranspose3d))
    ]
    assert torch_counts == keras_counts


def test_keras_initialization_and_momentum():
    torch.manual_seed(0)
    model = UNet3D(batch_norm_momentum=0.8)
    weight = model.down[0][0].weight
    assert weight.abs().max() <= 0.1 and 0.04 < weight.std() < 0.06  # truncated normal, std 0.05, cut at 2 std
    convs = [m for m in model.modules() if isinstance(m, (nn.Conv3d, nn.ConvTranspose3d))]
    assert all(torch.count_nonzero(m.bias) == 0 for m in convs)
    norm = model.down[0][1]
    assert norm.momentum == pytest.approx(0.2) and norm.eps == pytest.approx(1e-3)


@pytest.mark.parametrize("norm", ["batch", "group"])
def test_output_shape_and_range(norm):
    model = UNet3D(in_channels=4, num_classes=3, base_filters=4, levels=3, norm=norm).eval()
    x = torch.randn(2, 4, 16, 8, 24, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y = model(x)
    assert y.shape == (2, 3, 16, 8, 24)
    assert y.min() >= 0.0 and y.max() <= 1.0  # sigmoid


def test_group_norm_caps_groups_at_channels():
    model = UNet3D(base_filters=2, levels=2, norm="group", norm_groups=4)
    groups = [m.num_groups for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert groups == [2, 2, 4, 4, 2, 2]


def test_bad_arguments():
    with pytest.raises(ValueError, match="levels must be >= 2, got 1"):
        UNet3D(levels=1)
    with pytest.raises(ValueError, match="norm must be one of .* got 'instance'"):
        UNet3D(norm="instance")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="base_filters"):
        UNet3D(base_filters=0)
    with pytest.raises(ValueError, match="norm_groups \\(3\\) must divide base_filters \\(8\\)"):
        UNet3D(norm="group", norm_groups=3)
    with pytest.raises(ValueError, match="batch_norm_momentum"):
        UNet3D(batch_norm_momentum=1.0)
    with pytest.raises(ValueError, match="divisible by 8"):
        UNet3D()(torch.zeros(1, 4, 12, 16, 16))


def test_a_softmax_head_gives_class_probabilities_that_sum_to_one():
    sigmoid = UNet3D(in_channels=1, num_classes=4, base_filters=4, levels=3).eval()
    softmax = UNet3D(in_channels=1, num_classes=4, base_filters=4, levels=3, activation="softmax").eval()
    softmax.load_state_dict(sigmoid.state_dict())  # the activation holds no parameter: the same weights load
    assert count_trainable_parameters(softmax) == count_trainable_parameters(sigmoid)
    x = torch.randn(2, 1, 8, 16, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        prob, logits = softmax(x), torch.logit(sigmoid(x).double())  # the sigmoid head's logits, recovered
    assert prob.shape == (2, 4, 8, 16, 8) and prob.min() >= 0
    torch.testing.assert_close(prob.sum(dim=1), torch.ones(2, 8, 16, 8), atol=1e-5, rtol=0)
    torch.testing.assert_close(prob.double(), torch.softmax(logits, dim=1), atol=1e-5, rtol=0)
    assert UNet3D().activation == "sigmoid"
    with pytest.raises(ValueError, match="activation must be one of .* got 'relu'"):
        UNet3D(activation="relu")  # type: ignore[arg-type]
