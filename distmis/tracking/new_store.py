"""A new local sqlite MLflow store in milliseconds rather than seconds (:func:`seed_sqlite_store`).

MLflow makes a sqlite store by creating its first schema and then running every one of its migrations: about 2,000
statements, 2 to 4 s on a 2-core machine, paid by every search in a new output folder. distmis lets MLflow make one
such store per MLflow release (its migrations, by name, in the file's name), in the user's cache folder, with its
Default experiment removed; a new store starts as a copy of it. MLflow, opening the copy, finds its tables at its
newest schema and no Default experiment, and creates that experiment as in a store it made itself (its artifact
location where this process would have put it).

Seeding is an optimisation only: where the cache cannot be written or anything else fails, nothing is copied and
MLflow makes the store the slow way. An existing file is never replaced.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import tempfile
from pathlib import Path

__all__ = ["seed_sqlite_store", "store_template", "cache_folder"]

DEFAULT_EXPERIMENT_ID = 0  # MLflow's Default experiment, which the template leaves out


def cache_folder() -> Path:
    """Where distmis keeps what it can make again: ``$XDG_CACHE_HOME/distmis`` (``~/.cache/distmis``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "distmis"


def seed_sqlite_store(uri: str) -> bool:
    """Make the local sqlite store of ``uri`` (``sqlite:///PATH``) a copy of :func:`store_template` when PATH does
    not exist yet; True if it did. Any other URI, an existing file, or a template that cannot be made: False, and
    MLflow makes the store when it first opens it."""
    path = _sqlite_path(uri)
    if path is None or path.exists():
        return False
    try:
        template = store_template()
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f".{path.name}.seed-{os.getpid()}")
        try:
            shutil.copyfile(template, staged)
            os.link(staged, path)  # fails where a store appeared meanwhile: that one is kept
        finally:
            staged.unlink(missing_ok=True)
    except Exception:  # noqa: BLE001 - an optimisation only: MLflow makes the store when it first opens it
        return False
    return True


def store_template() -> Path:
    """The empty sqlite store of this MLflow release (made by MLflow, its Default experiment removed), made once in
    :func:`cache_folder`."""
    template = cache_folder() / f"mlflow-store-{_migrations_digest()}.db"
    if template.is_file():
        return template
    template.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".store-", dir=template.parent) as tmp:
        database = Path(tmp) / "store.db"
        _let_mlflow_make(database, Path(tmp) / "artifacts")
        with sqlite3.connect(database) as connection:
            connection.execute("DELETE FROM experiment_tags WHERE experiment_id = ?", (DEFAULT_EXPERIMENT_ID,))
            connection.execute("DELETE FROM experiments WHERE experiment_id = ?", (DEFAULT_EXPERIMENT_ID,))
        connection.close()
        os.replace(database, template)  # whole or not at all; two makers at once each put a whole one
    return template


def _let_mlflow_make(database: Path, artifacts: Path) -> None:
    """MLflow's own sqlite store at ``database``: its schema, every migration, its Default experiment."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore(f"sqlite:///{database}", artifacts.as_uri())
    store.engine.dispose()


def _migrations_digest() -> str:
    """MLflow's release and the names of its schema migrations, hashed: a template is made again when they change."""
    import mlflow
    from mlflow.store import db_migrations

    names = sorted(p.name for p in (Path(db_migrations.__file__).parent / "versions").glob("*.py"))
    return hashlib.sha256("\n".join([mlflow.__version__, *names]).encode()).hexdigest()[:16]


def _sqlite_path(uri: str) -> Path | None:
    """PATH of ``sqlite:///PATH`` (absolute or relative), None for any other URI or an in-memory database."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri.removeprefix("sqlite:///")
    if not path or path == ":memory:" or "?" in path:
        return None
    return Path(path)
