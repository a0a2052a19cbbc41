"""The spread that benchmarks/bench_logging.py prints beside each median ratio."""

from __future__ import annotations

from helpers.benchmarks import load_benchmark


def test_the_spread_of_a_ratio_stays_within_the_ratios_measured() -> None:
    """With few repeats (``--quick``: 2) the quartiles are of the ratios measured, not
    extrapolated past them: two repeats of ratios 2 and 10 printed ``6.00 (0.00-12.00)``, and
    timings on a busy machine gave a negative spread."""
    bench = load_benchmark("bench_logging")
    times = {"monitor": [2.0, 10.0], "read": [1.0, 1.0]}
    median, low, high = bench.ratio(times, "monitor", "read")
    assert (median, low, high) == (6.0, 4.0, 8.0)
    assert bench.fmt((median, low, high)) == "6.00 (4.00-8.00)"
    many = {"monitor": [float(r) for r in range(1, 10)], "read": [1.0] * 9}
    median, low, high = bench.ratio(many, "monitor", "read")
    assert 1.0 <= low <= median == 5.0 <= high <= 9.0
    assert bench.ratio({"monitor": [3.0], "read": [2.0]}, "monitor", "read") == (1.5, 1.5, 1.5)
