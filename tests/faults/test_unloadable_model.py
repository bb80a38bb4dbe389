"""A search whose best trial's weights cannot be loaded does not exit 0 (issue 32, case 1's second half): the
summary names the trial and why, nothing is published, and ``distmis run`` would exit 1.

Real Ray, real Tune checkpoints, a real sqlite store; the trial reports a complete training state whose weights
file is cut short, as a disk that filled up while it was written would leave it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from distmis.cli.main import print_search
from distmis.search.run import run_search
from distmis.spec import validate_spec
from distmis.tracking.results import trial_runs
from distmis.trial.record import RESUME_DIR, STATE_FILE, TrainingState
from tests.conftest import small_spec_tree

pytestmark = pytest.mark.slow  # a search on the shared local Ray


def trial_with_cut_weights(config: dict[str, Any], **kwargs: Any) -> None:
    """One epoch, reported with a checkpoint whose best weights (``model.weights.h5``) are a few bytes of a file."""
    from ray import tune

    metrics = {"epoch": 1, "train_loss": 0.5, "val_loss": 0.5, "val_dice": 0.5, "epoch_seconds": 1.0}
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "model.weights.h5").write_bytes(b"\x89HDF\r\n")  # an HDF5 signature, then nothing
        (Path(folder) / RESUME_DIR).mkdir()
        state = TrainingState(epoch=1, best_value=0.5, best_epoch=1, history=[metrics])
        (Path(folder) / RESUME_DIR / STATE_FILE).write_text(state.to_json())
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(folder))


def test_best_weights_that_cannot_be_loaded_fail_the_search_naming_the_trial(ray_local, tmp_path: Path, capsys):
    tree = small_spec_tree(tmp_path / "data")
    tree["training"]["epochs"] = 1
    tree["search"]["space"] = {"training.optimizer.lr": {"grid": [1.0e-3]}}
    spec = validate_spec(tree)
    outcome = run_search(spec, tmp_path / "out", progress=False, trainable=trial_with_cut_weights)

    assert outcome.failed == 0 and outcome.model is None and outcome.test is None
    (problem,) = outcome.problems
    client = MlflowClient(outcome.tracking_uri)
    (run,) = trial_runs(client, client.get_run(outcome.parent_run_id))
    assert f"trial {run.data.tags['distmis.trial_id']}'s best weights could not be loaded" in problem
    assert "model.weights.h5" in problem or "OSError" in problem or "HDF5" in problem, problem
    assert print_search(spec, outcome, tmp_path / "out") == 1
    assert problem in capsys.readouterr().err
    assert not (tmp_path / "out" / "model").exists()
    assert "could not be loaded" in client.get_run(outcome.parent_run_id).data.tags["distmis.test_error"]
    assert client.search_registered_models() == []
