"""Tracking URIs can hold credentials (``postgresql://user:secret@host/db``): never print them whole."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

#: What a redacted URI holds in place of its password.
REDACTED = "***"


def redact_uri(uri: str) -> str:
    """``scheme://user:secret@host/path`` -> ``scheme://user:***@host/path``; other URIs unchanged."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:{REDACTED}@{netloc}"))


def is_redacted(uri: str) -> bool:
    """Whether ``uri``'s password was replaced by :data:`REDACTED` (it cannot be used to connect)."""
    return urlsplit(uri).password == REDACTED
