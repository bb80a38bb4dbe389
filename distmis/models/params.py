"""Every registered network's ``model.params``: the arguments of its constructor that a spec may set and search.

One pydantic class per network, unknown keys refused (the spec error names the allowed ones). The arguments
distmis supplies itself (input and output channels, the input size, the output activation, the spatial
dimensions) are not among them. Pure pydantic: no torch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from distmis.models.dynunet_plan import MAX_DOWNSAMPLINGS


class NetworkParams(BaseModel):
    """Base of every network's params: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class UNet3DParams(NetworkParams):
    """The paper's 3D U-Net: ``levels`` resolutions with ``base_filters * 2**(s-1)`` filters."""

    base_filters: int = Field(8, ge=1, le=512)
    levels: int = Field(4, ge=2, le=7)
    norm: Literal["batch", "group"] = "batch"
    norm_groups: int = Field(4, ge=1)
    batch_norm_momentum: float = Field(0.9, gt=0, lt=1)

    @model_validator(mode="after")
    def _groups_divide_filters(self) -> UNet3DParams:
        if self.norm == "group" and self.base_filters % self.norm_groups:
            raise ValueError(
                f"norm_groups ({self.norm_groups}) must divide base_filters ({self.base_filters}) "
                "for group normalization"
            )
        return self


class ViTSegParams(NetworkParams):
    """A ViT encoder with a convolutional decoder (UNETR without skips; the SP-ViT paper's Figure 2).

    The defaults (L, E, A) = (12, 768, 12) with patch 16 are the paper's; tests and CPUs use small ones.
    """

    layers: int = Field(12, ge=1, le=128)
    embed_dim: int = Field(768, ge=8)
    heads: int = Field(12, ge=1)
    patch: int = Field(16, ge=2)
    mlp_ratio: float = Field(4.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    pos_embedding: Literal["learned", "sinusoidal"] = "learned"
    decoder_features: int = Field(128, ge=1)
    attention_kernel: Literal["fused", "math"] = Field(
        "fused", description="fused: torch's flash / memory-efficient kernels (memory linear in the tokens); math: "
                             "the unfused kernel, which holds every layer's score matrices (quadratic)")
    attention: Literal["full", "axial"] = Field(
        "full", description="full: every token attends to every token (s^2 scores per head); axial: each block "
                            "attends along H, then W, then D over the lines of the token grid (s (gh+gw+gd)), "
                            "which sequence parallelism can split with attention 'dsp'")

    @model_validator(mode="after")
    def _consistent(self) -> ViTSegParams:
        if self.embed_dim % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide embed_dim ({self.embed_dim})")
        if self.patch & (self.patch - 1):
            raise ValueError(f"patch must be a power of two (the decoder upsamples x2 per stage), got {self.patch}")
        return self




# --------------------------------------------------------------------------- MONAI's networks
# A normalization or activation is a name, or [name, {options}] (MONAI's ``norm`` / ``act`` arguments): only the
# layers a name builds (their other arguments, channels, are filled in by MONAI), each with the keyword options of its
# torch class that are plain data. Names are case-insensitive, as MONAI's factories read them.
NORM_OPTIONS: dict[str, tuple[str, ...]] = {
    "instance": ("eps", "momentum", "affine", "track_running_stats"),
    "batch": ("eps", "momentum", "affine", "track_running_stats"),
    "group": ("num_groups", "eps", "affine"),
}
ACT_OPTIONS: dict[str, tuple[str, ...]] = {
    "relu": ("inplace",), "leakyrelu": ("negative_slope", "inplace"), "prelu": ("num_parameters", "init"),
    "elu": ("alpha", "inplace"), "celu": ("alpha", "inplace"), "selu": ("inplace",), "relu6": ("inplace",),
    "gelu": ("approximate",), "swish": ("alpha",), "memswish": ("inplace",), "mish": ("inplace",),
    "sigmoid": (), "tanh": (),
}

LayerOptions = dict[str, bool | int | float | str]


def _layer(kind: str, table: dict[str, tuple[str, ...]], value: str | tuple[str, LayerOptions]) -> Any:
    name, options = (value, {}) if isinstance(value, str) else value
    key = name.lower()
    if key not in table:
        raise ValueError(f"unknown {kind} {name!r}: one of {', '.join(table)} (a name, or [name, {{options}}])")
    unknown = sorted(set(options) - set(table[key]))
    if unknown:
        raise ValueError(f"{kind} {name!r} takes no option {', '.join(map(repr, unknown))}; its options: "
                         f"{', '.join(table[key]) or 'none'}")
    if kind == "norm" and key == "group":
        groups = options.get("num_groups")
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"group normalization needs a positive number of groups: [{name}, {{num_groups: 8}}], "
                             f"got {value!r}")
    return value


