"""A spec's errors stay a screenful, and YAML that would expand without bound is refused (issue 46, finding 5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from distmis.spec import SpecError, validate_spec
from distmis.spec.load import (MAX_LINE_CHARACTERS, MAX_LISTED_PROBLEMS, MAX_SPEC_VALUES, clipped, expanded_size,
                               parse_set_options, read_spec_file, shown)

ROOT = Path(__file__).resolve().parents[2]


def test_a_value_is_shown_cut_with_its_length():
    assert shown("lol") == "'lol'"
    text = shown(["x" * 10] * 10_000)
    assert len(text) < 250 and text.startswith("['xxxxxxxxxx', ") and text.endswith("... (140,000 characters)")


def test_a_line_keeps_its_start_and_end():
    assert clipped("short") == "short"
    line = "search.space.x: value " + "y" * 10**6 + " is invalid: allowed are 'a' or 'b'"
    out = clipped(line)
    assert len(out) <= MAX_LINE_CHARACTERS + 40
    assert out.startswith("search.space.x: value yyy") and out.endswith("allowed are 'a' or 'b'")
    assert f"... ({len(line):,} characters) ..." in out


def test_a_spec_error_lists_twenty_problems_and_counts_the_rest():
    problems = [(f"training.bad_{i}", "unknown key") for i in range(100_000)]
    error = SpecError("my.yaml", problems)
    lines = str(error).splitlines()
    assert len(lines) == 1 + MAX_LISTED_PROBLEMS + 1
    assert lines[1] == "  - training.bad_0: unknown key"
    assert lines[MAX_LISTED_PROBLEMS] == "  - training.bad_19: unknown key"
    assert lines[-1] == "  ... and 99,980 more problem(s) (100,000 in all)"
    assert error.problems == problems  # all of them, for code that reads them
    assert str(SpecError("my.yaml", [("name", "x" * 10**6)])).count("\n") == 1
    assert len(str(SpecError("my.yaml", [("name", "x" * 10**6)]))) < 2 * MAX_LINE_CHARACTERS


def test_ten_thousand_unknown_keys_and_a_huge_grid_value_give_a_short_message(spec_tree):
    spec_tree["training"].update({f"bad_key_{i}": i for i in range(10_000)})
    with pytest.raises(SpecError) as info:
        validate_spec(spec_tree)
    assert len(info.value.problems) == 10_000 and len(str(info.value).splitlines()) == 22
    assert "unknown key 'bad_key_0'; allowed keys here: epochs, batch_size" in str(info.value)
    for key in range(10_000):
        del spec_tree["training"][f"bad_key_{key}"]
    spec_tree["search"]["space"] = {"model.params.norm": {"grid": ["batch", "x" * 10**6]}}
    with pytest.raises(SpecError) as info:
        validate_spec(spec_tree)
    (path, message), = info.value.problems
    assert path == "search.space.model.params.norm" and len(message) < 600
    assert message.startswith("value 'xxxx")
    assert "... (1,000,002 characters) is invalid for model.params.norm" in message


def bomb(levels: int) -> str:
    """The YAML of a list whose aliases of aliases hold 9**levels strings."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_the_expanded_size_counts_every_alias_without_expanding():
    shared = [1, 2, 3]
    assert expanded_size({"x": [shared, shared]}) == 1 + 1 + 1 + 2 * 4  # mapping, key, list, two lists of 3
    tree = yaml.safe_load(bomb(3))
    assert expanded_size(tree) == 1 + 3 + (1 + 9) + (1 + 9 * 10) + (1 + 9 * (1 + 9 * 10))
    assert expanded_size(yaml.safe_load(bomb(12))) > MAX_SPEC_VALUES  # 9**11 strings, counted in microseconds
    with pytest.raises(ValueError, match="holds itself"):
        expanded_size(yaml.safe_load("a: &a [1, *a]"))


def test_an_alias_bomb_a_recursive_alias_and_deep_nesting_are_refused_on_reading(tmp_path: Path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(bomb(9))
    with pytest.raises(SpecError, match=f"holds more than {MAX_SPEC_VALUES:,} values once its YAML aliases"):
        read_spec_file(spec)
    spec.write_text("name: a\nx: &x [1, *x]\n")
    with pytest.raises(SpecError, match="holds itself"):
        read_spec_file(spec)
    spec.write_text("name: a\nx:\n  " + "- " * 60_000 + "1\n")  # libyaml's own composer would crash the process
    with pytest.raises(SpecError, match="nest too deeply"):
        read_spec_file(spec)
    with pytest.raises(SpecError, match="holds more than"):
        parse_set_options(["search.space=" + "{" + bomb(9).replace("\n", ", ").rstrip(", ") + "}"])


def test_a_spec_reads_as_yaml_safe_load_reads_it(tmp_path: Path):
    paths = sorted((ROOT / "search_spaces").glob("*.yaml"))
    (tmp_path / "anchors.yaml").write_text("name: a\nbase: &base {lr: 1.0e-3, name: adam, on: yes}\n"
                                           "other: {<<: *base, lr: 1e-2, when: 2024-01-01, none: ~}\n")
    for path in paths + [tmp_path / "anchors.yaml"]:
        assert read_spec_file(path) == yaml.safe_load(path.read_text()), path.name
