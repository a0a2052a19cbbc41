"""Parts of the GPU benchmark that run without a GPU: its report of the AOTInductor comparison
(the comparison itself compiles for about 20 s; ``bench_gpu.py --device cpu --aot`` runs it)."""

from __future__ import annotations

import math

from helpers.benchmarks import load_benchmark


def test_the_aot_table_shows_each_call_and_a_failed_compile_with_its_reason() -> None:
    bench = load_benchmark("bench_gpu")
    rows = {
        "float32, 8x4x32x32, torch.compile": {
            "host per call (µs)": 185.0,
            "device operations per call": 7.0,
            "compile (s)": math.nan,
            "largest relative difference": 0.0,
        },
        "float32, 8x4x32x32, AOTInductor": {
            "host per call (µs)": 40.5,
            "device operations per call": 7.0,
            "compile (s)": 21.0,
            "largest relative difference": 3e-16,
        },
        "bfloat16, AOTInductor": {"failed": "RuntimeError: no compiler"},
    }
    lines = bench.aot_table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    width = lines[0].count("|")
    assert all(line.count("|") == width for line in lines)  # every row has every column
    compiled, ahead, failed = lines[2:]
    assert "185.000" in compiled and "—" in compiled  # no compile time of its own
    assert "40.500" in ahead and "21.000" in ahead and "3.00e-16" in ahead
    assert "failed: RuntimeError: no compiler" in failed
