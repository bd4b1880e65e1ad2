"""The library's import graph: no circle between modules, and every import between its parts goes to
a lower layer (docs/architecture.md, "Layers"). Read from the source with ``ast``, so an import
inside a function counts as much as one at the top of a file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "elastic_ddp"

# Lowest first. A part is a top-level module or package of elastic_ddp; the package's own
# __init__ (lazy names for users) stands above them all.
LAYERS: list[set[str]] = [
    {"config", "logs", "processes", "faults", "state", "etcd", "etcd_server", "ddp_buckets"},
    {"distributed", "stop", "prestart", "checkpoint"},
    {"data", "exiting", "failures", "lifecycle", "memory", "rendezvous"},
    {"metrics", "tensorboard_cli", "nn"},
    {"step_metrics", "step_guard", "resume"},
    {"run", "cli"},
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if "shim" in path.relative_to(PACKAGE).parts:  # runs before the package exists: stdlib only
            continue
        name = ".".join(("elastic_ddp", *path.relative_to(PACKAGE).with_suffix("").parts))
        found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The modules of this package that ``name`` imports, anywhere in its source."""
    package = path.name == "__init__.py"
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".")[: len(name.split(".")) - node.level + (1 if package else 0)]
                base = ".".join([*parent, *([base] if base else [])])
            candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in candidates:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
    return targets


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(part: str) -> int:
    if part == "__init__":
        return len(LAYERS)
    for number, parts in enumerate(LAYERS):
        if part in parts:
            return number
    raise AssertionError(f"elastic_ddp.{part} is in no layer of tests/unit/test_layers.py: add it where it belongs")


def test_every_part_of_the_library_has_a_layer():
    for module in MODULES:
        _layer(_part(module))


def test_imports_between_parts_go_to_a_lower_layer():
    upward = [
        f"{module} imports {target} (layer {_layer(_part(module))} -> {_layer(_part(target))})"
        for module, targets in sorted(GRAPH.items())
        for target in sorted(targets)
        if _part(module) != _part(target) and _layer(_part(target)) >= _layer(_part(module))
    ]
    assert not upward, "\n".join(upward)


def test_no_import_circle_between_modules():
    # Tarjan's strongly connected components: any with more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in GRAPH[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in GRAPH:
        if module not in index:
            visit(module)
    assert not circles, circles


@pytest.mark.parametrize("outside", ["recipes", "lm", "tests", "benchmarks"])
def test_the_library_never_imports_recipes_tests_or_benchmarks(outside):
    offenders = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])  # fmt: skip
            offenders += [f"{name} imports {n}" for n in names if n == outside or n.startswith(f"{outside}.")]
    assert not offenders, offenders


def test_the_graph_is_read_from_the_source():
    # A guard for the guard: the reader sees real edges, in both import forms.
    assert "elastic_ddp.resume" in GRAPH["elastic_ddp.run"]
    assert "elastic_ddp.etcd._etcd3" in GRAPH["elastic_ddp.etcd.client"]
    assert "elastic_ddp.checkpoint.manifest" in GRAPH["elastic_ddp.checkpoint.manager"]  # from package import module
