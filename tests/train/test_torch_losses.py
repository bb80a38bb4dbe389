"""The torch losses: dice, dice + BCE and dice + CE, on probabilities (the U-Net's sigmoid or softmax head) or on
logits (the ViT), sigmoid or softmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distmis.train.torch_losses import make_loss


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


def one_hot(classes: torch.Tensor, count: int) -> torch.Tensor:
    """(B, *spatial) class indices -> (B, C, *spatial) one-hot floats."""
    return torch.nn.functional.one_hot(classes, count).movedim(-1, 1).float()


def test_dice_ce_of_softmax_probabilities_by_hand():
    # one sample of 2 voxels, 3 classes (0 background); voxel 0 is class 1, voxel 1 class 2
    prob = torch.tensor([[0.2, 0.5], [0.7, 0.1], [0.1, 0.4]]).reshape(1, 3, 1, 1, 2)
    target = one_hot(torch.tensor([1, 2]).reshape(1, 1, 1, 2), 3)
    smooth = 1.0
    dice_1 = (2 * 0.7 + smooth) / (0.7 + 0.1 + 1 + smooth)  # the foreground classes only
    dice_2 = (2 * 0.4 + smooth) / (0.1 + 0.4 + 1 + smooth)
    ce = -(np.log(0.7) + np.log(0.4)) / 2  # -log p of each voxel's class, averaged over the voxels
    expected = 1 - (dice_1 + dice_2) / 2 + ce
    got = make_loss("dice-ce", smooth, activation="softmax")(prob, target)
    assert float(got) == pytest.approx(expected, rel=1e-6)
    assert float(make_loss("dice", smooth, activation="softmax")(prob, target)) == pytest.approx(
        1 - (dice_1 + dice_2) / 2, rel=1e-6)


def test_dice_ce_on_logits_is_monais_dice_ce_loss_and_the_probabilities_one():
    from monai.losses import DiceCELoss

    torch.manual_seed(0)
    logits = torch.randn(2, 4, 6, 6, 6) * 2
    target = one_hot(torch.randint(0, 4, (2, 6, 6, 6)), 4)
    on_logits = make_loss("dice-ce", 0.5, from_logits=True, activation="softmax")(logits, target)
    monai = DiceCELoss(softmax=True, include_background=False, smooth_nr=0.5, smooth_dr=0.5)(logits, target)
    on_probabilities = make_loss("dice-ce", 0.5, activation="softmax")(torch.softmax(logits, dim=1), target)
    torch.testing.assert_close(on_logits, monai, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(on_probabilities, on_logits, rtol=1e-5, atol=1e-6)
    dice_on_logits = make_loss("dice", 0.5, from_logits=True, activation="softmax")(logits, target)
    dice = make_loss("dice", 0.5, activation="softmax")(torch.softmax(logits, dim=1), target)
    torch.testing.assert_close(dice_on_logits, dice, rtol=1e-6, atol=1e-7)


def test_dice_ce_of_sigmoid_outputs_is_dice_bce():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 4, 4, 4) * 3
    target = (torch.rand(2, 3, 4, 4, 4) > 0.5).float()
    for from_logits in (False, True):
        pred = logits if from_logits else torch.sigmoid(logits)
        torch.testing.assert_close(make_loss("dice-ce", 1.0, from_logits=from_logits)(pred, target),
                                   make_loss("dice-bce", 1.0, from_logits=from_logits)(pred, target), rtol=0, atol=0)


def test_softmax_refuses_binary_cross_entropy_and_a_single_channel():
    with pytest.raises(ValueError, match="'dice-bce' .* is for sigmoid outputs"):
        make_loss("dice-bce", activation="softmax")
    with pytest.raises(ValueError, match="activation must be one of"):
        make_loss("dice", activation="relu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="background and at least one class"):
        make_loss("dice-ce", activation="softmax")(torch.ones(1, 1, 2, 2, 2), torch.ones(1, 1, 2, 2, 2))
