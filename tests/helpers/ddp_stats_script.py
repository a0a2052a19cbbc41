"""One rank of the two-process test of lightning_recorder.stats (CPU, gloo).

Usage: ``python ddp_stats_script.py RANK WORLD_SIZE PORT OUT_DIR``. Each rank updates with its
own data, computes, and saves its data and results to ``OUT_DIR/rank{RANK}.pt`` for the test to
compare against the statistics of the concatenation of every rank's data.
"""

from __future__ import annotations

import math
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_recorder.stats import FeatureStats, histogram, histogram_raw_kwargs


def rank_data(rank: int) -> dict[str, list[torch.Tensor]]:
    """Different data per rank: shapes, dtypes, NaN/Inf/zeros, and an empty tensor on rank 1."""
    g = torch.Generator().manual_seed(1234 + rank)
    a = torch.randn(17 + 5 * rank, 3, generator=g, dtype=torch.float64) * (1 + rank) + 2 * rank
    a[0, 0] = math.nan
    a[1, 1] = 0.0
    if rank == 1:
        a[2, 2] = -math.inf
    b = (torch.randn(9, generator=g) * 4).to(torch.float16)
    c = torch.randint(-3, 4, (6 + rank,), generator=g)
    batches = [a, b, c] if rank == 0 else [a, torch.empty(0, 2), b, c]
    extra = [torch.randn(11, generator=g) * 10 - 5 * rank]
    return {"batches": batches, "extra": extra}


def main(rank: int, world: int, port: int, out_dir: Path) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),  # a loaded machine may start one rank late
    )
    try:
        data = rank_data(rank)
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in data["batches"]])
        results: dict[str, object] = {"data": data}

        stats = FeatureStats()
        population = FeatureStats(correction=0)
        for batch in data["batches"]:
            stats.update(batch)
            population.update(batch)
        results["stats"] = stats.compute()
        results["population"] = population.compute()
        # compute() restores the local state: accumulation continues after it.
        for batch in data["extra"]:
            stats.update(batch)
        results["stats_extra"] = stats.compute()

        # A metric that only rank 0 updates: rank 1 still calls compute().
        only_first = FeatureStats()
        if rank == 0:
            only_first.update(data["batches"][0])
        results["only_first"] = only_first.compute()

        results["hist"] = histogram(flat, bins=16)
        results["hist_only_first"] = histogram(flat if rank == 0 else flat[:0], bins=8)
        results["raw"] = histogram_raw_kwargs(flat, bins=16)
        results["raw_local"] = histogram_raw_kwargs(flat, bins=16, sync=False)
        results["raw_no_finite"] = histogram_raw_kwargs(torch.tensor([math.nan]), bins=4)
        torch.save(results, out_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
