"""What the docs state about the code matches the code; their links resolve."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
from pathlib import Path

import pytest
from backpack.extensions import BatchGrad, SqrtGGNExact
from torch.nn.modules.loss import _Loss

import dampednewton
import dampednewton.diagnostics
from dampednewton.backpack.added_modules import ADDED_MODULES
from dampednewton.backpack.extensions import ExactSqrtGGN, MonteCarloSqrtGGN
from dampednewton.backpack.layers import LAYERS
from dampednewton.backpack.private import registered_module_types
from tests.markdown import ROOT

DOCS = ROOT / "docs"
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def table_rows(path: Path, heading: str) -> list[list[str]]:
    """The cells of the first table after ``heading``, without its header rows."""
    section = ("\n" + path.read_text()).split(f"\n{heading}\n")[1].splitlines()
    start = next(i for i, line in enumerate(section) if line.startswith("|"))
    table = itertools.takewhile(lambda line: line.startswith("|"), section[start:])
    rows = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in table]
    return rows[2:]


def test_migration_table_names_exist_with_their_defaults():
    """Every ``Name(args)`` of the table exists; its keyword values are defaults."""
    rows = table_rows(DOCS / "migration.md", "# Migrating from ViViT and Cockpit")
    calls = [
        chunk for row in rows for chunk in re.findall(r"`([A-Z]\w*\(.*?\))`", row[1])
    ]
    assert len(calls) >= 15, calls
    for chunk in calls:
        call = ast.parse(chunk, mode="eval").body
        name = call.func.id
        target = getattr(dampednewton, name, None) or getattr(
            dampednewton.diagnostics, name
        )
        parameters = inspect.signature(target).parameters
        for argument in call.args:
            assert argument.id in parameters, f"{chunk}: no argument {argument.id}"
        for keyword in call.keywords:
            default = _default(target, keyword.arg, parameters)
            expected = eval(ast.unparse(keyword.value), vars(dampednewton.diagnostics))
            assert default == expected, f"{chunk}: default {default!r}"


def _default(target, name: str, parameters) -> object:
    """A parameter's default, built by its factory for dataclass fields."""
    if dataclasses.is_dataclass(target):
        field = {f.name: f for f in dataclasses.fields(target)}[name]
        if field.default_factory is not dataclasses.MISSING:
            return field.default_factory()
    return parameters[name].default


def test_supported_layers_are_the_registries():
    """The table of docs/usage.md lists what the square-root extensions handle."""
    rows = table_rows(DOCS / "usage.md", "## Supported layers")
    structured, other_parametrized, parameter_free, added, losses = (
        set(re.findall(r"`(\w+)`", row[1])) for row in rows
    )
    # The package's square-root extensions: BackPACK's modules and those the package
    # adds (dampednewton/backpack/added_modules.py).
    exact = set(registered_module_types(ExactSqrtGGN()))
    assert exact == set(registered_module_types(MonteCarloSqrtGGN(1)))
    assert exact == set(registered_module_types(SqrtGGNExact())) | set(ADDED_MODULES)
    parametrized = exact & set(registered_module_types(BatchGrad()))
    loss_types = {cls for cls in exact if issubclass(cls, _Loss)}
    assert structured == {cls.__name__ for cls in LAYERS}
    assert structured | other_parametrized == {cls.__name__ for cls in parametrized}
    assert not structured & other_parametrized
    assert added == {cls.__name__ for cls in ADDED_MODULES}
    assert parameter_free | added == {
        cls.__name__ for cls in exact - parametrized - loss_types
    }
    assert losses == {cls.__name__ for cls in loss_types}


def _outside_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    headings = re.findall(r"^#+ (.*)$", _outside_code(path.read_text()), re.MULTILINE)
    return {
        re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        for heading in headings
    }


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda path: path.name)
def test_relative_links_resolve(path):
    links = re.findall(r"\]\(([^)\s]+)\)", _outside_code(path.read_text()))
    for link in links:
        if re.match(r"\w+://", link):
            continue
        target, _, anchor = link.partition("#")
        resolved = (path.parent / target).resolve() if target else path
        assert resolved.exists(), f"{path.name}: {link} does not exist"
        if anchor:
            assert anchor in _anchors(resolved), f"{path.name}: no heading #{anchor}"


def _cell_counts(text: str) -> list[tuple[int, int, int]]:
    r"""``(line, cells, header cells)`` of every table row, pipes escaped as ``\|``."""
    counts, header = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.startswith("|"):
            header = None
            continue
        cells = len(re.split(r"(?<!\\)\|", line.strip())) - 2
        header = cells if header is None else header
        counts.append((number, cells, header))
    return counts


def test_cell_counts_see_an_unescaped_pipe():
    table = "| a | b |\n| --- | --- |\n| `x \\| y` | z |\n| `|x|` | z |\n"
    assert _cell_counts(table) == [(1, 2, 2), (2, 2, 2), (3, 2, 2), (4, 4, 2)]


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda path: path.name)
def test_table_rows_have_the_header_cells(path):
    r"""A ``|`` inside a table cell, code spans included, must be escaped as ``\|``."""
    wrong = [row for row in _cell_counts(path.read_text()) if row[1] != row[2]]
    assert not wrong, f"{path.name}: (line, cells, header cells) {wrong}"
