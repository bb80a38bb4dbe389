"""Measured step settings kept across trials and processes: a JSON file of entries by a key of what decided them
(the network and its params, the input, the precision, the device, the threads and the library versions).

A torch trial's memory format and compilation (:mod:`distmis.train.step_settings`) and a Keras trial's XLA verdict
(:class:`~distmis.train.compile_choice.XlaProbe`) are measured once per key and read back by the next trial of the
same key: a warm experiment-parallel actor's next trial, another search's. No framework is imported here.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["ChoiceCache", "cache_key", "cpu_model", "default_cache_path"]


def cache_key(**identity: Any) -> str:
    """A key of ``identity`` (what decides a measured choice, library versions included): a hash of its JSON."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s), else what :mod:`platform` knows of it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def default_cache_path() -> Path:
    """``$DISTMIS_CACHE/step_settings.json``, else ``~/.cache/distmis/step_settings.json``."""
    root = os.environ.get("DISTMIS_CACHE") or Path.home() / ".cache" / "distmis"
    return Path(root) / "step_settings.json"


class ChoiceCache:
    """Measured choices by :func:`cache_key`, in a JSON file (written whole through a temporary file, so that
    another process reads the old file or the new one); a file that cannot be read counts as empty."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_cache_path()

    def _read(self) -> dict[str, Any]:
        try:
            loaded = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return loaded if isinstance(loaded, dict) else {}

    def entry(self, key: str) -> dict[str, Any] | None:
        """What was stored under ``key`` (a JSON object), if anything."""
        entry = self._read().get(key)
        return entry if isinstance(entry, dict) else None

    def put_entry(self, key: str, entry: dict[str, Any]) -> None:
        """Store ``entry`` (JSON-serialisable) under ``key``."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            entries = self._read()
            entries[key] = entry
            temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            temporary.write_text(json.dumps(entries, indent=1, sort_keys=True))
            os.replace(temporary, self.path)
        except OSError:  # a cache that cannot be written is measured again next time
            pass
