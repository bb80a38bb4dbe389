"""The model registry: one entry per network distmis can search (torchtitan's ``ModelSpec``).

An entry says everything the rest of distmis needs to know about a network, so that nothing else branches on
``model.name``:

- ``params``: the pydantic class of its ``model.params`` (:mod:`distmis.models.params`: the constructor's
  arguments a spec may set and search);
- ``frameworks``: which of ``torch`` / ``tensorflow`` build it;
- ``parallelisms``: ``dp`` for every network, ``sp`` (sequence parallelism) for the ViT, ``pp`` (pipeline
  stages) for the U-Net (the functions that apply them from outside the model are bound in
  :mod:`distmis.networks`);
- ``output``: what its forward returns, ``probabilities`` (its activation inside) or ``logits`` (the trainer
  trains on logits and applies the target scheme's activation to predict);
- its input-size rules (``input_multiple``, ``input_rule``; ``fixed_input`` for a network built for one input
  size, whose curriculum may not change the tile; ``input_check``, what else an input must be for it to train,
  such as a deepest feature map of more than one voxel under instance normalization) and so its inference window;
- ``deep_supervision``: the frameworks whose network has deep supervision heads (``training.deep_supervision``);
- ``draft_params``: the ``model.params`` ``distmis init`` writes for a data set of a given median volume (voxels),
  where the params class's defaults do not suit it (the U-Net's depth, nnU-Net's rule);
- ``perf_shape``: where the performance model describes it, its arithmetic shape
  (:class:`~distmis.perf.model.ViTShape`); ``token_attention``: for a sequence-parallel network, the attention over
  its tokens its params give (``full`` or ``axial``: DSP needs axial).

The code that builds each network, and that parallelizes it, is bound to its entry by name in
:mod:`distmis.networks` (the registries' composition), so that reading the registry (the spec's checks, the CLI)
imports no torch, TensorFlow or parallelism code. Adding a network is one entry here, its params class, its builder
and its bindings, one test and one docs row.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm, prod
from typing import Any, Callable, Literal, Sequence

from distmis.models.params import (BasicUNetParams, DynUNetParams, NetworkParams, SegResNetParams, SwinUNETRParams,
                                   UNet3DParams, UNETRParams, ViTSegParams, norm_kind)
from distmis.perf.model import ViTShape
from distmis.perf.partition import ModelAttention

__all__ = ["Framework", "Parallelism", "Output", "PARALLELISM_NAMES", "NetworkInput", "ModelEntry", "MODELS",
           "model_entry", "model_names", "supervision_heads"]

Framework = Literal["tensorflow", "torch"]
Parallelism = Literal["dp", "sp", "pp"]
Output = Literal["probabilities", "logits"]

#: How a refusal names each parallelism, with the spec field that asks for it.
PARALLELISM_NAMES: dict[str, str] = {
    "dp": "data parallelism (parallelism.mode 'data', workers_per_trial > 1)",
    "sp": "sequence parallelism (parallelism.sequence_parallel.degree > 1)",
    "pp": "pipeline stages (parallelism.pipeline.stages > 1)",
}


@dataclass(frozen=True)
class NetworkInput:
    """What a network is built for, besides its params: the data's channels, the target scheme's output channels and
    activation, the network input's size (the tile, or the whole volume; with a curriculum, the per-axis greatest
    common divisor of every stage's input, :func:`distmis.spec.load.network_tile`, which a planned architecture
    such as DynUNet's divides) and the preprocessed voxel spacing (None: isotropic)."""

    in_channels: int
    out_channels: int
    tile: tuple[int, int, int]
    activation: Literal["sigmoid", "softmax"] = "sigmoid"
    spacing: tuple[float, float, float] | None = None
    # training.precision: the Keras U-Net builds its layers in its dtype policy; torch networks are built in fp32
    # (autocast runs them in lower precision from outside)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # training.deep_supervision: in training mode the network returns its decoder's outputs too
    # (:mod:`distmis.train.deep_supervision`); only for an entry whose ``deep_supervision`` names the framework
    deep_supervision: bool = False


def supervision_heads(levels: int) -> int:
    """How many deep supervision heads a U-Net of ``levels`` resolution levels has besides its full-resolution
    output (``training.deep_supervision``): one per decoder level but the lowest, which nnU-Net weighs 0
    (:mod:`distmis.train.deep_supervision`), so ``levels - 3``, none below four levels."""
    if levels < 2:
        raise ValueError(f"a U-Net has at least 2 levels, got {levels}")
    return max(levels - 3, 0)


