"""The README's Python examples run and check themselves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_examples():
    assert EXAMPLES, "README.md has no ```python example"


@pytest.mark.parametrize("source", EXAMPLES, ids=lambda s: s.splitlines()[-1][:40])
def test_readme_example(source):
    exec(compile(source, str(README), "exec"), {"__name__": "readme_example"})
