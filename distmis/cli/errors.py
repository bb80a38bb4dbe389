"""Exit codes and the errors the ``distmis`` command turns into them."""

from __future__ import annotations

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class BadInput(ValueError):
    """An argument the user gave cannot be used (exit 2; nothing was started)."""
