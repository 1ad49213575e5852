"""The Python examples of docs/*.md run and check themselves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = sorted((Path(__file__).parents[1] / "docs").glob("*.md"))
EXAMPLES = [
    pytest.param(path, source, id=f"{path.stem}-{index}")
    for path in DOCS
    for index, source in enumerate(
        re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.DOTALL)
    )
]


def test_accumulation_doc_has_an_example():
    assert any(
        path.name == "accumulation.md" for path, _ in (e.values for e in EXAMPLES)
    )


@pytest.mark.parametrize(("path", "source"), EXAMPLES)
def test_docs_example(path, source):
    exec(compile(source, str(path), "exec"), {"__name__": "docs_example"})
