"""Two CPU processes under DDP: statistics over all ranks' data, written once, hooks firing once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.ddp_callbacks_script import PARAMS, train_data, val_data
from helpers.ddp_uneven_stats_script import BINS, train_rows, val_rows
from helpers.models import assert_counts_up_to_edges, events, reference_stats, scalars
from helpers.scripts import run_script

SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "ddp_callbacks_script.py"
STATS = ("mean", "std", "min", "max", "abs_mean", "zero_fraction", "nonfinite")
MODULES = ("probe", "body.0", "body.1", "body.2")


def approx(value: float) -> Any:
    # The callback reduces float32 statistics over two ranks and logs them as float32; the
    # expected values are computed in one process over the union. Different summation orders
    # of a few dozen float32 terms: a few ulps (eps = 1.2e-7) relative, hence 2e-6; abs covers
    # statistics that are near zero (a mean of symmetric data).
    return pytest.approx(value, rel=2e-6, abs=1e-6)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("ddp")
    run_script(SCRIPT, out)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    log_dir = out / "ddp" / "version_0"
    return {"ranks": ranks, "log_dir": log_dir, "scalars": scalars(log_dir)}


@pytest.mark.slow
def test_statistics_are_over_all_ranks(ddp_run: dict[str, Any]) -> None:
    got, ranks = ddp_run["scalars"], ddp_run["ranks"]
    x = train_data()
    for step in (1, 3):
        rows = x[8 * step : 8 * step + 8]  # the union of both ranks' batches of this step
        union = reference_stats(rows)
        rank0 = reference_stats(rows[0::2])
        for stat in STATS:
            assert got[f"stats/train/probe/{stat}"][step] == approx(union[stat]), (step, stat)
        for module in MODULES[1:]:
            both = torch.cat([r["outputs"][step][module] for r in ranks])
            expected = reference_stats(both)
            for stat in STATS:
                assert got[f"stats/train/{module}/{stat}"][step] == approx(expected[stat])
    # The data of rank 0 alone would give other values: the statistics really were synchronised.
    assert got["stats/train/probe/mean"][1] != approx(rank0["mean"])
    assert got["stats/train/probe/nonfinite"][1] == 2  # a NaN on rank 1, an inf on rank 0
    val = reference_stats(val_data())
    for stat in STATS:
        assert got[f"stats/val/probe/{stat}"] == {3: approx(val[stat])}  # no sanity-check entry


@pytest.mark.slow
def test_histograms_over_all_ranks(ddp_run: dict[str, Any]) -> None:
    acc = events(ddp_run["log_dir"])
    train = {e.step: e.histogram_value for e in acc.Histograms("stats/train/probe/histogram")}
    rows = train_data()[8:16]
    finite = rows[torch.isfinite(rows)].double()
    assert train[1].num == finite.numel() == 30
    assert train[1].min == approx(finite.min().item()) and train[1].max == approx(
        finite.max().item()
    )
    (val,) = acc.Histograms("stats/val/probe/histogram")
    assert val.step == 3 and val.histogram_value.num == 32  # the first batch of both ranks


@pytest.mark.slow
def test_parameters_and_gradient_norms(ddp_run: dict[str, Any]) -> None:
    got, ranks = ddp_run["scalars"], ddp_run["ranks"]
    for step in (1, 3):
        for name in PARAMS:
            norms = [r["grad_norms"][step][name] for r in ranks]
            assert norms[0] == pytest.approx(norms[1], rel=1e-6)  # DDP synchronised gradients
            assert got[f"stats/train/{name}/grad_norm"][step] == approx(norms[0])


@pytest.mark.slow
def test_hooks_fire_once_per_step_per_module(ddp_run: dict[str, Any]) -> None:
    for rank in ddp_run["ranks"]:
        assert len(rank["calls"]) == 4
        for calls in rank["calls"]:
            # Every submodule once; the root LightningModule (called twice by DDP) is never hooked.
            assert calls == {"probe": 1, "body": 1, "body.0": 1, "body.1": 1, "body.2": 1}


@pytest.mark.slow
def test_unequal_rows_per_rank_and_several_val_loaders(tmp_path: Path) -> None:
    # The ranks hold 4 + 4 and 2 + 1 training rows per step, and 9 + 4, 2 + 11 validation rows
    # per loader: the merged states must weigh each rank by its count, not each rank alike.
    run_script(SCRIPT.with_name("ddp_uneven_stats_script.py"), tmp_path, one_thread=True)
    log_dir = tmp_path / "ddp" / "version_0"
    got, acc = scalars(log_dir), events(log_dir)
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1  # rank 0 alone writes
    zero, one = train_rows(0), train_rows(1)
    steps = {0: torch.cat([zero[:4], one[:4]]), 1: torch.cat([zero[4:], one[4:]])}
    hists = {e.step: e.histogram_value for e in acc.Histograms("stats/train/probe/histogram")}
    for step, rows in steps.items():
        expected = reference_stats(rows)
        for stat in STATS:
            assert got[f"stats/train/probe/{stat}"][step] == approx(expected[stat]), (step, stat)
        edges = torch.tensor(list(hists[step].bucket_limit), dtype=torch.float64)
        counts = torch.tensor(list(hists[step].bucket)[1:])  # TensorBoard's open first bucket
        assert_counts_up_to_edges(counts, rows, edges, torch.float32)
    for k in (0, 1):
        union = torch.cat([val_rows(k, 0), val_rows(k, 1)])
        expected = reference_stats(union)
        for stat in STATS:
            assert got[f"stats/val/probe/{stat}/dataloader_idx_{k}"] == {1: approx(expected[stat])}
        (hist,) = acc.Histograms(f"stats/val/probe/histogram/dataloader_idx_{k}")
        first = torch.cat([val_rows(k, 0)[:4], val_rows(k, 1)[:4]])  # each rank's first batch
        assert hist.histogram_value.num == torch.isfinite(first).sum().item()
        assert len(hist.histogram_value.bucket) == BINS + 1
