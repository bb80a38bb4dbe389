"""The Ray token stays private: made 0600 before any Ray sees it, and refused by `cluster up` when others can read it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distmis.cli.main import main
from distmis.service.net import free_port
from distmis.service.token import ensure_token, token_problem

ROOT = Path(__file__).resolve().parents[2]


def test_a_new_token_is_owner_only_and_an_existing_one_is_kept(tmp_path: Path):
    path = ensure_token(tmp_path / "ray" / "auth_token")
    assert path.stat().st_mode & 0o777 == 0o600 and len(path.read_text()) == 64
    before = path.read_text()
    assert ensure_token(path).read_text() == before and token_problem(path) is None
    path.chmod(0o644)
    assert "chmod 600" in token_problem(path) and str(path) in token_problem(path)


def test_processes_making_the_token_at_once_all_use_the_one_token(tmp_path: Path):
    """Two ``distmis run``s started together on a fresh machine: each Ray must be given the token the others use (a
    token written over another's locked out the Ray that had read the first)."""
    path = tmp_path / "ray" / "auth_token"
    code = ("import sys, time\nfrom pathlib import Path\nfrom distmis.service.token import ensure_token\n"
            "start = float(sys.argv[2])\ntime.sleep(max(0.0, start - time.time()))\n"
            "print(ensure_token(Path(sys.argv[1])).read_text())")
    start = str(time.time() + 3)  # after every process has imported distmis
    racers = [subprocess.Popen([sys.executable, "-c", code, str(path), start], cwd=ROOT, stdout=subprocess.PIPE,
                               text=True) for _ in range(4)]
    tokens = {racer.communicate(timeout=120)[0].strip() for racer in racers}
    assert all(racer.returncode == 0 for racer in racers)
    assert tokens == {path.read_text()} and len(path.read_text()) == 64
    assert path.stat().st_mode & 0o777 == 0o600 and [p.name for p in path.parent.iterdir()] == ["auth_token"]
    path.write_text("")  # an empty file (the user's) is given a token, owner-only
    path.chmod(0o644)
    assert len(ensure_token(path).read_text()) == 64 and path.stat().st_mode & 0o777 == 0o600


def test_cluster_up_refuses_a_token_others_can_read(tmp_path: Path, monkeypatch, capsys):
    token = tmp_path / "auth_token"
    token.write_text("0" * 64)
    token.chmod(0o644)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    monkeypatch.setenv("DISTMIS_HOME", str(tmp_path / "home"))
    code = main(["cluster", "up", "--port", str(free_port()), "--dashboard-port", str(free_port())])
    err = capsys.readouterr().err
    assert code == 2 and f"chmod 600 {token}" in err and "mode 644" in err
    assert not (tmp_path / "home" / "cluster.json").exists()  # nothing was started
    assert token.read_text() == "0" * 64 and token.stat().st_mode & 0o777 == 0o644  # not touched


@pytest.mark.slow  # starts a real local Ray
def test_the_local_ray_of_a_search_finds_a_private_token_in_a_fresh_home(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE", "RAY_ADDRESS")}
    env.update(HOME=str(tmp_path), DISTMIS_HOME=str(tmp_path / ".distmis"))
    code = ("import ray\nfrom distmis.search.ray_session import ray_connection\n"
            "with ray_connection():\n    assert ray.is_initialized()\n    print(ray.cluster_resources()['CPU'])\n")
    subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True, capture_output=True, timeout=300)
    token = tmp_path / ".ray" / "auth_token"
    assert token.is_file() and token.stat().st_mode & 0o777 == 0o600
    # ... and `cluster up` in that home uses it, while a token others can read is refused.
    token.chmod(0o644)
    up = subprocess.run([sys.executable, "-m", "distmis", "cluster", "up", "--port", str(free_port()),
                         "--dashboard-port", str(free_port())], env=env, cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
    assert up.returncode == 2 and "chmod 600" in up.stderr
