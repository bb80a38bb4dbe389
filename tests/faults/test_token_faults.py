"""A Ray token the cluster refuses: exit 2 naming where the token came from and the cluster's address, never the
token itself, and no traceback (issue 32, item 7).

A real ``ray start --head`` cluster with token authentication (the module-scoped ``head`` fixture of
tests/service/test_cluster.py) and the real command in a subprocess, as a user on another machine runs it with a
token file that is not the cluster's, or with none.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import small_spec_tree
from tests.service.test_cluster import head  # noqa: F401  (a Ray head node of 2 CPUs, token auth, loopback)

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # a real Ray head node


def distmis(tmp_path: Path, *args: str, token_file: Path | None = None, token: str | None = None,
            home: str | None = None):
    """``distmis ARGS`` with ``token_file`` as RAY_AUTH_TOKEN_PATH (None: the default, ~/.ray/auth_token, in an
    empty HOME) and ``home`` as DISTMIS_HOME (None: a fresh one, which knows no cluster)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN", "RAY_ADDRESS")}
    env.update(DISTMIS_HOME=home or str(tmp_path / "client_home"), HOME=str(tmp_path / "client"))
    if token_file is not None:
        env["RAY_AUTH_TOKEN_PATH"] = str(token_file)
    if token is not None:
        env["RAY_AUTH_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "distmis", *args], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=180)


def wrong_token_file(tmp_path: Path) -> Path:
    path = tmp_path / "wrong_token"
    path.write_text("f" * 64)
    path.chmod(0o600)
    return path


def assert_refused(result: subprocess.CompletedProcess, head, *culprits: str) -> None:  # noqa: F811
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert head.dashboard_url in result.stderr, result.stderr
    for culprit in culprits:
        assert culprit in result.stderr, result.stderr
    assert "f" * 64 not in result.stderr + result.stdout  # the token itself is never printed
    assert Path(head.token_path).read_text().strip() not in result.stderr + result.stdout


@pytest.mark.parametrize("command", [["jobs"], ["status", "some-job"], ["logs", "some-job"], ["stop", "some-job"]])
def test_a_wrong_token_file_exits_2_naming_it_and_the_cluster(tmp_path: Path, head, command):  # noqa: F811
    token = wrong_token_file(tmp_path)
    result = distmis(tmp_path, *command, "--address", head.dashboard_url, token_file=token)
    assert_refused(result, head, str(token), "refused")


def test_no_token_at_all_exits_2_saying_where_one_is_looked_for(tmp_path: Path, head):  # noqa: F811
    result = distmis(tmp_path, "jobs", "--address", head.dashboard_url, token_file=tmp_path / "no_token")
    assert_refused(result, head, str(tmp_path / "no_token"), "does not exist", "RAY_AUTH_TOKEN")


def test_the_cluster_started_here_is_refused_with_its_own_token_file_named(tmp_path: Path, head):  # noqa: F811
    """`cluster up` ran with RAY_AUTH_TOKEN_PATH set; a later shell without it sends ~/.ray/auth_token (missing)."""
    result = distmis(tmp_path, "jobs", home=os.environ["DISTMIS_HOME"])  # the fixture's home: its saved cluster
    assert_refused(result, head, str(tmp_path / "client" / ".ray" / "auth_token"),
                   f"RAY_AUTH_TOKEN_PATH={head.token_path}")


def test_a_wrong_token_in_the_environment_is_named_as_such(tmp_path: Path, head):  # noqa: F811
    result = distmis(tmp_path, "jobs", "--address", head.dashboard_url, token="f" * 64)
    assert_refused(result, head, "RAY_AUTH_TOKEN")


def test_submit_with_a_wrong_token_exits_2_and_sends_nothing(tmp_path: Path, head):  # noqa: F811
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(small_spec_tree(tmp_path / "data")))
    token = wrong_token_file(tmp_path)
    result = distmis(tmp_path, "submit", str(spec), "--address", head.dashboard_url, token_file=token)
    assert_refused(result, head, str(token))
    assert not (tmp_path / "runs").exists()
