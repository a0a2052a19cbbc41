"""The statistics engine: one definition of the state, run eagerly and compiled, against float64.

Every path is held to the documented tolerance against a ``float64`` reference computed by torch
on the same values: counts, min and max exactly, mean/std/abs_mean within ``1e-9`` (relative).
Compiled and eager runs of the same function are compared within ``1e-12`` (they add the same
terms in another order).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.models import assert_counts_up_to_edges
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lightning_recorder.stats import _collect as collect
from lightning_recorder.stats import _engine as engine
from lightning_recorder.stats._collect import Collector, sample_stride
from lightning_recorder.stats._engine import row_counts
from lightning_recorder.stats._histogram import (
    add_ones,
    bucket_index,
    count_keys,
    edges,
    ranges,
    row_bases,
    stream_counts,
)
from lightning_recorder.stats._state import (
    COUNT,
    F64,
    MAX,
    MIN,
    NAN,
    NEGINF,
    NUMEL,
    POSINF,
    ZEROS,
    finalize,
    merge,
    rows_state,
)

ROOT = Path(__file__).resolve().parents[2]
EXACT = (COUNT, MIN, MAX, ZEROS, NAN, POSINF, NEGINF, NUMEL)


def reference(x: torch.Tensor) -> dict[str, float]:
    v = x.detach().reshape(-1).to(F64)
    finite = v[torch.isfinite(v)]
    seen = finite.numel() > 0
    return {
        "mean": finite.mean().item() if seen else math.nan,
        "std": finite.std().item() if finite.numel() > 1 else math.nan,
        "min": finite.min().item() if seen else math.nan,
        "max": finite.max().item() if seen else math.nan,
        "abs_mean": finite.abs().mean().item() if seen else math.nan,
        "zero_fraction": (v == 0).double().mean().item() if v.numel() else math.nan,
        "nonfinite": float((~torch.isfinite(v)).sum()),
        "numel": float(v.numel()),
    }


def assert_matches(state: torch.Tensor, x: torch.Tensor) -> None:
    got = {k: t.item() for k, t in finalize(state, 1).items()}
    want = reference(x)
    for name in ("min", "max", "zero_fraction", "nonfinite", "numel"):
        assert got[name] == want[name] or (math.isnan(got[name]) and math.isnan(want[name])), name
    scale = want["abs_mean"] if math.isfinite(want["abs_mean"]) else 0.0
    for name in ("mean", "std", "abs_mean"):
        if math.isnan(want[name]):
            assert math.isnan(got[name]), name
        else:
            assert got[name] == pytest.approx(want[name], rel=1e-9, abs=1e-12 * scale), name


def assert_close_states(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-12) -> None:
    """Two packed states of the same data by two paths: counts and extremes exact, sums close."""
    assert torch.equal(a[..., list(EXACT)], b[..., list(EXACT)])
    torch.testing.assert_close(a, b, rtol=rel, atol=rel * float(b.abs().max().clamp(min=1)))


def data(kind: str, dtype: torch.dtype = torch.float32, n: int = 5000) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(kind) % 2**31)
    base = torch.randn(n, generator=g, dtype=F64)
    if kind == "gaussian":
        x = base
    elif kind == "far":  # mean far from zero relative to the spread: cancellation
        x = 1e6 + base
    elif kind == "relu":
        x = base.clamp(min=0)
    elif kind == "negative":
        x = -base.abs() - 1
    elif kind == "specials":
        x = base.clone()
        x[::97], x[1::211], x[2::307], x[3::401] = 0.0, math.nan, math.inf, -math.inf
    elif kind == "allnan":
        x = torch.full((n,), math.nan, dtype=F64)
    else:
        raise ValueError(kind)
    return x.to(dtype)


KINDS = ["gaussian", "far", "relu", "negative", "specials", "allnan"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_eager_state_matches_float64(kind: str, dtype: torch.dtype) -> None:
    x = data(kind, dtype)
    if kind == "far" and dtype in (torch.bfloat16, torch.float16):
        x = data("gaussian", dtype) * 3 + 50  # 1e6 is beyond float16, coarse in bfloat16
    assert_matches(engine.tensor_state(x), x)
    assert_matches(rows_state(x.view(1, -1))[0], x)


def test_unmasked_variant_equals_masked_on_finite_data() -> None:
    x = torch.stack([data(k) for k in ("gaussian", "far", "relu", "negative")])
    assert_close_states(rows_state(x, finite=True), rows_state(x))


def test_cpu_takes_the_masked_variant_where_sums_show_a_nan_or_inf() -> None:
    rows = torch.stack([data("gaussian"), data("specials"), data("relu"), data("allnan")])
    states = engine.rows_states(rows)
    for state, x in zip(states, rows, strict=True):
        assert_matches(state, x)
    assert states[1, NAN] > 0 and states[1, POSINF] > 0 and states[1, NEGINF] > 0


# Lists of float32 values, the special ones often.
FLOAT32_LISTS = st.lists(
    st.one_of(
        st.floats(-1e30, 1e30, allow_nan=False).map(
            lambda v: float(torch.tensor(v, dtype=torch.float32))
        ),
        st.sampled_from([0.0, -0.0, math.nan, math.inf, -math.inf, 1.0]),
    ),
    min_size=1,
    max_size=300,
)


@settings(max_examples=80, deadline=None)
@given(FLOAT32_LISTS)
def test_property_state_matches_float64(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    assert_matches(engine.tensor_state(x), x)


def test_chunks_merge_to_the_state_of_one_pass() -> None:
    x = data("specials", n=3 * engine.CHUNK + 17)
    whole = rows_state(x.view(1, -1))[0]
    chunked = engine.tensor_state(x)  # eager: chunks of CHUNK, merged
    assert_close_states(chunked, whole)
    assert_matches(chunked, x)


def test_memory_layouts_are_read_as_they_lie() -> None:
    x = torch.randn(8, 6, 5, 7)
    channels_last = x.to(memory_format=torch.channels_last)
    assert engine.flat_view(channels_last) is not None
    assert engine.flat_view(x.transpose(1, 3)) is not None
    assert engine.flat_view(x[:, :, ::2]) is None  # gaps: not one block
    for view in (channels_last, x.transpose(1, 3), x[:, :, ::2], x[..., 3]):
        assert_matches(engine.tensor_state(view), view)
    big = torch.randn(3, engine.CHUNK // 2 + 5, 3)[:, :, 1]  # not dense, more than a chunk
    assert_matches(engine.tensor_state(big), big)


def test_merge_is_chans_formula_along_any_dimension() -> None:
    parts = [data(k)[: 100 + 37 * i] for i, k in enumerate(KINDS[:4])]
    states = torch.stack([engine.tensor_state(p) for p in parts])
    assert_matches(merge(states, 0), torch.cat(parts))
    grid = torch.stack([states, states.flip(0)], 1)  # (4, 2, WIDTH)
    assert_close_states(merge(grid, 0)[0], merge(states, 0))
    assert_close_states(merge(grid, 1)[1], merge(states[[1, 2]], 0))


# --- histograms ------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=1, max_size=200),
    st.integers(1, 40),
    st.booleans(),
)
@example([0.0, 1.1754943508222875e-38], 4, False)  # a subnormal width: the scale exceeds float32
def test_row_counts_are_torch_histogram_counts(values: list[float], bins: int, f64: bool) -> None:
    x = torch.tensor(values, dtype=F64 if f64 else torch.float32)
    lo, hi = ranges(engine.tensor_state(x)[None])
    counts = row_counts(x.view(1, -1), lo, hi, bins)[0]
    assert_counts_up_to_edges(counts, x, edges(lo, hi, bins)[0], x.dtype)
    # values exactly on the edges, and the extremes in the first and last buckets
    on_edges = edges(lo, hi, bins)[0].to(x.dtype)
    counted = row_counts(on_edges.view(1, -1), lo, hi, bins)[0]
    assert_counts_up_to_edges(counted, on_edges, edges(lo, hi, bins)[0], x.dtype)
    assert counted[0] >= 1 and counted[-1] >= 1


def test_row_counts_skip_padding_and_non_finite_values_and_are_deterministic() -> None:
    rows = torch.full((3, 50), math.nan)
    rows[0, :10] = torch.linspace(0, 1, 10)
    rows[1, :3] = torch.tensor([math.inf, 0.5, -math.inf])
    rows[2, :] = 2.0
    lo, hi = torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64)
    torch.use_deterministic_algorithms(True)
    try:
        counts = [row_counts(rows, lo, hi, 4) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(False)
    assert counts[0].dtype == torch.int64
    assert counts[0].sum(1).tolist() == [10, 1, 0]  # row 2 lies outside its range
    assert counts[0][0].tolist() == [3, 2, 2, 3]  # torch.histogram's buckets of linspace(0, 1, 10)
    assert all(torch.equal(counts[0], c) for c in counts)


def test_both_ways_of_counting_keys_agree_with_a_loop() -> None:
    """count_keys takes bincount on the CPU, the integer index_add_ of add_ones elsewhere: both
    count every key, keys at both ends of the range included."""
    key = torch.tensor([0, 3, 3, 7, 0, 0, 5, 7])
    want = torch.zeros(9, dtype=torch.int64)
    for k in key.tolist():
        want[k] += 1
    for found in (count_keys(key, 9), add_ones(key, 9)):
        assert found.dtype == torch.int64 and torch.equal(found, want)
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.equal(count_keys(key, 9), add_ones(key, 9))
    finally:
        torch.use_deterministic_algorithms(False)


def test_collector_states_and_counts() -> None:
    c = Collector(4, 2**10, torch.device("cpu"))
    big = data("specials", n=200_000)
    small = [torch.randn(7, 9), torch.randn(7, 9) + 4, torch.randn(300)]
    sparse = torch.zeros(50, 40)
    sparse[3, 4], sparse[10, 1] = 2.0, -1.0
    c.add(0, big)
    c.add(1, small[0])
    c.add(1, small[1])
    c.add(2, small[2].view(3, 100).t())  # not contiguous
    c.add(3, sparse.to_sparse())
    states = c.states()
    assert_matches(states[0], big)
    assert_matches(states[1], torch.cat([s.reshape(-1) for s in small[:2]]))
    assert_matches(states[2], small[2])
    assert_matches(states[3], sparse)
    lo, hi = ranges(states)
    counts = c.counts(lo, hi, 16, states)
    torch.testing.assert_close(counts.sum(1), states[:, COUNT], rtol=1e-12, atol=0)
    # wholly sampled tensors give the counts of all their values
    assert_counts_up_to_edges(counts[2], small[2], edges(lo[2], hi[2], 16), torch.float32)
    c.clear()
    assert c.empty and torch.equal(c.states()[:, COUNT], torch.zeros(4, dtype=F64))


def test_stream_counts_add_each_streams_weighted_rows() -> None:
    """Rows of integer counts, weighted and added stream by stream through the table of each
    stream's rows (padded with the number of rows); a stream with no row counts nothing."""
    counts = torch.tensor([[1, 2, 0], [0, 5, 1], [3, 0, 0], [2, 2, 2]])
    weights = torch.tensor([1.0, 0.5, 4.0, 2.5], dtype=F64)
    rows_of_stream = torch.tensor([[0, 2], [4, 4], [1, 3]])  # stream 1 has no row
    found = stream_counts(counts, weights, rows_of_stream)
    want = torch.zeros(3, 3, dtype=F64)
    for stream, rows in enumerate(([0, 2], [], [1, 3])):
        for row in rows:
            want[stream] += weights[row] * counts[row].to(F64)
    torch.testing.assert_close(found, want, rtol=1e-15, atol=0)
    assert found.dtype == F64 and found[1].eq(0).all()


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_collector_keeps_every_sample_row_whatever_names_its_device(
    device: str | torch.device,
) -> None:
    """A device given by name ("cpu"; on a GPU, "cuda" for "cuda:0") is the device of the
    staging buffers: taking a row keeps the rows taken before it."""
    c = Collector(3, 2**6, device)  # type: ignore[arg-type]
    tensors = [torch.randn(50) + 3 * i for i in range(3)]
    for i, t in enumerate(tensors):
        c.add(i, t)
    states = c.states()
    lo, hi = ranges(states)
    counts = c.counts(lo, hi, 8, states)
    for i, t in enumerate(tensors):
        assert_counts_up_to_edges(counts[i], t, edges(lo[i], hi[i], 8), torch.float32)


