"""Two DDP processes where only one rank's batch is bad: with ``"skip"`` both ranks skip the step,
the event names the rank and module, and the parameters stay identical and finite; the rules
run on rank zero only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.dist_exit import assert_no_c10d_threads_left
from helpers.scripts import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "health_ddp_script.py"


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("health_ddp")
    run_script(SCRIPT, out, timeout=300, one_thread=True)
    # no thread of the process group left at exit (helpers.dist_exit), which could abort a rank
    assert_no_c10d_threads_left(out)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    return {"ranks": ranks, "out": out}


@pytest.mark.slow
def test_both_ranks_skip_the_step_of_one_bad_batch(ddp_run: dict[str, Any]) -> None:
    events = [[e for e in r["events"] if e["kind"] == "nonfinite"] for r in ddp_run["ranks"]]
    assert events[0] == events[1]  # the same decision and the same event on both ranks
    [event] = events[0]
    assert (event["step"], event["batch_idx"], event["rank"]) == (1, 1, 1)
    assert (event["module"], event["direction"], event["producer"]) == ("body.0", "forward", True)
    assert event["action"] == "skipped" and event["reproduced"] is True
    params = [r["params"] for r in ddp_run["ranks"]]
    for step in range(3):
        for name, value in params[0][step].items():
            assert torch.equal(value, params[1][step][name]), (step, name)
            assert torch.isfinite(value).all()
    # the skipped step changed nothing; the steps around it did
    assert all(torch.equal(params[0][0][n], params[0][1][n]) for n in params[0][0])
    assert any(not torch.equal(params[0][1][n], params[0][2][n]) for n in params[0][1])


@pytest.mark.slow
def test_each_rank_wrote_its_evidence(ddp_run: dict[str, Any]) -> None:
    health = ddp_run["out"] / "health"
    assert sorted(p.name for p in health.iterdir()) == ["step00000001-rank0", "step00000001-rank1"]
    event = next(e for e in ddp_run["ranks"][0]["events"] if e["kind"] == "nonfinite")
    assert event["evidence"] == str(health / "step00000001-rank1")


@pytest.mark.slow
def test_rules_run_on_rank_zero_only(ddp_run: dict[str, Any]) -> None:
    zero, one = ddp_run["ranks"]
    assert zero["checks"] == [0, 1, 2] and one["checks"] == []
    rule_events = [[e for e in r["events"] if e["kind"] == "checks"] for r in (zero, one)]
    assert [(e["module"], e["step"], e["rank"]) for e in rule_events[0]] == [("body.1", 0, 0)]
    assert rule_events[1] == []


@pytest.mark.slow
def test_always_blames_the_rank_whose_forward_made_the_values(tmp_path: Path) -> None:
    # before the fix: with localize="always", rank 0 (whose batch was clean) blamed the backward
    # of the last layer, whose parameters' gradients DDP's all-reduce had made NaN, and won as
    # the lower rank
    run_script(SCRIPT, tmp_path, "always", timeout=300, one_thread=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    events = [[e for e in r["events"] if e["kind"] == "nonfinite"] for r in ranks]
    assert events[0] == events[1]
    [event] = events[0]
    assert (event["step"], event["batch_idx"], event["rank"]) == (1, 1, 1)
    assert (event["module"], event["direction"], event["producer"]) == ("body.0", "forward", True)
    assert event["action"] == "skipped"
    assert event["evidence"] == str(tmp_path / "health" / "step00000001-rank1")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("policy", "localize"), [("warn", "always"), ("warn", "False"), ("skip", "False")]
)
def test_the_report_names_the_rank_whose_batch_was_bad(
    tmp_path: Path, policy: str, localize: str
) -> None:
    # before the fix: with "warn" and localize="always" or False (the check read lazily, each
    # rank reporting what it saw, rank 0 alone logging), and with localize=False under any
    # policy, the step of rank 1's bad batch was reported on rank 0, as found on rank 0
    proc = run_script(SCRIPT, tmp_path, localize, policy, timeout=300, one_thread=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    events = [[e for e in r["events"] if e["kind"] == "nonfinite"] for r in ranks]
    assert events[0] == events[1]  # the ranks agree
    first = events[0][0]
    assert (first["step"], first["batch_idx"], first["rank"]) == (1, 1, 1)
    assert first["details"]["ranks"] == [1]  # rank 0's loss and forward were finite
    assert first["evidence"] == str(tmp_path / "health" / "step00000001-rank1")
    if localize == "always":
        assert (first["module"], first["direction"]) == ("body.0", "forward")
    else:
        assert first["module"] is None and first["direction"] == "loss"
    # what rank 0 logged
    assert "at step 1, batch 1, rank 1:" in proc.stderr
    assert "at step 1, batch 1, rank 0" not in proc.stderr
    if policy == "warn":  # the update went through: both ranks' batches are non-finite now
        second = events[0][1]
        assert (second["step"], second["rank"], second["details"]["ranks"]) == (2, 0, [0, 1])
        assert ", rank 0 (also on rank 1):" in second["message"]


@pytest.mark.slow
def test_a_checkpoint_that_cannot_be_written_lets_both_ranks_go_on(tmp_path: Path) -> None:
    # before the fix: the OSError of rank zero's write stopped its fit; caught without meeting
    # the other rank at save_checkpoint's barrier, the two ranks hung
    run_script(SCRIPT, tmp_path, "replay", "skip", "full-disk", timeout=300, one_thread=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    events = [[e for e in r["events"] if e["kind"] == "nonfinite"] for r in ranks]
    assert events[0] == events[1]  # both ranks say the checkpoint could not be written
    [event] = events[0]
    assert (event["step"], event["rank"], event["action"]) == (1, 1, "skipped")
    assert event["details"]["checkpoint_error"].startswith("OSError: [Errno 28] No space left")
    assert event["evidence"] == str(tmp_path / "health" / "step00000001-rank1")
    assert all(len(r["params"]) == 3 for r in ranks)  # both trained to the end
    assert list((tmp_path / "health").glob("*.ckpt")) == []