@dataclass(frozen=True)
class ModelEntry:
    """One registered network (see the module's docstring)."""

    name: str
    params: type[NetworkParams]
    frameworks: tuple[Framework, ...]
    output: Output
    input_multiple: Callable[[Any], int]  # params -> every input dimension must divide by it
    input_rule: Callable[[Any], str]  # params -> why, for messages
    parallelisms: frozenset[str] = frozenset({"dp"})
    fixed_input: bool = False  # built for one input size (position embeddings): the tile may not change
    perf_shape: Callable[[Any, Sequence[int], int, int], ViTShape] | None = None
    # sequence-parallel networks: the attention over tokens their params give, full or axial (DSP needs axial)
    token_attention: Callable[[Any], ModelAttention] | None = None
    constructor: str | None = None  # the library class it builds ("monai.networks.nets:SegResNet"), if any
    # (params, an input's shape, its batch size) -> why the network cannot train on it, or None
    input_check: Callable[[Any, tuple[int, int, int], int], str | None] | None = None
    # (params, tile) -> whether the tile planner (training.tile: auto) prefers the tile among those the network
    # takes (None: every one): a network that plans its own strides from the tile pools fully only on some
    tile_preference: Callable[[Any, tuple[int, int, int]], bool] | None = None
    # the data set's median volume (voxels) -> the model.params `distmis init` writes (defaults: {})
    draft_params: Callable[[tuple[int, int, int]], dict[str, Any]] = lambda volume: {}
    # the frameworks whose network has deep supervision heads (training.deep_supervision): in training mode it
    # returns a list of outputs, the full resolution's first, then the decoder's lower levels' (highest first)
    deep_supervision: frozenset[str] = frozenset()
    summary: str = ""

    def __post_init__(self) -> None:
        if "dp" not in self.parallelisms:
            raise ValueError(f"model {self.name!r}: every network supports data parallelism ('dp')")

    def supports(self, parallelism: str) -> bool:
        return parallelism in self.parallelisms


def _vit_shape(params: ViTSegParams, tile: Sequence[int], in_channels: int, out_channels: int) -> ViTShape:
    """vit-seg's arithmetic shape on ``tile``: the one place it is made from a spec's params."""
    return ViTShape.of(params, tile, in_channels=in_channels, num_classes=out_channels)


