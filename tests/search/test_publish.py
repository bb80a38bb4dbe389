"""Publishing a search's model: the local copy does not depend on the tracking store; a search's end that was
interrupted and is resumed logs, registers and records the test scores once."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from distmis.data.manifest import DataManifest
from distmis.models.unet3d_torch import UNet3D
from distmis.predict.model import SegmentationModel
from distmis.predict.registry import BEST_ALIAS
from distmis.predict.resolve import model_folder
from distmis.search.evaluate import BestModel, Candidate, TestEvaluation
from distmis.search.publish import publish_model
from distmis.search.finish import _record_test
from distmis.spec import validate_spec
from distmis.tracking.mlflow_tracking import SearchRun, default_tracking_uri
from tests.conftest import small_spec_tree


def torch_best_trial(tmp_path: Path) -> tuple[Any, Any, Any]:
    """A torch U-Net spec, a trainer holding its (untrained) model, and its data's manifest: (spec, trainer, data)."""
    tree = small_spec_tree(tmp_path / "data")
    tree["model"] = {"name": "unet3d", "framework": "torch", "params": {"base_filters": 4, "levels": 2}}
    spec = validate_spec(tree)
    trainer = SimpleNamespace(spec=spec, model=UNet3D(in_channels=4, num_classes=1, base_filters=4, levels=2).eval())
    manifest = DataManifest(preprocess={"layout": "msd", "labels": "whole-tumour", "crop": None, "resize": None},
                            image_shape=(16, 16, 16, 4), label_shape=(16, 16, 16, 1), splits={}, num_classes=1)
    data = SimpleNamespace(manifest=manifest)
    return spec, trainer, data


def test_a_store_that_fails_costs_the_registration_not_the_model(tmp_path: Path):
    spec, trainer, data = torch_best_trial(tmp_path)
    unreachable = tmp_path / "not-a-folder"
    unreachable.write_text("a file where the store's folder would be")
    published = publish_model([trainer], BestModel("t_00000", {}, 0.5, None), spec, data,
                              tracking_uri=f"sqlite:///{unreachable / 'mlflow.db'}", trial_run_id="0" * 32,
                              search_run_id="1" * 32, evaluation=None, folder=tmp_path / "out" / "model",
                              register=True)
    assert published.folder == tmp_path / "out" / "model" and published.model_uri is None and published.error
    assert SegmentationModel.load(published.folder).recipe.framework == "torch"  # usable all the same


# --------------------------------------------------------------------------- a search's end, interrupted and resumed
class Killed(KeyboardInterrupt):
    """What a Ctrl-C or a SIGTERM raises in the search's end (a SIGKILL leaves the store the same way)."""


def tiny_search(tmp_path: Path) -> tuple[Any, Any, Any, str, str]:
    """A torch spec, its best trial's trainer and data, and a sqlite store with the trial's finished run: (spec,
    trainer, data, tracking URI, trial run id)."""
    spec, trainer, data = torch_best_trial(tmp_path)
    uri = default_tracking_uri(tmp_path / "out")
    client = MlflowClient(uri)
    experiment = client.create_experiment("tiny", artifact_location=(tmp_path / "out" / "mlartifacts").as_uri())
    run_id = client.create_run(experiment, run_name="trial").info.run_id
    client.set_terminated(run_id, "FINISHED")
    return spec, trainer, data, uri, run_id


def published_on(uri: str, run_id: str, name: str) -> tuple[list[Any], list[Any]]:
    """The models logged on the run ``run_id`` and the versions registered from it."""
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    logged = client.search_logged_models([run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'")
    outputs = [output.model_id for output in (run.outputs.model_outputs if run.outputs else [])]
    assert sorted(outputs) == sorted(model.model_id for model in logged)  # the run links to each of them, once
    return list(logged), [v for v in client.search_model_versions(f"name = '{name}'")]


def kill_at(monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """The next call of ``MlflowClient.<method>`` is where the process is interrupted (nothing of it done)."""
    def killed(*args: Any, **kwargs: Any) -> None:
        monkeypatch.undo()
        raise Killed

    monkeypatch.setattr(MlflowClient, method, killed)


# Where the first end is interrupted: while the model's files are uploaded (the logged model PENDING, linked to the
# run); after the model was registered, before its description and alias (the first case's last round, an end
# interrupted after everything was published, finds the version too).
@pytest.mark.parametrize("moment", ["log_model_artifacts",
                                    pytest.param("update_model_version", marks=pytest.mark.slow)])
def test_a_resumed_end_publishes_the_model_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moment: str):
    spec, trainer, data, uri, run_id = tiny_search(tmp_path)
    model = BestModel("t_00000", {}, 0.5, None)

    def publish() -> Any:
        return publish_model([trainer], model, spec, data, tracking_uri=uri, trial_run_id=run_id,
                             search_run_id="1" * 32, evaluation=None, folder=tmp_path / "out" / "model",
                             register=True)

    kill_at(monkeypatch, moment)
    with pytest.raises(Killed):
        publish()
    logged, versions = published_on(uri, run_id, spec.registered_model_name)
    assert len(logged) == 1 and len(versions) == (moment == "update_model_version")  # what the kill left
    for _ in range(2):  # resumed; then resumed once more after an end that was interrupted when all was done
        published = publish()
        assert not published.error and published.version == "1" and published.best
        logged, versions = published_on(uri, run_id, spec.registered_model_name)
        assert [str(model.status) for model in logged] == ["READY"]  # completed, not logged beside
        assert published.model_uri == f"models:/{logged[0].model_id}"
        assert [(str(v.version), v.source, v.run_id) for v in versions] == [("1", published.model_uri, run_id)]
        version = MlflowClient(uri).get_model_version_by_alias(spec.registered_model_name, BEST_ALIAS)
        assert str(version.version) == "1" and "trial t_00000" in version.description
    image = np.random.default_rng(0).normal(100, 10, (16, 16, 16, 4)).astype(np.float32)
    with model_folder(published.model_uri, uri) as folder:  # the completed model loads and predicts as the copy
        from_store = SegmentationModel.load(folder).segment(image)
    np.testing.assert_array_equal(from_store, SegmentationModel.load(published.folder).segment(image))


def test_a_resumed_end_logs_each_test_score_once(tmp_path: Path):
    """``_record_test`` again, as a resumed search's end scores the best trial again: every ``test_*`` metric has
    one value on the trial's run and on the search's run; the scores' table is there once."""
    *_, uri, run_id = tiny_search(tmp_path)
    search_run = SearchRun(uri, "tiny", run_name="tiny", searched=["training.optimizer.lr"], metric="val_dice",
                           mode="max")
    cases = pd.DataFrame({"case": ["c1", "c2"], "dice_WT": [0.5, 0.7], "hd95_WT": [3.0, float("nan")]})
    evaluation = TestEvaluation("t_00000", cases)
    for _ in range(2):  # the end; then the end resumed, on the search's run reopened
        _record_test(search_run, run_id, evaluation, Candidate.of(BestModel("t_00000", {}, 0.5, None)), best=True)
        assert search_run.writer.close(timeout=60)
        search_run = SearchRun.reopen(uri, search_run.run_id)
    client = MlflowClient(uri)
    for run in (run_id, search_run.run_id):
        for key, value in evaluation.means.items():
            history = [m.value for m in client.get_metric_history(run, key)]
            assert len(history) == 1 and (history[0] == value or np.isnan(value)), (run, key, history)
        assert [a.path for a in client.list_artifacts(run)] == ["test_cases.csv"]
