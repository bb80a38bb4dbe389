"""Every registered network's ``model.params``: the arguments of its constructor that a spec may set and search.

One pydantic class per network, unknown keys refused (the spec error names the allowed ones). The arguments
distmis supplies itself (input and output channels, the input size, the output activation, the spatial
dimensions) are not among them. Pure pydantic: no torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


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