Norm = Annotated[str | tuple[str, LayerOptions], AfterValidator(lambda v: _layer("norm", NORM_OPTIONS, v))]
Act = Annotated[str | tuple[str, LayerOptions], AfterValidator(lambda v: _layer("activation", ACT_OPTIONS, v))]
Rate = Annotated[float, Field(ge=0, le=1)]
PositiveInts = tuple[Annotated[int, Field(ge=1)], ...]
Blocks = tuple[Annotated[int, Field(ge=0, le=64)], ...]
Window = Annotated[int, Field(ge=1, le=64)]


def norm_groups(norm: str | tuple[str, LayerOptions]) -> int | None:
    """The number of groups of a group normalization (``None``: another one)."""
    if isinstance(norm, str) or norm[0].lower() != "group":
        return None
    return int(norm[1]["num_groups"])


def norm_kind(norm: str | tuple[str, LayerOptions]) -> str:
    """``instance``, ``batch`` or ``group``."""
    return (norm if isinstance(norm, str) else norm[0]).lower()


def _groups_divide(norm: str | tuple[str, LayerOptions], field: str, channels: dict[str, int]) -> None:
    """ValueError when a group normalization's groups do not divide every channel count it normalizes."""
    groups = norm_groups(norm)
    bad = {where: c for where, c in channels.items() if groups and c % groups}
    if bad:
        where, count = next(iter(bad.items()))
        raise ValueError(f"{field}: group normalization's num_groups ({groups}) must divide the channels it "
                         f"normalizes: {where} has {count}")


class SegResNetParams(NetworkParams):
    """MONAI's SegResNet (Myronenko 2018, without the VAE branch): ``init_filters * 2**i`` filters at level ``i``,
    ``blocks_down[i]`` residual blocks down and ``blocks_up[i]`` up.

    Left out: ``norm_name`` and ``num_groups`` (deprecated by MONAI: ``norm`` says both), ``use_conv_final`` (false
    would output ``init_filters`` channels, not the target's), and what distmis supplies (``spatial_dims``,
    ``in_channels``, ``out_channels``).
    """

    init_filters: int = Field(8, ge=1, le=512)
    dropout_prob: Rate | None = None
    act: Act = ("RELU", {"inplace": True})
    norm: Norm = ("GROUP", {"num_groups": 8})
    blocks_down: Blocks = Field((1, 2, 2, 4), min_length=1, max_length=7)
    blocks_up: Blocks = Field((1, 1, 1), max_length=6)
    upsample_mode: Literal["deconv", "nontrainable", "pixelshuffle"] = "nontrainable"

    @model_validator(mode="after")
    def _consistent(self) -> SegResNetParams:
        if len(self.blocks_up) != len(self.blocks_down) - 1:
            raise ValueError(f"blocks_up needs one entry per upsampling, len(blocks_down) - 1 = "
                             f"{len(self.blocks_down) - 1}: got {len(self.blocks_up)} ({list(self.blocks_up)} for "
                             f"blocks_down {list(self.blocks_down)})")
        _groups_divide(self.norm, "norm", {"init_filters": self.init_filters})
        return self


class UNETRParams(NetworkParams):
    """MONAI's UNETR (Hatamizadeh 2021): a 12-layer ViT on 16^3 patches (``hidden_size``, ``num_heads``, ``mlp_dim``)
    and a convolutional decoder of ``feature_size * 2**i`` filters. Its position embedding is sized to the network
    input (its ``img_size``: the tile, which distmis supplies).

    Left out: ``save_attn`` (keeps every block's attention map for inspection: no effect on training), ``img_size``,
    ``spatial_dims``, ``in_channels``, ``out_channels`` (distmis's).
    """

    feature_size: int = Field(16, ge=1, le=512)
    hidden_size: int = Field(768, ge=1, le=8192)
    mlp_dim: int = Field(3072, ge=1, le=32768)
    num_heads: int = Field(12, ge=1, le=128)
    proj_type: Literal["conv", "perceptron"] = "conv"
    norm_name: Norm = "instance"
    conv_block: bool = True
    res_block: bool = True
    dropout_rate: Rate = 0.0
    qkv_bias: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> UNETRParams:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must divide by num_heads ({self.num_heads})")
        _groups_divide(self.norm_name, "norm_name", {"feature_size": self.feature_size})
        return self


