"""Errors raised by :mod:`distmis.data`.

Everything that goes wrong because of the *data* (a missing file, a corrupt
NIfTI, a label value that does not belong to the layout, cases that end up with
different shapes) is reported as a :class:`DataError`.  The message always
names the offending file or case, and, where it helps, what would have been
accepted, so that the user can fix the data set without reading the code.
"""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """A data set, case, file or derived artefact is missing or invalid.

    Subclasses :class:`ValueError` so that callers that only care about "bad
    input" can catch either.
    """
