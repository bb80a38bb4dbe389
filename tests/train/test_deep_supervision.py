"""Deep supervision (``training.deep_supervision``): nnU-Net's weights and downsampled targets against a hand
computation, the heads of distmis's U-Net and MONAI's DynUNet, a real trainer training them, and the refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from distmis.models.params import DynUNetParams, UNet3DParams
from distmis.models.registry import NetworkInput, supervision_heads
from distmis.networks import build_network
from distmis.spec import SpecError, validate_spec
from distmis.spec.schema import Spec
from distmis.models.registry import model_entry
from distmis.train.deep_supervision import DeepSupervisionLoss, downsample_target, level_weights
from tests.conftest import small_spec_tree


def nnunet_weights(decoder_outputs: int) -> np.ndarray:
    """nnU-Net v2's ``nnUNetTrainer._build_loss``: 1 / 2**i per decoder output, the lowest resolution's set to 0,
    normalized to sum to 1."""
    weights = np.array([1 / (2**i) for i in range(decoder_outputs)])
    weights[-1] = 0
    return weights / weights.sum()


@pytest.mark.parametrize("levels", [3, 4, 5, 6])
def test_the_weights_are_nnunets_over_the_outputs_built(levels: int):
    decoder_outputs = levels - 1  # nnU-Net: one segmentation output per decoder stage
    built = supervision_heads(levels) + 1  # the full resolution and the heads
    reference = nnunet_weights(decoder_outputs)
    assert np.count_nonzero(reference) == built  # what takes part in nnU-Net's loss is what is built here
    assert level_weights(built) == pytest.approx(reference[:built].tolist())


def test_the_target_is_downsampled_by_nearest_neighbour_and_the_loss_weighs_each_level():
    generator = torch.Generator().manual_seed(0)
    target = (torch.rand(2, 3, 8, 8, 4, generator=generator) > 0.5).float()
    half = downsample_target(target, (4, 4, 2))
    # nearest-exact of a factor 2: output voxel i samples input voxel floor((i + 0.5) * 2) = 2i + 1
    assert torch.equal(half, target[:, :, 1::2, 1::2, 1::2])
    assert downsample_target(target, (8, 8, 4)) is target
    quarter = downsample_target(target, (2, 2, 1))
    assert torch.equal(quarter, target[:, :, 2::4, 2::4, 2::4])  # floor((i + 0.5) * 4) = 4i + 2

    def squared(output: torch.Tensor, goal: torch.Tensor) -> torch.Tensor:
        return ((output - goal) ** 2).mean()

    outputs = [torch.rand(2, 3, 8, 8, 4, generator=generator), torch.rand(2, 3, 4, 4, 2, generator=generator),
               torch.rand(2, 3, 2, 2, 1, generator=generator)]
    by_hand = (4 / 7) * squared(outputs[0], target) + (2 / 7) * squared(outputs[1], target[:, :, 1::2, 1::2, 1::2]) \
        + (1 / 7) * squared(outputs[2], target[:, :, 2::4, 2::4, 2::4])
    loss = DeepSupervisionLoss(squared)
    assert float(loss(outputs, target)) == pytest.approx(float(by_hand))
    assert float(loss(outputs[0], target)) == pytest.approx(float(squared(outputs[0], target)))  # one output: itself
    with pytest.raises(ValueError, match="first output"):
        loss(outputs[1:], target)


def _network(name: str, params, tile=(32, 32, 32), deep_supervision: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_network(model_entry(name), params, NetworkInput(1, 2, tile, deep_supervision=deep_supervision))


@pytest.mark.parametrize("name, params, shapes", [
    ("unet3d", UNet3DParams(base_filters=4, levels=5, norm="group"), [(32, 32, 32), (16, 16, 16), (8, 8, 8)]),
    ("unet3d", UNet3DParams(base_filters=4, levels=3, norm="group"), [(32, 32, 32)]),
    # planned on 32^3: three downsamplings (feature maps of 4 voxels or more), four levels
    ("dynunet", DynUNetParams(filters=(4, 8, 8, 8, 8)), [(32, 32, 32), (16, 16, 16)]),
])
def test_a_deep_supervised_network_returns_its_decoder_levels_in_training_only(name, params, shapes):
    network = _network(name, params)
    x = torch.rand(1, 1, 32, 32, 32)
    network.train()
    out = network(x)
    if len(shapes) == 1:  # three levels: nothing to supervise below the full resolution
        assert isinstance(out, torch.Tensor)
    else:
        assert [tuple(o.shape[2:]) for o in out] == shapes and all(o.shape[:2] == (1, 2) for o in out)
    network.eval()
    with torch.no_grad():
        single = network(x)
        assert isinstance(single, torch.Tensor) and tuple(single.shape) == (1, 2, 32, 32, 32)
        plain = _network(name, params, deep_supervision=False).eval()
        plain.load_state_dict(network.state_dict(), strict=False)  # the same weights but the heads
        assert torch.allclose(plain(x), single)  # the registered model's forward is the plain network's
    if name == "dynunet":  # MONAI's skip layers fill their heads whenever they hold them: not in eval mode
        heads = list(network.deep_supervision_heads)
        called = []
        hooks = [head.register_forward_hook(lambda *_: called.append(1)) for head in heads]
        with torch.no_grad():
            network(x)
        assert heads and not called  # inference (and the exported program) runs the full-resolution path only
        network.train()
        assert len(network(x)) == len(shapes) and called  # and training gets its heads back
        for hook in hooks:
            hook.remove()


def _spec(tmp_path: Path, name: str, params: dict, framework: str = "torch", **training) -> Spec:
    tree = small_spec_tree(tmp_path / "data")
    tree["dataset"]["synthetic"]["shape"] = [32, 32, 32]
    tree["model"] = {"name": name, "framework": framework, "params": params}
    tree["training"].update({"epochs": 1, "tile": [32, 32, 32], "deep_supervision": True, **training})
    return validate_spec(tree)


@pytest.mark.parametrize("name, params", [("unet3d", {"base_filters": 4, "levels": 4, "norm": "group"}),
                                          ("dynunet", {"filters": [4, 8, 8, 8]})])
def test_a_trainer_trains_the_heads(tmp_path: Path, name: str, params: dict):
    from distmis.search.prepare import prepare_data
    from tests.train.torch_trainers import local_trainer

    spec = _spec(tmp_path, name, params, batch_size=1)
    trainer = local_trainer(spec, prepare_data(spec, tmp_path / "out", progress=False).tfrecord_dir)
    heads = trainer.model.supervision if name == "unet3d" else trainer.model.deep_supervision_heads
    assert len(heads) == 1
    before = [p.detach().clone() for p in heads.parameters()]
    metrics = trainer.run_epoch(1)
    assert np.isfinite(metrics.train_loss) and np.isfinite(metrics.val_dice)
    assert any(not torch.equal(b, p) for b, p in zip(before, heads.parameters()))  # the heads' loss trained them


def test_deep_supervision_is_refused_where_there_are_no_heads(tmp_path: Path):
    with pytest.raises(SpecError, match=r"training.deep_supervision.*no deep supervision heads in tensorflow.*unet3d "
                                        r"\(torch\)"):
        _spec(tmp_path, "unet3d", {"base_filters": 4, "levels": 4}, framework="tensorflow")
    with pytest.raises(SpecError, match="no deep supervision heads in torch"):
        _spec(tmp_path, "segresnet", {})
    with pytest.raises(SpecError, match="pipeline of 2 stages"):
        tree = small_spec_tree(tmp_path / "data")
        tree["model"] = {"name": "unet3d", "framework": "torch", "params": {"base_filters": 4, "levels": 4}}
        tree["training"]["deep_supervision"] = True
        tree["parallelism"]["pipeline"] = {"stages": 2}
        validate_spec(tree)
    with pytest.raises(ValueError, match="set training.deep_supervision: true instead"):
        DynUNetParams(deep_supervision=True)
