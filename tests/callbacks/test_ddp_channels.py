"""Two CPU processes under DDP tracking per-channel extremes of a module that one rank never
calls: every rank lays out the same channels, and rank 0 reports those of the other rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.scripts import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "ddp_channels_script.py"


@pytest.mark.slow
def test_channels_of_a_module_only_one_rank_calls(tmp_path: Path) -> None:
    # before the fix: rank 0 (which never called `gate`) gathered fewer channels than rank 1,
    # and the run died in the gather
    run_script(SCRIPT, tmp_path, one_thread=True)
    zero, one = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert len(zero["seen"]) == len(one["seen"]) == len(zero["channels"]) == 2
    for step, channels in enumerate(zero["channels"]):
        assert set(channels) == {"gate"} and "gate" not in zero["seen"][step]
        gate = one["seen"][step]["gate"].double()  # rank 1's alone: rank 0 never called it
        expected = [gate.amin(0), gate.amax(0), gate.abs().amin(0)]
        assert channels["gate"].shape == (3, 4)
        for row, want in zip(channels["gate"], expected, strict=True):
            # extremes are exact: float32 values compared as float64
            assert row.tolist() == pytest.approx(want.tolist(), rel=1e-12), step