class SwinUNETRParams(NetworkParams):
    """MONAI's SwinUNETR (Hatamizadeh 2022): a Swin transformer of four stages (``depths[i]`` blocks of
    ``num_heads[i]`` heads on ``feature_size * 2**i`` channels, attention in windows of ``window_size``) and a
    convolutional decoder. Any input whose dimensions divide by 32 (its 2^3 patches, then four 2x mergings).

    Left out: ``patch_size`` (MONAI's decoder brings the 2x2x2 patches back to the input's size: any other size
    outputs another shape), the Hyena operator (``use_hyena``, ``hyena_*``: an experimental replacement of the
    attention), ``norm_layer`` (a class), ``spatial_dims``, ``in_channels``, ``out_channels`` (distmis's).
    ``use_flash_attention`` (torch's fused attention kernel, at inference only) and ``use_checkpoint`` (activation
    checkpointing: memory for compute) are plain switches and kept.
    """

    depths: PositiveInts = Field((2, 2, 2, 2), min_length=4, max_length=4,
                                 description="Swin blocks in each of the four stages")
    num_heads: PositiveInts = Field((3, 6, 12, 24), min_length=4, max_length=4,
                                    description="attention heads in each of the four stages")
    window_size: Window | tuple[Window, Window, Window] = 7
    qkv_bias: bool = True
    mlp_ratio: float = Field(4.0, gt=0, le=64)
    feature_size: int = Field(24, ge=12, le=768, multiple_of=12)
    norm_name: Norm = "instance"
    drop_rate: Rate = 0.0
    attn_drop_rate: Rate = 0.0
    dropout_path_rate: Rate = 0.0
    normalize: bool = True
    patch_norm: bool = False
    use_checkpoint: bool = False
    downsample: Literal["merging", "mergingv2"] = "merging"
    use_v2: bool = False
    use_flash_attention: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> SwinUNETRParams:
        if len(self.num_heads) != len(self.depths):
            raise ValueError(f"num_heads needs one entry per stage of depths ({len(self.depths)}), got "
                             f"{list(self.num_heads)}")
        for stage, heads in enumerate(self.num_heads):
            channels = self.feature_size * 2**stage
            if channels % heads:
                raise ValueError(f"stage {stage} has feature_size * 2**{stage} = {channels} channels, which "
                                 f"num_heads[{stage}] = {heads} does not divide")
        _groups_divide(self.norm_name, "norm_name", {"feature_size": self.feature_size})
        return self


Step = Annotated[int, Field(ge=1, le=16)]
Level = Step | tuple[Step, Step, Step]  # one value for every axis, or one per axis


def _per_axis(value: int | tuple[int, int, int]) -> tuple[int, int, int]:
    return (value,) * 3 if isinstance(value, int) else tuple(value)  # type: ignore[return-value]


#: nnU-Net's filters per level, ``32 * 2**level`` capped at 320 (MONAI's DynUNet default for 3D).
def nnunet_filters(levels: int) -> tuple[int, ...]:
    return tuple(min(32 * 2**level, 320) for level in range(levels))


