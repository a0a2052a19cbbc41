"""Running documented examples: a page's Python blocks in order, a room's docstrings."""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path
from types import ModuleType

from lightning_recorder.recorders._registry import RECORDERS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: Path) -> list[str]:
    """The ```python fenced blocks of a Markdown page."""
    return FENCE.findall(page.read_text(encoding="utf-8"))


def run_page(page: Path) -> dict[str, object]:
    """Execute every Python block of ``page`` in one namespace and return it.

    Recorder types a page registers are unregistered afterwards.
    """
    registry = dict(RECORDERS._types)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    try:
        for number, block in enumerate(python_blocks(page), start=1):
            exec(compile(block, f"{page.name}[block {number}]", "exec"), namespace)
    finally:
        RECORDERS._types.clear()
        RECORDERS._types.update(registry)
    return namespace


def doctest_room(package: ModuleType) -> doctest.TestResults:
    """Run the docstring examples of a room: its face and every module inside it."""
    import pkgutil

    attempted = failed = 0
    names = [package.__name__] + [
        f"{package.__name__}.{info.name}" for info in pkgutil.iter_modules(package.__path__)
    ]
    for name in names:
        result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
        attempted += result.attempted
        failed += result.failed
    return doctest.TestResults(failed, attempted)
