"""The checks of ``tests/gpu`` run on the CPU: the same functions (``helpers.device_checks``),
here with ``device="cpu"``, so that their code paths are known to work before a GPU runs them.

On the CPU the engine compiles with inductor (``compiled``, marked slow: the first use compiles
every graph) or runs eagerly. Comparisons "against the CPU" then hold the compiled CPU result
to the eager one; host synchronisations do not exist on the CPU, so the counting itself is
checked, with synchronisations the test raises.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import device_checks as checks

from lightning_recorder.stats import _engine as engine

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]
MODES = ["eager", "native", pytest.param("compiled", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", autouse=True)
def _forget_compiled_graphs() -> Iterator[None]:
    """Later tests in this process find the engine as the suite leaves it: nothing compiled."""
    yield
    engine.reset_compiled()


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    with checks.engine_mode(request.param, CPU):
        yield request.param


@pytest.mark.parametrize("dtype", checks.DTYPES)
def test_stats_match_the_eager_cpu_and_float64(mode: str, dtype: torch.dtype) -> None:
    checks.check_stats_match_cpu(CPU, dtype)


@pytest.mark.slow
def test_stats_match_when_large_tensors_are_read_as_a_gpu_reads_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The path a GPU takes for large tensors, on the CPU: the compiled blocks of one tensor
    (``feature_stats``), and in the collector the rows of several tensors merged at once."""
    monkeypatch.setattr(engine, "ONE_ROW_DEVICES", ())
    with checks.engine_mode("compiled", CPU):
        assert "blocks cpu bfloat16" in engine.compile_status()
        checks.check_stats_match_cpu(CPU, torch.bfloat16)


@pytest.mark.parametrize("dtype", checks.DTYPES)
def test_histograms_match_the_eager_cpu_and_torch_histogram(mode: str, dtype: torch.dtype) -> None:
    checks.check_histograms_match_cpu(CPU, dtype)


@pytest.mark.slow
def test_compiled_engine_never_recompiles(monkeypatch: pytest.MonkeyPatch) -> None:
    with checks.engine_mode("compiled", CPU):
        checks.check_no_recompiles(CPU, checks.DTYPES, monkeypatch)


@pytest.mark.slow
def test_the_recompile_check_sees_eager_states(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check fails where states whose graphs are ready run eagerly."""
    with (
        checks.engine_mode("compiled", CPU),
        engine.eager_only(),
        pytest.raises(AssertionError, match="run eagerly"),
    ):
        checks.check_no_recompiles(CPU, (torch.float32,), monkeypatch, sizes=(4097,))


def test_monitor_and_histogram_are_deterministic(mode: str, tmp_path: Path) -> None:
    checks.check_deterministic(tmp_path, CPU)
    assert not torch.are_deterministic_algorithms_enabled()  # restored


MEMORY_SCRIPT = """
import sys, tempfile, torch
from pathlib import Path
from helpers import device_checks as checks
torch.set_num_threads(1)
with checks.engine_mode("eager", "cpu"):
    print(checks.check_engine_memory(torch.device("cpu")))
    print(checks.check_memory(Path(sys.argv[1]), torch.device("cpu")))
"""


@pytest.mark.slow
@pytest.mark.skipif(not checks.Meter.available(CPU), reason="resets VmHWM via /proc")
def test_a_large_bfloat16_output_adds_little_memory_in_a_fit(tmp_path: Path) -> None:
    """The memory checks of tests/gpu with the resident set size for the allocator's peak: in a
    process of its own whose allocator maps every block of 64 KiB or more apart (so that freed
    memory leaves the resident set and the peak follows what is allocated)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "LIGHTNING_RECORDER_COMPILE": "0",
    }
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    figures = ast.literal_eval(lines[-1])
    assert figures["logging_steps"] == [1, 3]
    assert int(lines[-2]) <= 2**27 / 10


class _FakeSync(pl.Callback):
    """Raises the warning of a synchronising call at the end of each logging step."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step % checks.SYNC_EVERY == 0:
            warnings.warn("called a synchronizing CUDA operation (test)", UserWarning, stacklevel=1)


def test_sync_counting_finds_each_synchronisation_of_a_step(tmp_path: Path) -> None:
    """The window of a step catches what runs in it: one synchronisation raised on each
    logging step passes the GPU test's check (1 per logging step, 0 elsewhere), none fails it."""
    with checks.engine_mode("eager", CPU):
        torch.manual_seed(0)
        bare = checks.sync_run(tmp_path / "bare", CPU, [], checks.ConvNet())
        assert all(stacks == [] for stacks in bare)  # no CUDA: nothing synchronises
        checks.check_monitor_syncs(tmp_path / "one", CPU, bare, extra=[_FakeSync()])
        channels = tmp_path / "channels"  # the GPU test's variant with per-channel extremes
        checks.check_monitor_syncs(channels, CPU, bare, extra=[_FakeSync()], channels=True)
        with pytest.raises(AssertionError, match="step 3: 0 syncs"):
            checks.check_monitor_syncs(tmp_path / "none", CPU, bare)
