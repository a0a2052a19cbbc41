"""Running the Python examples of a documentation page, block by block, in order."""

from __future__ import annotations

import re
from pathlib import Path

from lightning_recorder.manager import _REGISTRY

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: Path) -> list[str]:
    """The ```python fenced blocks of a Markdown page."""
    return FENCE.findall(page.read_text(encoding="utf-8"))


def run_page(page: Path) -> dict[str, object]:
    """Execute every Python block of ``page`` in one namespace and return it.

    Recorder types a page registers are unregistered afterwards.
    """
    registry = dict(_REGISTRY)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    try:
        for number, block in enumerate(python_blocks(page), start=1):
            exec(compile(block, f"{page.name}[block {number}]", "exec"), namespace)
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(registry)
    return namespace
