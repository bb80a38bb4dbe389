"""The model registry: one entry per network distmis can search (torchtitan's ``ModelSpec``).

An entry says everything the rest of distmis needs to know about a network, so that nothing else branches on
``model.name``:

- ``params``: the pydantic class of its ``model.params`` (:mod:`distmis.models.params`: the constructor's
  arguments a spec may set and search);
- ``frameworks``: which of ``torch`` / ``tensorflow`` build it;
- ``parallelisms``: ``dp`` for every network, ``sp`` (sequence parallelism) for the ViT, ``pp`` (pipeline
  stages) for the U-Net, each with the function that applies it from outside the model (``parallelize``,
  ``pipeline``);
- ``output``: what its forward returns, ``probabilities`` (its activation inside) or ``logits`` (the trainer
  trains on logits and applies the target scheme's activation to predict);
- its input-size rules (``input_multiple``, ``input_rule``; ``fixed_input`` for a network built for one input
  size, whose curriculum may not change the tile) and so its inference window;
- ``perf_shape``: where the performance model describes it, its arithmetic shape
  (:class:`~distmis.perf.model.ViTShape`).

Builders are named as ``"module:function"`` strings and imported when a network is built, so that reading the
registry (the spec's checks, the CLI) imports no torch. Adding a network is one entry here, its params class, its
builder, one test and one docs row.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

from distmis.models.params import NetworkParams, UNet3DParams, ViTSegParams
from distmis.perf.model import ViTShape

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

__all__ = ["Framework", "Parallelism", "Output", "PARALLELISM_NAMES", "NetworkInput", "ModelEntry", "MODELS",
           "model_entry", "model_names"]

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
    activation, the network input's size (the tile, or the whole volume) and the preprocessed voxel spacing."""

    in_channels: int
    out_channels: int
    tile: tuple[int, int, int]
    activation: Literal["sigmoid", "softmax"] = "sigmoid"
    spacing: tuple[float, float, float] | None = None


def _import(target: str) -> Any:
    """``"package.module:attribute"`` -> the attribute."""
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class ModelEntry:
    """One registered network (see the module's docstring)."""

    name: str
    params: type[NetworkParams]
    frameworks: tuple[Framework, ...]
    output: Output
    builders: dict[str, str]  # framework -> "module:function" taking (params, NetworkInput)
    input_multiple: Callable[[Any], int]  # params -> every input dimension must divide by it
    input_rule: Callable[[Any], str]  # params -> why, for messages
    parallelisms: frozenset[str] = frozenset({"dp"})
    fixed_input: bool = False  # built for one input size (position embeddings): the tile may not change
    parallelize: str | None = None  # "module:function" applying sequence parallelism from outside
    pipeline: str | None = None  # "module:function" cutting the network into pipeline stages
    perf_shape: Callable[[Any, Sequence[int], int, int], ViTShape] | None = None
    constructor: str | None = None  # the library class it builds ("monai.networks.nets:SegResNet"), if any
    summary: str = ""
    loss_from_logits: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss_from_logits", self.output == "logits")
        if "dp" not in self.parallelisms:
            raise ValueError(f"model {self.name!r}: every network supports data parallelism ('dp')")
        if ("sp" in self.parallelisms) != (self.parallelize is not None):
            raise ValueError(f"model {self.name!r}: sequence parallelism ('sp') needs a parallelize function")
        if ("pp" in self.parallelisms) != (self.pipeline is not None):
            raise ValueError(f"model {self.name!r}: pipeline stages ('pp') need a pipeline function")

    def supports(self, parallelism: str) -> bool:
        return parallelism in self.parallelisms

    def build(self, params: NetworkParams, network_input: NetworkInput, framework: Framework = "torch") -> nn.Module:
        """The network for ``params`` and ``network_input`` (built on the CPU, in the caller's random state)."""
        if framework not in self.builders:
            raise ValueError(f"model {self.name!r} has no {framework} builder; frameworks: {list(self.frameworks)}")
        return _import(self.builders[framework])(params, network_input)

    def parallelize_function(self) -> Callable[..., Any]:
        if self.parallelize is None:
            raise ValueError(f"model {self.name!r} does not support {PARALLELISM_NAMES['sp']}")
        return _import(self.parallelize)

    def pipeline_function(self) -> Callable[..., Any]:
        if self.pipeline is None:
            raise ValueError(f"model {self.name!r} does not support {PARALLELISM_NAMES['pp']}")
        return _import(self.pipeline)


def _vit_shape(params: ViTSegParams, tile: Sequence[int], in_channels: int, out_channels: int) -> ViTShape:
    """vit-seg's arithmetic shape on ``tile``: the one place it is made from a spec's params."""
    return ViTShape.of(params, tile, in_channels=in_channels, num_classes=out_channels)


MODELS: dict[str, ModelEntry] = {
    entry.name: entry
    for entry in (
        ModelEntry(
            name="unet3d", params=UNet3DParams, frameworks=("tensorflow", "torch"), output="probabilities",
            builders={"torch": "distmis.models.unet3d_torch:build_unet3d"},
            input_multiple=lambda p: 2 ** (p.levels - 1),
            input_rule=lambda p: f"2**(levels-1) for levels={p.levels}",
            parallelisms=frozenset({"dp", "pp"}), pipeline="distmis.parallel.pipeline:pipeline_unet",
            summary="the DistMIS paper's 3D U-Net (TensorFlow and torch)",
        ),
        ModelEntry(
            name="vit-seg", params=ViTSegParams, frameworks=("torch",), output="logits",
            builders={"torch": "distmis.models.vit_seg:build_vit_seg"},
            input_multiple=lambda p: p.patch,
            input_rule=lambda p: f"the patch size, model.params.patch={p.patch}",
            parallelisms=frozenset({"dp", "sp"}), fixed_input=True,
            parallelize="distmis.parallel.sequence:parallelize_vit_seg", perf_shape=_vit_shape,
            summary="a ViT encoder with a convolutional decoder (sequence-parallel)",
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
