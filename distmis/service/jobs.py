"""Submitting a search to a Ray cluster through the Ray Jobs API, and following the jobs.

``distmis submit SPEC`` validates the spec here first (a bad spec never reaches the cluster), then
sends it as a job: the fully resolved spec travels in the job's ``working_dir`` and the entrypoint is
``python -m distmis run spec.yaml --output OUT``, so on the head node the search runs exactly as
``distmis run`` would, connected to that cluster (the job's ``RAY_ADDRESS``).

Where results land must be reachable: a sqlite store or output folder given as a path on *this*
machine only works when the cluster is this machine (the one-node cluster ``distmis cluster up`` started).
Otherwise the spec must name an MLflow tracking server every node reaches and an absolute output
folder on storage every node sees; :func:`check_reachable_storage` says so before submitting.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import yaml

from distmis.service.cluster import ClusterError, ClusterState, alive_nodes, cluster_alive, default_dashboard_address
from distmis.service.token import auth_headers, refused_token_message
from distmis.spec.load import spec_to_dict
from distmis.spec.schema import Spec

logger = logging.getLogger(__name__)

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
LOCAL_STORE_SCHEMES = ("", "file", "sqlite")
#: How long a job being followed may go without an answer from its cluster before the follower gives up: a
#: tunnel that drops for a moment, or a dashboard that is slow to answer under load, is waited out.
RECONNECT_S = 10.0

T = TypeVar("T")


class SubmitError(ValueError):
    """The search cannot be submitted as asked (nothing was sent); the message says why."""


class ClusterGone(ClusterError):
    """The cluster stopped answering about a job that was being followed (exit 1, as a cluster that is not up)."""

    def __init__(self, address: str, job_id: str, reason: str) -> None:
        try:
            default = default_dashboard_address()
        except ClusterError:  # a damaged state file
            default = None
        where = "" if default and resolve_address(default) == resolve_address(address) else f" --address {address}"
        super().__init__(
            f"lost the Ray cluster at {address} while following job {job_id}: no answer for {RECONNECT_S:.0f} s "
            f"({reason}); the cluster stopped or restarted, or the network or tunnel to it is down. What became of "
            f"the job is not known here: once the cluster answers again, see 'distmis status {job_id}{where}' and "
            f"'distmis logs {job_id}{where}'")


def resolve_address(address: str | None) -> str:
    """The Jobs API address: given, else the cluster ``distmis cluster up`` started, else ``$RAY_ADDRESS``."""
    address = address or default_dashboard_address()
    if not address:
        raise SubmitError("no Ray cluster to talk to: start one with 'distmis cluster up', or pass "
                          "--address http://HEAD:8265 (the head node's dashboard), or set RAY_ADDRESS")
    if "://" not in address:
        address = f"http://{address}"
    return address.rstrip("/")


@contextmanager
def token_accepted(address: str) -> Iterator[None]:
    """Turn the cluster's refusal of this client's token (Ray's ``AuthenticationError``, HTTP 401 or 403) into a
    SubmitError naming ``address`` and where the token came from (never the token)."""
    from ray.exceptions import AuthenticationError

    try:
        yield
    except AuthenticationError as exc:
        lines = str(exc).strip().splitlines()
        detail = lines[0] if lines else type(exc).__name__
    except urllib.error.HTTPError as exc:
        if exc.code not in (401, 403):
            raise
        detail = f"HTTP {exc.code} {exc.reason}"
    else:
        return
    try:
        state = ClusterState.load()
    except ClusterError:  # a damaged state file: no hint, the refusal is still the error
        state = None
    ours = state is not None and resolve_address(state.dashboard_url) == resolve_address(address)
    raise SubmitError(refused_token_message(address, detail, Path(state.token_path) if ours and state else None))


def job_client(address: str | None) -> Any:
    """A ``JobSubmissionClient`` for ``address`` that sends the authentication token. SubmitError when the
    cluster cannot be reached or refuses the token (:func:`token_accepted`)."""
    from ray.job_submission import JobSubmissionClient

    url = resolve_address(address)
    try:
        with token_accepted(url):
            return JobSubmissionClient(url, headers=auth_headers())
    except (ConnectionError, RuntimeError) as exc:
        raise SubmitError(f"cannot reach the Ray Jobs API at {url}: {exc}") from exc


def cluster_nodes(address: str) -> int:
    """Alive nodes of the cluster behind ``address``."""
    url = resolve_address(address)
    try:
        with token_accepted(url):
            return alive_nodes(url)
    except OSError as exc:
        raise SubmitError(f"cannot list the nodes of the cluster at {url}: {exc}") from exc


# --------------------------------------------------------------------------- what the job needs
def is_local_store(uri: str | None) -> bool:
    """True for a store that is a file on one machine (the default sqlite store, sqlite:, file:, a path)."""
    if uri is None:
        return True
    return urllib.parse.urlparse(uri).scheme.lower() in LOCAL_STORE_SCHEMES


def is_this_machine(address: str, nodes: int) -> bool:
    """True when ``address`` is the one-node cluster ``distmis cluster up`` started on this machine.

    A loopback address alone proves nothing: it may be an SSH tunnel to a remote head node.
    """
    state = ClusterState.load()
    return (nodes == 1 and state is not None and cluster_alive(state)
            and resolve_address(state.dashboard_url) == resolve_address(address))


def check_reachable_storage(spec: Spec, output: Path | None, *, address: str, local: bool, nodes: int) -> None:
    """Raise SubmitError unless the job's results land where the user (and every node) can reach them.

    ``local``: the cluster is this machine (:func:`is_this_machine`), where paths mean the same as here.
    """
    if local:
        return
    where = f"the cluster at {address} ({nodes} node(s), not started on this machine by 'distmis cluster up')"
    problems = []
    if is_local_store(spec.tracking.uri):
        problems.append(
            f"tracking.uri {spec.tracking.uri or '(default: a sqlite file in the output folder)'} is a store on one "
            f"machine; for {where} name an MLflow tracking server every node reaches, e.g. "
            "--set tracking.uri=http://MLFLOW_HOST:5000 (a team server, or 'distmis ui --host' on the head node)")
    if output is None or not output.is_absolute():
        problems.append(f"--output must be an absolute folder on storage every node sees (NFS, Lustre, a shared "
                        f"volume), got {output or '(default: runs/<name>, relative)'}")
    if not Path(spec.dataset.path).is_absolute():
        problems.append(f"dataset.path {spec.dataset.path!r} is relative; give its absolute path on the cluster")
    if problems:
        raise SubmitError("cannot submit: the results would be lost:\n  - " + "\n  - ".join(problems))


def job_spec_tree(spec: Spec, *, local: bool) -> dict[str, Any]:
    """The resolved spec the job runs; on a local cluster relative paths are made absolute here."""
    tree = spec_to_dict(spec)
    if local:
        tree["dataset"]["path"] = str(Path(spec.dataset.path).resolve())
    return tree


@dataclass(frozen=True)
class Submission:
    job_id: str
    address: str
    output: str


def submit_search(spec: Spec, *, address: str | None = None, output: Path | None = None,
                  submission_id: str | None = None, resume: bool = False) -> Submission:
    """Send ``spec`` as a Ray job; returns once the cluster accepted it (see :func:`wait_for_job`).

    ``resume``: the job continues the interrupted search in ``output`` (``distmis run --resume``)."""
    from distmis.spec.load import default_output_dir

    url = resolve_address(address)
    client = job_client(url)
    nodes = cluster_nodes(url)
    local = is_this_machine(url, nodes)
    check_reachable_storage(spec, output, address=url, local=local, nodes=nodes)
    out = (output or default_output_dir(spec))
    out = out.resolve() if local else out
    submission_id = submission_id or f"distmis-{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    workdir = Path(tempfile.mkdtemp(prefix="distmis-job-"))
    try:
        (workdir / "spec.yaml").write_text(yaml.safe_dump(job_spec_tree(spec, local=local), sort_keys=False))
        with token_accepted(url):
            job_id = client.submit_job(
                # No env_vars here: the driver's ray.init sets the trials' own, and Ray refuses to merge the two.
                entrypoint=f"PYTHONUNBUFFERED=1 python -m distmis run spec.yaml --output {_quote(str(out))}"
                           + (" --resume" if resume else ""),
                submission_id=submission_id,
                runtime_env={"working_dir": str(workdir)},
                metadata={"distmis.spec": spec.name, "distmis.output": str(out)},
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # uploaded by submit_job
    return Submission(job_id=job_id, address=url, output=str(out))


def _quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


# --------------------------------------------------------------------------- following jobs
def answered(client: Any, job_id: str, request: Callable[[], T], *, poll: float = 1.0) -> T:
    """``request()``, a question to the Jobs API about ``job_id``, asked again every ``poll`` seconds while the
    cluster does not answer it (no connection, or an error instead of an answer: a dashboard going down, or a new
    cluster that does not know the job), for up to :data:`RECONNECT_S` seconds; then :class:`ClusterGone`.

    A refused token (Ray's ``AuthenticationError``) is not retried: :func:`token_accepted` turns it into its message.
    """
    deadline = None
    while True:
        try:
            return request()
        except (OSError, RuntimeError) as exc:  # requests' ConnectionError and Timeout are OSErrors
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            if deadline is None:
                deadline = time.monotonic() + RECONNECT_S
            elif time.monotonic() >= deadline:
                raise ClusterGone(str(client.get_address()), job_id, reason) from None
            logger.debug("no answer about job %s (%s); asking again", job_id, reason)
            time.sleep(poll)


def wait_for_job(client: Any, job_id: str, *, timeout: float | None = None, poll: float = 1.0) -> str:
    """Poll until the job ends; its final status (SUCCEEDED, FAILED or STOPPED). :class:`ClusterGone` when the
    cluster stops answering (:func:`answered`)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        status = str(answered(client, job_id, lambda: client.get_job_status(job_id), poll=poll).value)
        if status in TERMINAL:
            return status
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {status} after {timeout:.0f} s")
        time.sleep(poll)


def follow_logs(client: Any, job_id: str, *, poll: float = 1.0) -> Iterator[str]:
    """The job's log as it grows, until the job has ended: streamed by the Jobs API's websocket
    (``JobSubmissionClient.tail_job_logs``, from the log's start), or, where that stream fails or ends before the
    job has (a proxy that drops websockets, a dashboard going down), polled every ``poll`` seconds from where the
    stream stopped. :class:`ClusterGone` when the cluster stops answering (:func:`answered`)."""
    import asyncio

    if not logger.isEnabledFor(logging.DEBUG):  # unless --verbose: Ray's INFO line on every stream's close is noise
        logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)
    loop = asyncio.new_event_loop()
    stream = client.tail_job_logs(job_id)
    shown, closed = 0, False
    try:
        while True:
            try:
                chunk = loop.run_until_complete(stream.__anext__())
            except StopAsyncIteration:  # the server closed the stream: at the job's end, or as it went down
                closed = True
                break
            except Exception as exc:  # noqa: BLE001  (aiohttp's and the server's errors)
                logger.debug("log stream of job %s failed (%s); polling instead", job_id, exc)
                break
            shown += len(chunk)
            yield chunk
    finally:
        try:
            loop.run_until_complete(stream.aclose())
        finally:
            loop.close()
    if closed and str(answered(client, job_id, lambda: client.get_job_status(job_id), poll=poll).value) in TERMINAL:
        return
    yield from _poll_logs(client, job_id, poll=poll, shown=shown)


def _poll_logs(client: Any, job_id: str, *, poll: float, shown: int = 0) -> Iterator[str]:
    while True:
        ended = str(answered(client, job_id, lambda: client.get_job_status(job_id), poll=poll).value) in TERMINAL
        text = answered(client, job_id, lambda: client.get_job_logs(job_id), poll=poll)
        if len(text) > shown:
            yield text[shown:]
            shown = len(text)
        if ended:
            return
        time.sleep(poll)


def job_rows(client: Any) -> list[dict[str, Any]]:
    """Every job the cluster knows, newest first, as table rows."""
    rows = []
    for job in client.list_jobs():
        rows.append({
            "job_id": job.submission_id or job.job_id,
            "status": str(job.status.value),
            "spec": (job.metadata or {}).get("distmis.spec", ""),
            "start": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.start_time / 1000)) if job.start_time else "",
            "end": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.end_time / 1000)) if job.end_time else "",
            "entrypoint": job.entrypoint,
        })
    return sorted(rows, key=lambda r: r["start"], reverse=True)
