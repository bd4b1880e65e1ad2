"""tests/README.md's module -> tests map stays true: one row for every module of the library, under
its folder's heading, and every test file a row names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "elastic_ddp"
MAP = ROOT / "tests" / "README.md"
TOP_LEVEL = "elastic_ddp"


def _modules() -> set[tuple[str, str]]:
    """(folder, module path within it) of every Python module of the library; the folder is the
    top-level package it belongs to, or ``elastic_ddp`` for the package's own top-level modules."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        folder = parts[0] if len(parts) > 1 else TOP_LEVEL
        found.add((folder, "/".join(parts[1:]) if len(parts) > 1 else parts[0]))
    return found


def _rows() -> dict[tuple[str, str], str]:
    """(folder, module) -> the tests cell of each row of the map."""
    rows, folder = {}, None
    for line in MAP.read_text().splitlines():
        heading = re.match(r"### (\S+)", line)
        if heading:
            folder = heading.group(1)
        row = re.match(r"\| `([^`]+\.py)`[^|]*\| (.*) \|$", line)
        if row and folder is not None:
            assert (folder, row.group(1)) not in rows, f"two rows for {folder}/{row.group(1)}"
            rows[folder, row.group(1)] = row.group(2)
    return rows


def _named_test_files(cell: str) -> set[str]:
    """The test files a cell names, with ``dir/test_{a,b}.py`` spelled out."""
    names = set()
    for match in re.finditer(r"\b((?:unit|integration|chaos|setup)/test_[\w{},]+\.py)", cell):
        text = match.group(1)
        brace = re.search(r"\{([^}]+)\}", text)
        options = brace.group(1).split(",") if brace else [""]
        names |= {text.replace(brace.group(0), option) if brace else text for option in options}
    return names


def test_every_module_of_the_library_has_one_row_under_its_folder():
    rows = set(_rows())
    modules = _modules()
    assert not modules - rows, f"modules with no row in tests/README.md: {sorted(modules - rows)}"
    assert not rows - modules, f"rows for modules that do not exist: {sorted(rows - modules)}"


def test_every_test_file_the_map_names_exists():
    missing = sorted(
        f"{folder}/{module}: tests/{name}"
        for (folder, module), cell in _rows().items()
        for name in _named_test_files(cell)
        if not (ROOT / "tests" / name).is_file()
    )
    assert not missing, missing
