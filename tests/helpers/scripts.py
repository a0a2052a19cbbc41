"""Test scripts run in a Python process of their own (the two-process runs start there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


def run_script(
    script: Path, out: Path, *args: str, timeout: int = 240, one_thread: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``script out *args`` in ``out`` with this interpreter, the repository and ``tests/``
    importable (``one_thread``: ``OMP_NUM_THREADS=1``), as a launcher's first process (no
    ``LOCAL_RANK`` inherited); assert that it exits with 0, the tails of its output in the
    message."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    if one_thread:
        env["OMP_NUM_THREADS"] = "1"
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [sys.executable, str(script), str(out), *args],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
