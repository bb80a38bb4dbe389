"""A trial's performance-model predictions (what the MLflow callback logs): the performance model's numbers for
the trial's own layout, batch and kernel, for the networks whose registry entry has a ``perf_shape``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from distmis.data.layouts import MODALITIES
from distmis.perf.model import SequenceLayout, ViTShape, communication_bytes, vit_flops, vit_memory
from distmis.tracking.predicted import MIB, PREDICTED_METRICS, predict_trial, trial_shape
from distmis.spec import validate_spec
from distmis.spec.layout import resolve_trial
from tests.conftest import small_spec_tree

VIT = {"name": "vit-seg", "framework": "torch",
       "params": {"layers": 2, "embed_dim": 32, "heads": 4, "patch": 4, "decoder_features": 16,
                  "attention_kernel": "math"}}


def vit_tree(sp: int = 1, *, dp: int = 1, attention: str = "ulysses", **training: Any) -> dict[str, Any]:
    tree = small_spec_tree("/nonexistent/data", model=VIT)  # synthetic 16^3 volumes: the spec sizes them
    tree["training"].update({"tile": [16, 16, 16], "batch_size": 2, **training})
    tree["parallelism"] = {"mode": "data", "workers": dp, "resources_per_worker": {"cpu": 1},
                           "sequence_parallel": {"degree": sp, "attention": attention}}
    return tree


def predicted(tree: dict[str, Any]) -> dict[str, float]:
    spec, layout = resolve_trial(validate_spec(tree), {})
    return predict_trial(spec, layout)


def test_the_predictions_are_the_performance_models_for_the_trials_layout():
    spec, layout = resolve_trial(validate_spec(vit_tree(2, dp=2)), {})
    assert (layout.sp, layout.dp) == (2, 2)
    shape = ViTShape((16, 16, 16), 4, 2, 32, 4, 4.0, 16, 4, 1)  # whole-tumour: one class
    sequence = SequenceLayout(sp=2, attention="ulysses", decoder="gather")
    flops, memory = vit_flops(shape, sequence, 2), vit_memory(shape, sequence, batch=2, kernel="math")
    sent = communication_bytes(shape, sequence, batch=2, dp=2, cost="gloo")
    assert predict_trial(spec, layout) == {
        "predicted_flops_per_step": flops.matmul, "predicted_forward_flops": flops.forward,
        "predicted_peak_memory_mb": memory.peak / 2**20, "predicted_step_memory_mb": memory.step / 2**20,
        "predicted_sent_mb": sent.total / 2**20,
    }
    assert tuple(predict_trial(spec, layout)) == PREDICTED_METRICS and MIB == 2**20


def test_sp_2_halves_the_encoders_flops_and_memory_of_sp_1():
    one, two = predicted(vit_tree(1)), predicted(vit_tree(2))
    shape = trial_shape(validate_spec(vit_tree(1)))
    assert shape is not None
    whole = vit_flops(shape, batch=2)
    # SP=2 computes half the patch embedding and the transformer blocks; the gather decoder stays whole.
    assert one["predicted_forward_flops"] - two["predicted_forward_flops"] == pytest.approx(
        (whole.embed_forward + whole.encoder_forward) / 2)
    assert two["predicted_step_memory_mb"] < one["predicted_step_memory_mb"]
    assert one["predicted_sent_mb"] == 0 and two["predicted_sent_mb"] > 0  # one rank sends nothing


def test_the_layout_decides_the_degree_and_dp_the_gradient_bytes():
    spec, layout = resolve_trial(validate_spec(vit_tree(2)), {})
    four = predict_trial(spec, replace(layout, sp=4))  # the layout's degree, whatever the spec's field says
    assert four["predicted_forward_flops"] < predict_trial(spec, layout)["predicted_forward_flops"]
    dp2 = predict_trial(spec, replace(layout, dp=2))
    shape = trial_shape(spec)
    assert shape is not None
    params = communication_bytes(shape, SequenceLayout(sp=2, attention="ulysses"), batch=2, dp=2).dp_gradients
    assert dp2["predicted_sent_mb"] - predict_trial(spec, layout)["predicted_sent_mb"] == pytest.approx(params / MIB)


def test_the_kernel_and_batch_change_the_memory():
    math_kernel = predicted(vit_tree(1))
    tree = vit_tree(1)
    tree["model"] = {**VIT, "params": {**VIT["params"], "attention_kernel": "fused"}}
    fused = predicted(tree)
    assert fused["predicted_peak_memory_mb"] < math_kernel["predicted_peak_memory_mb"]
    assert fused["predicted_flops_per_step"] == math_kernel["predicted_flops_per_step"]
    single = predicted(vit_tree(1, batch_size=1))
    assert single["predicted_forward_flops"] == pytest.approx(math_kernel["predicted_forward_flops"] / 2)


def test_other_models_and_unknown_inputs_have_no_prediction(tmp_path):
    spec, layout = resolve_trial(validate_spec(small_spec_tree("/nonexistent")), {})
    assert predict_trial(spec, layout) == {}  # the U-Net
    tree = vit_tree(1, tile=None)
    tree["dataset"]["path"] = str(tmp_path)  # the data exist: only they know the volume
    spec, layout = resolve_trial(validate_spec(tree), {})
    assert predict_trial(spec, layout) == {}
    whole = predict_trial(spec, layout, volume=(16, 16, 16, 4))
    assert whole == predicted(vit_tree(1))  # the whole 16^3 volume is the tile


def test_the_image_channels_are_the_datasets():
    """The spec's channel count (the model's input) is what every dataset layout reads."""
    assert validate_spec(vit_tree(1)).dataset.in_channels == len(MODALITIES)


def test_the_shape_comes_from_the_registry_entrys_perf_shape(monkeypatch):
    """No network name is asked: a network is predicted when its registry entry has a ``perf_shape``."""
    from distmis.models import registry

    spec, layout = resolve_trial(validate_spec(vit_tree(1)), {})
    assert trial_shape(spec) == registry.MODELS["vit-seg"].perf_shape(spec.model.params, (16, 16, 16), 4, 1)
    monkeypatch.setitem(registry.MODELS, "vit-seg", replace(registry.MODELS["vit-seg"], perf_shape=None))
    assert trial_shape(spec) is None and predict_trial(spec, layout) == {}