def _deepest_map(norm: Any, factor: Sequence[int], shape: Sequence[int], batch_size: int) -> str | None:
    """Why a network whose deepest normalized feature map is the input over ``factor`` (per axis) cannot train on
    ``shape``, or None: instance normalization needs more than one voxel per map, batch normalization more than one
    value per channel in a batch, which a single-voxel map lacks whenever a batch holds one sample (an epoch's short
    last batch, a data-parallel replica's share), whatever ``batch_size`` says."""
    cells = prod(max(s // f, 1) for s, f in zip(shape, factor))
    kind = norm_kind(norm)
    if cells > 1 or kind not in ("instance", "batch"):
        return None
    larger = [2 * f for f in factor[:1]] + list(shape[1:])
    if kind == "instance":
        return (f"its deepest feature map (the input / {list(factor)}) is a single voxel on {list(shape)}, which "
                f"instance normalization cannot normalize: make an axis at least twice as large (e.g. {larger}), "
                "or use group normalization")
    return (f"its deepest feature map (the input / {list(factor)}) is a single voxel on {list(shape)}, and batch "
            f"normalization holds one value per channel whenever a batch has one sample (an epoch's short last "
            f"batch of {batch_size}, a replica's share): make an axis at least twice as large (e.g. {larger}), or "
            "use group normalization")


def _unet_draft(volume: tuple[int, int, int]) -> dict[str, Any]:
    """The U-Net ``distmis init`` writes: nnU-Net's depth rule (halve while the smallest side of the deepest map stays
    at 4 voxels or more, at most 5 times: 2 to 6 levels), 16 filters, group normalization (nnU-Net's instance
    normalization in groups of 8, which does not depend on the batch)."""
    halvings = max(0, min(volume).bit_length() - 3)  # the largest k with min(volume) / 2**k >= 4
    return {"base_filters": 16, "levels": max(2, min(6, halvings + 1)), "norm": "group", "norm_groups": 8}


def _dynunet_multiple(params: DynUNetParams) -> int:
    product = params.downsampling()
    return 1 if product is None else lcm(*product)


def _dynunet_rule(params: DynUNetParams) -> str:
    product = params.downsampling()
    if product is None:
        return "none: kernels and strides are planned from the tile"
    return f"the least common multiple of the strides' product along each axis, {list(product)}"


def _dynunet_prefers(params: DynUNetParams, tile: tuple[int, int, int]) -> bool:
    """Planned strides: a tile on which every axis is pooled as nnU-Net would pool it (:func:`full_pooling`)."""
    from distmis.models.dynunet_plan import full_pooling

    return not params.planned or full_pooling(tile, max_downsamplings=params.planned_depth)


def _dynunet_check(params: DynUNetParams, shape: tuple[int, int, int], batch_size: int) -> str | None:
    product = params.downsampling()  # planned strides keep every feature map at 4 voxels or more
    return None if product is None else _deepest_map(params.norm_name, product, shape, batch_size)


MODELS: dict[str, ModelEntry] = {
    entry.name: entry
    for entry in (
        ModelEntry(
            name="unet3d", params=UNet3DParams, frameworks=("tensorflow", "torch"), output="probabilities",
            input_multiple=lambda p: 2 ** (p.levels - 1),
            input_rule=lambda p: f"2**(levels-1) for levels={p.levels}",
            parallelisms=frozenset({"dp", "pp"}), draft_params=_unet_draft, deep_supervision=frozenset({"torch"}),
            summary="the DistMIS paper's 3D U-Net (TensorFlow and torch)",
        ),
        ModelEntry(
            name="vit-seg", params=ViTSegParams, frameworks=("torch",), output="logits",
            input_multiple=lambda p: p.patch,
            input_rule=lambda p: f"the patch size, model.params.patch={p.patch}",
            parallelisms=frozenset({"dp", "sp"}), fixed_input=True,
            # its decoder instance-normalizes the token grid (the input / patch)
            input_check=lambda p, shape, batch: _deepest_map("instance", (p.patch,) * 3, shape, batch),
            perf_shape=_vit_shape, token_attention=lambda p: p.attention,
            summary="a ViT encoder with a convolutional decoder (sequence-parallel)",
        ),
        ModelEntry(
            name="segresnet", params=SegResNetParams, frameworks=("torch",), output="logits",
            input_multiple=lambda p: 2 ** (len(p.blocks_down) - 1),
            input_rule=lambda p: f"2**(len(blocks_down)-1) for model.params.blocks_down={list(p.blocks_down)}",
            input_check=lambda p, shape, batch: _deepest_map(p.norm, (2 ** (len(p.blocks_down) - 1),) * 3, shape,
                                                             batch),
            constructor="monai.networks.nets:SegResNet",
            summary="MONAI's SegResNet: a residual encoder-decoder (Myronenko 2018, without the VAE)",
        ),
        ModelEntry(
            name="unetr", params=UNETRParams, frameworks=("torch",), output="logits",
            input_multiple=lambda p: 16, input_rule=lambda p: "UNETR's patch size, 16",
            fixed_input=True, constructor="monai.networks.nets:UNETR",
            summary="MONAI's UNETR: a 12-layer ViT on 16^3 patches with a convolutional decoder, built for one tile",
        ),
        ModelEntry(
            name="swinunetr", params=SwinUNETRParams, frameworks=("torch",), output="logits",
            input_multiple=lambda p: 32,
            input_rule=lambda p: "SwinUNETR's 2^3 patches and four 2x patch mergings, 2**5",
            input_check=lambda p, shape, batch: _deepest_map(p.norm_name, (32, 32, 32), shape, batch),
            constructor="monai.networks.nets:SwinUNETR",
            summary="MONAI's SwinUNETR: a Swin transformer encoder with a convolutional decoder, any input of 32s",
        ),
        ModelEntry(
            name="dynunet", params=DynUNetParams, frameworks=("torch",), output="logits",
            input_multiple=_dynunet_multiple, input_rule=_dynunet_rule, input_check=_dynunet_check,
            tile_preference=_dynunet_prefers, constructor="monai.networks.nets:DynUNet",
            deep_supervision=frozenset({"torch"}),
            summary="MONAI's DynUNet: nnU-Net's U-Net, its kernels and strides planned from the tile and spacing",
        ),
        ModelEntry(
            name="basicunet", params=BasicUNetParams, frameworks=("torch",), output="logits",
            input_multiple=lambda p: 16, input_rule=lambda p: "BasicUNet's four 2x max-poolings, 2**4",
            input_check=lambda p, shape, batch: _deepest_map(p.norm, (16, 16, 16), shape, batch),
            constructor="monai.networks.nets:BasicUNet",
            summary="MONAI's BasicUNet: a five-level U-Net of two convolutions per level",
        ),
    )
}


def model_names() -> list[str]:
    return list(MODELS)


def model_entry(name: str) -> ModelEntry:
    """The registered entry of ``name``; ValueError naming the registered networks."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"no model {name!r}; registered: {', '.join(MODELS)}") from None
