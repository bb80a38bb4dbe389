"""The package's layering: no import cycles, and a spec package that imports neither torch nor Ray."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "distmis"


#: Modules below the spec: plain arithmetic and pydantic, no torch, Ray or TensorFlow.
PURE_MODULES = {"distmis.perf", "distmis.perf.model", "distmis.perf.partition", "distmis.perf.sizing",
                "distmis.models.registry", "distmis.models.params"}


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
    return ".".join(module.split(".")[:2])


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
