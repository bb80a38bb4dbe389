"""The registries' composition (distmis.networks): every registered network bound to its builders and to the
functions its parallelisms need, and nothing bound that the registry does not hold."""

from __future__ import annotations

from dataclasses import replace

import pytest

from distmis.models.registry import MODELS, model_entry
from distmis.networks import BINDINGS, Bindings, binding_problems, parallelize_function, pipeline_function


def test_every_registered_network_is_bound_as_its_entry_says():
    assert binding_problems(MODELS, BINDINGS) == []


def test_the_binding_check_finds_a_missing_builder_parallelism_or_network():
    unet = MODELS["unet3d"]
    assert binding_problems({"toy": unet}, {}) == ["'toy' is registered but has no bindings"]
    assert binding_problems({}, {"toy": Bindings()}) == ["'toy' has bindings but no registry entry"]
    torch_only = Bindings({"torch": BINDINGS["unet3d"].builders["torch"]}, pipeline=BINDINGS["unet3d"].pipeline)
    assert binding_problems({"unet3d": unet}, {"unet3d": torch_only}) == [
        "'unet3d': builders for ['torch'], frameworks ['tensorflow', 'torch']"]
    without_pipeline = replace(BINDINGS["unet3d"], pipeline=None)
    [problem] = binding_problems({"unet3d": unet}, {"unet3d": without_pipeline})
    assert "pipeline stages" in problem
    with_parallelize = replace(BINDINGS["unet3d"], parallelize=BINDINGS["vit-seg"].parallelize)
    [problem] = binding_problems({"unet3d": unet}, {"unet3d": with_parallelize})
    assert "sequence parallelism" in problem


def test_a_network_without_a_parallelism_says_so_by_name():
    with pytest.raises(ValueError, match="model 'segresnet' does not support sequence parallelism"):
        parallelize_function(model_entry("segresnet"))
    with pytest.raises(ValueError, match="model 'vit-seg' does not support pipeline stages"):
        pipeline_function(model_entry("vit-seg"))
    from distmis.parallel.pipeline import UNetPipeline  # noqa: F401 - the real functions are bound: they import

    assert callable(pipeline_function(model_entry("unet3d"))) and callable(parallelize_function(model_entry("vit-seg")))
