"""The fused CPU kernels (``stats._native``) and their build (``_core.native``).

Every kernel is compared with a float64 reference computed by torch, with tolerances that follow
from the kernels' arithmetic (stated at each assert); the torch fallback, taken where no kernel
can be built, is compared with the same reference.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_recorder._core import native
from lightning_recorder.stats import _native
from lightning_recorder.stats._kernels import (
    HistogramRow,
    Workspace,
    arithmetic_64,
    bucket_native,
    empty_state,
    finalize,
    histogram_rows_cpu,
    native_state,
    raw_table,
    sample_of,
    sampled_state,
)
from lightning_recorder.stats.batched import (
    change_norms,
    copy_with_norms,
    flatten_segments,
    fused_kernels,
    fused_kernels_status,
    native_histogram_table,
    native_histograms,
    native_segmented_histograms,
    native_segmented_table,
    native_segments,
    segmented_histograms,
    segmented_states,
)

HAVE_CC = native.compiler() is not None


def reference(x: torch.Tensor) -> dict[str, float]:
    v = x.detach().double().reshape(-1)
    return {
        "sum": v.sum().item(),
        "abs": v.abs().sum().item(),
        "min": v.min().item(),
        "max": v.max().item(),
        "zeros": (v == 0).sum().item(),
    }


def test_the_kernels_build_where_a_compiler_is_found() -> None:
    if not HAVE_CC:
        pytest.skip("no C compiler on this machine: the torch path is used (tested below)")
    assert _native.available(), native.status()
    assert native.status()["lightning_recorder_stats"].startswith("loaded from ")


def data(kind: str, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    if kind == "relu":
        return x.relu()
    if kind == "offset":  # far from zero relative to its spread: cancellation in one pass
        return x * 1e-3 + 1e3
    if kind == "ints":
        return torch.randint(-3, 4, (n,), generator=g).float()
    return x * 3 + 0.5


@pytest.mark.skipif(not HAVE_CC, reason="needs a C compiler")
@pytest.mark.parametrize("kind", ["gaussian", "relu", "offset", "ints"])
@pytest.mark.parametrize("n", [1, 7, 8, 15, 17, 255, 257, 1000, 2**16 + 5])
def test_moments_match_float64(kind: str, n: int) -> None:
    x = data(kind, n)
    shift, total, squares, abs_sum, low, high, zeros = _native.moments(x)
    ref = reference(x)
    scale = ref["abs"] + 1e-30
    deviations = x.double() - shift
    # the deviations' sum runs in float32 lanes of at most 64 terms (flushed to float64 by
    # rows): recursive summation of k terms errs by at most (k - 1) * 2**-24 * sum |d|
    bound = 64 * 2.0**-24 * deviations.abs().sum().item() + 1e-12 * scale
    assert abs(total - deviations.sum().item()) <= bound
    # positive terms in float32 lanes of at most 64 terms each: 1e-6 relative is ample
    assert abs_sum == pytest.approx(ref["abs"], rel=1e-6)
    assert squares == pytest.approx(deviations.square().sum().item(), rel=1e-6, abs=1e-30)
    assert (low, high, zeros) == (ref["min"], ref["max"], ref["zeros"])  # exact
    assert shift == float(torch.tensor(shift, dtype=torch.float32))  # a float32


@pytest.mark.skipif(not HAVE_CC, reason="needs a C compiler")
@pytest.mark.parametrize("kind", ["gaussian", "relu", "offset"])
def test_native_state_matches_exact_statistics(kind: str) -> None:
    x = data(kind, 11 * 17_881).view(11, -1).t()  # not contiguous: copied flat first
    got = finalize(native_state(x, Workspace()), correction=1)
    v = x.double().reshape(-1)
    # the documented precision of the monitor's kernels: 1e-6 relative (of mean |x - shift| for
    # a mean near zero); min, max, counts exact
    assert got["mean"].item() == pytest.approx(v.mean().item(), rel=1e-6, abs=1e-7)
    assert got["std"].item() == pytest.approx(v.std().item(), rel=1e-6)
    assert got["abs_mean"].item() == pytest.approx(v.abs().mean().item(), rel=1e-6)
    assert (got["min"].item(), got["max"].item()) == (v.min().item(), v.max().item())
    assert got["zero_fraction"].item() == (v == 0).double().mean().item()


@pytest.mark.skipif(not HAVE_CC, reason="needs a C compiler")
def test_nonfinite_values_take_the_exact_path() -> None:
    x = torch.randn(5000)
    x[[3, 100, 4999]] = torch.tensor([math.nan, math.inf, -math.inf])
    got = finalize(native_state(x, Workspace()), correction=1)
    finite = x[torch.isfinite(x)].double()
    assert got["nonfinite"].item() == 3
    assert got["mean"].item() == pytest.approx(finite.mean().item(), rel=1e-12)
    assert (got["min"].item(), got["max"].item()) == (finite.min().item(), finite.max().item())


@pytest.mark.skipif(not HAVE_CC, reason="needs a C compiler")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_upcast_exactly(dtype: torch.dtype) -> None:
    x = torch.randn(70_000).to(dtype)
    got = finalize(native_state(x, Workspace()), correction=1)
    v = x.double()
    assert got["mean"].item() == pytest.approx(v.mean().item(), rel=1e-6, abs=1e-7)
    assert got["std"].item() == pytest.approx(v.std().item(), rel=1e-6)
    assert (got["min"].item(), got["max"].item()) == (v.min().item(), v.max().item())


@pytest.mark.skipif(not HAVE_CC, reason="needs a C compiler")
@pytest.mark.parametrize(
    ("n", "size"),
    [
        (5_000, 2**14),  # stride 1: all of it
        (2**14 + 1, 2**14),  # stride 2, sampled after the pass (in cache)
        (40_000, 2**14),  # stride 3
        (2**17 + 1, 2**16),  # stride 3, row by row
        (2**17, 2**16),  # stride 2, row by row
        (2**18 + 3, 2**14),  # stride 17
        (2**21 + 7, 2**14),  # split across two threads
        (2**21 + 7, 2**20),  # stride 3 in parts that start between two sampled elements
    ],
)
def test_the_sample_is_the_strided_copy(n: int, size: int) -> None:
    x = torch.randn(n)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # 2**21 elements are split across two threads
    try:
        state, sample, weight = sampled_state(x, Workspace(), size)
    finally:
        torch.set_num_threads(threads)
    expected, expected_weight = sample_of(x, size)
    assert torch.equal(sample, expected)  # a copy: bit for bit
    assert weight == expected_weight
    # the mean within 2**-24 of mean |x - shift| (about 0.8 here): 1e-7
    assert finalize(state, 1)["mean"].item() == pytest.approx(x.double().mean().item(), abs=1e-7)


@pytest.mark.skipif(not HAVE_CC, reason="needs a C compiler")
def test_parallel_parts_agree_with_one_thread() -> None:
    x = torch.randn(2**21 + 13) * 2 - 1
    one = _native.moments(x)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        four = _native.moments(x)
    finally:
        torch.set_num_threads(threads)
    assert one[0] == four[0] and one[4:] == four[4:]  # shift, min, max, zeros: exact
    for a, b in zip(one[1:4], four[1:4], strict=True):  # sums in another order: 1e-7
        assert a == pytest.approx(b, rel=1e-7)


@pytest.mark.skipif(not HAVE_CC, reason="needs a C compiler")
def test_buckets_match_the_torch_bucketing() -> None:
    x = torch.randn(100_000)
    x[::7] = math.nan
    x[::11] = math.inf
    finite = x[torch.isfinite(x)]
    lo, hi = finite.min().item(), finite.max().item()
    limits = [lo + (hi - lo) * i / 30 for i in range(31)]
    ours = torch.tensor(_native.bucket(x, lo, hi, 30))
    theirs = bucket_native(finite, limits, lo, hi, Workspace())
    assert ours.sum().item() == finite.numel()  # every finite value counted once
    # float64 positions against float32 ones: a value within rounding of an edge may move
    assert (ours - theirs).abs().sum().item() <= 4


@pytest.mark.skipif(not HAVE_CC, reason="needs a C compiler")
def test_parameter_kernels_match_torch() -> None:
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(*s, generator=g) for s in [(3,), (64, 33), (1000, 17)]]
    grads = [torch.randn(p.shape, generator=g) for p in params]
    buffers = [torch.empty_like(p) for p in params]
    fused = copy_with_norms(buffers, params, grads)
    assert fused is not None
    sizes, grad_sizes = fused
    for p, b, s, gs, gr in zip(params, buffers, sizes, grad_sizes, grads, strict=True):
        assert torch.equal(b, p)
        # float32 lanes of at most 32 terms, float64 across: 1e-6 relative is ample
        assert s == pytest.approx(p.double().square().sum().item(), rel=1e-6)
        assert gs == pytest.approx(gr.double().square().sum().item(), rel=1e-6)
    after = [p + 1e-3 * torch.randn(p.shape, generator=g) for p in params]
    changes, norms = change_norms(after, buffers)  # type: ignore[misc]
    for a, b, c, n in zip(after, buffers, changes, norms, strict=True):
        assert c == pytest.approx((a.double() - b.double()).square().sum().item(), rel=1e-5)
        assert n == pytest.approx(a.double().square().sum().item(), rel=1e-6)


def test_parameter_kernels_decline_what_they_cannot_take() -> None:
    p = torch.randn(8, 8)
    assert copy_with_norms([torch.empty(8, 8)], [p.t()], [p]) is None  # not contiguous
    assert copy_with_norms([torch.empty(8, 8)], [p.double()], [p]) is None  # float64
    assert change_norms([p.half()], [p]) is None


def test_disabled_kernels_fall_back_to_torch(
    fresh_native: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIGHTNING_RECORDER_NATIVE", "0")
    assert not _native.available()
    assert native.status() == {"lightning_recorder_stats": "disabled by LIGHTNING_RECORDER_NATIVE"}
    assert not fused_kernels()
    assert fused_kernels_status() == "disabled by LIGHTNING_RECORDER_NATIVE"
    x = data("gaussian", 2**17)
    got = finalize(native_state(x, Workspace()), correction=1)
    assert got["mean"].item() == pytest.approx(x.double().mean().item(), rel=1e-6, abs=1e-7)
    assert got["std"].item() == pytest.approx(x.double().std().item(), rel=1e-6)
    _, sample, _ = sampled_state(x, Workspace(), 2**14)
    assert torch.equal(sample, sample_of(x, 2**14)[0])
    assert copy_with_norms([torch.empty(3)], [torch.ones(3)], [torch.ones(3)]) is None


def test_a_failing_compiler_falls_back_with_the_reason(
    fresh_native: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = shutil.which("false")
    if failing is None:
        pytest.skip("no `false` command to stand for a broken compiler")
    monkeypatch.setenv("CC", failing)
    assert native.compiler() == [failing]
    assert not _native.available()
    assert native.status()["lightning_recorder_stats"].startswith("build failed")
    assert fused_kernels_status().startswith("build failed")
    x = data("relu", 5000)
    got = finalize(native_state(x, Workspace()), correction=1)
    assert got["zero_fraction"].item() == (x == 0).double().mean().item()


@pytest.mark.skipif(not HAVE_CC, reason="needs a C compiler")
def test_a_compiler_without_avx512_builds_for_avx2(
    fresh_native: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Where torch runs AVX-512 kernels but the compiler cannot build for AVX-512, the kernels
    are built for AVX2 rather than not at all."""
    real = native.compiler()
    assert real is not None
    wrapper = tmp_path / "cc-without-avx512"
    wrapper.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do [ "$a" = -mavx512f ] && { echo "unknown: $a" >&2; exit 1; }; done\n'
        f'exec {" ".join(real)} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    monkeypatch.setattr(native, "cpu_flags", lambda: ["-mavx2", "-mfma", "-mavx512f"])
    assert _native.available(), native.status()
    assert native.status()["lightning_recorder_stats"].startswith("loaded from ")
    (built,) = (tmp_path / "cache").glob("lightning_recorder_stats-*.so")
    x = data("gaussian", 5000)
    assert _native.moments(x)[4:6] == (x.min().item(), x.max().item())
    monkeypatch.setattr(native, "cpu_flags", lambda: ["-mavx2", "-mfma"])
    native.reset()
    assert _native.available()
    assert native.status()["lightning_recorder_stats"] == f"loaded from {built}"  # the AVX2 build


