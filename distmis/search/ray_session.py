"""The driver's Ray: join a cluster or start a local Ray (:func:`ray_connection`), whose servers listen on
127.0.0.1 only (:func:`loopback_node`), whose workers start with the trials' environment (:data:`TRIAL_ENV`,
:func:`local_worker_env`), and whose start, when it fails or is interrupted, leaves none of its processes behind."""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

from distmis.service.cluster import joins_single_machine_cluster
from distmis.service.net import LOOPBACK, claim_port, free_port, port_in_use, release_port
from distmis.service.token import prepare_local_token
from distmis.tracking.store import process_environment
from distmis.train.threads import tensorflow_env

__all__ = ["TRIAL_ENV", "RAY_DASHBOARD_PORT", "local_ray_options", "local_worker_env", "init_local_ray",
           "ray_connection", "loopback_node"]

# Environment every Ray worker process starts with (distmis.train.threads.tensorflow_env: quiet TensorFlow,
# Keras on TF, oneDNN's kernels), set before any of them imports TensorFlow.
TRIAL_ENV = {**tensorflow_env(), "PYTHONUNBUFFERED": "1"}

#: Ray's usual dashboard port, which a local Ray's dashboard takes when it is free (:func:`local_ray_options`).
RAY_DASHBOARD_PORT = 8265


def local_ray_options(dashboard_port: int | None = None) -> dict[str, Any]:
    """``ray.init`` arguments of a local Ray started by distmis (:func:`init_local_ray` starts it).

    The dashboard (and Ray's state API, which Ray Train's placement-group cleaner asks every second whether
    its controller lives) listens on 127.0.0.1 only, on Ray's usual port when free. Of two distmis processes that
    start their Rays at the same moment, only the one that claims that port (:func:`claim_port`) takes it, the other
    a free one: both saw it free, and the dashboard that lost the race to bind it used to fail after Ray's timeout.
    """
    port = dashboard_port
    if port is None:  # Ray's usual port when free, and not being taken by another distmis starting at this moment
        port = RAY_DASHBOARD_PORT
        if not claim_port(port) or port_in_use(LOOPBACK, port):
            release_port(port)
            port = free_port(LOOPBACK)
    return {"address": "local", "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": port}


def local_worker_env(options: dict[str, Any]) -> dict[str, str]:
    """The environment every worker of a local Ray started with ``options`` (:func:`local_ray_options`) has:
    :data:`TRIAL_ENV`, and where its state API is (``RAY_API_SERVER_ADDRESS``). Otherwise a worker finds "the"
    cluster through Ray's ``/tmp/ray/ray_current_cluster``, which a ``ray start`` cluster that has since gone leaves
    behind: each Ray Train run then waited about 10 s at its end on a state query to that dead cluster."""
    return {**TRIAL_ENV, "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{options['dashboard_port']}"}


def init_local_ray(options: dict[str, Any]) -> None:
    """``ray.init(**options)`` for a new local Ray (``options``: :func:`local_ray_options`' and more), on a loopback
    node (:func:`loopback_node`), its processes started with :func:`local_worker_env` in their environment.

    The environment is the raylet's, which every worker it starts inherits, rather than a job's
    ``runtime_env``: a worker for a job with a runtime environment is started only once the runtime-env agent has
    set it up for that job, so the workers Ray starts ahead of the first tasks (one per CPU) could not take the
    trials, and every trial process started cold (about 1 s for an actor, against 0.2 to 0.6 s).
    """
    import ray

    with loopback_node(), process_environment(local_worker_env(options)):
        ray.init(**options)


@contextmanager
def ray_connection(address: str | None = None, *, verbose: bool = False) -> Iterator[None]:
    """Join ``address`` or start a local Ray, unless one is already up; shut down only what this started.

    Unless ``verbose``, what the trial processes print is not forwarded to this process's console (it stays in
    Ray's log files) and Ray's own notices below ERROR are not shown: the search's console
    (:class:`~distmis.search.console.SearchConsole`) says what happens.

    Without an address this starts a new local Ray ("local"), rather than Ray's default of joining
    whatever ``ray start`` cluster runs on the machine: ``--address`` says which cluster to use. The local
    Ray's servers listen on 127.0.0.1 only (:func:`loopback_node`), and a start that fails or is interrupted
    (Ctrl-C) leaves none of its processes behind.
    """
    import ray

    if ray.is_initialized():
        yield
        return
    console = {"log_to_driver": verbose, "logging_level": logging.WARNING if verbose else logging.ERROR}
    if address in (None, "local"):
        prepare_local_token()  # made 0600 before Ray writes one readable by everybody
        try:
            _start_local_ray({**local_ray_options(), **console})
        except Exception:  # noqa: BLE001 - another local Ray took the dashboard's port between check and bind
            _start_local_ray({**local_ray_options(free_port(LOOPBACK)), **console})
    else:  # the single-machine head of `cluster up` is joined in Ray's single-machine mode, as it runs
        with loopback_node() if joins_single_machine_cluster(address) else nullcontext():
            ray.init(address=address, runtime_env={"env_vars": TRIAL_ENV}, **console)
    try:
        yield
    finally:
        ray.shutdown()


@contextmanager
def loopback_node() -> Iterator[None]:
    """While a local Ray starts in this process: its node's address is 127.0.0.1, so that every server it starts
    (GCS, raylet, workers, the dashboard and runtime-env agents, the Prometheus metrics export port) listens on
    loopback only.

    Ray 2.60 binds those servers to every interface unless the node's address is loopback, and takes that address
    from the route to the internet: a ``_node_ip_address`` of 127.0.0.1 is replaced by it. Only its single-machine
    mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read once when Ray is imported) keeps 127.0.0.1; this turns that
    mode on for the moment ``ray.init`` takes, in this process (the processes it starts are given the address).
    A Ray without that switch starts as it would anyway (``tests/faults/test_ray_ports.py`` says so).
    """
    from ray._private import ray_constants

    if not isinstance(getattr(ray_constants, "ENABLE_RAY_CLUSTER", None), bool):
        yield
        return
    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def _start_local_ray(options: dict[str, Any]) -> None:
    """``ray.init(**options)`` on a loopback node. When it fails or is interrupted, the processes it had started are
    stopped before this raises: interrupted while its node was being made, Ray has lost track of them, and its
    raylet's agents would outlive the driver."""
    import psutil
    import ray

    me = psutil.Process()
    before = set(me.children(recursive=True))
    try:
        init_local_ray({"logging_level": logging.WARNING, **options})
    except BaseException:
        ray.shutdown()
        _stop_processes([p for p in _descendants(me) if p not in before])
        raise


def _descendants(process: Any) -> list[Any]:
    import psutil

    try:
        return process.children(recursive=True)
    except psutil.Error:
        return []


def _stop_processes(processes: list[Any], grace: float = 2.0) -> None:
    """SIGTERM ``processes`` (listed before any is signalled: a child outlives its parent re-parented), then SIGKILL
    those still alive after ``grace`` seconds (a raylet or GCS whose start was cut short waits on the other; Ray's
    own shutdown kills them so too)."""
    import psutil

    for process in processes:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
