"""The library's import graph: no circle between modules, and every import between its parts goes to
a lower layer (docs/architecture.md, "Layers"). Read from the source with ``ast``, so an import
inside a function counts as much as one at the top of a file.

And the contract between its processes (``elastic_ddp/contract.py``): standard library only, below
every other part, and the one place that spells each name that crosses a process boundary."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "elastic_ddp"
ROOT = PACKAGE.parent

# Lowest first. A part is a top-level module or package of elastic_ddp, or one module of worker/ (the
# training worker's own modules, which sit between data/, memory/ and checkpoint/); the package's own
# __init__ (lazy names for users), worker/'s and tools/ (the user's shell) stand above them all. The
# contract stands alone below them all: every module may import it.
LAYERS: list[set[str]] = [
    {"contract"},
    {"config", "logs", "processes", "faults", "state", "etcd", "worker.ddp_buckets", "worker.seeding"},
    {"agent_marks"},
    {"worker.distributed", "worker.stop", "prestart", "checkpoint"},
    {"data", "worker.exiting", "worker.failures", "worker.lifecycle", "memory", "rendezvous"},
    {"worker.metrics", "worker.nn", "worker.step"},
    {"worker.step_metrics", "worker.step_guard", "worker.resume"},
    {"worker.run"},
    {"worker.launch"},
    {"worker", "tools"},
]
# Packages whose modules are parts of their own.
SPLIT = {"worker"}


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
    if len(parts) > 2 and parts[1] in SPLIT:
        return f"{parts[1]}.{parts[2]}"
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


# The processes: the torchrun agent's side (with the node's template) and the training worker's. The
# agent imports nothing of the worker's (torch.distributed, the checkpoint and data code): what both
# need is below both, in the contract and the agent directory's marks.
AGENT_SIDE = {"rendezvous", "etcd", "prestart"}
WORKER_SIDE = {"worker", "data", "memory", "checkpoint"}


def _agent_to_worker(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{module} imports {target}"
        for module, targets in sorted(graph.items())
        if _part(module) in AGENT_SIDE
        for target in sorted(targets)
        if _part(target).partition(".")[0] in WORKER_SIDE
    ]


def test_the_agent_side_never_imports_the_worker_side():
    crossing = _agent_to_worker(GRAPH)
    assert not crossing, "\n".join(crossing)


@pytest.mark.parametrize("target", ["elastic_ddp.worker.stop", "elastic_ddp.checkpoint.manager", "elastic_ddp.data"])
def test_the_agent_side_rule_catches_an_import_of_the_worker_side(target):
    # A guard for the guard: one such edge added to the real graph is named.
    graph = {**GRAPH, "elastic_ddp.rendezvous.handler": GRAPH["elastic_ddp.rendezvous.handler"] | {target}}
    assert _agent_to_worker(graph) == [f"elastic_ddp.rendezvous.handler imports {target}"]


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
    assert "elastic_ddp.worker.resume" in GRAPH["elastic_ddp.worker.run"]
    assert "elastic_ddp.etcd._etcd3" in GRAPH["elastic_ddp.etcd.client"]
    assert "elastic_ddp.checkpoint.manifest" in GRAPH["elastic_ddp.checkpoint.manager"]  # from package import module


# Loaded by their paths, not imported, by the template and each worker's relay before anything else
# (elastic_ddp/prestart/): an import of the package there would import torch first.
LOADED_BY_PATH = ["contract.py", "prestart/wire.py", "prestart/shim/sitecustomize.py"]


def _imported_top_level(tree: ast.AST) -> set[str]:
    """The top-level names of the modules imported anywhere in ``tree`` ("." for a relative import)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else (node.module or "").partition(".")[0])
    return names - {"__future__"}


@pytest.mark.parametrize("relative", LOADED_BY_PATH)
def test_what_the_template_and_relay_load_by_path_imports_only_the_standard_library(relative):
    imported = _imported_top_level(ast.parse((PACKAGE / relative).read_text()))
    assert imported <= sys.stdlib_module_names, sorted(imported - sys.stdlib_module_names)


def test_the_contract_imports_nothing_of_the_package_and_every_part_may_import_it():
    assert GRAPH["elastic_ddp.contract"] == set()
    assert LAYERS[0] == {"contract"}  # alone below every other part


def test_the_template_imports_only_the_standard_library_before_it_counts_its_threads():
    # Its module-level imports run before main() counts the threads numpy starts (template.fork_hazard);
    # the package's modules it needs later are imported inside its functions.
    tree = ast.parse((PACKAGE / "prestart" / "template.py").read_text())
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    top = _imported_top_level(ast.Module(body=imports, type_ignores=[]))
    assert top <= sys.stdlib_module_names, sorted(top - sys.stdlib_module_names)


def test_importing_the_contract_imports_neither_torch_nor_another_module_of_the_package():
    code = (
        "import sys, elastic_ddp.contract; "
        "print(sorted(m for m in sys.modules if m.startswith(('torch', 'elastic_ddp.'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "['elastic_ddp.contract']"


def _contract():
    spec = importlib.util.spec_from_file_location("_contract_under_test", PACKAGE / "contract.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _code_strings(path: Path):
    """(line, text) of every string constant in ``path`` but its documentation: docstrings and other
    strings standing alone as statements."""
    tree = ast.parse(path.read_text())
    docs = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.lineno, node.value


def test_each_cross_process_name_is_spelled_only_in_the_contract():
    # Python code only: deploy/'s manifests and shell scripts are the user's side, where the
    # variables are set by name. Documentation (docstrings, docs/) and tests may name them.
    contract = _contract()
    defined = {name: value for name, value in vars(contract).items() if name.isupper()}
    assert sorted(contract.__all__) == sorted(defined)
    strings = [value for value in defined.values() if isinstance(value, str)]
    assert len(strings) == len(set(strings)), "two names of the contract have the same value"
    variables = {value for value in strings if value.startswith(contract.ENV_PREFIX) and value != contract.ENV_PREFIX}
    names = set(strings) - variables  # file, socket and process names, and the prefix itself: whole strings
    any_variable = re.compile(rf"\b{re.escape(contract.ENV_PREFIX)}[A-Z0-9_]+")
    offenders = []
    for root in (PACKAGE, ROOT / "recipes", ROOT / "deploy"):
        for path in sorted(root.rglob("*.py")):
            if path == PACKAGE / "contract.py":
                continue
            where = path.relative_to(ROOT)
            for line, text in _code_strings(path):
                for variable in any_variable.findall(text):
                    new = "" if variable in variables else " (not in contract.py: define it there)"
                    offenders.append(f"{where}:{line}: {variable}{new}")
                if text in names:
                    offenders.append(f"{where}:{line}: {text!r}")
    assert not offenders, "import these from elastic_ddp.contract:\n" + "\n".join(offenders)
