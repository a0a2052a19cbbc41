"""Shared fixtures. Every test must leave no hook and no patch behind."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_recorder._core import native
from lightning_recorder._core.hooks import live_hooks, remove_live_hooks
from lightning_recorder._core.patching import active_patches

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:  # test helper modules (e.g. toy modules to patch)
    sys.path.insert(0, str(TESTS))

os.environ.setdefault("PL_DISABLE_FORK", "1")


@pytest.fixture(autouse=True)
def no_leftover_hooks_or_patches() -> Iterator[None]:
    """Fail any test that leaves a hook or a patch installed by this package."""
    hooks_before, patches_before = live_hooks(), active_patches()
    yield
    hooks_after, patches_after = live_hooks(), active_patches()
    if hooks_after != hooks_before:
        remove_live_hooks()  # so that one leak does not fail the tests that follow
    assert hooks_after == hooks_before, f"hooks left behind: {hooks_after}"
    assert patches_after == patches_before, f"patches left behind: {patches_after}"


@pytest.fixture
def fresh_native(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """A process-wide build state of the fused kernels that the test may change (a cache
    directory of its own; ``native.reset()`` before and after)."""
    monkeypatch.setenv("LIGHTNING_RECORDER_CACHE", str(tmp_path / "cache"))
    native.reset()
    yield
    monkeypatch.undo()
    native.reset()
