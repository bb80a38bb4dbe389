"""Ctrl-C stops a real ``distmis run`` in every phase (issue 32, item 4): exit 130 within 30 s, no traceback,
nothing half-written, no process of its own left behind, and an interrupted search resumable.

One test walks the phases, each in a fresh ``distmis run`` started in its own session, as a terminal starts a
command in its own process group. Ctrl-C is a SIGINT to that whole group (Ray's processes and the conversion's
reader processes get it too) or, where said, to the driver's pid alone. Each phase is recognised by what it
leaves on disk or in the process tree, never by a hook in distmis:

* the preflight: the tracking server (a socket of this test that never answers) is asked;
* Ray's start: Ray's dashboard agent runs, its node not yet made (Ray then loses track of what it started);
* the data set's generation: its ``.NAME.partial-*`` folder exists;
* the TFRecord conversion: its ``.partial-*`` folder exists and its reader processes run;
* the trials: a trial has logged an epoch;
* the search's end: its best trial's model is being logged (scored on the test split, published: copied, logging);
  resumed, the end logs the model, registers it and records each test score once (issue 46, finding 7).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import psutil
import pytest
import yaml

from distmis.data.synthetic import synthesize_dataset
from tests.conftest import query, small_spec_tree

pytestmark = pytest.mark.slow  # real searches, each with its own local Ray

ROOT = Path(__file__).resolve().parents[2]
EXIT_WITHIN_S = 30


def run_statuses(db: Path) -> dict[str, list[str]]:
    """The statuses of the search's run and of its trials' runs, by role."""
    rows = query(db, "SELECT t.value, r.status FROM runs r JOIN tags t ON r.run_uuid = t.run_uuid "
                     "WHERE t.key = 'distmis.role' ORDER BY r.start_time")
    statuses: dict[str, list[str]] = {}
    for role, status in rows:
        statuses.setdefault(role, []).append(status)
    return statuses


def state_of(output: Path) -> str:
    return json.loads((output / "search_state.json").read_text())["status"]


def partial_folders(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".partial-" in p.name] if folder.is_dir() else []


class Run:
    """``distmis run SPEC ARGS``, its process tree watched (every process it ever started, with its own)."""

    def __init__(self, spec: Path, output: Path, *args: str, home: Path):
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
        env["RAY_AUTH_TOKEN_PATH"] = str(home / "auth_token")  # made 0600 by distmis; not the user's
        self.process = subprocess.Popen(
            [sys.executable, "-m", "distmis", "run", str(spec), "--output", str(output), "--quiet", *args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.seen: set[psutil.Process] = set()
        self._watch = threading.Thread(target=self._watch_tree, daemon=True)
        self._watch.start()

    def _watch_tree(self) -> None:
        while self.process.poll() is None:
            self.seen.update(self.tree())
            time.sleep(0.1)

    def tree(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.Error:
            return []

    def wait_for(self, ready: Callable[[], bool], what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.process.poll() is None, (f"exited before {what}", self.process.communicate()[1][-3000:])
            assert time.monotonic() < deadline, f"never reached {what}"
            time.sleep(0.05)

    def ctrl_c(self, *, group: bool = True) -> str:
        """SIGINT to the process group (a terminal's Ctrl-C) or to the driver alone; its stderr, once it exited
        with 130 within EXIT_WITHIN_S seconds, printing no traceback, and every process it started ended."""
        if group:
            os.killpg(self.process.pid, signal.SIGINT)
        else:
            self.process.send_signal(signal.SIGINT)
        start = time.monotonic()
        _, err = self.process.communicate(timeout=EXIT_WITHIN_S)
        took = time.monotonic() - start
        assert self.process.returncode == 130, err[-3000:]
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-5000:]
        assert took <= EXIT_WITHIN_S
        self.assert_nothing_left()
        return err

    def finish(self, timeout: float = 300) -> str:
        _, err = self.process.communicate(timeout=timeout)
        assert self.process.returncode == 0, err[-3000:]
        self.assert_nothing_left()
        return err

    def assert_nothing_left(self) -> None:
        self._watch.join(timeout=5)
        _, alive = psutil.wait_procs(list(self.seen), timeout=15)
        names = []
        for process in alive:
            try:
                names.append(f"{process.pid} {' '.join(process.cmdline())[:80]}")
            except psutil.Error:
                continue
        assert not names, f"processes of the interrupted run still alive: {names}"

    def kill(self) -> None:
        """After a failed assertion: nothing of this run outlives the test."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        for process in self.seen:
            try:
                process.kill()
            except psutil.Error:
                pass


def test_ctrl_c_in_every_phase_of_a_run(tmp_path: Path):
    small = small_spec_tree(tmp_path / "data")
    small["search"]["space"] = {"training.optimizer.lr": {"grid": [1.0e-3]}}  # one trial
    small["training"]["epochs"] = 8  # long enough to interrupt after the first, short enough to finish resumed
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(small))
    big = small_spec_tree(tmp_path / "big")  # a data set that takes seconds to generate and to convert
    big["dataset"]["synthetic"] = {"cases": 16, "shape": [48, 48, 48], "seed": 0}
    big_spec = tmp_path / "big.yaml"
    big_spec.write_text(yaml.safe_dump(big))
    out, big_out = tmp_path / "out", tmp_path / "big_out"
    runs: list[Run] = []

    def start(spec_file: Path, output: Path, *args: str) -> Run:
        runs.append(Run(spec_file, output, *args, home=tmp_path))
        return runs[-1]

    try:
        # The preflight, SIGINT to the driver alone: the tracking server it asks never answers.
        silent = socket.create_server(("127.0.0.1", 0))
        silent.settimeout(0.1)
        store = dict(small, tracking={"uri": f"http://127.0.0.1:{silent.getsockname()[1]}"})
        (tmp_path / "store.yaml").write_text(yaml.safe_dump(store))
        run = start(tmp_path / "store.yaml", tmp_path / "store_out")
        asked: list[socket.socket] = []

        def store_asked() -> bool:
            try:
                asked.append(silent.accept()[0])
            except TimeoutError:
                return False
            return True

        run.wait_for(store_asked, "the tracking store's check")
        run.ctrl_c(group=False)
        assert not (tmp_path / "store_out").exists() and not (tmp_path / "data").exists()
        silent.close()

        # Ray's start: interrupted while Ray makes its node, none of Ray's processes outlive the run.
        run = start(spec, out)
        run.wait_for(lambda: any("DashboardAgent" in " ".join(p.cmdline()) for p in run.tree()), "Ray's start")
        run.ctrl_c()
        assert not out.exists() and not (tmp_path / "data").exists()

        # The data set's generation, SIGINT to the driver alone: no half-generated data set.
        run = start(big_spec, big_out)
        run.wait_for(lambda: bool(partial_folders(tmp_path)), "the data set's generation")
        run.ctrl_c(group=False)
        assert not (tmp_path / "big").exists() and not partial_folders(tmp_path) and not big_out.exists()

        # The TFRecord conversion, its reader processes running: no partial folder, no reader left.
        synthesize_dataset(tmp_path / "big", "msd", cases=16, shape=(48, 48, 48), seed=0, progress=False)
        run = start(big_spec, big_out)

        def command_line(process: psutil.Process) -> str:
            try:
                return " ".join(process.cmdline())
            except (psutil.NoSuchProcess, psutil.ZombieProcess):  # a child that ended while it was listed
                return ""

        def converting() -> bool:
            readers = [p for p in psutil.Process(run.process.pid).children() if "spawn_main" in command_line(p)]
            return bool(readers) and bool(partial_folders(big_out / "tfrecords"))

        run.wait_for(converting, "the TFRecord conversion")
        run.ctrl_c()
        assert not partial_folders(big_out / "tfrecords") and not big_out.exists()

        # The trials: the search's run and the trial's run KILLED, the state says interrupted.
        db = out / "mlflow.db"
        run = start(spec, out)
        run.wait_for(lambda: bool(query(db, "SELECT 1 FROM metrics WHERE key = 'val_dice'")), "a trial's epoch")
        err = run.ctrl_c()
        assert "interrupted" in err and "SIGINT" in err and "--resume" in err
        assert run_statuses(db) == {"search": ["KILLED"], "trial": ["KILLED"]}
        assert state_of(out) == "interrupted"

        # The search's end, resumed: the trial went on and finished; interrupted while its model is logged (scored,
        # its copy written, its logged model created in the store).
        run = start(spec, out, "--resume")
        run.wait_for(lambda: bool(query(db, "SELECT 1 FROM logged_models")), "the search's end")
        run.ctrl_c()
        assert run_statuses(db) == {"search": ["KILLED"], "trial": ["FINISHED"]}
        assert state_of(out) == "interrupted"
        assert not [p for p in out.iterdir() if p.name.startswith(".model")]  # the copy is whole or absent

        # Resumed once more, the search ends as an uninterrupted one does: one model, registered once, each test
        # score once.
        start(spec, out, "--resume").finish()
        assert run_statuses(db) == {"search": ["FINISHED"], "trial": ["FINISHED"]}
        assert state_of(out) == "finished" and (out / "model" / "MLmodel").is_file()
        assert_published_once(db)
    finally:
        for run in runs:
            run.kill()


