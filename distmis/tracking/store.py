"""Is the tracking store there? Asked once, with a short timeout, before a search converts data or starts Ray.

MLflow's own client retries an unreachable server for minutes; a search that finds out only after its data
conversion and Ray's start wastes both. :func:`check_store` asks the store one cheap question (an HTTP server:
its experiments; a database: a connection; a local store: a folder it can write in) and raises
:class:`StoreUnreachable`, naming the URI with any password redacted, when it gets no answer in time.
"""

from __future__ import annotations

import os
import re
import sqlite3
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping
from urllib.parse import unquote, urlsplit

from distmis.tracking.uri import redact_uri

TIMEOUT_S = 10.0  # per question; an HTTP store is asked without MLflow's retries
DATABASE_SCHEMES = ("postgresql", "mysql", "mssql")


class StoreUnreachable(ValueError):
    """The tracking store gave no answer (exit 2, before anything started)."""


def check_store(uri: str, timeout: float = TIMEOUT_S) -> None:
    """Raise :class:`StoreUnreachable` unless the store at ``uri`` answers within about ``timeout`` seconds."""
    scheme = urlsplit(uri).scheme.split("+")[0].lower()
    try:
        if scheme in ("http", "https", "databricks"):
            _ask_server(uri, timeout)
        elif scheme == "sqlite":
            _check_sqlite(uri, timeout)
        elif scheme in DATABASE_SCHEMES:
            _check_database(uri, timeout)
        elif scheme in ("", "file"):
            _check_folder(Path(unquote(urlsplit(uri).path) if scheme == "file" else uri))
        # other schemes (plugins): MLflow itself says what is wrong when the search opens its run
    except StoreUnreachable as exc:
        raise StoreUnreachable(_message(uri, str(exc))) from None
    except Exception as exc:  # noqa: BLE001 - whatever the client raised, it is the store's answer
        raise StoreUnreachable(_message(uri, f"{type(exc).__name__}: {_first_line(exc)}")) from None


def _message(uri: str, why: str) -> str:
    return (f"the tracking store {redact_uri(uri)} (tracking.uri, else $MLFLOW_TRACKING_URI) cannot be reached: {why}. "
            "Nothing was started: start the store or fix the URI, then run again")


_CREDENTIALS = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)[^@\s]+@")


def _first_line(exc: BaseException) -> str:
    """The client's reason, on one line, with any ``user:password@`` in URLs it quotes redacted."""
    text = str(exc).strip().splitlines()
    line = _CREDENTIALS.sub(lambda m: f"{m.group('head')}***@", text[0] if text else "no message")
    return line if len(line) <= 400 else line[:400] + " ..."


@contextmanager
def process_environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in this process's environment for the block, the previous values (or their absence) after."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _ask_server(uri: str, timeout: float) -> None:
    """One experiments query through MLflow's own client (its authentication included), without its retries."""
    from mlflow.tracking import MlflowClient

    with process_environment({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
                              "MLFLOW_HTTP_REQUEST_TIMEOUT": str(int(max(timeout, 1)))}):
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)


def _check_sqlite(uri: str, timeout: float) -> None:
    """A sqlite file that exists must open as a database; a new one must be creatable where it would go."""
    path = uri.split(":///", 1)[1] if ":///" in uri else ""
    if not path or path == ":memory:":
        return
    database = Path(path)
    if database.is_file():
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=timeout) as connection:
            connection.execute("PRAGMA schema_version").fetchone()
        return
    _check_folder(database.parent)


def _check_folder(folder: Path) -> None:
    """The nearest existing folder on the way to ``folder`` is a folder this process may write in."""
    existing = folder.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise StoreUnreachable(f"{existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise StoreUnreachable(f"{existing} cannot be written to")


def _check_database(uri: str, timeout: float) -> None:
    import sqlalchemy

    scheme = urlsplit(uri).scheme.lower()
    connect_args = {"connect_timeout": int(max(timeout, 1))} if scheme.startswith(("postgresql", "mysql")) else {}
    engine = sqlalchemy.create_engine(uri, connect_args=connect_args, poolclass=sqlalchemy.pool.NullPool)
    try:
        with engine.connect() as connection:
            connection.execute(sqlalchemy.text("SELECT 1"))
    finally:
        engine.dispose()
