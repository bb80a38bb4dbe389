"""The registries' composition: each registered network bound to the code that builds it and the code that
parallelizes it from outside (as torchtitan's model ``__init__`` binds a ``ModelSpec`` to real callables).

The model registry (:mod:`distmis.models.registry`) says what a network is (its params class, frameworks, input
rules, which parallelisms it supports) and imports no torch, TensorFlow or parallelism code, so that a spec is
checked without them. This module binds each entry, by name, to

- a builder per framework (``(params, NetworkInput) -> network``), which imports its network's module when called;
- with ``sp`` among its parallelisms, the function that applies sequence parallelism to it
  (:func:`~distmis.parallel.sequence.parallelize_vit_seg`);
- with ``pp``, the function that cuts it into pipeline stages (:func:`~distmis.parallel.pipeline.pipeline_unet`).

Every import is written out (those inside the builders too), so the layering test sees each edge. The trainers
(:mod:`distmis.train`) build and parallelize networks through :func:`build_network`, :func:`parallelize_function`
and :func:`pipeline_function`. Adding a network: its registry entry, its builder, and one :class:`Bindings` here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from distmis.models.params import (BasicUNetParams, DynUNetParams, NetworkParams, SegResNetParams, SwinUNETRParams,
                                   UNet3DParams, UNETRParams, ViTSegParams)
from distmis.models.registry import MODELS, PARALLELISM_NAMES, Framework, ModelEntry, NetworkInput

if TYPE_CHECKING:  # pragma: no cover
    import keras
    from torch import nn

    from distmis.parallel.pipeline import UNetPipeline

__all__ = ["Builder", "SequenceParallelize", "PipelineCut", "Bindings", "BINDINGS", "bindings", "build_network",
           "parallelize_function", "pipeline_function", "binding_problems"]


class Builder(Protocol):
    """Builds a network for its ``model.params`` and input (on the CPU, in the caller's random state)."""

    def __call__(self, params: NetworkParams, network: NetworkInput, /) -> nn.Module | keras.Model: ...


class SequenceParallelize(Protocol):
    """Applies sequence parallelism over ``sp_group`` to a plain network, in place; returns the parallel module."""

    def __call__(self, model: nn.Module, sp_group: object = None, *, attention: str = ..., decoder: str = ...,
                 split: str = ...) -> nn.Module: ...


class PipelineCut(Protocol):
    """This rank's stage of a network cut into as many stages as ``group`` holds, with its schedule."""

    def __call__(self, model: nn.Module, *, tile: tuple[int, ...], microbatches: int, batch_size: int,
                 schedule: str = ..., loss_fn: object, group: object = None, device: object = ...,
                 compute_dtype: object = None) -> UNetPipeline: ...


@dataclass(frozen=True)
class Bindings:
    """A registered network's code: a builder per framework, and its parallelizing functions."""

    builders: Mapping[str, Builder] = field(default_factory=dict)
    parallelize: SequenceParallelize | None = None
    pipeline: PipelineCut | None = None


# --------------------------------------------------------------------------- builders (each imports its network)
def _unet3d_torch(params: UNet3DParams, network: NetworkInput) -> nn.Module:
    from distmis.models.unet3d_torch import build_unet3d

    return build_unet3d(params, network)


def _unet3d_keras(params: UNet3DParams, network: NetworkInput) -> keras.Model:
    from distmis.models.unet3d_tf import build_keras_unet3d

    return build_keras_unet3d(params, network)


def _vit_seg(params: ViTSegParams, network: NetworkInput) -> nn.Module:
    from distmis.models.vit_seg import build_vit_seg

    return build_vit_seg(params, network)


def _segresnet(params: SegResNetParams, network: NetworkInput) -> nn.Module:
    from distmis.models.monai_nets import build_segresnet

    return build_segresnet(params, network)


def _unetr(params: UNETRParams, network: NetworkInput) -> nn.Module:
    from distmis.models.monai_nets import build_unetr

    return build_unetr(params, network)


def _swinunetr(params: SwinUNETRParams, network: NetworkInput) -> nn.Module:
    from distmis.models.monai_nets import build_swinunetr

    return build_swinunetr(params, network)


def _dynunet(params: DynUNetParams, network: NetworkInput) -> nn.Module:
    from distmis.models.monai_nets import build_dynunet

    return build_dynunet(params, network)


def _basicunet(params: BasicUNetParams, network: NetworkInput) -> nn.Module:
    from distmis.models.monai_nets import build_basicunet

    return build_basicunet(params, network)


# --------------------------------------------------------------------------- parallelism applied from outside
def _parallelize_vit_seg(model: nn.Module, sp_group: object = None, **options: str) -> nn.Module:
    from distmis.parallel.sequence import parallelize_vit_seg

    return parallelize_vit_seg(model, sp_group, **options)  # type: ignore[arg-type]


def _pipeline_unet(model: nn.Module, **options: object) -> UNetPipeline:
    from distmis.parallel.pipeline import pipeline_unet

    return pipeline_unet(model, **options)  # type: ignore[arg-type]


#: Each registered network's code, by its registry name.
BINDINGS: dict[str, Bindings] = {
    "unet3d": Bindings({"torch": _unet3d_torch, "tensorflow": _unet3d_keras}, pipeline=_pipeline_unet),
    "vit-seg": Bindings({"torch": _vit_seg}, parallelize=_parallelize_vit_seg),
    "segresnet": Bindings({"torch": _segresnet}),
    "unetr": Bindings({"torch": _unetr}),
    "swinunetr": Bindings({"torch": _swinunetr}),
    "dynunet": Bindings({"torch": _dynunet}),
    "basicunet": Bindings({"torch": _basicunet}),
}


def binding_problems(models: Mapping[str, ModelEntry], bound: Mapping[str, Bindings]) -> list[str]:
    """What does not match between the registry's entries and their bindings: a network without bindings (or
    bindings without a network), a framework without a builder, a parallelism without its function (or a function
    without the parallelism)."""
    problems = [f"{name!r} is registered but has no bindings" for name in models if name not in bound]
    problems += [f"{name!r} has bindings but no registry entry" for name in bound if name not in models]
    for name, entry in models.items():
        if name not in bound:
            continue
        code = bound[name]
        if set(code.builders) != set(entry.frameworks):
            problems.append(f"{name!r}: builders for {sorted(code.builders)}, frameworks {sorted(entry.frameworks)}")
        if entry.supports("sp") != (code.parallelize is not None):
            problems.append(f"{name!r}: {PARALLELISM_NAMES['sp']} needs a parallelize function, and only it")
        if entry.supports("pp") != (code.pipeline is not None):
            problems.append(f"{name!r}: {PARALLELISM_NAMES['pp']} needs a pipeline function, and only it")
    return problems


def bindings(name: str) -> Bindings:
    """The code of the registered network ``name``; ValueError naming the registered networks."""
    try:
        return BINDINGS[name]
    except KeyError:
        raise ValueError(f"no model {name!r}; registered: {', '.join(MODELS)}") from None


def build_network(entry: ModelEntry, params: NetworkParams, network: NetworkInput,
                  framework: Framework = "torch") -> nn.Module | keras.Model:
    """``entry``'s network for ``params`` and ``network`` (built on the CPU, in the caller's random state)."""
    builders = bindings(entry.name).builders
    if framework not in builders:
        raise ValueError(f"model {entry.name!r} has no {framework} builder; frameworks: {list(entry.frameworks)}")
    return builders[framework](params, network)


def parallelize_function(entry: ModelEntry) -> SequenceParallelize:
    """The function that applies sequence parallelism to ``entry``'s network; ValueError when it has none."""
    function = bindings(entry.name).parallelize
    if function is None:
        raise ValueError(f"model {entry.name!r} does not support {PARALLELISM_NAMES['sp']}")
    return function


def pipeline_function(entry: ModelEntry) -> PipelineCut:
    """The function that cuts ``entry``'s network into pipeline stages; ValueError when it has none."""
    function = bindings(entry.name).pipeline
    if function is None:
        raise ValueError(f"model {entry.name!r} does not support {PARALLELISM_NAMES['pp']}")
    return function
