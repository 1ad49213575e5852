"""The README's Python examples run and check themselves."""

from __future__ import annotations

import pytest

from tests.markdown import ROOT, python_blocks

README = ROOT / "README.md"
EXAMPLES = python_blocks(README)


def test_readme_has_examples():
    assert EXAMPLES, "README.md has no ```python example"


@pytest.mark.parametrize("source", EXAMPLES, ids=lambda s: s.splitlines()[-1][:40])
def test_readme_example(source):
    code = compile(source, str(README), "exec", dont_inherit=True)
    exec(code, {"__name__": "readme_example"})


def test_readme_stays_short():
    lines = len(README.read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines: move details into docs/"
