"""``search.scheduler: stage-asha`` and ``stage-halving`` (:mod:`distmis.search.stage_rungs`): Tune's ASHA rule,
and synchronous successive halving, at the ends of the curriculum's stages. The halving under a real Ray Tune, with
a trainable of a few lines (pauses, restarts from checkpoints, a failure); distmis's searches end to end:
tests/search/test_schedulers.py; the benchmark against the grid: benchmarks/stage_rungs.py."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from ray.tune.schedulers import TrialScheduler

from distmis.search.search_space import scheduler
from distmis.search.folds import Configurations
from distmis.search.stage_rungs import StageRungASHA, StageRungHalving, stage_rungs
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


# --------------------------------------------------------------------------- stage-halving
def halving_tree(tmp_path: Path, **search) -> dict:
    tree = stage_tree(tmp_path)
    tree["search"].update(scheduler="stage-halving", stage_halving={"reduction_factor": 2}, **search)
    tree["search"].pop("stage_asha")
    return tree


def test_halving_plans_exactly_the_epochs_it_will_train(tmp_path: Path):
    spec = validate_spec(halving_tree(tmp_path, space={"training.optimizer.lr": {"grid": [1e-4, 3e-4, 1e-3, 3e-3,
                                                                                           1e-2]}}))
    made = scheduler(spec)
    assert isinstance(made, StageRungHalving) and made.rungs == [2, 5] and made.trials == 5
    # 5 trials reach the first stage's end, 3 go on (ceil(5 / 2)), 2 of them past the second
    assert scheduler_entry("stage-halving").planned_epochs(5, spec) == [8.0, 8.0, 5.0, 2.0, 2.0]


def _data_mode(tree: dict) -> None:
    tree["parallelism"] = {"mode": "data", "workers": 2}


def _folds(tree: dict) -> None:
    tree["dataset"]["split"] = {"test": 0.25, "seed": 0, "folds": 2}


def _budget(tree: dict) -> None:
    tree["search"]["budget"] = {"wall": "1h"}


def _at_once(tree: dict) -> None:
    tree.setdefault("parallelism", {})["max_concurrent_trials"] = 2


@pytest.mark.parametrize("change, culprit, why", [
    (_data_mode, "search.scheduler", "mode 'experiment'"),
    (_folds, "search.scheduler", "each fold's trial on its own"),
    (_budget, "search.budget", "use 'stage-asha' with a budget"),
    (_at_once, "parallelism.max_concurrent_trials", "leave it unset"),
])
def test_halving_refuses_what_it_cannot_pause_and_resume(tmp_path: Path, change, culprit: str, why: str):
    tree = halving_tree(tmp_path)
    change(tree)
    with pytest.raises(SpecError) as refused:
        validate_spec(tree)
    assert f"{culprit}: " in str(refused.value) and why in str(refused.value)
    change(stage_tree(tmp_path))  # the same spec under stage-asha is valid
    asha = stage_tree(tmp_path)
    change(asha)
    validate_spec(asha)


#: six trials, the best last (in the order an asynchronous rule stops none); the 0.9 one dips at the second rung
MERITS = [0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
FLAKY, DIPPING = 0.7, 0.9


def climb(config: dict) -> None:
    """A trial of three epochs whose result is its merit (plus a little each epoch), checkpointed every epoch; it
    goes on from the checkpoint it is given. The FLAKY one fails once before its second epoch; the DIPPING one
    reports a bad second epoch."""
    from ray import tune

    start, given = 0, tune.get_checkpoint()
    if given is not None:
        with given.as_directory() as folder:
            start = json.loads((Path(folder) / "state.json").read_text())["epoch"]
    for epoch in range(start + 1, 4):
        marker = Path(config["marker"])
        if config["merit"] == FLAKY and epoch == 2 and not marker.exists():
            marker.touch()
            raise RuntimeError("a failure Tune retries")
        dice = 0.1 if (config["merit"] == DIPPING and epoch == 2) else config["merit"] + 0.01 * epoch
        with marker.with_name(f"epochs-{config['merit']}.jsonl").open("a") as log:  # what it reported, in order
            log.write(json.dumps({"epoch": epoch, "started_at": start}) + "\n")
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "state.json").write_text(json.dumps({"epoch": epoch}))
            tune.report({"epoch": epoch, "val_dice": dice, "started_at": start},
                        checkpoint=tune.Checkpoint.from_directory(folder))


def test_halving_pauses_every_trial_at_a_rung_and_goes_on_with_the_best_from_their_checkpoints(ray_local,
                                                                                               tmp_path: Path):
    from ray import tune

    space = {"merit": tune.grid_search(MERITS), "marker": str(tmp_path / "failed-once")}
    tuner = tune.Tuner(
        climb,
        tune_config=tune.TuneConfig(metric="val_dice", mode="max", num_samples=len(MERITS),
                                    # distmis's searcher: one trial made at a time, as in its searches
                                    search_alg=Configurations(space, 1, seed=0),
                                    scheduler=StageRungHalving([1, 2], max_t=3, reduction_factor=2,
                                                               trials=len(MERITS))),
        run_config=tune.RunConfig(storage_path=str(tmp_path / "tune"), verbose=0,
                                  failure_config=tune.FailureConfig(max_failures=1)),
    )
    results = tuner.fit()
    assert not results.errors
    # every result each trial reported, as the trial wrote them down (the ResultGrid's frame drops some of a restored
    # trial's, and Tune's progress.csv of a trial may not be in its storage yet when the run returns)
    history = {merit: pd.read_json(tmp_path / f"epochs-{merit}.jsonl", lines=True) for merit in MERITS}
    epochs = {merit: list(frame["epoch"]) for merit, frame in history.items()}
    # rung 1: the best 3 of 6 go on; rung 2: the best 2 of those 3 by their best result so far (the dipping one's
    # 0.91 of its first epoch, not its 0.1 of the second), whatever order they arrived in
    assert epochs == {0.4: [1], 0.5: [1], 0.6: [1], 0.7: [1, 2], 0.8: [1, 2, 3], 0.9: [1, 2, 3]}
    # each trial that went on past a rung went on from its checkpoint there, paused and restarted, but the one whose
    # report completed the rung, which goes on at once in the process it had: one started at 0 or at an earlier rung
    # (paused there and restarted, when another's report completed that rung)
    for rung in (1, 2):
        after = [frame.set_index("epoch").loc[rung + 1, "started_at"] for frame in history.values()
                 if rung + 1 in set(frame["epoch"])]
        earlier = [start for start in after if start != rung]
        assert len(after) >= 2 and len(earlier) <= 1 and all(start < rung for start in earlier)
    assert (tmp_path / "failed-once").exists()  # the flaky one failed, was restarted and kept its place
    assert list(history[FLAKY]["started_at"]) == [0, 1]
