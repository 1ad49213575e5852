"""The package's floors: every module imports only from its own floor or below.

Parsed with :mod:`ast` (nothing is imported): each ``import`` and ``from … import``
of a ``dampednewton`` module, at module level or inside a function, is checked
against :data:`FLOORS`, from the ground up. A unit (a subpackage or a top-level
module) may import from itself and from the floors below its own, never from a
floor above nor from another unit of its floor.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "dampednewton"

FLOORS: list[set[str]] = [
    {"math"},
    {"threads", "distributed", "policies"},
    {"backpack", "averaging", "process_groups"},
    {"computations"},
    {"diagnostics"},
    {"_step"},
    {"optimizer"},
    {"__init__"},
]
"""Units from the ground floor (pure tensor math) up to the public entry point."""

THIRD_PARTY_OF_MATH = {"torch", "numpy"}


def unit_of(module: str) -> str:
    """The unit of a dotted ``dampednewton`` module name (``__init__`` for the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def floor_of(unit: str) -> int:
    """The floor index of a unit; a unit on no floor fails the test."""
    for index, floor in enumerate(FLOORS):
        if unit in floor:
            return index
    raise AssertionError(f"dampednewton.{unit} is on no floor: add it to FLOORS.")


def module_name(path: Path) -> str:
    """The dotted name of a module file of the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    """Whether a dotted ``dampednewton`` name is a module or subpackage of it."""
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute (relative imports resolved).

    ``from a import b`` imports the module ``a.b`` if there is one, else ``a``.
    """
    package = module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                name = f"{base}.{alias.name}"
                inside = base.split(".")[0] == "dampednewton" and is_module(name)
                imported.add(name if inside else base)
    return imported


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_unit_is_on_a_floor():
    units = {unit_of(module_name(path)) for path in MODULES}
    for unit in units:
        floor_of(unit)
    assert {unit for floor in FLOORS for unit in floor} == units


@pytest.mark.parametrize("path", MODULES, ids=module_name)
def test_imports_go_down_only(path):
    unit = unit_of(module_name(path))
    floor = floor_of(unit)
    for imported in imported_modules(path):
        if imported.split(".")[0] != "dampednewton" or unit_of(imported) == unit:
            continue
        assert floor_of(unit_of(imported)) < floor, (
            f"{module_name(path)} (floor {floor}) imports {imported} "
            f"(floor {floor_of(unit_of(imported))}): move what it needs down."
        )


@pytest.mark.parametrize(
    "path", sorted((PACKAGE / "math").rglob("*.py")), ids=lambda path: path.name
)
def test_math_is_pure_tensor_math(path):
    """``math/`` imports torch, numpy, the standard library and itself only."""
    for imported in imported_modules(path):
        top = imported.split(".")[0]
        allowed = (
            top in THIRD_PARTY_OF_MATH
            or top in sys.stdlib_module_names
            or imported == "dampednewton.math"
            or imported.startswith("dampednewton.math.")
        )
        assert allowed, f"math/{path.name} imports {imported}."
