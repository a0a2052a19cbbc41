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


@pytest.mark.slow
# the NaN in rank 1's shard under "skip" (both ranks agree; rank 0's finding is the module that
# passed it on), in rank 0's under "warn" (read lazily, each rank on its own): two processes
# each, about 15 s, so not every pair of policy and rank
@pytest.mark.parametrize(("policy", "rank"), [("skip", 1), ("warn", 0)])
def test_always_names_the_layer_whose_dtensor_output_is_nan(
    tmp_path: Path, policy: str, rank: int
) -> None:
    # before the fix: the trace counted the DTensor output itself (its sum a collective,
    # ``.tolist()`` refused on a DTensor) and the fit failed at the NaN step instead of naming
    # ``net.0``; then, with the NaN in rank 1's shard, the event was rank 0's, naming ``net``
    # (whose output net.1's all-reduce had made NaN). Counts are exact integers (no tolerance):
    # one NaN, in the [2, 8] shard of ``rank``.
    script = TESTS / "helpers" / "tp_health_script.py"
    run_script(script, tmp_path, policy, str(rank), one_thread=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    events = [[e for e in r if e["kind"] == "nonfinite"] for r in ranks]
    first = events[rank][0]
    assert (first["step"], first["batch_idx"], first["rank"]) == (1, 1, rank)
    assert (first["module"], first["direction"], first["producer"]) == ("net.0", "forward", True)
    assert first["counts"] == {"nan": 1, "posinf": 0, "neginf": 0}
    assert first["shape"] == [2, 16] and first["details"]["shard"] == [2, 8]
    assert "(counted in this rank's shard, of shape [2, 8])" in first["message"]
    if policy == "skip":  # decided together: both ranks report the same event
        assert events[1] == events[0]
        assert first["details"]["ranks"] == [0, 1]  # both losses were NaN (net.1 spread it)
        assert first["action"] == "skipped"
    else:  # read lazily, each rank on its own: rank 1 reports its step too, without failing
        assert events[1][0]["step"] == 1 and events[1][0]["rank"] == 1
