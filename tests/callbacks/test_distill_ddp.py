"""FeatureDistillation under DDP: two CPU processes (gloo) keep student and connectors identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.scripts import run_script

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


@pytest.mark.slow
def test_two_process_ddp_keeps_student_and_connectors_identical(tmp_path: Path) -> None:
    run_script(TESTS / "helpers" / "distill_ddp_script.py", tmp_path)
    rank0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    rank1 = torch.load(tmp_path / "rank1.pt", weights_only=True)

    # Each rank saw its own shard: the local connector gradients differ …
    assert not torch.allclose(rank0["local_grad"], rank1["local_grad"])
    # … and FeatureDistillation replaced them with their mean on both ranks.
    mean = (rank0["local_grad"] + rank1["local_grad"]) / 2
    # float32 (a + b) / 2 here against the all-reduced sum divided there: at most an ulp or two
    # apart, well inside assert_close's float32 default (rtol 1.3e-6, atol 1e-5).
    torch.testing.assert_close(rank0["averaged_grad"], mean)
    # Exact on purpose: an all-reduce hands every rank the same bits (with two ranks the sum is
    # a + b on one and b + a on the other, and float addition is commutative).
    assert torch.equal(rank0["averaged_grad"], rank1["averaged_grad"])

    # After four steps, every weight is bit-identical across ranks: the same starting weights and
    # the same (all-reduced) gradients through the same optimizer step on each rank, which is
    # what DDP guarantees and what FeatureDistillation must keep for its connectors.
    assert torch.equal(rank0["connector"], rank1["connector"])
    assert rank0["student"].keys() == rank1["student"].keys()
    for key, value in rank0["student"].items():
        assert torch.equal(value, rank1["student"][key]), key
    # Plain DDP (no find_unused_parameters) sufficed, and the patch is gone after fit.
    assert not rank0["find_unused_parameters"]
    assert not rank0["patched_after_fit"] and not rank1["patched_after_fit"]


@pytest.mark.slow
def test_a_step_health_monitor_skips_leaves_the_connectors_as_in_one_process(
    tmp_path: Path,
) -> None:
    # before the fix: HealthMonitor("skip") set the connectors' gradients to None, then their
    # all-reduce made them zeros, and Adam moved the connectors on the skipped step
    from helpers.distill_skip_ddp_script import train

    run_script(TESTS / "helpers" / "distill_skip_ddp_script.py", tmp_path, one_thread=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    _, alone = train(tmp_path / "alone", world=1)
    assert len(alone) == len(ranks[0]) == len(ranks[1]) == 3
    for after in ranks:
        assert torch.equal(after[1]["connector"], after[0]["connector"])  # step 1: skipped
        assert not torch.equal(after[2]["connector"], after[1]["connector"])
        for step in range(3):
            for key, value in alone[step].items():
                # the mean of two ranks' float32 gradients against one process's: Adam's
                # normalised step makes them differ by a few ulps of the weights
                torch.testing.assert_close(after[step][key], value, rtol=1e-5, atol=1e-6)
