"""The search spec: schema, loading, overrides and validation."""

from __future__ import annotations

from distmis.spec.load import (
    SpecError,
    get_path,
    load_spec,
    parse_set_options,
    set_path,
    spec_to_dict,
    spec_to_yaml,
    validate_spec,
    volume_shape,
    with_overrides,
)
from distmis.spec.schema import Domain, Spec

__all__ = [
    "Domain",
    "Spec",
    "SpecError",
    "get_path",
    "load_spec",
    "parse_set_options",
    "set_path",
    "spec_to_dict",
    "spec_to_yaml",
    "validate_spec",
    "volume_shape",
    "with_overrides",
]
