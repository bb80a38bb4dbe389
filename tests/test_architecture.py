"""The package's layering: no import cycles, and a spec package that imports neither torch nor Ray."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "distmis"


#: Modules below the spec: plain arithmetic and pydantic, no torch, Ray or TensorFlow.
PURE_MODULES = {"distmis.perf", "distmis.perf.model", "distmis.perf.partition", "distmis.perf.sizing",
                "distmis.perf.makespan", "distmis.models.registry", "distmis.models.params"}


def import_graph() -> dict[str, set[str]]:
    """Module -> the distmis modules it imports anywhere in its source (function-level imports included)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("distmis"):
                deps.add(node.module)
                deps.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names if alias.name.startswith("distmis"))
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep, path + [dep])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def subpackage(module: str) -> str:
    """The unit of the layering ``module`` belongs to: its subpackage (``distmis.search``), or a module the layering
    names on its own (``distmis.trial.record``: a leaf that the trial processes write and the driver reads)."""
    for unit in LEAF_MODULES:
        if module == unit or module.startswith(unit + "."):
            return unit
    return ".".join(module.split(".")[:2])


#: Modules that are a unit of the layering of their own, apart from their subpackage (:func:`subpackage`).
LEAF_MODULES = ("distmis.trial.record",)


def test_no_import_cycle_between_modules_or_subpackages():
    graph = import_graph()
    assert find_cycle(graph) is None, find_cycle(graph)
    packages: dict[str, set[str]] = {}
    for module, deps in graph.items():
        packages.setdefault(subpackage(module), set()).update(
            subpackage(d) for d in deps if subpackage(d) != subpackage(module))
    assert find_cycle(packages) is None, find_cycle(packages)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_spec_package_imports_neither_torch_nor_ray_nor_tensorflow():
    graph = import_graph()
    spec_deps = {d for m, deps in graph.items() if m.startswith("distmis.spec") for d in deps}
    # the spec reads the model registry (pure) and the performance arithmetic, nothing else of distmis
    assert {d for d in spec_deps if not d.startswith("distmis.spec")} <= PURE_MODULES
    code = ("import sys, distmis.spec, distmis.spec.layout, distmis.perf.partition; "
            "from distmis.spec import load_spec; load_spec('search_spaces/quickstart.yaml'); "
            "print(sorted(m for m in ('torch', 'ray', 'tensorflow', 'keras') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout
    assert out.strip() == "[]"


# --------------------------------------------------------------------------- the typed seams between search and trainers
#: The modules whose signatures (parameters, returns, annotated class fields) name no ``Any``: what one trial runs,
#: the epoch loop, the evaluation; they speak of a trainer by :class:`distmis.train.protocol.Trainer`.
TYPED_MODULES = ("distmis/trial/trainables.py", "distmis/trial/trainers.py", "distmis/train/loop.py",
                 "distmis/search/evaluate.py", "distmis/search/run.py", "distmis/search/outcome.py",
                 "distmis/search/tune_run.py")

def _names_any(annotation: ast.expr | None, aliases: set[str]) -> bool:
    """Whether an annotation names ``Any`` (``Any``, ``typing.Any``, a string of either, or an alias of one)."""
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                if _names_any(ast.parse(node.value, mode="eval").body, aliases):
                    return True
            except SyntaxError:
                continue
        if isinstance(node, ast.Name) and (node.id == "Any" or node.id in aliases):
            return True
        if isinstance(node, ast.Attribute) and node.attr == "Any":
            return True
    return False


def any_in_signatures(source: str) -> list[tuple[str, str]]:
    """``(function or class, what)`` of every ``Any`` in a module's signatures: each function's (nested ones
    included) parameters and return, each class's annotated fields (dataclasses, TypedDicts, Protocols); a
    module-level alias whose value names ``Any`` counts as ``Any``."""
    tree = ast.parse(source)
    aliases: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and _names_any(node.value, aliases):
            aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None \
                and _names_any(node.value, aliases):
            aliases.add(node.target.id)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            every = [*args.posonlyargs, *args.args, *args.kwonlyargs, *filter(None, (args.vararg, args.kwarg))]
            found += [(node.name, arg.arg) for arg in every if _names_any(arg.annotation, aliases)]
            if _names_any(node.returns, aliases):
                found.append((node.name, "return"))
        elif isinstance(node, ast.ClassDef):
            found += [(node.name, item.target.id) for item in node.body
                      if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                      and _names_any(item.annotation, aliases)]
    return found


def test_no_any_in_the_signatures_of_the_search_loop_and_evaluation():
    found = {path: any_in_signatures((PACKAGE.parent / path).read_text()) for path in TYPED_MODULES}
    assert found == {path: [] for path in TYPED_MODULES}


def test_the_any_finder_finds_any():
    source = ("from typing import Any\nimport typing\nAlias = dict[str, Any]\n"
              "def f(a: int, *b: 'Any', c: typing.Any = 1, **d: int) -> Alias:\n"
              "    def g(x: list[Any]) -> None: ...\n"
              "class C:\n    field: Any\n    other: int\n")
    assert sorted(any_in_signatures(source)) == [("C", "field"), ("f", "b"), ("f", "c"), ("f", "return"), ("g", "x")]
    assert any_in_signatures("def f(a: object) -> dict[str, int | str]: ...\n") == []


def test_no_trainer_class_inherits_from_another_trainer():
    """One trainer class per framework, each whole: none builds on another ``...Trainer`` (a Protocol extending the
    :class:`~distmis.train.protocol.Trainer` protocol is no implementation, and may)."""
    inheriting = []
    for path in sorted((PACKAGE / "train").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
                     for base in node.bases]
            if "Protocol" in bases:
                continue
            inheriting += [f"{path.relative_to(PACKAGE.parent)}: {node.name}({base})" for base in bases
                           if base.endswith("Trainer")]
    assert inheriting == []


def _helpers(tree: ast.Module, root: str) -> dict[str, ast.FunctionDef]:
    """``root`` and the module's functions it calls, directly or through one another."""
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    reached, todo = {}, [root]
    while todo:
        name = todo.pop()
        if name in reached or name not in functions:
            continue
        reached[name] = functions[name]
        todo += [call.func.id for call in ast.walk(functions[name])
                 if isinstance(call, ast.Call) and isinstance(call.func, ast.Name)]
    return reached


def asks_params_class(node: ast.AST) -> bool:
    """Whether ``node`` is ``isinstance(..., <...>Params)``: a question of which network's params these are."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
        and len(node.args) == 2 and any((isinstance(leaf, ast.Name) and leaf.id.endswith("Params"))
                                        or (isinstance(leaf, ast.Attribute) and leaf.attr.endswith("Params"))
                                        for leaf in ast.walk(node.args[1]))


def model_branches(source: str, root: str = "build_trainer") -> list[str]:
    """Where ``root`` (or a helper of it) asks which network a trial trains: ``<x>.model.name`` or ``model.name``,
    or ``isinstance(..., <...>Params)``."""
    found = []
    for name, function in _helpers(ast.parse(source), root).items():
        for node in ast.walk(function):
            if isinstance(node, ast.Attribute) and node.attr == "name" and (
                    (isinstance(node.value, ast.Attribute) and node.value.attr == "model")
                    or (isinstance(node.value, ast.Name) and node.value.id == "model")):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
            if asks_params_class(node):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_build_trainer_never_asks_which_network_a_trial_trains():
    """The trainer is the framework's, whatever the network (the model registry's entry builds it): building one
    branches on the framework and the layout, never on ``model.name`` or the type of ``model.params``."""
    assert model_branches((PACKAGE / "trial" / "trainers.py").read_text()) == []


def test_the_branch_finder_finds_a_branch():
    source = ("def build_trainer(spec):\n    return helper(spec)\n"
              "def helper(spec):\n    if spec.model.name == 'x' or isinstance(spec.model.params, m.ViTParams):\n"
              "        return 1\n"
              "def unrelated(model):\n    return model.name\n")
    assert [hit.split(":")[0] for hit in model_branches(source)] == ["helper", "helper"]


# --------------------------------------------------------------------------- the layering docs/architecture.md draws
#: Each subpackage (or top-level module) of distmis -> the others it may import (docs/architecture.md, "Where
#: everything lives"). ``distmis`` itself (an empty ``__init__``) is free to import.
ALLOWED: dict[str, set[str]] = {
    "distmis.perf": set(),  # pure arithmetic on plain numbers
    "distmis.pyfunc_model": set(),  # the registered model's code: MLflow runs it without distmis
    "distmis.trial.record": set(),  # what a trial leaves for the driver: report keys, checkpoint folders
    "distmis.models": {"distmis.perf"},
    "distmis.spec": {"distmis.perf", "distmis.models"},
    "distmis.data": {"distmis.spec", "distmis.pyfunc_model"},
    "distmis.parallel": {"distmis.perf", "distmis.models", "distmis.spec"},
    # the registries' composition: each network bound to its builders and parallelizing functions
    "distmis.networks": {"distmis.perf", "distmis.models", "distmis.parallel"},
    "distmis.tracking": {"distmis.perf", "distmis.models", "distmis.spec", "distmis.trial.record"},
    # a network's training step traced on fake tensors: its memory and FLOPs, from the network itself
    "distmis.estimate": {"distmis.perf", "distmis.models", "distmis.networks"},
    "distmis.train": {"distmis.perf", "distmis.models", "distmis.spec", "distmis.data", "distmis.parallel",
                      "distmis.networks", "distmis.estimate", "distmis.pyfunc_model", "distmis.trial.record"},
    "distmis.predict": {"distmis.models", "distmis.spec", "distmis.data", "distmis.pyfunc_model", "distmis.train",
                        "distmis.networks", "distmis.tracking"},
    "distmis.service": {"distmis.spec", "distmis.tracking"},
    # what runs in a trial's processes: Tune's trainables, the worker group, checkpoints, the trainer factory
    "distmis.trial": {"distmis.perf", "distmis.models", "distmis.spec", "distmis.data", "distmis.parallel",
                      "distmis.networks", "distmis.train", "distmis.pyfunc_model", "distmis.trial.record"},
    # the driver: the search from spec to results; of the trial package, its entry points only (TRIAL_ENTRY_POINTS)
    "distmis.search": {"distmis.perf", "distmis.models", "distmis.spec", "distmis.data", "distmis.parallel",
                       "distmis.estimate",
                       "distmis.networks", "distmis.train", "distmis.tracking", "distmis.predict", "distmis.service",
                       "distmis.pyfunc_model", "distmis.trial", "distmis.trial.record"},
    "distmis.cli": {"distmis.perf", "distmis.models", "distmis.spec", "distmis.data", "distmis.parallel",
                    "distmis.estimate",
                    "distmis.networks", "distmis.train", "distmis.tracking", "distmis.predict", "distmis.service",
                    "distmis.search", "distmis.pyfunc_model", "distmis.trial.record"},
    "distmis.__main__": {"distmis.cli"},
    "distmis": set(),
}


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """``module -> dependency`` for every import that crosses into a subpackage its own may not import."""
    return sorted(f"{module} -> {dep}" for module, deps in graph.items() for dep in deps
                  if subpackage(dep) not in ({subpackage(module), "distmis"} | ALLOWED.get(subpackage(module), set())))


def test_every_subpackage_imports_only_what_the_layering_allows():
    graph = import_graph()
    assert {subpackage(m) for m in graph} <= set(ALLOWED), "a new subpackage: give it a row in ALLOWED and the docs"
    assert layering_violations(graph) == []


def test_tracking_imports_neither_training_nor_the_parallel_runtime_and_perf_nothing_of_distmis():
    graph = import_graph()
    tracking = {d for m, deps in graph.items() if subpackage(m) == "distmis.tracking" for d in deps}
    assert not {d for d in tracking if subpackage(d) in ("distmis.train", "distmis.parallel")}
    assert not {d for m, deps in graph.items() if subpackage(m) == "distmis.perf" for d in deps
                if subpackage(d) != "distmis.perf"}
    assert graph["distmis"] == set()  # the root package imports nothing: importing it is free


def test_the_layering_check_finds_a_forbidden_edge():
    assert layering_violations({"distmis.tracking.x": {"distmis.train.loop"}}) == [
        "distmis.tracking.x -> distmis.train.loop"]
    assert layering_violations({"distmis.train.loop": {"distmis.spec.schema", "distmis.train.checkpoint"}}) == []


def test_every_allowed_row_is_acyclic_and_the_docs_name_every_subpackage():
    assert find_cycle(ALLOWED) is None, find_cycle(ALLOWED)
    docs = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    section = docs[docs.index("## Where everything lives"):]
    section = section[:section.index("\n## ", 1)]
    for package in ALLOWED:
        if package != "distmis":
            assert f"`{package.removeprefix('distmis.')}`" in section, package


# --------------------------------------------------------------------------- the driver and the trial processes
#: What the driver (every package but the trial package itself, and what runs in trials below it) may import of
#: the trial package: Tune's trainables and what the driver must know of them, the trainer factory (the driver loads
#: a trained trial's best weights), the checkpoint folders it reads, the storage both write through, the record.
TRIAL_ENTRY_POINTS = {"distmis.trial.trainables", "distmis.trial.trainers", "distmis.trial.checkpoints",
                      "distmis.trial.storage", "distmis.trial.record"}
DRIVER_PACKAGES = ("distmis.search", "distmis.cli", "distmis.service", "distmis.tracking", "distmis.predict")


def trial_internals_imported(graph: dict[str, set[str]]) -> list[str]:
    """``module -> dependency`` for every driver module's import of a trial module that is not an entry point."""
    return sorted(f"{module} -> {dep}" for module, deps in graph.items() if module.startswith(DRIVER_PACKAGES)
                  for dep in deps if dep.startswith("distmis.trial.") and dep not in TRIAL_ENTRY_POINTS
                  and dep.rsplit(".", 1)[0] not in TRIAL_ENTRY_POINTS)


