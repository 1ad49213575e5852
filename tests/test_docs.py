"""The Python blocks of docs/*.md run, file by file, as one script each."""

from __future__ import annotations

import pytest

from tests.markdown import ROOT, python_blocks, run_blocks

DOCS = sorted((ROOT / "docs").glob("*.md"))


def test_docs_have_examples():
    assert DOCS, "no docs/*.md"
    for path in DOCS:
        assert python_blocks(path), f"{path} has no ```python block"


@pytest.mark.parametrize("path", DOCS, ids=lambda path: path.name)
def test_doc_blocks_run(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # whatever a block writes stays in tmp_path
    run_blocks(path, python_blocks(path))
