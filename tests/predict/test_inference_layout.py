"""The layout a search's torch network predicts in (:func:`distmis.pyfunc_model.inference_memory_format`): measured
once per network, window batch and device (a fake clock here, never a real timing), the faster taken, the weights
left in it; the same probabilities in either layout."""

from __future__ import annotations

import copy

import numpy as np
import torch

from distmis import pyfunc_model as pm
from tests.predict.test_ensemble import unets
from tests.predict.test_mirror import recipe
from tests.train.test_step_settings import ScriptedClock

BATCH = (3, 4, 8, 8, 8)  # the recipe's inference batch of 8^3 windows, its four modalities


def weights_channels_last(network: torch.nn.Module) -> bool:
    weights = [p for p in network.parameters() if p.dim() == 5]
    assert weights
    return all(p.is_contiguous(memory_format=torch.channels_last_3d) for p in weights)


def test_the_faster_layout_is_measured_once_and_kept():
    network = unets(recipe(), 1)[0]
    # a warm-up and two forwards in each layout: contiguous 1.0 s, channels-last 0.5 s
    clock = ScriptedClock([9.0, 1.0, 1.0, 9.0, 0.5, 0.5])
    assert pm.inference_memory_format(network, BATCH, timer=clock) == "channels_last"
    assert weights_channels_last(network) and not clock.readings  # every reading taken
    assert pm.inference_memory_format(network, BATCH, timer=ScriptedClock([])) == "channels_last"  # remembered
    other = unets(recipe(), 1)[0]  # faster, but by less than 5%: contiguous
    assert pm.inference_memory_format(other, BATCH, timer=ScriptedClock([9.0, 1.0, 1.0, 9.0, 0.97, 0.97])) \
        == "contiguous"
    assert not weights_channels_last(other)
    assert pm.inference_memory_format(lambda windows: windows, BATCH) == "contiguous"  # a function: as it is


def test_either_layout_predicts_the_same_probabilities():
    network = unets(recipe(), 1)[0]
    contiguous = copy.deepcopy(network)
    pm.inference_memory_format(network, BATCH, timer=ScriptedClock([9.0, 1.0, 1.0, 9.0, 0.5, 0.5]))
    pm.inference_memory_format(contiguous, BATCH, timer=ScriptedClock([9.0, 0.5, 0.5, 9.0, 1.0, 1.0]))
    assert weights_channels_last(network) and not weights_channels_last(contiguous)
    stored = recipe().to_dict()
    volume = np.random.default_rng(0).normal(size=(12, 12, 12, 4)).astype(np.float32)
    np.testing.assert_allclose(pm.network_probabilities(network, volume, stored),
                               pm.network_probabilities(contiguous, volume, stored), atol=1e-5)
