"""Following a job whose cluster stops answering (issue 46, finding 3): a moment's silence is waited out; a cluster
that stays gone is one error naming the cluster, the job and what to run later. The real cluster going away under
``distmis logs --follow`` and ``distmis submit --follow`` is tests/service/test_cluster.py's last test."""

from __future__ import annotations

import pytest
import requests

import distmis.service.jobs as jobs
from distmis.service.cluster import ClusterError

ADDRESS = "http://127.0.0.1:8265"


class Client:
    """What :func:`distmis.service.jobs.answered` asks of a ``JobSubmissionClient``: its address."""

    def get_address(self) -> str:
        return ADDRESS


@pytest.fixture
def no_saved_cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTMIS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def test_a_moment_without_an_answer_is_waited_out(no_saved_cluster):
    failures = [requests.exceptions.ConnectionError("Connection refused"), RuntimeError("Request failed with 503")]

    def request() -> str:
        if failures:
            raise failures.pop(0)
        return "RUNNING"

    assert jobs.answered(Client(), "job-1", request, poll=0.01) == "RUNNING"


def test_a_cluster_that_stays_gone_is_one_line_saying_what_to_run_later(no_saved_cluster, monkeypatch):
    monkeypatch.setattr(jobs, "RECONNECT_S", 0.05)
    asked = []

    def request() -> str:
        asked.append(1)
        raise requests.exceptions.ConnectionError("HTTPConnectionPool(host='127.0.0.1', port=8265): Max retries\nmore")

    with pytest.raises(jobs.ClusterGone) as info:
        jobs.answered(Client(), "job-1", request, poll=0.01)
    message = str(info.value)
    assert isinstance(info.value, ClusterError)  # the CLI's exit 1, "error: ..." and no traceback
    assert len(asked) > 1 and "\n" not in message
    assert f"lost the Ray cluster at {ADDRESS} while following job job-1" in message and "Max retries" in message
    # No saved cluster, no RAY_ADDRESS: the commands to run later must name the cluster.
    assert f"'distmis status job-1 --address {ADDRESS}'" in message
    assert f"'distmis logs job-1 --address {ADDRESS}'" in message


def test_the_default_cluster_needs_no_address_in_the_advice(no_saved_cluster, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:8265")
    message = str(jobs.ClusterGone(ADDRESS, "job-1", "Connection refused"))
    assert "'distmis status job-1' and 'distmis logs job-1'" in message


def test_a_refused_token_is_not_retried(no_saved_cluster):
    from ray.exceptions import AuthenticationError

    asked = []

    def request() -> str:
        asked.append(1)
        raise AuthenticationError("invalid token")

    with pytest.raises(AuthenticationError):
        jobs.answered(Client(), "job-1", request, poll=0.01)
    assert len(asked) == 1
