"""Shared fixtures: a small valid spec, and one local Ray for the whole session (its tests run last)."""

from __future__ import annotations

import os

from distmis.train.threads import THREAD_ENV_VARS, tensorflow_env  # imports no TensorFlow

# TensorFlow in the test process as in a trial's (quiet, Keras on TensorFlow, oneDNN on), whichever test imports it
# first: on a CPU without AVX-512 VNNI, BF16 or AMX, TensorFlow leaves oneDNN off unless asked, and then its CPU
# allocator keeps no statistics, which the peak-memory tests read (tests/train/test_tf_metering.py).
for _var, _value in tensorflow_env().items():
    os.environ.setdefault(_var, _value)
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Under `make test`'s pytest-xdist workers, each worker's torch, TensorFlow and BLAS threads get its share of the
# CPUs, as a trial's do (distmis.train.threads), rather than one per core each: two workers of two threads on two
# cores spin-wait on each other's, and an in-process training test took 3 to 20 times longer than alone. One process
# (xdist off, or one worker) keeps the libraries' defaults. The user's own settings win.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _share = str(max(1, len(os.sched_getaffinity(0)) // _WORKERS))
    for _var in THREAD_ENV_VARS:
        os.environ.setdefault(_var, _share)
# The measured step settings a trial caches (distmis.train.step_settings): the session's own, not the user's
if "DISTMIS_CACHE" not in os.environ:
    import tempfile

    os.environ["DISTMIS_CACHE"] = tempfile.mkdtemp(prefix="distmis-test-cache-")

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402


def small_spec_tree(data_path: str | Path, **sections: Any) -> dict[str, Any]:
    """A valid spec mapping for a tiny synthetic dataset; ``sections`` replace whole sections."""
    tree: dict[str, Any] = {
        "name": "tiny",
        "dataset": {
            "path": str(data_path),
            "layout": "msd",
            "synthetic": {"cases": 6, "shape": [16, 16, 16], "seed": 0},
            "split": {"train": 0.5, "val": 0.25, "test": 0.25, "seed": 0},
        },
        "model": {"name": "unet3d", "framework": "tensorflow", "params": {"base_filters": 4, "levels": 3}},
        "training": {"epochs": 2, "batch_size": 2, "optimizer": {"lr": 1.0e-3}},
        "search": {"algorithm": "grid", "space": {"training.optimizer.lr": {"grid": [1.0e-3, 5.0e-3]}}},
        "parallelism": {"resources_per_trial": {"cpu": 1}},
    }
    tree.update(sections)
    return tree


def query(db: Path, sql: str) -> list[tuple]:
    """Rows of ``sql`` on the sqlite MLflow store at ``db``, read directly (``[]`` while it is missing or locked)."""
    import sqlite3

    try:
        with sqlite3.connect(db, timeout=1) as conn:
            return conn.execute(sql).fetchall()
    except sqlite3.Error:  # not created yet, or locked
        return []


def has_epoch_metric(db: Path) -> bool:
    """True once a trial has logged a validation dice to the sqlite MLflow store at ``db`` (read directly)."""
    import sqlite3

    try:
        with sqlite3.connect(db, timeout=1) as conn:
            return bool(conn.execute("SELECT count(*) FROM metrics WHERE key = 'val_dice'").fetchone()[0])
    except sqlite3.Error:  # not created yet, or locked
        return False


@pytest.fixture
def spec_tree(tmp_path: Path) -> dict[str, Any]:
    return small_spec_tree(tmp_path / "data")


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for every test that needs it (starting Ray costs seconds)."""
    import ray

    from distmis.search.ray_session import init_local_ray, local_ray_options
    from distmis.service.net import LOOPBACK, free_port
    from distmis.service.token import prepare_local_token

    prepare_local_token()  # as distmis does: the token file 0600 before Ray would write one readable by all
    # As distmis's own local Ray (every server on 127.0.0.1, the trial environment in every worker's), on a free
    # dashboard port, not Ray's usual 8265: a distmis run started beside the tests may be taking it.
    init_local_ray({**local_ray_options(free_port(LOOPBACK)), "num_cpus": 2, "logging_level": "WARNING"})
    yield ray
    ray.shutdown()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that joins the session's Ray (``ray_local``) is part of the slow tier, and the files holding such
    tests run after every other file (each group in its collected order; a file stays whole, so its module fixtures
    are made once): the session's Ray, once started, stays up to the end, and its processes would otherwise run
    beside the tests that start Rays, clusters and searches of their own (the fault tests' runs took a third longer
    with it up). That order holds in one process (``python -m pytest``); ``make test``'s pytest-xdist workers each
    start their own session Ray and take whole files in xdist's order (most tests first), so a test must not rely on
    which files ran before it in its process."""
    on_ray = {item.nodeid.split("::")[0] for item in items if "ray_local" in getattr(item, "fixturenames", ())}
    for item in items:
        if "ray_local" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    items[:] = ([item for item in items if item.nodeid.split("::")[0] not in on_ray]
                + [item for item in items if item.nodeid.split("::")[0] in on_ray])
