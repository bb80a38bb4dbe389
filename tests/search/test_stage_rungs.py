"""``search.scheduler: stage-asha`` (:mod:`distmis.search.stage_rungs`): Tune's ASHA rule at the ends of the
curriculum's stages. End to end: tests/search/test_schedulers.py; the benchmark against the grid:
benchmarks/stage_rungs.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from ray.tune.schedulers import TrialScheduler

from distmis.search.search_space import scheduler
from distmis.search.stage_rungs import StageRungASHA, stage_rungs
from distmis.spec import validate_spec
from distmis.spec.load import SpecError
from distmis.spec.searchers import scheduler_entry
from tests.conftest import small_spec_tree

CURRICULUM = [{"tile": [8, 8, 8], "epochs": 2}, {"tile": [12, 12, 12], "epochs": 3}, {"tile": None, "epochs": 3}]


def stage_tree(tmp_path: Path, curriculum=CURRICULUM) -> dict:
    tree = small_spec_tree(tmp_path / "data")
    tree["training"] = {"curriculum": curriculum, "batch_size": 2}
    tree["search"].update(scheduler="stage-asha", stage_asha={"reduction_factor": 2})
    return tree


def test_the_rungs_are_the_ends_of_the_stages_but_the_last(tmp_path: Path):
    spec = validate_spec(stage_tree(tmp_path))
    assert spec.training.epochs == 8 and stage_rungs(spec.training) == [2, 5]
    made = scheduler(spec)
    assert isinstance(made, StageRungASHA) and made.rungs == [2, 5]
    # the makespan plan's expectation: the first trial to arrive trains every epoch, the others stop at a stage's end
    planned = scheduler_entry("stage-asha").planned_epochs(4, spec)
    assert planned[0] == 8 and set(planned) <= {2.0, 5.0, 8.0}


def test_a_trial_goes_on_past_a_stage_only_in_the_top_share_of_those_recorded_there():
    made = StageRungASHA([2, 5], max_t=8, reduction_factor=2)
    made.set_search_properties("val_dice", "max")
    trials = {name: SimpleNamespace(trial_id=name) for name in "abcd"}
    for trial in trials.values():
        made.on_trial_add(None, trial)

    def report(name: str, epoch: int, dice: float) -> str:
        return made.on_trial_result(None, trials[name], {"epoch": epoch, "val_dice": dice})

    assert report("a", 1, 0.1) == TrialScheduler.CONTINUE  # inside a stage: never judged
    assert report("a", 2, 0.5) == TrialScheduler.CONTINUE  # the first at a rung goes on
    assert report("b", 2, 0.3) == TrialScheduler.STOP  # below the median of [0.5]
    assert report("c", 2, 0.6) == TrialScheduler.CONTINUE
    assert report("a", 3, 0.9) == TrialScheduler.CONTINUE and report("a", 4, 0.9) == TrialScheduler.CONTINUE
    assert report("a", 5, 0.7) == TrialScheduler.CONTINUE
    assert report("c", 5, 0.65) == TrialScheduler.STOP
    assert report("d", 3, 0.8) == TrialScheduler.CONTINUE  # past the first rung unjudged: judged there now, and on


def test_stage_asha_needs_a_curriculum_of_two_stages(tmp_path: Path):
    for curriculum, why in ((None, "there is no curriculum"), ([{"tile": None, "epochs": 4}], "has one stage")):
        tree = stage_tree(tmp_path, curriculum)
        if curriculum is None:
            tree["training"] = {"epochs": 4}
        with pytest.raises(SpecError, match=why):
            validate_spec(tree)
    with pytest.raises(ValueError, match="rungs must be epochs within 1..7"):
        StageRungASHA([8], max_t=8, reduction_factor=2)
