"""Parts of the GPU benchmark that run without a GPU: its reports of the call comparisons, and
the comparison of a call per output with one call for all at toy sizes on the CPU (the
AOTInductor comparison compiles for about 20 s more; ``bench_gpu.py --device cpu --aot`` runs
it)."""

from __future__ import annotations

import math

import torch
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


def test_the_batched_table_shows_each_way_per_output() -> None:
    bench = load_benchmark("bench_gpu")
    rows = {
        "float32, 20 outputs, a torch.compile call per output": {
            "host per output (µs)": 185.0,
            "device operations per output": 2.0,
            "first call (s)": 12.5,
            "largest relative difference": 0.0,
        },
        "float32, 20 outputs, one torch.compile call for all": {
            "host per output (µs)": 31.25,
            "device operations per output": 2.0,
            "first call (s)": 30.0,
            "largest relative difference": 0.0,
        },
    }
    lines = bench.batched_table(rows).splitlines()
    assert lines[0].startswith("| calls | host per output (µs) |")
    assert len(lines) == 2 + len(rows)
    each, together = lines[2:]
    assert "185.000" in each and "12.500" in each and "0.00e+00" in each
    assert "31.250" in together and "30.000" in together


def test_a_call_per_output_and_one_call_for_all_agree_on_the_cpu() -> None:
    """The comparison itself, at the CPU's toy sizes (two compiles of a few seconds): both ways
    give the states of the same outputs (the same graph source), within float32 summation
    order (the states' sums are float64: 1e-9 relative leaves room for another kernel
    order)."""
    bench = load_benchmark("bench_gpu")
    bench.Setup.cpu()  # this module's own copy of the benchmark: nothing shared is changed
    shapes = bench.step_output_shapes()
    assert shapes == [(4, 4, 32, 32), (4, 8, 16, 16), (4, 16, 8, 8), (4, 32, 4, 4)]
    rows = bench.batched_rows()
    assert list(rows) == [
        "float32, 4 outputs, a torch.compile call per output",
        "float32, 4 outputs, one torch.compile call for all",
    ]
    for row in rows.values():
        assert row["host per output (µs)"] > 0 and row["first call (s)"] > 0
        assert row["largest relative difference"] <= 1e-9
        assert math.isnan(row["device operations per output"])  # counted on a GPU only
    # the graph of all outputs is the per-output graph's source, applied to each in turn
    xs = [torch.randn(shape).reshape(bench.engine.BLOCK_ROWS, -1) for shape in shapes]
    expected = torch.cat([bench.rows_state(x, False) for x in xs])
    torch.testing.assert_close(bench._all_states(xs), expected, rtol=0, atol=0)
