"""Specs refused at validation as they should be, with a message a person can read (issue 46, findings 1, 4 and 5).

Each case runs the real ``distmis`` command in its own process:

1. a ``model.name`` grid whose networks the whole volume breaks (SwinUNETR on 16^3, BasicUNet's one-voxel deepest
   map): exit 2 at ``validate`` whether the data set exists or not, and ``run`` refuses it before Ray or conversion;
4. ``tracking.model_name`` that MLflow's registry refuses (``../../etc``): exit 2 at ``validate``;
5. 10^5 unknown keys, a megabyte grid value, an alias bomb in a grid value: exit 2, and a message of a screenful.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from tests.conftest import small_spec_tree
from tests.faults.test_refused_before_work import distmis, write_spec

pytestmark = pytest.mark.slow  # each case is a real distmis process (a few seconds of imports)


def test_a_network_the_whole_volume_breaks_is_refused_with_or_without_the_data(tmp_path: Path):
    from distmis.data.synthetic import synthesize_dataset

    data = tmp_path / "data"
    tree = small_spec_tree(data)
    tree["model"] = {"name": "unet3d", "framework": "torch", "params": {"base_filters": 4, "levels": 3}}
    tree["training"]["tile"] = None
    tree["search"]["space"] = {"model.name": {"grid": ["unet3d", "swinunetr", "basicunet"]}}
    spec = write_spec(tmp_path, tree)

    def refused(done: Any) -> None:
        assert done.returncode == 2, done.stderr[-2000:]
        assert "search.space.model.name: value 'swinunetr' makes" in done.stderr  # the network,
        assert "the whole volume [16, 16, 16]" in done.stderr and "must divide by 32" in done.stderr  # the volume,
        assert "value 'basicunet'" in done.stderr and "single voxel" in done.stderr  # and each one's rule

    refused(distmis("validate", str(spec), timeout=120))  # the data set will be generated: its shape is the spec's
    synthesize_dataset(data, "msd", cases=6, shape=(16, 16, 16), seed=0, progress=False)
    done = distmis("validate", str(spec), timeout=120)  # the data set is there: its cases' headers tell the shape
    refused(done)
    assert f"(case file '{data / 'imagesTr'}" in done.stderr
    assert "must divide by 32 (swinunetr: SwinUNETR's 2^3 patches and four 2x patch mergings, 2**5)" in done.stderr
    done = distmis("run", str(spec), "--output", str(tmp_path / "out"), timeout=120)
    refused(done)
    assert not done.started_ray and not (tmp_path / "out").exists()  # before Ray, conversion or any folder


def unknown_keys(text: str) -> str:
    """The spec's YAML with 10^5 keys the training section does not have (written out: yaml's dumper takes seconds)."""
    return text.replace("training:\n", "training:\n" + "".join(f"  bad_key_{i}: {i}\n" for i in range(100_000)), 1)


def huge_grid_value(tree: dict[str, Any]) -> None:
    tree["search"]["space"] = {"model.params.norm": {"grid": ["batch", "x" * 1_000_000]}}


def registry_path(tree: dict[str, Any]) -> None:
    tree["tracking"] = {"model_name": "../../etc"}


def alias_bomb(text: str) -> str:
    """The spec's YAML with a grid value whose aliases of aliases hold 9**9 strings (PyYAML shares them; anything
    that walks the value expands them)."""
    anchors = ['&a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    anchors += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    return text.replace("search:\n", f"search:\n  space:\n    model.params.norm: {{grid: [{', '.join(anchors)}]}}\n", 1)


CASES: dict[str, tuple[Callable[[dict[str, Any]], None] | None, Callable[[str], str] | None, list[str]]] = {
    "unknown keys": (None, unknown_keys, ["training.bad_key_0: unknown key 'bad_key_0'; allowed keys here: epochs",
                                          "... and 99,980 more problem(s) (100,000 in all)"]),
    "huge grid value": (huge_grid_value, None, ["search.space.model.params.norm: value 'xxx",
                                                "... (1,000,002 characters) is invalid for model.params.norm"]),
    "alias bomb": (None, alias_bomb, ["holds more than 1,000,000 values once its YAML aliases (*name) are expanded"]),
    "model name": (registry_path, None, ["tracking.model_name: MLflow's model registry refuses this name (it holds "
                                         "'/')", "(got '../../etc')"]),
}


@pytest.mark.parametrize("case", CASES)
def test_a_spec_error_is_a_screenful(tmp_path: Path, case: str):
    edit_tree, edit_text, expected = CASES[case]
    tree = small_spec_tree(tmp_path / "data")
    tree["search"].pop("space")
    if edit_tree is not None:
        edit_tree(tree)
    text = yaml.safe_dump(tree)
    spec = tmp_path / "spec.yaml"
    spec.write_text(edit_text(text) if edit_text is not None else text)
    done = distmis("validate", str(spec), timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    for part in expected:
        assert part in done.stderr, done.stderr[-3000:]
    assert len(done.stderr) < 25_000 and len(done.stderr.splitlines()) <= 23, done.stderr[:3000]
    assert not (tmp_path / "data").exists()  # nothing generated
