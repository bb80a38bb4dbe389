"""The Ray authentication token: one file, readable by its owner only.

Ray's Jobs API runs whatever it is sent, so every Ray that distmis starts (a ``cluster up`` head, or the local
Ray of ``distmis run``) uses token authentication, and the token file is made here, with mode 0600, before
Ray sees it (Ray would write it world-readable). Clients of this package send the same token.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

logger = logging.getLogger(__name__)


def token_path() -> Path:
    """Where Ray and this package read the authentication token: ``$RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``."""
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH", "~/.ray/auth_token")).expanduser()


def token_auth_disabled() -> bool:
    """The user opted out of Ray's token authentication (``RAY_AUTH_MODE=disabled``)."""
    return os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled"


def ensure_token(path: Path | None = None) -> Path:
    """The token file, created (random, mode 0600 from the start) if it does not exist or is empty.

    Two processes may make it at the same moment (two ``distmis run``s, the first on a machine): each writes a whole
    token to a file of its own and links it into place, which only the first does; the other then uses that one.
    A token written over another's would have locked out the Ray already started with the first."""
    path = path or token_path()
    if path.exists() and path.read_text().strip():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(staged, path)  # fails where another process's token is in place by now
        except FileExistsError:
            if not path.read_text().strip():  # an empty file of the user's: replaced (0600, whole)
                os.replace(staged, path)
                logger.info("wrote a new Ray authentication token to %s", path)
            return path
        logger.info("wrote a new Ray authentication token to %s", path)
    finally:
        staged.unlink(missing_ok=True)
    return path


def token_problem(path: Path) -> str | None:
    """Why the token file must not be used (other users can read or write it), or None."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        return (f"the token file {path} can be read by other users (mode {mode:o}): anyone who reads it can run code "
                f"on the cluster. Run 'chmod 600 {path}' (or remove it to get a new one), then try again")
    return None


def read_token() -> str | None:
    """The token a client sends: ``$RAY_AUTH_TOKEN``, else the token file, else None."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = token_path()
    return path.read_text().strip() if path.exists() else None


def token_source() -> str:
    """Where the token a client sends comes from (:func:`read_token`), as a clause for messages; never the token."""
    path = token_path()
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return (f"the token sent came from the RAY_AUTH_TOKEN environment variable, which takes precedence over "
                f"the token file {path} (unset it to use that file)")
    where = ("RAY_AUTH_TOKEN_PATH" if os.environ.get("RAY_AUTH_TOKEN_PATH")
             else "the default; RAY_AUTH_TOKEN_PATH sets it")
    if not path.exists():
        return f"no token was sent: RAY_AUTH_TOKEN is not set and the token file {path} ({where}) does not exist"
    if not path.read_text().strip():
        return f"no token was sent: RAY_AUTH_TOKEN is not set and the token file {path} ({where}) is empty"
    return f"the token sent came from the token file {path} ({where})"


def refused_token_message(address: str, detail: str, cluster_token: Path | None = None) -> str:
    """What to say when the cluster at ``address`` refuses the token this client sent (``detail``: the server's
    reason): where the token came from and what to do; ``cluster_token``: the token file of the cluster, when
    ``distmis cluster up`` started it on this machine. Never the token itself."""
    path = token_path()
    if cluster_token is not None and cluster_token == path and os.environ.get("RAY_AUTH_TOKEN", "").strip():
        fix = (f"this is the cluster 'distmis cluster up' started here, whose token file {path} is the one this "
               "client reads once RAY_AUTH_TOKEN is unset: unset it, then try again")
    elif cluster_token is not None and cluster_token != path:
        fix = (f"this is the cluster 'distmis cluster up' started here, whose token file is {cluster_token}: set "
               f"RAY_AUTH_TOKEN_PATH={cluster_token} (and unset RAY_AUTH_TOKEN), then try again")
    else:
        fix = ("use the cluster's own token: copy the token file of its head node (the 'token file' that "
               f"'distmis cluster up' printed there) to {path} with mode 600, or point RAY_AUTH_TOKEN_PATH at a "
               "copy of it, then try again")
    return f"the Ray cluster at {address} refused the authentication token ({detail}); {token_source()}. To fix: {fix}"


def auth_headers() -> dict[str, str]:
    token = read_token()
    return {"Authorization": f"Bearer {token}"} if token else {}


def auth_env(path: Path) -> dict[str, str]:
    """Environment that makes Ray processes (and Ray clients) use token authentication with ``path``."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)}


def prepare_local_token() -> Path | None:
    """Before a local ``ray.init()``: the token file Ray will use, made 0600 if missing; a warning if others can
    read an existing one. None when the user disabled token authentication."""
    if token_auth_disabled():
        return None
    path = ensure_token()
    problem = token_problem(path)
    if problem:
        logger.warning(problem)
    return path
