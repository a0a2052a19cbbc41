"""The Python examples in the docs run as tests, page by page, in order."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_recorder.manager import _REGISTRY

DOCS = Path(__file__).resolve().parent.parent / "docs"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# Pages whose examples are run by their own test modules.
OWN_TESTS = {
    "bulk.md",  # tests/test_bulk.py
    "distillation.md",  # tests/test_distillation.py
    "feature_stats_monitor.md",  # tests/test_stats_monitor.py
    "graph.md",  # tests/test_graph.py
    "inspector.md",  # tests/test_inspector.py
    "recorder_callback.md",  # tests/test_callback.py
}


def _pages() -> list[Path]:
    pages = [DOCS.parent / "README.md", *sorted(DOCS.rglob("*.md"))]
    return [p for p in pages if FENCE.search(p.read_text()) and p.name not in OWN_TESTS]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(DOCS.parent)))
def test_page_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # files an example writes (logs, pictures) land here
    registry = dict(_REGISTRY)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    try:
        for number, block in enumerate(FENCE.findall(page.read_text()), start=1):
            code = compile(block, f"{page.name}[block {number}]", "exec")
            exec(code, namespace)
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(registry)