@pytest.mark.skipif(not HAVE_CC, reason="needs a C compiler")
def test_a_built_library_is_reused_from_the_cache(tmp_path: Path) -> None:
    """A second process loads the file the first built instead of building it again."""
    script = textwrap.dedent(
        """
        from lightning_recorder._core import native
        from lightning_recorder.stats import _native
        assert _native.available()
        print(native.status()["lightning_recorder_stats"])
        """
    )
    env = {"LIGHTNING_RECORDER_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    first = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert first.returncode == 0, first.stderr
    built = list(tmp_path.glob("lightning_recorder_stats-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    second = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert second.returncode == 0, second.stderr
    assert list(tmp_path.glob("lightning_recorder_stats-*.so")) == built  # nothing built anew
    assert built[0].stat().st_mtime_ns == stamp
    assert first.stdout == second.stdout  # the same file, named in the status


@pytest.mark.skipif(not HAVE_CC, reason="needs a C compiler")
def test_segments_match_the_torch_segmented_path() -> None:
    """Many small tensors reduced in one call: the states and histograms of the torch path (float64
    segmented reductions) within the fused kernels' precision."""
    g = torch.Generator().manual_seed(3)
    groups = [
        [torch.randn(8, 8, generator=g)],
        [],  # a module not called
        [torch.randn(5, generator=g).relu(), torch.randn(7, generator=g) + 10],  # two calls
        [torch.tensor([1.0, math.nan, -math.inf, 2.0])],  # non-finite values counted apart
        [torch.randn(33, generator=g).half()],
        [torch.full((9,), 3.0)],  # one value: the range widened to ±0.5
        [torch.randn(40, generator=g) * 1e-3 + 1001],  # the shift 1000: M2 redone
    ]
    fused = native_segments(groups)
    assert fused is not None
    values, offsets, states = fused
    assert offsets.tolist() == [0, 64, 64, 76, 80, 113, 122, 162]
    _, redo = _native.segment_states(values, offsets, 3)  # what the one pass leaves to redo
    assert redo is not None and redo.tolist() == [0, 0, 0, 1, 0, 0, 2]  # non-finite; cancelled
    flat, seg = flatten_segments(groups, "cpu")
    reference_states = segmented_states(flat, seg, len(groups))
    ours, theirs = finalize(states, 1), finalize(reference_states, 1)
    for stat in ("mean", "std", "abs_mean", "min", "max", "zero_fraction", "nonfinite", "numel"):
        # float32 sums of squares and |x| (1e-7 relative), float64 deviations' sum: 1e-6
        torch.testing.assert_close(ours[stat], theirs[stat], rtol=1e-6, atol=1e-9, equal_nan=True)
    counts, edges, vmin, vmax, sums = native_segmented_histograms(
        values, offsets, states, 10, sync=False, group=None
    )
    ref_counts, ref_edges, ref_vmin, ref_vmax, ref_sums = segmented_histograms(
        flat, seg, reference_states, 10, sync=False, group=None
    )
    assert torch.equal(vmin, ref_vmin) and torch.equal(vmax, ref_vmax)  # exact extremes
    torch.testing.assert_close(sums, ref_sums, rtol=1e-6, atol=1e-9)  # from the states
    torch.testing.assert_close(edges, ref_edges, rtol=1e-12, atol=0)
    # float32 positions against float64 ones: a value within rounding of an edge may move one
    # bucket; the totals are exact
    assert (counts - ref_counts).abs().sum().item() <= 2
    torch.testing.assert_close(counts.sum(1), ref_counts.sum(1), rtol=0, atol=0)
    assert counts.sum(1).tolist() == [64.0, 0.0, 12.0, 2.0, 33.0, 9.0, 40.0]
    # the whole table in one call (one process): the same rows
    table = native_segmented_table(values, offsets, states, 10)
    reference_table = raw_table(counts, edges, vmin, vmax, sums)
    assert torch.equal(table[:, 3:16], reference_table[:, 3:16])  # extremes, edges: exact
    assert torch.equal(table[:, 16:], reference_table[:, 16:])  # the same counts
    torch.testing.assert_close(table[:, :3], reference_table[:, :3], rtol=1e-15, atol=0)


def test_segments_decline_float64() -> None:
    assert native_segments([[torch.randn(4, dtype=torch.float64)]]) is None


@pytest.mark.skipif(not HAVE_CC, reason="needs a C compiler")
def test_all_histograms_in_one_call_match_the_per_set_path() -> None:
    """:func:`native_histograms` (every set at once) against :func:`histogram_rows_cpu`
    (set by set, the same bucketing): the same rows, within float64 rounding of the scaling."""
    g = torch.Generator().manual_seed(8)
    big, small = torch.randn(3000, generator=g), torch.randn(50, generator=g) * 2
    parts = [
        [big[::7].clone(), small],  # a sample of one output and the whole of another
        [],  # a module not called
        [torch.randn(4096, generator=g).relu()],  # most values in one bucket
        [torch.tensor([1.0, math.nan, -math.inf, 2.0, 2.0])],  # non-finite values not counted
        [torch.full((9,), 3.0)],  # one value: the range widened to ±0.5
    ]
    weights = [[7.0, 1.0], [], [1.0], [1.0], [1.0]]
    work = Workspace()
    whole = [[big, small], *parts[1:]]  # the data the states describe
    cpu = torch.device("cpu")
    states = torch.stack(
        [native_state(torch.cat(p), work) if p else empty_state(cpu) for p in whole]
    )
    found = native_histograms(parts, states, 12, weights)
    assert found is not None
    ours = [HistogramRow.from_flat(row, 12) for row in raw_table(*found).tolist()]
    theirs = histogram_rows_cpu(
        parts, states, 12, sync=False, group=None, work=work, exact=False, weights=weights
    )
    for a, b in zip(ours, theirs, strict=True):
        assert (a.num, a.min, a.max) == (b.num, b.min, b.max)
        assert a.edges == b.edges  # the same operations in float64
        # weighted counts scaled to the count in another order of operations: 1e-12
        assert a.counts == pytest.approx(b.counts, rel=1e-12, abs=1e-9)
        assert a.sum == pytest.approx(b.sum, rel=1e-12, abs=1e-12)
        assert a.sum_squares == pytest.approx(b.sum_squares, rel=1e-12, abs=1e-12)
    assert sum(ours[0].counts) == pytest.approx(3050.0, rel=1e-12)  # scaled to the whole count
    assert ours[1].num == 0 and sum(ours[1].counts) == 0
    assert sum(ours[3].counts) == 3.0 and ours[4].edges[0] == 2.5


@pytest.mark.skipif(not HAVE_CC, reason="needs a C compiler")
@pytest.mark.parametrize("bins", [1, 30, 1000])
@pytest.mark.parametrize("low", [1.0, -3.0e6, 7.5e-200, 1e280])
def test_the_table_declines_the_ranges_arithmetic_64_declines(bins: int, low: float) -> None:
    """The C table applies :func:`arithmetic_64`'s rule: on both sides of its threshold (a span
    of ``bins * |lo| * 2**-40``), it declines exactly the ranges the rule declines."""
    threshold = bins * abs(low) * 2.0**-40
    outcomes = set()
    for factor in (0.5, 0.999, 1.001, 2.0, 1e6):
        high = low + threshold * factor
        if not high > low:
            continue  # the span is below the resolution of ``low``: no such range
        values = torch.tensor([low, high], dtype=torch.float64)
        state = torch.tensor(
            [[2.0, (low + high) / 2, 0.0, low, high, 0.0, 0.0, 0.0, 2.0]], dtype=torch.float64
        )
        sample = [[values.float()]] if values.float().isfinite().all() else [[]]
        table = native_histogram_table(sample, state, bins)
        assert (table is not None) == bool(arithmetic_64(low, high, bins)), factor
        outcomes.add(table is not None)
    assert outcomes == {True, False}  # both sides of the threshold were tried


def test_all_histograms_in_one_call_decline_what_they_cannot_take() -> None:
    states = torch.stack([native_state(torch.tensor([1.0, 2.0]), Workspace())])
    as64 = [[torch.tensor([1.0, 2.0], dtype=torch.float64)]]
    assert native_histograms(as64, states, 10) is None  # not float32
    narrow = torch.tensor([1e6, 1e6 + 0.0625])
    narrow_states = torch.stack([native_state(narrow, Workspace())])
    assert native_histograms([[narrow]], narrow_states, 2**25) is None  # a "search" range


@pytest.mark.skipif(not HAVE_CC, reason="needs a C compiler")
def test_the_state_in_one_call_flags_what_it_cannot_finish() -> None:
    """``state_row``: the packed state from the kernel's own arithmetic, or a flag (1: not
    finite, 2: cancellation) that sends :func:`native_state` to the exact paths."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5000, generator=g) * 2 + 0.25
    row, flag = _native.state_row(x, None, 1, 3)
    assert flag == 0
    shift, total, squares, abs_sum, low, high, zeros = _native.moments(x)
    mean = shift + total / 5000
    assert row == [
        5000,
        mean,
        squares - total * total / 5000,
        low,
        high,
        abs_sum / 5000,
        zeros,
        0,
        5000,
    ]
    bad = x.clone()
    bad[7] = math.inf
    assert _native.state_row(bad, None, 1, 3)[1] == 1
    far = torch.randn(5000, generator=g) * 1e-3 + 1001  # the shift is 1000: one pass cancels
    assert _native.state_row(far, None, 1, 3)[1] == 2
    for v in (bad, far):  # the flagged cases through the monitor's kernel: the exact values
        got = finalize(native_state(v, Workspace())[None], 1)
        exact = v.double()[torch.isfinite(v)]  # the statistics are of the finite values
        assert got["min"].item() == exact.min().item() and got["max"].item() == exact.max().item()
        assert got["nonfinite"].item() == v.numel() - exact.numel()
        assert got["mean"].item() == pytest.approx(exact.mean().item(), rel=1e-6)
        assert got["std"].item() == pytest.approx(exact.std().item(), rel=1e-5)


_LEVEL_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from lightning_recorder._core import native
    flags = sys.argv[1].split()
    native.cpu_flags = lambda: flags
    from lightning_recorder.stats import _native
    assert _native.available(), native.status()
    g = torch.Generator().manual_seed(4)
    found = {}
    for n in (1, 15, 17, 4099, 2**16 + 3, 2**18 + 5):  # below and above a vector, in cache, rows
        x = torch.randn(n, generator=g) * 2 + 0.5
        x[::7] = 0.0
        sample = torch.empty(-(-n // 3))
        found[f"moments{n}"] = torch.tensor(_native.moments(x, sample, 3), dtype=torch.float64)
        found[f"sample{n}"] = sample
        row, flag = _native.state_row(x, None, 1, 20)
        found[f"state{n}"] = torch.tensor([*row, flag], dtype=torch.float64)
        found[f"bucket{n}"] = torch.tensor(_native.bucket(x, -4.0, 5.0, 30))
    xs = [torch.randn(m, generator=g) for m in (100, 5000, 40000)]
    states = torch.tensor([[m, 0.0, m, -4.5, 4.5, 1.0, 0.0, 0.0, m] for m in (100, 5000, 40000)],
                          dtype=torch.float64)
    found["table"] = _native.sets_table(xs, [0, 1, 2], [1.0, 2.0, 1.0], states, 30)
    torch.save(found, sys.argv[2])
    """
)


def _cpu_has(flag: str) -> bool:
    try:
        return flag in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


@pytest.mark.skipif(not HAVE_CC, reason="needs a C compiler")
def test_every_vector_width_computes_the_same(tmp_path: Path) -> None:
    """The kernels built for 16-byte (no flags), 32-byte (AVX2) and, where the CPU has it,
    64-byte vectors (AVX-512): the same extremes, counts, samples and buckets; the sums in
    another order of float32 additions (fewer or more lanes), within 1e-6 relative."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the vector widths are x86-64 flags")
    levels = {"sse2": "", "avx2": "-mavx2 -mfma"}
    if _cpu_has("avx512f"):
        levels["avx512"] = "-mavx2 -mfma -mavx512f"
    results = {}
    for name, flags in levels.items():
        out = tmp_path / f"{name}.pt"
        env = {**os.environ, "LIGHTNING_RECORDER_CACHE": str(tmp_path / name)}
        done = subprocess.run(
            [sys.executable, "-c", _LEVEL_SCRIPT, flags, str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        results[name] = torch.load(out)
    first, *others = results.values()
    for other in others:
        for key, value in first.items():
            got = other[key]
            if key.startswith(("sample", "bucket", "table")):
                # copies, counts, and the table's head from the same states: exact
                assert torch.equal(got, value), key
            elif key.startswith("moments"):  # shift, sum(d), sum(d^2), sum|x|, min, max, zeros
                n = int(key.removeprefix("moments"))
                assert torch.equal(got[[0, 4, 5, 6]], value[[0, 4, 5, 6]]), key
                # float32 lanes summed in another order: (lane terms) * 2**-24 * sum |d| at
                # most, with sum |d| <= sum |x| + n |shift|; 1e-5 of it is ample
                scale = value[3].item() + n * abs(value[0].item())
                assert abs(got[1].item() - value[1].item()) <= 1e-5 * scale, key
                torch.testing.assert_close(got[2:4], value[2:4], rtol=1e-6, atol=0.0)
            else:  # the state: count, min, max, zeros, nonfinite, numel, flag exact
                exact = [0, 3, 4, 6, 7, 8, 9]
                assert torch.equal(got[exact], value[exact]), key
                mean_scale = value[5].item() + abs(value[1].item())
                assert abs(got[1].item() - value[1].item()) <= 1e-5 * mean_scale, key
                torch.testing.assert_close(got[[2, 5]], value[[2, 5]], rtol=1e-5, atol=0.0)