def assert_published_once(db: Path) -> None:
    """One model logged (READY, on the trial's run) and one version registered; every test score (``test_*``) has
    one value on the runs it is on (the trial's and the search's)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{db}")
    runs = {role: run for role, run in query(db, "SELECT t.value, t.run_uuid FROM tags t WHERE t.key = 'distmis.role'")}
    experiment = client.get_run(runs["trial"]).info.experiment_id
    logged = client.search_logged_models([experiment])
    assert [(str(m.status), m.source_run_id) for m in logged] == [("READY", runs["trial"])]
    assert len(client.search_model_versions()) == 1
    for run_id in runs.values():
        scores = [key for key in client.get_run(run_id).data.metrics if key.startswith("test_")]
        assert scores and all(len(client.get_metric_history(run_id, key)) == 1 for key in scores), run_id


def mapped(pid: int, library: str, timeout: float = 30) -> bool:
    """Wait until process ``pid`` has loaded a shared library whose path holds ``library`` (what it is importing);
    False if it ended or did not within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if library in Path(f"/proc/{pid}/maps").read_text():
                return True
        except OSError:  # ended
            return False
        time.sleep(0.002)
    return False


def test_ctrl_c_while_the_command_is_still_importing_is_one_line_and_130(tmp_path: Path):
    """The first seconds of any command import its libraries: a Ctrl-C then is exit 130 with one line, no
    traceback. The moments are told by the libraries the process has loaded: numpy's core while
    ``distmis.cli.main`` is imported (``python -m distmis``), Ray's core while ``main()`` imports what ``validate``
    needs (``distmis.search.search_space`` imports Ray Tune)."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(small_spec_tree(tmp_path / "data")))
    for library in ("_multiarray_umath", "_raylet"):
        process = subprocess.Popen([sys.executable, "-m", "distmis", "validate", str(spec)], cwd=ROOT,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert mapped(process.pid, library), f"{library} was never loaded: the moment was not reached"
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=EXIT_WITHIN_S)
        assert process.returncode == 130, (library, err[-2000:])
        assert "Traceback" not in err and err.strip().splitlines()[-1] == "interrupted", (library, err[-2000:])
