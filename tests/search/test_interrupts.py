"""A Ctrl-C that cuts an MLflow read short on a sqlite store: the frames it was raised through held the read's cursor,
and with it the file's lock; the handler lets them go before it marks the runs KILLED (``let_go``)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Iterator

import pytest
import sqlalchemy
from mlflow.tracking import MlflowClient

from distmis.search.interrupts import let_go
from distmis.search.output import ended_unless_recorded
from distmis.tracking.mlflow_tracking import SearchRun


def writable_at_once(db: Path) -> bool:
    """No other connection holds the file: an exclusive lock is granted without waiting."""
    connection = sqlite3.connect(db, timeout=0, isolation_level=None)
    try:
        connection.execute("BEGIN EXCLUSIVE")
        connection.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        connection.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[Path, SearchRun, MlflowClient]]:
    """A search run on a sqlite store, and a client whose next read of the runs table is interrupted the moment its
    statement has run (a Ctrl-C there: its first row read, the cursor open)."""
    db = tmp_path / "mlflow.db"
    run = SearchRun(f"sqlite:///{db}", "tiny", run_name="tiny", searched=[], metric="val_dice", mode="max")
    reader = MlflowClient(f"sqlite:///{db}")
    engine = reader._tracking_client.store.engine
    fired: list[str] = []

    def interrupt(conn: object, cursor: object, statement: str, *args: object) -> None:
        if not fired and statement.lstrip().upper().startswith("SELECT") and " runs" in statement:
            fired.append(statement)
            raise KeyboardInterrupt

    sqlalchemy.event.listen(engine, "after_cursor_execute", interrupt)
    yield db, run, reader
    sqlalchemy.event.remove(engine, "after_cursor_execute", interrupt)
    assert fired, "the read was never interrupted: the test tested nothing"


def test_letting_go_of_the_interrupted_frames_frees_the_store(store):
    db, run, reader = store
    try:
        reader.get_run(run.run_id)
    except KeyboardInterrupt as interrupt:
        assert not writable_at_once(db)  # the interrupted read's cursor holds the file while its frames live
        let_go(interrupt)
        assert writable_at_once(db)
    else:
        pytest.fail("the read was not interrupted")


def test_a_ctrl_c_in_a_read_while_the_search_is_set_up_leaves_its_run_killed(store):
    db, run, reader = store
    with pytest.raises(KeyboardInterrupt):
        with ended_unless_recorded(run):
            reader.get_run(run.run_id)
    assert reader.get_run(run.run_id).info.status == "KILLED"
