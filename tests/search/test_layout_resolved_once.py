"""A trial resolves its layout once: what one experiment-parallel trial runs, in this process, without Ray.

``single_process_trial`` resolves the trial's spec and layout (``resolve_trial``), builds its trainer with that
layout (``build_trainer``) and hands it to the epoch loop (``train_and_report``): nothing after the first step may
resolve the layout again (a trainer that fell back to ``resolve_layout(spec)`` would, and could train at another
rate than the one the trial was resolved to). The evaluation after the search rebuilds the trial's trainer in the
driver (``loaded_trainer``): it starts from the trial's config, not from the trial's process, so it resolves the
trial once more, itself, to the same layout (and builds it on one device, a local mesh): one call for the trial,
one for its evaluation.
"""

from __future__ import annotations

import importlib
import shutil
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

import distmis.spec.layout
from distmis.search.evaluate import BestModel, loaded_trainer
from distmis.search.prepare import prepare_data
from distmis.trial.trainers import build_trainer
from distmis.spec import validate_spec
from distmis.spec.layout import resolve_trial
from distmis.train.loop import Metrics, StoredCheckpoint, train_and_report
from distmis.train.protocol import Trainer
from tests.conftest import small_spec_tree

CONFIG = {"training.optimizer.lr": 5.0e-3}


class FolderCheckpoint:
    """A checkpoint kept in a folder of its own, as Tune keeps a reported one (the loop's folder is temporary)."""

    root: Path

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def from_directory(cls, path: str) -> FolderCheckpoint:
        kept = cls.root / uuid.uuid4().hex
        shutil.copytree(path, kept)
        return cls(str(kept))

    @contextmanager
    def as_directory(self) -> Iterator[str]:
        yield self.path


@pytest.fixture
def resolutions(monkeypatch) -> list[object]:
    """Every call of ``resolve_layout``, wherever it is called from: the function is replaced in
    :mod:`distmis.spec.layout` (which ``resolve_trial`` calls) and in every module that imported it by name (each
    module of distmis that names it is imported first, so that none binds the original later)."""
    package = Path(distmis.spec.layout.__file__).parents[1]
    for path in sorted(package.rglob("*.py")):
        if "resolve_layout" in path.read_text():
            importlib.import_module(".".join(path.relative_to(package.parent).with_suffix("").parts)
                                    .removesuffix(".__init__"))
    original = distmis.spec.layout.resolve_layout
    calls: list[object] = []

    def counting(spec):
        calls.append(spec)
        return original(spec)

    for name, module in list(sys.modules.items()):
        if name.startswith("distmis") and getattr(module, "resolve_layout", None) is original:
            monkeypatch.setattr(module, "resolve_layout", counting)
    return calls


@pytest.mark.parametrize("framework", ["tensorflow", "torch"])
def test_a_trial_resolves_its_layout_once_and_its_evaluation_once_more(framework: str, tmp_path: Path, resolutions,
                                                                       monkeypatch):
    tree = small_spec_tree(tmp_path / "data")
    tree["model"]["framework"] = framework
    tree["training"]["epochs"] = 1
    spec = validate_spec(tree)
    data = prepare_data(spec, tmp_path / "out", progress=False)
    assert resolutions == []  # preparing the data lays out no trial
    monkeypatch.setattr(FolderCheckpoint, "root", tmp_path / "checkpoints", raising=False)

    # single_process_trial's steps, without Tune
    trial, layout = resolve_trial(spec, CONFIG)
    trainer = build_trainer(trial, layout, data.tfrecord_dir)
    assert isinstance(trainer, Trainer) and trainer.layout is layout
    reports: list[tuple[Metrics, StoredCheckpoint | None]] = []
    train_and_report(trainer, trial, lambda metrics, checkpoint=None: reports.append((metrics, checkpoint)),
                     FolderCheckpoint)
    assert [metrics["epoch"] for metrics, _ in reports] == [1]
    assert resolutions == [resolutions[0]] and resolutions[0].training.optimizer.lr == 5.0e-3  # the trial's, once

    # the evaluation's rebuild in the driver: from the trial's config, resolved once there
    best = BestModel("t_00000", CONFIG, float(reports[0][0]["val_dice"]), reports[0][1])
    with loaded_trainer(best, spec, data) as rebuilt:
        assert isinstance(rebuilt, Trainer)
        assert rebuilt.layout == layout  # the trial's layout again (on one device: a local mesh)
    assert len(resolutions) == 2
