"""A new local sqlite store is a copy of an empty one MLflow made (distmis.tracking.new_store): the same store as
MLflow makes, never over an existing file, and nothing at all for any other store."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from distmis.tracking.new_store import cache_folder, seed_sqlite_store, store_template


def contents(database: Path) -> dict[str, object]:
    """The tables, MLflow's schema revision, the experiments and the workspaces of a sqlite store."""
    with sqlite3.connect(database) as connection:
        tables = sorted(row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))
        revision = connection.execute("SELECT version_num FROM alembic_version").fetchall()
        experiments = connection.execute("SELECT experiment_id, name, artifact_location, lifecycle_stage, workspace "
                                         "FROM experiments").fetchall()
        workspaces = connection.execute("SELECT name FROM workspaces").fetchall()
    connection.close()
    return {"tables": tables, "revision": revision, "experiments": experiments, "workspaces": workspaces}


def test_a_seeded_store_is_the_store_mlflow_makes_and_works(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # MLflow puts the Default experiment's artifacts under the working directory
    made, seeded = tmp_path / "made" / "mlflow.db", tmp_path / "seeded" / "mlflow.db"
    made.parent.mkdir()
    MlflowClient(f"sqlite:///{made}").search_experiments()  # MLflow's own way: every migration
    assert seed_sqlite_store(f"sqlite:///{seeded}") and seeded.is_file()
    client = MlflowClient(f"sqlite:///{seeded}")
    client.search_experiments()  # MLflow opens it: the Default experiment is created as in its own store
    assert contents(seeded) == contents(made)
    assert contents(seeded)["experiments"][0][:3] == (0, "Default", str(tmp_path / "mlruns" / "0"))

    experiment = client.create_experiment("tiny", artifact_location=(tmp_path / "artifacts").as_uri())
    run = client.create_run(experiment)
    client.log_batch(run.info.run_id, metrics=[Metric("val_dice", 0.5, 0, 1)])
    client.create_registered_model("tiny")
    assert client.get_run(run.info.run_id).data.metrics == {"val_dice": 0.5}
    assert [m.name for m in client.search_registered_models()] == ["tiny"]


def test_an_existing_file_is_never_replaced(tmp_path: Path):
    mine = tmp_path / "mlflow.db"
    mine.write_text("not a store distmis made")
    assert not seed_sqlite_store(f"sqlite:///{mine}")
    assert mine.read_text() == "not a store distmis made"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]  # nothing staged left behind


@pytest.mark.parametrize("uri", ["http://127.0.0.1:5000", "postgresql://db/mlflow", "sqlite:///:memory:",
                                 "sqlite://", "file:///tmp/mlruns"])
def test_any_other_store_is_left_to_mlflow(uri: str):
    assert not seed_sqlite_store(uri)


def test_without_a_writable_cache_mlflow_makes_the_store(tmp_path: Path, monkeypatch):
    (tmp_path / "cache").write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert cache_folder() == tmp_path / "cache" / "distmis"
    assert not seed_sqlite_store(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}")
    assert not (tmp_path / "out").exists()


def test_the_template_has_mlflow_s_tables_and_no_experiment():
    template = store_template()
    assert template.parent == cache_folder() and template.name.startswith("mlflow-store-")
    found = contents(template)
    assert found["experiments"] == [] and found["revision"] and "runs" in found["tables"]
