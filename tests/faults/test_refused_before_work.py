"""Specs and folders a search cannot use are refused before any work: exit 2 within seconds, naming the culprit,
with no data converted, no Ray started and nothing written (issue 32, cases 3, 4, 5 and the state-file ones).

Each case runs the real ``distmis`` command in its own process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from distmis.search.preflight import new_state
from distmis.search.state import STATE_FILE
from distmis.spec import validate_spec
from tests.conftest import small_spec_tree

pytestmark = pytest.mark.slow  # each case is a real distmis process (a few seconds of imports)

ROOT = Path(__file__).resolve().parents[2]


class Done:
    """A finished ``distmis`` process: its exit code, output, wall time, and the Ray sessions it started."""

    def __init__(self, process: subprocess.Popen, stdout: str, stderr: str, seconds: float,
                 new_sessions: set[Path]) -> None:
        self.returncode, self.stdout, self.stderr, self.seconds = process.returncode, stdout, stderr, seconds
        self.pid, self.new_sessions = process.pid, new_sessions

    @property
    def started_ray(self) -> bool:
        """Whether this process started a local Ray: Ray names a session's folder after its driver's pid.

        Only folders that appeared while the process ran count: pids are reused, and ``/tmp/ray`` keeps the
        folders of every earlier session on this machine.
        """
        return any(session.name.endswith(f"_{self.pid}") for session in self.new_sessions)


def ray_sessions() -> set[Path]:
    return set(Path("/tmp/ray").glob("session_2*"))


def distmis(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> Done:
    """The command in its own process (imports included in its time)."""
    environment = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    environment.update(env or {})
    sessions_before = ray_sessions()
    start = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "distmis", *args], cwd=ROOT, env=environment, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
    return Done(process, stdout, stderr, time.monotonic() - start, ray_sessions() - sessions_before)


def write_spec(tmp_path: Path, tree: dict[str, Any]) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_million_trial_grid_is_refused_by_validate_and_run(tmp_path: Path):
    tree = small_spec_tree(tmp_path / "data")
    tree["search"]["space"] = {f"model.params.{name}": {"grid": list(range(1, 11))} for name in ("base_filters",)}
    tree["search"]["space"].update({"training.optimizer.lr": {"grid": [1e-3 * (i + 1) for i in range(100)]},
                                    "training.seed": {"grid": list(range(1000))}})
    spec = write_spec(tmp_path, tree)  # 10 x 100 x 1000 = 10^6 trials
    for command in ("validate", "run"):
        done = distmis(command, str(spec), *(["--output", str(tmp_path / "out")] if command == "run" else []))
        assert done.returncode == 2, done.stderr[-2000:]
        assert "1,000,000 trials" in done.stderr and "search.max_trials 10,000" in done.stderr
        assert done.seconds < 60
        assert not (tmp_path / "out").exists() and not (tmp_path / "data").exists()  # nothing generated or written
        assert not done.started_ray
    tree["search"]["max_trials"] = 2_000_000  # meant: validate accepts it (run would build them)
    done = distmis("validate", str(write_spec(tmp_path, tree)))
    assert done.returncode == 0 and "1000000 trial(s)" in done.stdout, done.stderr[-2000:]


def test_an_unreachable_tracking_server_is_refused_before_data_or_ray(tmp_path: Path):
    tree = small_spec_tree(tmp_path / "data")
    uri = f"http://user:s3cret@127.0.0.1:{closed_port()}"
    tree["tracking"] = {"uri": uri}
    done = distmis("run", str(write_spec(tmp_path, tree)), "--output", str(tmp_path / "out"))
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.seconds < 60 and not done.started_ray
    assert "tracking store http://user:***@127.0.0.1" in done.stderr and "s3cret" not in done.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "data").exists()
    # The same through $MLFLOW_TRACKING_URI, and a sqlite store that cannot be made where it would go.
    del tree["tracking"]
    spec = write_spec(tmp_path, tree)
    done = distmis("run", str(spec), "--output", str(tmp_path / "out"), env={"MLFLOW_TRACKING_URI": uri})
    assert done.returncode == 2 and "cannot be reached" in done.stderr, done.stderr[-2000:]
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    done = distmis("run", str(spec), "--output", str(tmp_path / "out"),
                      env={"MLFLOW_TRACKING_URI": f"sqlite:///{blocker}/mlflow.db"})
    assert done.returncode == 2 and f"{blocker} is not a folder" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "out").exists() and not (tmp_path / "data").exists()


def test_a_search_name_ending_in_a_newline_is_refused(tmp_path: Path):
    tree = small_spec_tree(tmp_path / "data", name="tiny\n")
    done = distmis("validate", str(write_spec(tmp_path, tree)))
    assert done.returncode == 2 and "name" in done.stderr and "'tiny\\n'" in done.stderr, done.stderr[-2000:]


def started_search(tmp_path: Path, status: str) -> tuple[Path, Path]:
    """A spec and an output folder holding the state of a search that stopped ``status`` (no trial ran)."""
    tree = small_spec_tree(tmp_path / "data")
    spec_file = write_spec(tmp_path, tree)
    spec = validate_spec(tree)
    output = tmp_path / "out"
    output.mkdir()
    from distmis.data.synthetic import synthesize_dataset

    synthetic = spec.dataset.synthetic
    synthesize_dataset(tmp_path / "data", "msd", cases=synthetic.cases, shape=synthetic.shape, seed=synthetic.seed,
                       progress=False)
    state = new_state("search", spec, output, run_id="0" * 32)
    state.status = status  # type: ignore[assignment]
    state.save(output)
    return spec_file, output


def test_a_plain_run_into_an_unfinished_search_is_refused_and_keeps_its_state(tmp_path: Path):
    spec, output = started_search(tmp_path, "interrupted")
    before = (output / STATE_FILE).read_text()
    done = distmis("run", str(spec), "--output", str(output))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "was interrupted" in done.stderr and "--resume" in done.stderr and "another --output" in done.stderr
    assert (output / STATE_FILE).read_text() == before
    assert sorted(p.name for p in output.iterdir()) == [STATE_FILE]


def test_a_resume_onto_changed_data_or_another_store_is_refused_naming_what_changed(tmp_path: Path):
    spec, output = started_search(tmp_path, "running")  # a SIGKILLed driver leaves "running"
    before = (output / STATE_FILE).read_text()
    edited = sorted((tmp_path / "data" / "labelsTr").iterdir())[1]
    os.utime(edited, ns=(edited.stat().st_atime_ns, edited.stat().st_mtime_ns + 10**9))  # regenerated, same size
    done = distmis("run", str(spec), "--output", str(output), "--resume")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "1 file(s) changed" in done.stderr and f"labelsTr/{edited.name}" in done.stderr
    os.utime(edited, ns=(edited.stat().st_atime_ns, edited.stat().st_mtime_ns - 10**9))  # as it was
    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    done = distmis("run", str(spec), "--output", str(output), "--resume", env={"MLFLOW_TRACKING_URI": uri})
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"the tracking store is {uri!r}" in done.stderr and str(output / "mlflow.db") in done.stderr
    assert (output / STATE_FILE).read_text() == before
    assert not (tmp_path / "elsewhere.db").exists()


def test_a_corrupt_search_state_is_named_not_a_traceback(tmp_path: Path):
    spec, output = started_search(tmp_path, "running")
    (output / STATE_FILE).write_text('{"kind": "search", "run_id": ')  # cut short
    for extra in ((), ("--resume",)):
        done = distmis("run", str(spec), "--output", str(output), *extra)
        assert done.returncode == 2, done.stderr[-2000:]
        assert "Traceback" not in done.stderr
        assert f"{output / STATE_FILE} cannot be read as a distmis search state" in done.stderr


@pytest.mark.parametrize(("model", "parallelism", "named"), [
    ({"name": "segresnet", "params": {"not_an_arg": 1}}, {},
     ["model.params.not_an_arg", "segresnet", "init_filters", "blocks_down"]),
    ({"name": "segresnet"}, {"mode": "data", "workers": 2, "sequence_parallel": {"degree": 2}},
     ["segresnet", "sequence parallelism"]),
    ({"name": "swinunetr"}, {"mode": "data", "workers": 2, "pipeline": {"stages": 2}},
     ["swinunetr", "pipeline"]),
], ids=["unknown-argument", "sp-with-segresnet", "pipeline-with-swinunetr"])
def test_a_network_s_unknown_argument_or_unsupported_parallelism_is_refused(tmp_path: Path, model, parallelism,
                                                                            named):
    tree = small_spec_tree(tmp_path / "data", model={"framework": "torch", **model})
    tree["training"]["tile"] = [32, 32, 32]
    tree["dataset"]["synthetic"]["shape"] = [32, 32, 32]
    tree["parallelism"].update(parallelism)
    if parallelism:
        tree["parallelism"].pop("resources_per_trial")
    done = distmis("run", str(write_spec(tmp_path, tree)), "--output", str(tmp_path / "out"))
    assert done.returncode == 2, done.stderr[-2000:]
    for word in named:
        assert word in done.stderr, (word, done.stderr[-2000:])
    assert not done.started_ray and not (tmp_path / "out").exists() and not (tmp_path / "data").exists()
