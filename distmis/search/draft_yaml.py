"""The spec ``distmis init`` drafted (:class:`~distmis.search.draft_spec.Draft`) as commented YAML: each decided
field followed by why, and the predicted step of every trial as a table at the end (:func:`render_spec`); read back
and checked as ``distmis run`` will read it (:func:`checked_spec`)."""

from __future__ import annotations

import re
from typing import Mapping

import yaml

from distmis.search.draft_spec import Draft
from distmis.search.memory_fit import check_trials_fit, format_steps
from distmis.search.tile_search import mib
from distmis.spec.load import validate_spec
from distmis.spec.schema import Spec

__all__ = ["render_spec", "checked_spec"]


def _commented(text: str, comments: Mapping[tuple[str, ...], str]) -> list[str]:
    """YAML lines with a ``# comment`` after each key whose path has one."""
    lines, stack = [], []
    for line in text.splitlines():
        match = re.match(r"^( *)([^\s:#][^:]*):(\s|$)", line)
        if match:
            depth = len(match.group(1)) // 2
            stack = stack[:depth] + [match.group(2).strip("'\"")]
            note = comments.get(tuple(stack))
            if note:
                line = f"{line}  # {note}"
        lines.append(line)
    return lines


def _prediction(draft: Draft) -> list[str]:
    """The predicted steps as comment lines: the table of every trial's step, and the least training time."""
    lines = [f"Predicted per trial ({draft.fit.device} rules; {mib(draft.fit.usable)} MiB usable per worker):"]
    lines += format_steps(draft.fit)
    steps_per_epoch = draft.spec.training.epoch_steps(draft.train_cases, draft.spec.training.batch_size)
    flops = [s.memory.trace.flops for s in draft.fit.steps if s.memory is not None]
    if flops:
        most = max(flops) * steps_per_epoch * draft.spec.training.epochs
        line = (f"A trial's training steps: {steps_per_epoch} per epoch x {draft.spec.training.epochs} epochs, at "
                f"most {most / 1e12:.3g} TFLOP")
        if draft.device_flops:
            least, longest = (f * steps_per_epoch * draft.spec.training.epochs / draft.device_flops / 60
                              for f in (min(flops), max(flops)))
            line += (f"; at {draft.device_flops / 1e9:.3g} GFLOP/s, the device's matmul rate, {least:.2g} to "
                     f"{longest:.2g} minutes: a lower bound, since convolutions reach a fraction of that rate, and "
                     "validation is not counted")
        lines.append(line + ".")
    return lines


def render_spec(draft: Draft, spec_path: str = "spec.yaml", command: str = "") -> str:
    """The drafted spec as commented YAML."""
    out = [f"# {command}"] if command else []
    out += [f"# {line}" for line in draft.header]
    out += ["# Every value below may be edited; `distmis validate` checks the spec again and predicts every trial's "
            "step.", f"#   distmis validate {spec_path}", f"#   distmis run {spec_path}"]
    for section, value in draft.tree.items():
        out.append("")
        leaf = not isinstance(value, dict) or not any(isinstance(v, (dict, list)) for v in value.values())
        text = yaml.safe_dump({section: value}, sort_keys=False, default_flow_style=False if leaf else None,
                              width=120)
        out += _commented(text.rstrip("\n"), draft.reasons)
    out.append("")
    out += [f"# {line}" for line in _prediction(draft)]
    return "\n".join(out) + "\n"


def checked_spec(text: str) -> Spec:
    """The spec ``text`` holds, read back as ``distmis run`` will read it and checked again, its steps too."""
    spec = validate_spec(yaml.safe_load(text), source="init")
    check_trials_fit(spec)
    return spec