class DynUNetParams(NetworkParams):
    """MONAI's DynUNet: nnU-Net's U-Net, level ``i`` two convolutions of ``kernel_size[i]`` (the first of stride
    ``strides[i]``) with ``filters[i]`` filters.

    ``kernel_size``, ``strides`` and ``upsample_kernel_size`` left out (null) are planned as nnU-Net plans them from
    the network input and the voxel spacing (:mod:`distmis.models.dynunet_plan`: stride 2 along an axis while its
    feature map stays at least 4 voxels and its spacing within twice the finest, up to 5 downsamplings). Given,
    ``kernel_size`` and ``strides`` come together (one entry per level, at least three levels, the first of stride
    1); ``upsample_kernel_size`` defaults to ``strides[1:]``. ``filters`` default nnU-Net's ``32 * 2**i`` capped at
    320; with planned strides, a ``filters`` list also caps the depth at ``len(filters)`` levels.

    ``deep_supervision`` must stay false here: deep supervision is ``training.deep_supervision``, which builds MONAI's
    heads at every decoder level but the lowest and trains on them as nnU-Net does
    (:mod:`distmis.train.deep_supervision`). Left out: ``deep_supr_num`` (deep supervision's, planned with it),
    ``spatial_dims``, ``in_channels``, ``out_channels`` (distmis's).
    """

    kernel_size: tuple[Level, ...] | None = None
    strides: tuple[Level, ...] | None = None
    upsample_kernel_size: tuple[Level, ...] | None = None
    filters: PositiveInts | None = Field(None, min_length=3, max_length=16)
    dropout: Rate | None = None
    norm_name: Norm = ("INSTANCE", {"affine": True})
    act_name: Act = ("leakyrelu", {"inplace": True, "negative_slope": 0.01})
    deep_supervision: bool = False
    res_block: bool = False
    trans_bias: bool = False

    @property
    def planned(self) -> bool:
        """Whether the kernels and strides are planned from the network input (not given)."""
        return self.strides is None

    @property
    def planned_depth(self) -> int:
        """The most downsamplings planned strides may make: nnU-Net's 5, or ``len(filters) - 1`` when fewer."""
        return MAX_DOWNSAMPLINGS if self.filters is None else min(MAX_DOWNSAMPLINGS, len(self.filters) - 1)

    @model_validator(mode="after")
    def _consistent(self) -> DynUNetParams:
        if self.deep_supervision:
            raise ValueError("model.params.deep_supervision must be false: set training.deep_supervision: true "
                             "instead, which builds DynUNet's heads at every decoder level but the lowest and weighs "
                             "their losses as nnU-Net does")
        if (self.kernel_size is None) != (self.strides is None):
            raise ValueError("kernel_size and strides are given together (one entry per level), or both left out "
                             "to be planned from the network input")
        if self.strides is None:
            if self.upsample_kernel_size is not None:
                raise ValueError("upsample_kernel_size needs the strides it upsamples: give kernel_size and strides "
                                 "too, or leave all three out to plan them")
            _groups_divide(self.norm_name, "norm_name", {f"filters[{i}]": f for i, f in
                                                         enumerate(self.filters or nnunet_filters(6))})
            return self
        assert self.kernel_size is not None
        levels = len(self.strides)
        if len(self.kernel_size) != levels or levels < 3:
            raise ValueError(f"kernel_size and strides need one entry per level and at least three levels (input, "
                             f"one downsampling, bottleneck), got {len(self.kernel_size)} kernels and {levels} strides")
        strides = [_per_axis(s) for s in self.strides]
        kernels = [_per_axis(k) for k in self.kernel_size]
        if strides[0] != (1, 1, 1):
            raise ValueError(f"strides[0] must be 1: the first level works at the input's resolution, so that the "
                             f"output is the input's size, got {self.strides[0]}")
        for level, (stride, kernel) in enumerate(zip(strides, kernels)):
            for s, k in zip(stride, kernel):
                if (s == 1 and k % 2 == 0) or k < s - 1:
                    raise ValueError(f"level {level}: kernel_size {self.kernel_size[level]} with stride "
                                     f"{self.strides[level]} does not keep the feature map's size (stride 1 needs an "
                                     f"odd kernel, stride s a kernel of at least s - 1)")
        if self.upsample_kernel_size is not None:
            if len(self.upsample_kernel_size) != levels - 1:
                raise ValueError(f"upsample_kernel_size needs one entry per upsampling, len(strides) - 1 = "
                                 f"{levels - 1}, got {len(self.upsample_kernel_size)}")
            for level, up in enumerate(self.upsample_kernel_size, start=1):
                if any(k < s - 1 for k, s in zip(_per_axis(up), strides[level])):
                    raise ValueError(f"upsample_kernel_size[{level - 1}] {up} is smaller than stride - 1 of "
                                     f"strides[{level}] {self.strides[level]}")
        if self.filters is not None and len(self.filters) < levels:
            raise ValueError(f"filters needs one entry per level ({levels}), got {list(self.filters)}")
        filters = (self.filters or nnunet_filters(levels))[:levels]
        _groups_divide(self.norm_name, "norm_name", {f"filters[{i}]": f for i, f in enumerate(filters)})
        return self

    def downsampling(self) -> tuple[int, int, int] | None:
        """Given strides: their product along each axis (every input dimension must divide by it); planned: None."""
        if self.strides is None:
            return None
        product = [1, 1, 1]
        for stride in self.strides:
            product = [p * s for p, s in zip(product, _per_axis(stride))]
        return tuple(product)  # type: ignore[return-value]


class BasicUNetParams(NetworkParams):
    """MONAI's BasicUNet: a U-Net of four 2x max-poolings, ``features`` the filters of its five encoder levels and
    of its last decoder level.

    Left out: ``spatial_dims``, ``in_channels``, ``out_channels`` (distmis's).
    """

    features: PositiveInts = Field((32, 32, 64, 128, 256, 32), min_length=6, max_length=6)
    act: Act = ("LeakyReLU", {"negative_slope": 0.1, "inplace": True})
    norm: Norm = ("instance", {"affine": True})
    bias: bool = True
    dropout: Rate = 0.0
    upsample: Literal["deconv", "nontrainable", "pixelshuffle"] = "deconv"

    @model_validator(mode="after")
    def _consistent(self) -> BasicUNetParams:
        _groups_divide(self.norm, "norm", {f"features[{i}]": f for i, f in enumerate(self.features)})
        return self
