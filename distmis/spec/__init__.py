"""The search spec: schema, loading, overrides and validation, a trial's spec and its parallel layout.

Pure data and arithmetic: nothing here imports torch, TensorFlow or Ray.
"""

from __future__ import annotations

from distmis.spec.layout import TrialLayout, resolve_layout, resolve_trial
from distmis.spec.load import (
    SpecError,
    apply_config,
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
    "TrialLayout",
    "apply_config",
    "load_spec",
    "parse_set_options",
    "resolve_layout",
    "resolve_trial",
    "set_path",
    "spec_to_dict",
    "spec_to_yaml",
    "validate_spec",
    "volume_shape",
    "with_overrides",
]
