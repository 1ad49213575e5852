"""The ```python blocks of the project's markdown files, run as tests."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def python_blocks(path: Path) -> list[str]:
    """The sources of the ```python blocks of a markdown file, in order."""
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.DOTALL)


def run_blocks(path: Path, blocks: list[str]) -> None:
    """Run blocks one after the other in one namespace, as one script.

    Each block is compiled under the name ``<path>, block <i>`` so that a traceback
    says which block failed, and without this module's ``__future__`` imports: a
    block runs as the script a reader would paste it into.
    """
    namespace = {"__name__": f"markdown_{path.stem}"}
    for index, source in enumerate(blocks, start=1):
        name = f"{path.relative_to(ROOT)}, block {index}"
        exec(compile(source, name, "exec", dont_inherit=True), namespace)