def test_collector_memory_is_bounded_by_many_calls() -> None:
    c = Collector(1, 256, torch.device("cpu"))
    held = []
    for i in range(3000):
        c.add(0, torch.full((16, 64), float(i)))
        held.append(c.nbytes())
    assert max(held) <= 4 * 2**19 + 4 * 256 * 4 + 80 * 11 * 8
    assert max(held[2000:]) <= max(held[:1000]) + 80 * 11 * 8  # no growth with the calls
    state = c.states()[0]
    assert state[NUMEL].item() == 3000 * 16 * 64
    assert state[MAX].item() == 2999.0
    assert c.counts(*ranges(state[None]), 8, state[None]).sum().item() == pytest.approx(
        3000 * 16 * 64, rel=1e-12
    )


def test_sample_stride_is_prime_and_keeps_the_budget() -> None:
    for n in (10, 16384, 16385, 100_000, 2**22 + 3):
        stride = sample_stride(n, 16384)
        assert -(-n // stride) <= 16384
        assert stride == 1 or all(stride % d for d in range(2, math.isqrt(stride) + 1))


# --- compiled --------------------------------------------------------------------------------


@pytest.fixture
def compiled_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The engine with compiling on, its float32 and float64 CPU graphs compiled, and used in
    this thread instead of the CPU kernel."""
    monkeypatch.setenv("LIGHTNING_RECORDER_COMPILE", "1")
    engine.reset_compiled()
    engine.warm_up("cpu", [torch.float32, torch.float64, torch.bfloat16], wait=True, native=False)
    if engine.compile_status().startswith("failed"):
        pytest.fail(f"torch.compile failed on this machine: {engine.compile_status()}")
    with engine.compiled_only():
        yield
    monkeypatch.undo()
    engine.reset_compiled()


@pytest.mark.slow
def test_compiled_equals_eager_and_never_recompiles(compiled_engine: None) -> None:
    import torch._dynamo

    assert "state cpu float32" in engine.compile_status()
    with torch._dynamo.config.patch(error_on_recompile=True):
        warnings.simplefilter("error")  # a compiled graph that fails would fall back with a warning
        for kind in KINDS:
            for dtype in (torch.float32, torch.float64, torch.bfloat16):
                for n in (70_001, 300_000, 2**20 + 3):
                    x = data(kind, dtype, n)
                    if kind == "far" and dtype == torch.bfloat16:
                        continue
                    compiled = engine.tensor_state(x)  # one row, compiled
                    pieces = [rows_state(c.view(1, -1)) for c in x.split(engine.CHUNK)]
                    assert_close_states(compiled, merge(torch.cat(pieces)), rel=1e-11)
                    assert_matches(compiled, x)
            rows = torch.stack([data(kind, n=40_000)[:30_000] for _ in range(3)])
            assert_close_states(engine.rows_states(rows), rows_state(rows), rel=1e-11)
        with torch.enable_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # global state
            x = data("gaussian", n=100_000).requires_grad_()
            assert_matches(engine.tensor_state(x), x.detach())
        with torch.inference_mode():
            x = data("relu", n=100_000)
            assert_matches(engine.tensor_state(x), x)


def test_a_float64_range_too_narrow_for_one_scale_still_buckets_its_values(
    compiled_engine: None,
) -> None:
    """bins / (hi - lo) overflows float64 for a range narrower than about 1e-307 (values of about
    that size, down to subnormal ones): the scale is then taken in two factors, so that values
    inside the range land in their buckets as in any other range (up to rounding at the
    edges), not all in the last one; compiled and eager alike."""
    assert "buckets cpu float64" in engine.compile_status(), engine.compile_status()
    for lo_, hi_ in ((0.0, 1e-308), (1e-320, 3e-320), (-2e-310, 1e-310)):
        x = torch.full((1, 4096), lo_, dtype=F64)  # long enough for the compiled graph
        inside = torch.linspace(lo_, hi_, 61, dtype=F64)  # edges and the buckets' middles
        x[0, : inside.numel()] = inside
        lo, hi = torch.tensor([lo_], dtype=F64), torch.tensor([hi_], dtype=F64)
        base = row_bases(1, 30, x.device)
        compiled = engine._run("buckets", x, lo, hi, base, 30)[0]
        with engine.eager_only():
            eager = engine._run("buckets", x, lo, hi, base, 30)[0]
        # each path on its own (the even points are edges, where the two may round apart): the
        # middle of bucket i (the odd points of the 61) lands in bucket i, the ends in the end
        # buckets
        for found in (compiled, eager):
            assert found[1:60:2].tolist() == list(range(30)), (lo_, hi_, found[:61].tolist())
            assert found[0] == 0 and found[60] == 29
        counts = row_counts(x, lo, hi, 30)[0]
        assert counts.sum() == 4096 and counts[0] >= 4096 - 60 and counts[-1] >= 1
        assert_counts_up_to_edges(counts, x[0], edges(lo, hi, 30)[0], F64)


@pytest.mark.parametrize(
    ("dtype", "end"), [(torch.float32, 3e38), (F64, 1.5e308), (torch.float32, 2e38)]
)
def test_a_range_too_wide_for_its_precision_still_buckets_its_values(
    compiled_engine: None, dtype: torch.dtype, end: float
) -> None:
    """A range of both signs near the largest finite value (a diverging run's activations) is
    wider than ``v - lo`` holds in the values' precision: the difference overflowed to inf and
    every value above about the middle landed in the last bucket (and float64's edges were
    NaN). Halved first, each value lands in its bucket and the edges are finite, compiled and
    eager alike."""
    assert f"buckets cpu {str(dtype).removeprefix('torch.')}" in engine.compile_status()
    lo_, hi_ = -end, end
    lo, hi = torch.tensor([lo_], dtype=F64), torch.tensor([hi_], dtype=F64)
    limits = edges(lo, hi, 30)[0]
    assert bool(torch.isfinite(limits).all()) and bool((limits.diff() > 0).all())
    assert limits[0] == lo_ and limits[-1] == hi_
    x = torch.full((1, 4096), 0.0, dtype=dtype)  # long enough for the compiled graph
    middles = (limits[:-1] / 2 + limits[1:] / 2).to(dtype)  # a / 2 + b / 2: no overflow
    x[0, :30] = middles
    x[0, 30], x[0, 31] = lo_, hi_
    base = row_bases(1, 30, x.device)
    compiled = engine._run("buckets", x, lo, hi, base, 30)[0]
    with engine.eager_only():
        eager = engine._run("buckets", x, lo, hi, base, 30)[0]
    for found in (compiled, eager):  # each path on its own (the filler 0 is an edge)
        assert found[:30].tolist() == list(range(30)), found[:30].tolist()
        assert found[30] == 0 and found[31] == 29
    assert_counts_up_to_edges(row_counts(x, lo, hi, 30)[0], x[0], limits, dtype)


def test_rows_read_in_pieces_count_each_row_in_its_own_buckets() -> None:
    """Eagerly, many rows larger than a chunk in all are bucketed a few rows at a time: each
    piece's keys keep their rows' places (the bases are split with the rows)."""
    rows, length, bins = 40, 8192, 16
    assert rows * length > engine.CHUNK
    torch.manual_seed(0)
    values = torch.rand(rows, length) * torch.arange(1, rows + 1).unsqueeze(1)
    lo = torch.zeros(rows, dtype=F64)
    hi = torch.arange(1, rows + 1, dtype=F64)
    with engine.eager_only():
        counts = row_counts(values, lo, hi, bins)
    for r in range(rows):
        want = torch.histc(values[r].double(), bins, 0.0, float(r + 1)).long()
        # a value within rounding of an edge may fall in the bucket next to it (documented)
        assert (counts[r] - want).abs().sum() <= 2, r
        assert counts[r].sum() == length


@pytest.fixture
def blocked_engine(compiled_engine: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled engine reading large CPU tensors as a GPU does: BLOCK_ROWS rows."""
    monkeypatch.setattr(engine, "ONE_ROW_DEVICES", ())
    engine.warm_up("cpu", [torch.bfloat16], wait=True, native=False)
    assert "blocks cpu bfloat16" in engine.compile_status()


def test_large_tensors_are_read_as_rows_of_blocks(
    blocked_engine: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flat tensor of BLOCKED_LENGTH elements or more runs compiled as BLOCK_ROWS rows merged
    in the graph (so that a GPU reduces them in parallel), with what is left over apart: the
    state of one row, within float64 rounding."""
    read: list[int] = []
    blocked = engine._blocked

    def spy(flat: torch.Tensor, masked: bool) -> torch.Tensor | None:
        read.append(flat.shape[0])
        return blocked(flat, masked)

    monkeypatch.setattr(engine, "_blocked", spy)
    # a whole number of rows; a rest long enough to run compiled; a rest of 3; too short
    sizes = (2**17, 3 * 2**16 + 1000, 2**20 + 3, engine.BLOCKED_LENGTH - 1)
    for n in sizes:
        for kind in ("gaussian", "far", "specials"):
            x = data(kind, torch.bfloat16, n)
            state = engine.tensor_state(x)
            assert_matches(state, x)
            assert_close_states(state, rows_state(x.view(1, -1))[0], rel=1e-11)
    assert read == [n for n in sizes[:-1] for _ in range(3)]
    monkeypatch.setattr(engine, "ONE_ROW_DEVICES", ("cpu",))  # the CPU's default: one row
    engine.tensor_state(data("gaussian", torch.bfloat16, 2**17))
    assert len(read) == 3 * (len(sizes) - 1)


@pytest.mark.parametrize("rows_ready", [True, False])
def test_a_collector_merges_the_blocks_of_several_tensors_at_once(
    blocked_engine: None, monkeypatch: pytest.MonkeyPatch, rows_ready: bool
) -> None:
    """The collector reads a large tensor as the blocks graph does (BLOCK_ROWS rows, the rest
    apart) but holds its rows unmerged and merges those of several tensors at once; where the
    rows' graph is not ready it takes each tensor's state whole. Either way a stream's state
    is that of all its tensors, and the rows held stay bounded."""
    blocked: list[int] = []
    whole = engine._blocked
    monkeypatch.setattr(
        engine, "_blocked", lambda flat, masked: blocked.append(1) or whole(flat, masked)
    )
    if not rows_ready:
        ready = engine._COMPILER.ready
        monkeypatch.setattr(
            engine._COMPILER,
            "ready",
            lambda key: ready(key) and not (key is not None and key[0] == "state" and key[3]),
        )
    c = Collector(3, 2**10, torch.device("cpu"))
    sizes = (2**17, 3 * 2**16 + 1000, 2**20 + 3)  # a whole number of rows, rests of two lengths
    kinds = ("gaussian", "far", "specials")
    added: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    held = []
    for i in range(collect._BLOCKS_HELD + 3):
        x = data(kinds[i % 3], torch.bfloat16, sizes[i % 3])
        c.add(i % 3, x)
        added[i % 3].append(x)
        held.append(len(c._blocks))
    states = c.states()
    for stream, tensors in added.items():
        assert_matches(states[stream], torch.cat([t.reshape(-1) for t in tensors]))
    if rows_ready:
        assert not blocked  # no tensor's rows merged on their own
        assert held == [*range(1, collect._BLOCKS_HELD), 0, 1, 2, 3]
    else:
        assert len(blocked) == len(held) and max(held) == 0
    assert not c._blocks  # merged into the batch's states


def test_a_blocks_graph_failing_at_run_time_warns_and_reads_in_chunks(
    blocked_engine: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("no kernel for this input")

    function = engine._COMPILER.function
    monkeypatch.setattr(
        engine._COMPILER, "function", lambda key: broken if key[0] == "blocks" else function(key)
    )
    x = data("far", torch.bfloat16, 2**17 + 5)
    with pytest.warns(UserWarning, match="no kernel for this input"):
        state = engine.tensor_state(x)
    assert_matches(state, x)
    assert engine.compile_status().startswith("failed: RuntimeError")


def test_a_state_graph_failing_at_run_time_reads_a_long_row_in_pieces(
    compiled_engine: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The eager fallback of one long row takes it in pieces of CHUNK, merged: its transient
    memory stays a few pieces (the whole row converted to float64 would be 8 bytes a value)."""

    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("no kernel for this input")

    function = engine._COMPILER.function
    monkeypatch.setattr(
        engine._COMPILER, "function", lambda key: broken if key[0] == "state" else function(key)
    )
    read: list[int] = []
    definition = engine._KERNELS["state"]

    def recorded(x: torch.Tensor, *args: object) -> torch.Tensor:
        read.append(x.shape[1])
        return definition(x, *args)

    monkeypatch.setitem(engine._KERNELS, "state", recorded)
    x = data("specials", torch.bfloat16, 3 * engine.CHUNK + 11)
    with pytest.warns(UserWarning, match="no kernel for this input"):
        state = engine.tensor_state(x)
    assert_matches(state, x)
    assert read and max(read) <= engine.CHUNK
    values = torch.rand(1, 2 * engine.CHUNK + 5)  # buckets, one value each: pieces side by side
    lo, hi = torch.zeros(1, dtype=F64), torch.ones(1, dtype=F64)
    with engine.eager_only():
        whole = engine._run("buckets", values, lo, hi, row_bases(1, 8, values.device), 8)
    assert torch.equal(whole, bucket_index(values, lo, hi, 8).long())


def test_a_failed_compile_warns_once_and_stays_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_RECORDER_COMPILE", "1")
    engine.reset_compiled()

    def broken(self: object, key: object) -> object:
        raise RuntimeError("no C++ compiler here\nmore detail")

    monkeypatch.setattr(engine._Compiler, "function", broken)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.warm_up("cpu", [torch.float32, torch.float64], wait=True, native=False)
            engine.warm_up("cpu", [torch.float16], wait=True, native=False)
        ours = [w for w in caught if "computes feature statistics eagerly" in str(w.message)]
        assert len(ours) == 1
        message = str(ours[0].message)
        assert "no C++ compiler here" in message and "LIGHTNING_RECORDER_COMPILE=0" in message
        assert "more detail" not in message
        assert engine.compile_status().startswith("failed: RuntimeError: no C++ compiler here")
        x = data("specials", n=300_000)
        with engine.compiled_only():
            assert_matches(engine.tensor_state(x), x)
    finally:
        monkeypatch.undo()
        engine.reset_compiled()


def test_a_compiler_error_without_a_message_is_reported_by_its_type(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bare ``assert`` of the compiler has an empty message: the background compile crashed
    on it (no warning, the status stuck at compiling), and a graph failing so at run time
    raised an IndexError out of the statistics."""
    monkeypatch.setenv("LIGHTNING_RECORDER_COMPILE", "1")
    monkeypatch.setattr(engine, "_COMPILER", engine._Compiler())
    crashed: list[object] = []
    monkeypatch.setattr(threading, "excepthook", crashed.append)

    def broken(self: object, key: object) -> object:
        raise AssertionError()

    monkeypatch.setattr(engine._Compiler, "function", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.warm_up("cpu", [torch.float16], wait=True, native=False)
    assert not crashed
    ours = [
        str(w.message) for w in caught if "computes feature statistics eagerly" in str(w.message)
    ]
    assert len(ours) == 1 and "torch.compile failed (AssertionError)" in ours[0]
    assert engine.compile_status().startswith("failed: AssertionError")

    # at run time: a graph that is ready fails with no message (a fresh engine state)
    monkeypatch.setattr(engine, "_COMPILER", engine._Compiler())
    x = data("gaussian", torch.float16, 1000)
    engine._COMPILER._ready.add(("state", "cpu", torch.float16, False, False, False))
    with pytest.warns(UserWarning, match=r"torch.compile failed \(AssertionError\)"):
        state = engine.tensor_state(x)
    assert_matches(state, x)


def test_a_compile_cut_short_by_the_process_exiting_says_nothing(tmp_path: Path) -> None:
    """A script that ends (or crashes) while the background compile runs must not print a
    misleading "torch.compile failed" warning on its way out."""
    script = tmp_path / "exiting.py"
    script.write_text(
        textwrap.dedent(
            """
            import threading
            import torch
            from lightning_recorder.stats import _engine as engine

            def cut_short(self, key):
                threading.main_thread().join()  # the interpreter is shutting down
                raise RuntimeError("can't register atexit after shutdown")

            engine._Compiler.function = cut_short
            engine.warm_up("cpu", [torch.float32])
            print("main thread done")
            """
        )
    )
    env = {**os.environ, "LIGHTNING_RECORDER_COMPILE": "1", "PYTHONWARNINGS": "always"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "main thread done" in done.stdout
    assert "computes feature statistics eagerly" not in done.stderr, done.stderr


def test_a_process_that_exits_while_compiling_waits_for_one_graph_not_all(
    tmp_path: Path,
) -> None:
    """A script (or a fit interrupted early) that ended while the background compile ran waited
    at exit until every graph was compiled: tens of seconds on a busy machine. It finishes the
    graph it is compiling (never killed halfway: the compiler's cache stays whole) and begins
    no other."""
    script = tmp_path / "exiting.py"
    script.write_text(
        textwrap.dedent(
            """
            import time
            import torch
            from lightning_recorder.stats import _engine as engine

            def slow(self, key):
                print("compiling", key, flush=True)
                time.sleep(2.0)  # a graph that takes a while to compile
                return lambda *args: None

            engine._Compiler.function = slow
            engine.warm_up("cpu", [torch.float32], native=False)
            print("main thread done", flush=True)
            """
        )
    )
    env = {**os.environ, "LIGHTNING_RECORDER_COMPILE": "1"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "main thread done" in done.stdout
    begun = done.stdout.count("compiling")
    # eight graphs for float32 on the CPU: before, every one was compiled (16 s here); now the
    # one begun before the main thread ended, and at most one more on a machine so loaded that
    # the interpreter's exit took longer than a graph
    assert 1 <= begun <= 2, done.stdout


def test_the_status_while_the_first_graphs_compile_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It said "compiled for none (more compiling)": as if compiling had given nothing."""
    monkeypatch.setenv("LIGHTNING_RECORDER_COMPILE", "1")
    monkeypatch.setattr(engine, "_COMPILER", engine._Compiler())
    release = threading.Event()

    def slow(self: object, key: object) -> object:
        release.wait()
        return lambda *args: None

    monkeypatch.setattr(engine._Compiler, "function", slow)
    engine.warm_up("cpu", [torch.float16], native=False)
    try:
        assert engine.compile_status().startswith("compiling, none ready yet")
    finally:
        release.set()
        engine.warm_up("cpu", [], wait=True, native=False)
    assert engine.compile_status().startswith("compiled for ")
    assert "(more compiling)" not in engine.compile_status()


def test_compiling_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_RECORDER_COMPILE", "0")
    engine.reset_compiled()
    engine.warm_up("cpu", [torch.float32], wait=True)
    assert engine.compile_status().startswith("off (LIGHTNING_RECORDER_COMPILE=0)")


def test_an_unwarmed_dtype_runs_eagerly_and_compiles_nothing(
    compiled_engine: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[object] = []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: calls.append(a) or (lambda *b: None))
    x = data("gaussian", torch.float16, 300_000)  # float16 was not warmed up
    assert_matches(engine.tensor_state(x), x)
    assert not calls


# --- memory ----------------------------------------------------------------------------------

#: the scripts' peak resident memory so far, in bytes (Linux)
PEAK = textwrap.dedent(
    """
    def peak():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    """
)

MEMORY_SCRIPT = PEAK + textwrap.dedent(
    """
    import sys, torch
    from lightning_recorder.stats._collect import Collector
    from lightning_recorder.stats._engine import tensor_state


    torch.set_num_threads(1)
    x = torch.empty(2**28, dtype=torch.bfloat16).normal_()  # 512 MiB
    before = peak()
    state = tensor_state(x)
    after_state = peak()
    c = Collector(1, 2**14, torch.device("cpu"))
    c.add(0, x.view(2**14, 2**14))
    lo, hi = torch.full((1,), -5.0, dtype=torch.float64), torch.full((1,), 5.0, dtype=torch.float64)
    c.states(); c.counts(lo, hi, 30, state[None])
    print(peak() - before, x.numel() * x.element_size(), after_state - before)
    """
)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_a_large_bfloat16_output_adds_little_memory(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LIGHTNING_RECORDER_COMPILE": "0"}
    out = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    added, size, by_state = int(out[0]), int(out[1]), int(out[2])
    # the old float64 formulas raised the peak by about 20x the tensor; a tenth of it here
    # (eagerly: a few pieces of CHUNK elements at a time, whatever the tensor's size)
    assert added <= size / 10, (added, size, by_state)


GAPS_SCRIPT = PEAK + textwrap.dedent(
    """
    import sys, torch
    from lightning_recorder.stats import feature_stats, histogram


    torch.set_num_threads(1)
    read = {"state": feature_stats, "histogram": lambda x: histogram(x, 8)}[sys.argv[1]]
    read(torch.ones(3, 4).t())  # the first call's own allocations, outside the measure
    # 2**27 float32 elements (512 MiB were they one block) in 16 bytes: not one block of memory
    x = torch.arange(4.0).expand(2**25, 4)
    before = peak()
    read(x)
    print(peak() - before, x.numel() * x.element_size())
    """
)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
@pytest.mark.parametrize("read", ["state", "histogram"])
def test_a_tensor_that_is_not_one_block_adds_little_memory(read: str) -> None:
    """Read in pieces, within a tenth of its size in float32. Before: the state kept its pieces'
    states in a list between their temporaries, which they pinned apart (590 MiB here), and
    ``histogram`` reshaped the tensor to one row first, a copy of the whole (1.1 GiB for these
    2**27 float32 elements held in 16 bytes)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LIGHTNING_RECORDER_COMPILE": "0"}
    out = subprocess.run(
        [sys.executable, "-c", GAPS_SCRIPT, read],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    added, size = int(out[0]), int(out[1])
    assert added <= size / 10, (added, size)


def test_the_pieces_of_a_tensor_that_is_not_one_block_merge_to_its_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine, "CHUNK", 64)
    monkeypatch.setattr(engine, "_PIECES_HELD", 3)  # the buffer of states fills many times
    base = data("specials", torch.float32, 3 * 5000)
    for x in (base.view(3, 5000)[:, ::3], base[:7].expand(900, 7), base.view(50, 300).t()[::2]):
        assert engine.flat_view(x) is None
        with engine.eager_only():
            assert_matches(engine.tensor_state(x), x)


def test_graphs_dropped_by_torch_compiler_reset_compile_at_the_next_warm_up_not_in_a_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The troubleshooting page has users call torch.compiler.reset() before a second run: the
    # engine's graphs are dropped with everything else, and were still taken as ready, so the
    # first logged step of the next run compiled them inside the step.
    monkeypatch.setenv("LIGHTNING_RECORDER_COMPILE", "1")
    engine.reset_compiled()
    key: engine.Key = ("buckets", "cpu", torch.float32, True, False, False)
    try:
        engine.warm_up("cpu", [torch.float32], wait=True, native=False)
        assert engine._COMPILER.ready(key)
        torch.compiler.reset()
        engine.warm_up("cpu", [torch.float32], wait=True, native=False)  # a new run attaches
        assert engine._COMPILER.ready(key)
        example = engine._example(key)
        # a compile in this call (the step's thread) raises under this stance
        with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
            found = engine._COMPILER.function(key)(*example)
        assert torch.equal(found.long(), engine._KERNELS["buckets"](*example).long())
    finally:
        engine.reset_compiled()
