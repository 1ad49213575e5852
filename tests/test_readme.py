"""The README's Python examples run and check themselves."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re

import pytest

import dampednewton
import dampednewton.diagnostics
from tests.markdown import ROOT, python_blocks

README = ROOT / "README.md"
EXAMPLES = python_blocks(README)


def test_readme_has_examples():
    assert EXAMPLES, "README.md has no ```python example"


@pytest.mark.parametrize("source", EXAMPLES, ids=lambda s: s.splitlines()[-1][:40])
def test_readme_example(source):
    exec(compile(source, str(README), "exec"), {"__name__": "readme_example"})


def migration_rows() -> list[str]:
    """The middle column (this package's names) of the README's migration table."""
    section = README.read_text().split("## Migrating from ViViT and Cockpit")[1]
    table = section.split("\n\n")[2]
    return [row.split(" | ")[1] for row in table.splitlines()[2:]]


def test_migration_table_names_exist_with_their_defaults():
    """Every ``Name(args)`` of the table exists; its keyword values are defaults."""
    calls = [
        chunk
        for row in migration_rows()
        for chunk in re.findall(r"`([A-Z]\w*\(.*?\))`", row)
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
