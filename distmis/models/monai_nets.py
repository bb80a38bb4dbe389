"""MONAI's segmentation networks as registered models: each builder returns exactly MONAI's module (no wrapper), built
for distmis's input (3D, the data's channels, the target's output channels, UNETR's ``img_size`` the network input)
with a spec's ``model.params`` as its other arguments. Every one outputs logits (no activation inside).

One exception: DynUNet under ``training.deep_supervision`` is :class:`DeepSupervisedDynUNet`, MONAI's DynUNet with
its deep supervision heads whose training forward returns the heads' outputs at their own resolution (a list, the
full resolution's first) rather than MONAI's stack of them interpolated up to the full resolution, so that the loss
downsamples the targets, as nnU-Net does (:mod:`distmis.train.deep_supervision`). Its weights and eval forward are
DynUNet's.

The registry names these builders (:data:`distmis.models.registry.MODELS`); the params classes are in
:mod:`distmis.models.params`.
"""

from __future__ import annotations

from typing import Any

import torch
from monai.networks.nets import DynUNet
from monai.networks.nets.dynunet import DynUNetSkipLayer
from torch import nn

from distmis.models.dynunet_plan import plan_dynunet
from distmis.models.params import (BasicUNetParams, DynUNetParams, NetworkParams, SegResNetParams, SwinUNETRParams,
                                   UNETRParams)
from distmis.models.registry import NetworkInput, supervision_heads

__all__ = ["build_segresnet", "build_unetr", "build_swinunetr", "build_dynunet", "build_basicunet",
           "dynunet_arguments", "DeepSupervisedDynUNet"]


def _params(params: NetworkParams) -> dict[str, Any]:
    """The params as constructor keyword arguments (tuples stay tuples)."""
    return {name: getattr(params, name) for name in type(params).model_fields}


def _io(network_input: NetworkInput) -> dict[str, Any]:
    return {"spatial_dims": 3, "in_channels": network_input.in_channels, "out_channels": network_input.out_channels}


def dynunet_arguments(params: DynUNetParams, network_input: NetworkInput) -> dict[str, Any]:
    """DynUNet's keyword arguments: the params, with the kernels and strides planned from the network input's tile
    and spacing when the params leave them out."""
    arguments = _params(params)
    if params.strides is None:
        plan = plan_dynunet(network_input.tile, network_input.spacing, max_downsamplings=params.planned_depth)
        arguments.update(kernel_size=plan.kernel_size, strides=plan.strides,
                         upsample_kernel_size=plan.upsample_kernel_size)
    elif params.upsample_kernel_size is None:
        arguments["upsample_kernel_size"] = params.strides[1:]
    return arguments


def build_segresnet(params: SegResNetParams, network_input: NetworkInput) -> nn.Module:
    from monai.networks.nets import SegResNet

    return SegResNet(**_io(network_input), **_params(params))


def build_unetr(params: UNETRParams, network_input: NetworkInput) -> nn.Module:
    """UNETR for the network input's size (its position embedding is sized to it)."""
    from monai.networks.nets import UNETR

    return UNETR(**_io(network_input), img_size=tuple(network_input.tile), **_params(params))


def build_swinunetr(params: SwinUNETRParams, network_input: NetworkInput) -> nn.Module:
    from monai.networks.nets import SwinUNETR

    return SwinUNETR(**_io(network_input), **_params(params))


def build_dynunet(params: DynUNetParams, network_input: NetworkInput) -> nn.Module:
    """DynUNet, its kernels and strides planned from the network input when the params leave them out
    (:mod:`distmis.models.dynunet_plan`); with ``network_input.deep_supervision`` and four levels or more, its
    heads at every decoder level but the lowest (:func:`~distmis.models.registry.supervision_heads`), built as
    :class:`DeepSupervisedDynUNet`."""
    arguments = {**_io(network_input), **dynunet_arguments(params, network_input)}
    heads = supervision_heads(len(arguments["strides"])) if network_input.deep_supervision else 0
    if not heads:
        return DynUNet(**arguments)
    return DeepSupervisedDynUNet(**{**arguments, "deep_supervision": True, "deep_supr_num": heads})


class DeepSupervisedDynUNet(DynUNet):
    """DynUNet whose training forward returns ``[output, head_1, ..., head_k]``, each head's logits at its decoder
    level's resolution (MONAI's ``heads``, which its own forward interpolates up to the output's and stacks)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        if not (self.training and self.deep_supervision):
            return super().forward(x)
        out = self.output_block(self.skip_layers(x))  # fills self.heads, as DynUNet.forward does
        return [out, *self.heads]

    def train(self, mode: bool = True) -> DeepSupervisedDynUNet:
        """In eval mode the heads are not computed (MONAI's skip layers fill ``heads`` whenever they hold it):
        inference and the published ``torch.export`` program run the full-resolution path only."""
        super().train(mode)
        layer = self.skip_layers
        while isinstance(layer, DynUNetSkipLayer):
            layer.heads = self.heads if mode else None
            layer = layer.next_layer
        return self


def build_basicunet(params: BasicUNetParams, network_input: NetworkInput) -> nn.Module:
    from monai.networks.nets import BasicUNet

    return BasicUNet(**_io(network_input), **_params(params))
