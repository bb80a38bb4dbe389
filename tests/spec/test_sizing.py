"""degree: auto on the shipped vit-seg spec (search_spaces/vit_sp.yaml): the degree each patch size gets."""

from __future__ import annotations

from pathlib import Path

from distmis.spec import apply_config, load_spec
from distmis.spec.load import network_input
from distmis.spec.sizing import PROCESS_RESERVE, AutoDegree, auto_sp_degree, memory_configs

SPEC = Path(__file__).parents[2] / "search_spaces" / "vit_sp.yaml"


def choose(spec, config) -> AutoDegree:
    trial = apply_config(spec, config)
    return auto_sp_degree(trial, network_input(trial))


def test_degree_auto_is_the_smallest_degree_that_fits():
    spec = load_spec(SPEC)  # degree: auto, memory_per_worker 6GB, max_degree 4, math kernel
    at = {patch: choose(spec, {"model.params.patch": patch}) for patch in (16, 8, 4)}
    assert {patch: choice.degree for patch, choice in at.items()} == {16: 1, 8: 1, 4: 4}
    assert set(at[4].peaks) == {1, 2, 4}  # ulysses: 4 heads allow 1, 2 and 4 (not 3)
    assert at[4].peaks[2] > at[4].usable >= at[4].peaks[4]
    roomy = apply_config(spec, {"model.params.patch": 4, "parallelism.sequence_parallel.memory_per_worker": 64e9})
    assert choose(roomy, {}).degree == 1
    fused = apply_config(spec, {"model.params.patch": 4, "model.params.attention_kernel": "fused"})
    assert choose(fused, {}).degree == 1  # no score matrices: one worker holds patch 4
    tight = choose(spec, {"model.params.patch": 4, "parallelism.sequence_parallel.max_degree": 2})
    assert tight.degree is None
    assert "no degree up to 2 fits tile 96x96x96 at patch 4 (13824 tokens, math attention kernel)" in tight.reason()


def test_the_usable_memory_is_the_workers_less_the_process_reserve():
    choice = choose(load_spec(SPEC), {"model.params.patch": 4})
    assert choice.usable == 6e9 - PROCESS_RESERVE == choice.memory_per_worker - 512 * 2**20


def test_the_combinations_are_the_searched_shape_values():
    spec = load_spec(SPEC, {"search.space": {"model.params.patch": {"grid": [16, 8]},
                                             "model.params.layers": {"grid": [1, 2]},
                                             "training.optimizer.lr": {"grid": [1e-4, 1e-3]}}})
    configs = memory_configs(spec)  # the learning rate does not change the memory
    assert configs == [{"model.params.patch": p, "model.params.layers": n} for p in (16, 8) for n in (1, 2)]


def test_degree_auto_on_an_axial_model_with_dsp():
    """Axial attention holds s (gh + gw + gd) scores, not s^2: patch 4 fits one worker, and patch 2 (110,592
    tokens, about 3 GB of activations on one worker) is sized like any other; DSP is tried only at degrees
    that divide two grid axes."""
    spec = apply_config(load_spec(SPEC), {"model.params.attention": "axial",
                                          "parallelism.sequence_parallel.attention": "dsp"})
    assert choose(spec, {"model.params.patch": 4}).degree == 1
    patch2 = choose(spec, {"model.params.patch": 2, "parallelism.sequence_parallel.memory_per_worker": "2GB"})
    assert set(patch2.peaks) == {1, 2, 3, 4}  # a 48^3 grid: every degree up to 4 divides its three axes
    assert patch2.degree is not None and patch2.degree > 1
    assert patch2.peaks[patch2.degree] <= patch2.usable < patch2.peaks[patch2.degree - 1]
    odd = choose(spec, {"model.params.patch": 2, "training.tile": [96, 80, 80],
                        "parallelism.sequence_parallel.memory_per_worker": "64GB"})
    assert set(odd.peaks) == {1, 2, 4} and odd.degree == 1  # 48 x 40 x 40: degree 3 divides one axis only
