"""The Python examples in the README and the docs run as tests, page by page, in order."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.docs import DOCS, ROOT, python_blocks, run_page

# Pages whose examples are run, with further checks, by their own test modules.
OWN_TESTS = {
    "bulk.md",  # tests/test_bulk.py
    "distillation.md",  # tests/test_distillation.py
    "feature_stats_monitor.md",  # tests/test_stats_monitor.py
    "inspector.md",  # tests/test_inspector.py
    "recorder_callback.md",  # tests/test_callback.py
}


def _pages() -> list[Path]:
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    return [p for p in pages if python_blocks(p) and p.name not in OWN_TESTS]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # files an example writes (logs, pictures) land here
    run_page(page)
