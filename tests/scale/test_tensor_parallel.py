"""Tensor parallelism on two CPU processes: a recorded output that is a ``DTensor``.

The first layer is column-parallel with ``use_local_output=False``: its output is a ``DTensor``
sharded on the feature dimension, each rank holding half of the features of the same batch. The
monitor's statistics and histograms must describe the full tensor (each element once), the
parameter norms the full weights, and ``RecorderCallback`` hands the ``DTensor`` itself (its
``full_tensor()`` is the unsharded output). Tolerance: 1e-5 relative (float32 reductions in
another order).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.models import events, reference_stats, scalars
from helpers.scripts import run_script
from helpers.tp_script import STEPS, data, net

TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_dtensor_outputs_are_described_as_the_full_tensor(tmp_path: Path) -> None:
    run_script(TESTS / "helpers" / "tp_script.py", tmp_path)
    run = tmp_path / "tp" / "version_0"
    got = scalars(run)
    model, x = net(), data()
    with torch.no_grad():
        for step in range(STEPS):
            out = model[0](x[4 * step : 4 * step + 4])
            for stat, value in reference_stats(out).items():
                tag = f"stats/train/net.0/{stat}"
                if tag in got:
                    # Sharded (two ranks, reduced) against whole float32 computations: other
                    # summation orders, a few ulps on each term, so 1e-5 relative; abs for
                    # statistics near zero.
                    assert got[tag][step] == pytest.approx(value, rel=1e-5, abs=1e-7), tag
        assert got["stats/train/net.0.weight/norm"][0] == pytest.approx(
            model[0].weight.norm().item(), rel=1e-5
        )
    histograms = events(run).Histograms("stats/train/net.0/histogram")
    assert [h.step for h in histograms] == list(range(STEPS))
    assert all(h.histogram_value.num == 4 * 16 for h in histograms)  # every element once
    for rank in (0, 1):
        seen = torch.load(tmp_path / f"record{rank}.pt")
        expected = model[0](x[4 * (STEPS - 1) : 4 * STEPS]).detach()
        torch.testing.assert_close(seen["full"], expected, rtol=1e-5, atol=1e-6)
        assert seen["local"].shape == (4, 8)  # the rank's half of the features
