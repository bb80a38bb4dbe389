"""Learning-rate schedules: their formulas at the points that define them, and the spec's checks."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from distmis.spec.schema import LRScheduleSpec, TrainingSpec
from distmis.train.schedules import LearningRateSchedule, lr_factor


def factors(schedule: LRScheduleSpec, epochs: int) -> list[float]:
    return [lr_factor(schedule, e, epochs) for e in range(epochs)]


def test_constant_is_the_peak_throughout():
    assert factors(LRScheduleSpec(), 5) == [1.0] * 5


def test_cosine_from_the_peak_to_its_floor():
    f = factors(LRScheduleSpec(name="cosine"), 4)
    assert f[0] == 1.0
    assert f[2] == pytest.approx(0.5)  # half-way down half a cosine
    assert all(a > b for a, b in zip(f, f[1:]))
    assert lr_factor(LRScheduleSpec(name="cosine", min_factor=0.1), 4, 4) == pytest.approx(0.1)  # the end
    assert lr_factor(LRScheduleSpec(name="cosine", min_factor=0.1), 2, 4) == pytest.approx(0.55)


def test_warmup_rises_linearly_then_the_schedule_runs_over_the_epochs_left():
    s = LRScheduleSpec(name="cosine", warmup_epochs=2, warmup_start_factor=0.2)
    assert lr_factor(s, 0, 6) == pytest.approx(0.2)
    assert lr_factor(s, 1, 6) == pytest.approx(0.6)
    assert lr_factor(s, 2, 6) == pytest.approx(1.0)  # the peak at the end of the warm-up
    assert lr_factor(s, 4, 6) == pytest.approx(0.5)  # half-way through the 4 epochs left


def test_cyclic_is_triangular_between_trough_and_peak():
    s = LRScheduleSpec(name="cyclic", cycle_epochs=4)  # trough 0.25 by default
    assert factors(s, 9) == pytest.approx([0.25, 0.625, 1.0, 0.625, 0.25, 0.625, 1.0, 0.625, 0.25])
    assert lr_factor(LRScheduleSpec(name="cyclic", cycle_epochs=2, min_factor=0.0), 1, 4) == pytest.approx(1.0)


def test_poly_is_nnunets():
    s = LRScheduleSpec(name="poly")
    assert lr_factor(s, 0, 10) == 1.0
    assert lr_factor(s, 5, 10) == pytest.approx(0.5**0.9)
    assert lr_factor(LRScheduleSpec(name="poly", power=1.0), 9, 10) == pytest.approx(0.1)


def test_per_step_progress_moves_within_an_epoch():
    training = TrainingSpec(epochs=4, lr_schedule={"name": "cosine", "interval": "step"})
    rates = LearningRateSchedule.for_training(training, peak=2.0)
    assert rates.per_step
    assert rates.at(1, 0, 4) == pytest.approx(2.0)
    assert rates.at(3, 0, 4) == pytest.approx(1.0)  # progress 2 of 4
    assert rates.at(3, 2, 4) == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * 2.5 / 4)))
    per_epoch = LearningRateSchedule.for_training(TrainingSpec(epochs=4, lr_schedule={"name": "cosine"}), 2.0)
    assert not per_epoch.per_step and per_epoch.at(3, 2, 4) == per_epoch.at(3, 0, 4) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="epochs count from 1"):
        rates.at(0)
    with pytest.raises(ValueError, match="outside an epoch of 4"):
        rates.at(1, 4, 4)


def test_the_peak_is_the_scaled_rate_the_layout_gives():
    rates = LearningRateSchedule.for_training(TrainingSpec(epochs=2, lr_schedule={"name": "poly", "power": 1.0}),
                                              peak=4.0e-3)
    assert rates.at(1) == pytest.approx(4.0e-3) and rates.at(2) == pytest.approx(2.0e-3)


def test_the_spec_refuses_a_warmup_as_long_as_training():
    with pytest.raises(ValidationError, match=r"warmup_epochs \(3\) must be fewer than training.epochs \(3\)"):
        TrainingSpec(epochs=3, lr_schedule={"name": "cosine", "warmup_epochs": 3})
    with pytest.raises(ValidationError, match="name"):
        LRScheduleSpec(name="exponential")
    with pytest.raises(ValidationError, match="interval"):
        LRScheduleSpec(interval="batch")
    with pytest.raises(ValidationError, match="min_factor"):
        LRScheduleSpec(name="cosine", min_factor=1.0)


def test_tile_sampling_needs_tiles():
    with pytest.raises(ValidationError, match=r"tile_sampling \(0.33\) needs training.tile"):
        TrainingSpec(tile_sampling=0.33)
    with pytest.raises(ValidationError, match="tile_sampling"):
        TrainingSpec(tile=[8, 8, 8], tile_sampling=1.5)
    assert TrainingSpec(tile=[8, 8, 8], tile_sampling=0.33).tile_sampling == 0.33
