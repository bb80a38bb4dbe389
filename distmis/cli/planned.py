"""The spec a command reads: its file, the ``--set`` overrides, and its ``auto`` tile, batch or stages planned."""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["load_planned"]


def load_planned(path: str, overrides: Mapping[str, Any]) -> Any:
    """The spec file at ``path`` with ``overrides``, its ``auto`` tile, batch or pipeline stages planned
    (:func:`~distmis.search.input_plan.load_planned_spec`), the plan printed in one line."""
    from distmis.search.input_plan import load_planned_spec

    spec, plan = load_planned_spec(path, overrides)
    if plan is not None:
        print(plan.describe())
    return spec
