"""The statistics engine on a CUDA device, compiled (Triton) and eager: statistics and histograms
against the CPU's, no recompiles, determinism, bounded memory in a real fit.

The checks are the functions of ``helpers.device_checks``; the ordinary suite runs the same
functions on the CPU (``tests/callbacks/test_device_checks.py``). Skipped where no CUDA device
is available (hardware, not a failure).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import device_checks as checks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", checks.DTYPES)
def test_stats_match_the_cpu_and_float64(mode: str, dtype: torch.dtype) -> None:
    checks.check_stats_match_cpu(CUDA, dtype)


@pytest.mark.parametrize("dtype", checks.DTYPES)
def test_histograms_match_the_cpu_and_torch_histogram(mode: str, dtype: torch.dtype) -> None:
    checks.check_histograms_match_cpu(CUDA, dtype)


def test_compiled_engine_never_recompiles(monkeypatch: pytest.MonkeyPatch) -> None:
    with checks.engine_mode("compiled", CUDA):
        checks.check_no_recompiles(CUDA, checks.DTYPES, monkeypatch)


def test_monitor_and_histogram_are_deterministic(mode: str, tmp_path: Path) -> None:
    checks.check_deterministic(tmp_path, CUDA)
    assert not torch.are_deterministic_algorithms_enabled()  # restored


def test_the_engine_adds_little_memory(mode: str, record_property: Any) -> None:
    added = checks.check_engine_memory(CUDA, numel=2**26, dtype=torch.bfloat16)
    record_property("added_bytes", added)


def test_a_large_bfloat16_output_adds_little_memory_in_a_fit(
    mode: str, tmp_path: Path, record_property: Any
) -> None:
    figures = checks.check_memory(tmp_path, CUDA, numel=2**26, dtype=torch.bfloat16)
    assert figures["logging_steps"] == [1, 3]
    for key, value in figures.items():
        record_property(key, value)
