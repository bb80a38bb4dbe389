"""Population-based training end to end (issue 51), in each framework: two trials whose learning rates differ by
300x, perturbed every epoch, the bottom half exploiting the top. Each trial takes both CPUs of the session's Ray, so
the two take turns, as a population larger than its cluster does: PBT pauses a trial after each epoch while the other
waits, and both have reported before either can end. Run side by side instead, one trial's few tiny epochs could all
end before the other's process had started (they take a third of a second each), leaving PBT a population of one
(CI, with a second pytest worker beside it). The trial that falls behind goes on from the other's
checkpoint: its run says from which trial and run, at which epoch and from which checkpoint (``distmis.pbt.exploits``),
its learning rate per epoch (``pbt/training.optimizer.lr``) shows the explored value from the epoch after, and its
epochs go on after the donor's checkpoint's. The search registers its best model. The exploit's effect inside the
trial's process (the weights, the optimizer's rate): ``tests/trial/test_pbt_exploit.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from distmis.search.run import run_search
from distmis.spec import validate_spec
from distmis.tracking.lineage import EXPLOITS_TAG, PBT_PREFIX
from distmis.tracking.results import trial_runs
from tests.conftest import small_spec_tree

pytestmark = pytest.mark.slow  # whole searches on the local Ray

EPOCHS = 4  # taking turns, the first exploit comes after the second epoch at the latest
LRS = [3.0e-2, 1.0e-4]


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_a_trial_behind_goes_on_from_a_better_ones_checkpoint_and_says_so(ray_local, tmp_path: Path,
                                                                            framework: str):
    tree = small_spec_tree(tmp_path / "data")
    tree["model"]["framework"] = framework
    tree["training"]["epochs"] = EPOCHS
    tree["parallelism"]["resources_per_trial"] = {"cpu": 2}  # the session's Ray has 2: one trial at a time
    tree["search"].update(scheduler="pbt", space={"training.optimizer.lr": {"grid": LRS}},
                          pbt={"interval": 1, "quantile": 0.5, "resample_probability": 0.0})
    outcome = run_search(validate_spec(tree), tmp_path / "out", progress=False)
    assert outcome.failed == 0 and outcome.model is not None

    client = MlflowClient(outcome.tracking_uri)
    runs = {run.data.tags["distmis.trial_id"]: run for run in trial_runs(client, client.get_run(outcome.parent_run_id))}
    assert len(runs) == 2 and all(run.info.status == "FINISHED" for run in runs.values())
    exploited = {trial: json.loads(run.data.tags[EXPLOITS_TAG]) for trial, run in runs.items()
                 if EXPLOITS_TAG in run.data.tags}
    assert exploited, "no trial exploited the other"
    for trial, exploits in exploited.items():
        run = runs[trial]
        (donor,) = set(runs) - {trial}
        lrs: dict[int, list[float]] = {}  # an epoch trained again after an exploit is logged again
        for metric in client.get_metric_history(run.info.run_id, f"{PBT_PREFIX}training.optimizer.lr"):
            lrs.setdefault(metric.step, []).append(metric.value)
        donor_epochs = {m.step for m in client.get_metric_history(runs[donor].info.run_id, "val_dice")}
        for exploit in exploits:
            assert exploit["from"] == donor and exploit["from_run"] == runs[donor].info.run_id
            # an epoch the donor trained, with one left to train after it: the checkpoint PBT chose (at most the
            # donor's epoch when it chose) or, where the receiver waited paused while the donor trained on and
            # emptied that one, the donor's nearest newer one (trial.checkpoints.exploit_candidates)
            assert 1 <= exploit["went_on_after"] < EPOCHS and exploit["went_on_after"] in donor_epochs
            assert exploit["epoch"] >= 1 and 1 <= exploit["donor_epoch"] < EPOCHS
            assert exploit["values"]["training.optimizer.lr"] in LRS
        last = exploits[-1]
        # the epoch after the one it went on after trained at the explored rate; every epoch up to the end is logged
        assert pytest.approx(last["values"]["training.optimizer.lr"]) in lrs[last["went_on_after"] + 1]
        steps = {m.step for m in client.get_metric_history(run.info.run_id, "val_dice")}
        assert set(range(last["went_on_after"] + 1, EPOCHS + 1)) <= steps
    assert {float(lr) for lr in outcome.results["lr"]} <= set(LRS)
