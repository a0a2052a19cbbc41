"""Shared fixtures. Every test must leave no hook and no patch behind."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_recorder._core.hooks import live_hooks, remove_live_hooks
from lightning_recorder._core.patching import active_patches

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:  # test helper modules (e.g. toy modules to patch)
    sys.path.insert(0, str(TESTS))

os.environ.setdefault("PL_DISABLE_FORK", "1")
# The statistics engine runs eagerly in the suite (the same function as compiled, op by op):
# compiling costs seconds per process. Tests of the compiled path turn it on themselves
# (``compiled_engine`` fixture).
os.environ.setdefault("LIGHTNING_RECORDER_COMPILE", "0")


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
def restore_sigint() -> Iterator[None]:
    """Lightning ignores SIGINT after a KeyboardInterrupt; put the handler back."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)