def test_the_driver_imports_only_the_trial_packages_entry_points():
    graph = import_graph()
    assert trial_internals_imported(graph) == []
    assert TRIAL_ENTRY_POINTS <= set(graph)  # each entry point exists
    assert trial_internals_imported({"distmis.search.x": {"distmis.trial.worker_group"}}) == [
        "distmis.search.x -> distmis.trial.worker_group"]
    assert trial_internals_imported({"distmis.search.x": {"distmis.trial.trainables.single_process_trial"}}) == []


#: The most lines a module of the driver's search package may hold: one job a module.
SEARCH_MODULE_LINES = 400


def test_no_module_of_the_search_package_is_a_hub():
    long = {path.name: n for path in sorted((PACKAGE / "search").glob("*.py"))
            if (n := len(path.read_text().splitlines())) > SEARCH_MODULE_LINES}
    assert long == {}, f"split these by job: {long}"


# --------------------------------------------------------------------------- no ladder on a network's name
#: Where a network is named and its params classes used: the registry, the params, the networks themselves and their
#: composition (distmis.networks). Everywhere else reads the registry entry.
REGISTRY_PLACES = ("distmis/models/", "distmis/networks.py")


def network_branches(source: str) -> list[str]:
    """Where code compares ``<x>.model.name`` (or ``model.name``) with a literal network name, or asks
    ``isinstance(..., <...>Params)``: a branch on which network a trial trains."""
    def model_name(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "name" and (
            (isinstance(node.value, ast.Attribute) and node.value.attr == "model")
            or (isinstance(node.value, ast.Name) and node.value.id == "model"))

    def literal(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str) or (
            isinstance(node, (ast.Tuple, ast.List, ast.Set)) and all(literal(e) for e in node.elts))

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(model_name(side) for side in sides) and any(literal(side) for side in sides):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        if asks_params_class(node):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_code_outside_the_registry_branches_on_a_network():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = str(path.relative_to(PACKAGE.parent))
        if not relative.startswith(REGISTRY_PLACES) and (hits := network_branches(path.read_text())):
            found[relative] = hits
    assert found == {}


def test_the_network_branch_finder_finds_a_branch():
    source = ("if spec.model.name == 'vit-seg' or model.name in ('a', 'b'):\n    pass\n"
              "ok = isinstance(spec.model.params, m.ViTSegParams)\n"
              "same = config['model.name'] != spec.model.name\n")  # a change of network, not a branch on one
    assert sorted(hit.split(":")[0] for hit in network_branches(source)) == ["1", "1", "3"]
