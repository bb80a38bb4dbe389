"""The service commands: a Ray head node (``cluster``), jobs on it (``submit``, ``jobs``, ``status``,
``logs``, ``stop``) and the MLflow UI (``ui``).

Exit codes as in :mod:`distmis.cli.main`: 0 success; 1 a job failed, a server did not come up, or the cluster
stopped answering while a job was followed (``submit --follow``, ``logs --follow``: one line saying so, the job's
fate unknown); 2 bad input (a bad spec is refused here and never reaches the cluster).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from typing import Any, Iterator

from distmis.cli.errors import EXIT_FAILED, EXIT_OK, BadInput


# --------------------------------------------------------------------------- cluster
def cmd_cluster_up(args: argparse.Namespace) -> int:
    from distmis.service.cluster import SINGLE_MACHINE_ENV, cluster_up, open_endpoints

    try:
        state = cluster_up(host=args.host, port=args.port, dashboard_port=args.dashboard_port,
                           num_cpus=args.num_cpus, num_gpus=args.num_gpus)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    print(f"Ray head node up (pid {state.pid}), token authentication on")
    print(f"  dashboard / Jobs API: {state.dashboard_url}")
    if state.single_machine:
        print(f"  cluster address:      {state.gcs_address}   (this machine only: every port on 127.0.0.1)")
        mode = " ".join(f"{name}={value}" for name, value in SINGLE_MACHINE_ENV.items())
        print(f"  Ray's own clients here (ray status, ray.init) need {mode} in their environment; distmis sets it")
    else:
        print(f"  cluster address:      {state.gcs_address}   (ray start --address=... on worker nodes)")
        print("  open to every machine that reaches this one, WITHOUT a token (Ray cannot bind them elsewhere):")
        for line in open_endpoints(state):
            print(f"    {line}")
        print("  the token guards Ray's other ports; firewall them all (docs/cluster.md, Security)")
    print(f"  token file:           {state.token_path}   (copy to clients; never log it)")
    print(f"  log:                  {state.log_path}")
    print("Next: distmis submit SPEC   |   distmis cluster status   |   distmis cluster down")
    return EXIT_OK


def cmd_cluster_status(args: argparse.Namespace) -> int:
    from distmis.service.cluster import cluster_resources, cluster_status

    state, up = cluster_status()
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state.started_at))
    print(f"cluster {'UP' if up else 'DOWN'}: pid {state.pid}, started {started}")
    print(f"  dashboard / Jobs API: {state.dashboard_url}\n  cluster address:      {state.gcs_address}")
    if up:
        print(cluster_resources(state))
    return EXIT_OK if up else EXIT_FAILED


def cmd_cluster_down(args: argparse.Namespace) -> int:
    from distmis.service.cluster import cluster_down

    pids = cluster_down()
    print(f"cluster stopped ({len(pids)} process(es))" if pids else "cluster was not running; state cleared")
    return EXIT_OK


# --------------------------------------------------------------------------- jobs
def cmd_submit(args: argparse.Namespace) -> int:
    from distmis.service.jobs import follow_logs, job_client, submit_search, token_accepted, wait_for_job
    from distmis.cli.planned import load_planned
    from distmis.spec import parse_set_options

    spec = load_planned(args.spec, parse_set_options(args.set))  # SpecError: exit 2, nothing sent
    submission = submit_search(spec, address=args.address, output=Path(args.output) if args.output else None,
                               resume=args.resume)
    print(f"submitted {submission.job_id} to {submission.address}")
    print(f"  output: {submission.output}")
    print(f"  distmis logs {submission.job_id} --follow   |   distmis status {submission.job_id}   |   "
          f"distmis stop {submission.job_id}")
    if not args.follow:
        return EXIT_OK
    client = job_client(submission.address)
    with token_accepted(submission.address):  # the cluster may restart with another token meanwhile
        print_log(follow_logs(client, submission.job_id))
        status = wait_for_job(client, submission.job_id)
    print(f"\njob {submission.job_id}: {status}")
    return EXIT_OK if status == "SUCCEEDED" else EXIT_FAILED


def cmd_jobs(args: argparse.Namespace) -> int:
    from distmis.service.jobs import job_client, job_rows, resolve_address, token_accepted

    client = job_client(args.address)
    with token_accepted(resolve_address(args.address)):
        rows = job_rows(client)
    if not rows:
        print("no jobs")
        return EXIT_OK
    columns = ["job_id", "status", "spec", "start", "end"]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(str(row[c]).ljust(widths[c]) for c in columns))
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    from distmis.service.jobs import job_client

    info = _job_info(job_client(args.address), args.job, args.address)
    print(f"{args.job}: {info.status.value}" + (f" ({info.message})" if info.message else ""))
    return EXIT_OK


def cmd_logs(args: argparse.Namespace) -> int:
    from distmis.service.jobs import follow_logs, job_client, resolve_address, token_accepted

    client = job_client(args.address)
    _job_info(client, args.job, args.address)
    with token_accepted(resolve_address(args.address)):
        if args.follow:
            print_log(follow_logs(client, args.job))
        else:
            print(client.get_job_logs(args.job), end="")
    return EXIT_OK


def cmd_stop(args: argparse.Namespace) -> int:
    from distmis.service.jobs import job_client, resolve_address, token_accepted

    client = job_client(args.address)
    _job_info(client, args.job, args.address)
    with token_accepted(resolve_address(args.address)):
        stopped = client.stop_job(args.job)
    print(f"{args.job}: {'stop requested' if stopped else 'already ended'}")
    return EXIT_OK


def print_log(chunks: Iterator[str]) -> None:
    """Print a job's log as it comes. When following it fails (the cluster went away: ClusterGone), its last line is
    ended first, so that the error starts a line of its own."""
    ended = True
    try:
        for chunk in chunks:
            print(chunk, end="", flush=True)
            ended = chunk.endswith("\n") if chunk else ended
    except BaseException:
        if not ended:
            print(flush=True)
        raise


def _job_info(client: Any, job_id: str, address: str | None) -> Any:
    from distmis.service.jobs import SubmitError, resolve_address, token_accepted

    try:
        with token_accepted(resolve_address(address)):
            return client.get_job_info(job_id)
    except RuntimeError as exc:
        raise SubmitError(f"no job {job_id!r} on the cluster (see 'distmis jobs'): {exc}") from None


# --------------------------------------------------------------------------- ui
def cmd_ui(args: argparse.Namespace) -> int:
    from distmis.service.server import BACKEND_STORE_ENV, start_server, store_for
    from distmis.tracking.uri import redact_uri

    runs_root = Path(os.environ.get("DISTMIS_OUTPUT", "runs"))
    # A URI with a password can come from the environment rather than this command line (which `ps` shows).
    tracking_uri = args.tracking_uri or (None if args.output else os.environ.get(BACKEND_STORE_ENV) or None)
    try:
        uri, artifacts = store_for(Path(args.output) if args.output else None, tracking_uri,
                                   runs_root=runs_root)
        server = start_server(uri, artifacts=artifacts, host=args.host, port=args.port)
    except ValueError as exc:  # the store or the port (ServerError, a server that did not start: exit 1)
        raise BadInput(str(exc)) from None
    # Ctrl-C, `kill` or a closed terminal all stop the server's process group (the with block) before exiting;
    # SIGINT is set explicitly because a shell that starts this in the background makes it ignored.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    with server:
        print(f"MLflow UI at {server.url}  (store {redact_uri(uri)}); Ctrl-C stops it", flush=True)
        try:
            server.process.wait()
        except KeyboardInterrupt:
            print("stopping the MLflow server", flush=True)
    return EXIT_OK


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


# --------------------------------------------------------------------------- parser
def add_service_commands(sub: Any, spec_args: Any) -> None:
    """Add ``cluster``, ``submit``, ``jobs``, ``status``, ``logs``, ``stop`` and ``ui`` to the parser."""
    cluster = sub.add_parser("cluster", help="a Ray head node on this machine: up, status, down")
    csub = cluster.add_subparsers(dest="cluster_command", required=True, metavar="CLUSTER_COMMAND")
    p = csub.add_parser("up", help="start a Ray head node (dashboard + Jobs API) with token authentication")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: every port on loopback, "
                                                       "this machine only; others take worker nodes, and warn)")
    p.add_argument("--port", type=int, default=6379, help="cluster (GCS) port (default 6379)")
    p.add_argument("--dashboard-port", type=int, default=8265, help="dashboard and Jobs API port (default 8265)")
    p.add_argument("--num-cpus", type=int, help="CPUs to offer (default: all)")
    p.add_argument("--num-gpus", type=int, help="GPUs to offer (default: all detected)")
    p.set_defaults(func=cmd_cluster_up)
    p = csub.add_parser("status", help="is the cluster up; its nodes and resources")
    p.set_defaults(func=cmd_cluster_status)
    p = csub.add_parser("down", help="stop the cluster 'cluster up' started (no other Ray process)")
    p.set_defaults(func=cmd_cluster_down)

    def address_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--address", help="the head node's dashboard, e.g. http://127.0.0.1:8265 (default: the "
                                         "cluster 'distmis cluster up' started, else $RAY_ADDRESS)")

    p = sub.add_parser("submit", help="validate a spec here, then run it on a Ray cluster as a job")
    spec_args(p)
    address_arg(p)
    p.add_argument("--output", help="output folder of the search (default: runs/<name>; on a multi-node or "
                                    "remote cluster an absolute folder every node sees)")
    p.add_argument("--follow", action="store_true", help="print the job's log until it ends; exit 1 unless it succeeded")
    p.add_argument("--resume", action="store_true", help="continue the interrupted search in --output (distmis run --resume)")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("jobs", help="the cluster's jobs")
    address_arg(p)
    p.set_defaults(func=cmd_jobs)
    for name, func, text in (("status", cmd_status, "a job's status"), ("logs", cmd_logs, "a job's log"),
                             ("stop", cmd_stop, "stop a job")):
        p = sub.add_parser(name, help=text)
        p.add_argument("job", help="job id (as 'distmis submit' printed it)")
        address_arg(p)
        if name == "logs":
            p.add_argument("--follow", action="store_true", help="keep printing until the job ends")
        p.set_defaults(func=func)

    p = sub.add_parser("ui", help="browse results: an MLflow server (and UI) over a search's store")
    p.add_argument("output", nargs="?", help="a search's output folder (default: the one under runs/)")
    p.add_argument("--tracking-uri", help="any MLflow backend store URI instead, e.g. postgresql://... (default: "
                                          "$MLFLOW_BACKEND_STORE_URI when no OUTPUT is given; put a URI holding a "
                                          "password there, not on the command line)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; others warn)")
    p.add_argument("--port", type=int, default=5000, help="port (default 5000)")
    p.set_defaults(func=cmd_ui)
