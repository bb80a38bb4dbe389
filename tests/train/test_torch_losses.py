"""The torch losses: dice and dice + BCE, on probabilities (the U-Net's sigmoid head) or on logits (the ViT)."""

from __future__ import annotations

import pytest
import torch

from distmis.train.torch_unet import make_loss


@pytest.mark.parametrize("name", ["dice", "dice-bce"])
def test_logits_and_probabilities_give_the_same_loss_where_nothing_is_clipped(name):
    torch.manual_seed(0)
    logits = torch.randn(2, 1, 4, 4, 4) * 3
    target = (torch.rand(2, 1, 4, 4, 4) > 0.5).float()
    on_logits = make_loss(name, 1.0, from_logits=True)(logits, target)
    on_probabilities = make_loss(name, 1.0)(torch.sigmoid(logits), target)
    torch.testing.assert_close(on_logits, on_probabilities, rtol=1e-5, atol=1e-6)


def test_bce_on_logits_keeps_the_gradient_of_a_confidently_wrong_voxel():
    """Clipped probabilities zero the gradient beyond a logit of about 16; BCE with logits does not."""
    target = torch.zeros(1, 1, 2, 2, 2)
    logits = torch.full((1, 1, 2, 2, 2), 40.0, requires_grad=True)  # every voxel confidently wrong
    make_loss("dice-bce", 1.0, from_logits=True)(logits, target).backward()
    assert torch.all(logits.grad > 0.1)  # d(BCE)/d(logit) = (sigmoid(40) - 0) / 8 voxels

    logits_clipped = torch.full((1, 1, 2, 2, 2), 40.0, requires_grad=True)
    make_loss("dice-bce", 1.0)(torch.sigmoid(logits_clipped), target).backward()
    assert torch.all(logits_clipped.grad.abs() < 1e-6)  # what the ViT trained with before


def test_unknown_loss():
    with pytest.raises(ValueError, match="loss must be one of"):
        make_loss("focal")  # type: ignore[arg-type]
