"""Every trainer class is a :class:`~distmis.train.protocol.Trainer`: what the search, the epoch loop,
checkpointing, evaluation and inference timing call on one, with the protocol's signatures."""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from pathlib import Path

import numpy as np
import pytest

from distmis.search.prepare import prepare_data
from distmis.spec import validate_spec
from distmis.spec.layout import resolve_layout
from distmis.train.protocol import RestartableTrainer, Trainer
from tests.conftest import small_spec_tree

#: (module, class) of every trainer; a module not written yet is skipped (the torch trainer being merged).
TRAINER_CLASSES = [("distmis.train.tf_unet", "UNetTrainer"), ("distmis.train.torch_trainer", "TorchTrainer")]


def protocol_methods() -> list[str]:
    return sorted(name for name, value in vars(Trainer).items() if not name.startswith("_") and callable(value))


def protocol_attributes() -> list[str]:
    return sorted(Trainer.__annotations__)


def assigned_attributes(cls: type) -> set[str]:
    """The attributes ``cls`` (or a base of it) defines: class attributes, properties and ``self.<name> = ...``."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        names.update(vars(klass))
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # no source (a builtin base)
            continue
        for node in ast.walk(tree):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for target in targets:
                for leaf in ast.walk(target):
                    if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                            and leaf.value.id == "self"):
                        names.add(leaf.attr)
    return names


def shape(function: object) -> list[tuple[str, inspect._ParameterKind]]:
    """A method's parameters but ``self``: names and kinds (defaults may differ)."""
    parameters = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, p.kind) for p in parameters]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("protocol")
    spec = validate_spec(small_spec_tree(tmp / "data"))
    return spec, prepare_data(spec, tmp / "out", progress=False)


def test_the_protocol_has_what_its_callers_use():
    assert set(protocol_methods()) >= {
        "run_epoch", "train_epoch", "validate", "predict_volume", "predict_with_window", "save", "load",
        "save_state", "load_state", "weights_from", "case_dice"}
    assert set(protocol_attributes()) >= {"spec", "layout", "num_parameters", "model", "weight_files"}


@pytest.mark.parametrize(("module", "name"), TRAINER_CLASSES)
def test_every_trainer_class_has_the_protocols_methods_and_attributes(module: str, name: str):
    cls = getattr(importlib.import_module(module), name)
    for method in protocol_methods():
        assert callable(getattr(cls, method, None)), f"{name} has no method {method}"
        assert shape(getattr(cls, method)) == shape(getattr(Trainer, method)), \
            f"{name}.{method}{inspect.signature(getattr(cls, method))} against the protocol's " \
            f"{inspect.signature(getattr(Trainer, method))}"
    missing = set(protocol_attributes()) - assigned_attributes(cls)
    assert not missing, f"{name} never sets {sorted(missing)}"


def test_a_built_tensorflow_trainer_is_a_trainer(prepared, tmp_path: Path):
    from distmis.train.tf_unet import UNetTrainer

    spec, data = prepared
    trainer = UNetTrainer(spec, data.tfrecord_dir, layout=resolve_layout(spec))
    assert isinstance(trainer, Trainer) and isinstance(trainer, RestartableTrainer)
    assert trainer.weight_files == (trainer.save(tmp_path).name,)
    _, image, _ = trainer.val_cases[0]
    before = trainer.predict_volume(image)
    with trainer.weights_from(tmp_path):  # a context manager, as inference timing uses it
        np.testing.assert_array_equal(trainer.predict_with_window(image, trainer.window), before)


def test_a_class_without_a_method_of_the_protocol_is_no_trainer():
    class Partial:
        spec = layout = model = None
        num_parameters = 0
        weight_files = ("model.pt",)
        volume_shape = (8, 8, 8)
        val_cases = ()

        def run_epoch(self, epoch):  # and nothing else
            raise NotImplementedError

    assert not isinstance(Partial(), Trainer)
