"""Set-up of the CUDA tests (skipped where no CUDA device is available).

cuBLAS is deterministic under ``torch.use_deterministic_algorithms(True)`` only with a fixed
workspace, which it reads when CUDA starts: set here, before any test touches the device.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from helpers import device_checks as checks

from lightning_recorder.stats import _engine as engine

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

CUDA = torch.device("cuda")


@pytest.fixture(scope="session", autouse=True)
def _forget_compiled_graphs() -> Iterator[None]:
    yield
    engine.reset_compiled()


@pytest.fixture(params=["compiled", "eager"])
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """The statistics engine compiled (Triton; the first test compiles every graph of
    ``helpers.device_checks.DTYPES``, later ones find them ready) or eager."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with checks.engine_mode(request.param, CUDA):
        yield request.param
