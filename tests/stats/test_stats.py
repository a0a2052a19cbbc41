"""Tests of lightning_recorder.stats against direct torch computations on concatenated data."""

from __future__ import annotations

import math
import os
import pickle
import re
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.docs import doctest_room
from helpers.models import assert_counts_up_to_edges
from hypothesis import example, given, settings
from hypothesis import strategies as st

import lightning_recorder.stats as stats_module
from lightning_recorder.errors import RecorderConfigError
from lightning_recorder.stats import (
    STAT_NAMES,
    FeatureStats,
    feature_stats,
    global_norm,
    histogram,
    histogram_raw_kwargs,
    tensor_norm,
    update_ratio,
)
from lightning_recorder.stats._state import WIDTH
from lightning_recorder.stats.metric import BucketCounts, StreamStates

ROOT = Path(__file__).resolve().parents[2]
F64 = torch.float64
NAN = math.nan


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([torch.zeros(0, dtype=F64), *(t.reshape(-1).to(F64) for t in tensors)])


def reference(tensors: list[torch.Tensor], correction: int = 1) -> dict[str, torch.Tensor]:
    """The statistics computed directly by torch on the concatenation of ``tensors``."""
    values = _flat(tensors)
    finite = values[torch.isfinite(values)]
    nan = torch.tensor(NAN, dtype=F64)
    seen = finite.numel() > 0
    return {
        "mean": finite.mean() if seen else nan,
        "std": torch.std(finite, correction=correction) if finite.numel() > correction else nan,
        "min": finite.min() if seen else nan,
        "max": finite.max() if seen else nan,
        "abs_mean": finite.abs().mean() if seen else nan,
        "zero_fraction": (values == 0).sum(dtype=F64) / values.numel() if values.numel() else nan,
        "nonfinite": (~torch.isfinite(values)).sum().to(F64),
        "numel": torch.tensor(values.numel(), dtype=F64),
    }


def assert_stats(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert tuple(actual) == STAT_NAMES
    for name in STAT_NAMES:
        assert actual[name].dtype == F64 and actual[name].shape == (), name
        torch.testing.assert_close(
            actual[name], expected[name].to(F64), rtol=1e-9, atol=1e-9, equal_nan=True, msg=name
        )


def streamed(batches: list[torch.Tensor], correction: int = 1) -> dict[str, torch.Tensor]:
    metric = FeatureStats(correction=correction)
    for batch in batches:
        metric.update(batch)
    return metric.compute()


def with_specials(x: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = x.clone().reshape(-1)
    idx = torch.randperm(x.numel(), generator=g)
    x[idx[:3]] = 0.0
    x[idx[3:5]] = NAN
    x[idx[5:6]] = math.inf
    x[idx[6:7]] = -math.inf
    return x


# --- FeatureStats ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_shapes_match_torch(dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(5):
        shape = tuple(
            int(s)
            for s in torch.randint(
                1, 6, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g
            )
        )
        x = torch.randn(shape, generator=g, dtype=dtype) * 100 + 1e4 * seed
        batches.append(with_specials(x, seed * 10 + i) if x.numel() > 7 else x)
    for correction in (0, 1):
        assert_stats(streamed(batches, correction), reference(batches, correction))


finite_floats = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False)
elements = st.one_of(finite_floats, st.sampled_from([0.0, NAN, math.inf, -math.inf]))
batch_lists = st.lists(st.lists(elements, max_size=25), max_size=6)


@settings(max_examples=60, deadline=None)
@given(batch_lists, st.sampled_from([0, 1, 2]))
def test_property_streamed_equals_torch(lists: list[list[float]], correction: int) -> None:
    batches = [torch.tensor(b, dtype=F64) for b in lists]
    assert_stats(streamed(batches, correction), reference(batches, correction))
    # One update of the concatenation gives the same result as the stream.
    assert_stats(feature_stats(_flat(batches), correction), reference(batches, correction))


def test_chunked_updates_equal_single_update() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 7 + 1e5
    sizes = [1, 0, 13, 250, 36, 700]
    assert_stats(streamed(list(torch.split(x, sizes))), streamed([x]))


def test_naive_sum_of_squares_would_fail() -> None:
    # Large offset, small spread: sum(x^2) - sum(x)^2/n cancels catastrophically in float64.
    x = 1e9 + torch.arange(1000, dtype=F64) * 1e-3
    out = streamed(list(torch.split(x, 7)))
    torch.testing.assert_close(out["std"], torch.std(x), rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_is_upcast(dtype: torch.dtype) -> None:
    x = torch.full((4000,), 60000.0).to(dtype)  # its sum overflows float16
    x[:10] = -1.5
    out = streamed([x, x[:7]])
    assert_stats(out, reference([x, x[:7]]))
    assert math.isfinite(out["mean"].item()) and math.isfinite(out["std"].item())


@pytest.mark.parametrize(
    "x",
    [
        torch.tensor([[1, 0, -3], [7, 0, 2]]),
        torch.tensor([3, 250, 0], dtype=torch.uint8),
        torch.tensor([True, False, True, True]),
    ],
    ids=["int64", "uint8", "bool"],
)
def test_integer_and_bool_input(x: torch.Tensor) -> None:
    assert_stats(streamed([x, x]), reference([x, x]))


def test_empty_and_no_data() -> None:
    empty = reference([])
    assert empty["numel"].item() == 0 and math.isnan(empty["zero_fraction"].item())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not even torchmetrics' "compute before update" warning
        assert_stats(FeatureStats().compute(), empty)
        assert_stats(streamed([torch.empty(0, 3)]), empty)
        no_finite = streamed([torch.tensor([NAN, math.inf, -math.inf])])
    for name in ("mean", "std", "min", "max", "abs_mean"):
        assert math.isnan(no_finite[name].item()), name
    assert no_finite["nonfinite"].item() == no_finite["numel"].item() == 3
    assert no_finite["zero_fraction"].item() == 0.0
    assert math.isnan(streamed([torch.tensor([5.0])])["std"].item())
    assert streamed([torch.tensor([5.0])], correction=0)["std"].item() == 0.0


def test_reset_and_fixed_size_state() -> None:
    metric = FeatureStats()
    for _ in range(20):
        metric.update(torch.randn(64, 3))
    assert list(metric.metric_state) == ["packed"]
    assert metric.packed.shape == (WIDTH,) and metric.packed.dtype == F64
    metric.reset()
    assert_stats(metric.compute(), reference([]))
    y = torch.tensor([1.0, -2.0, 0.0])
    metric.update(y)
    assert_stats(metric.compute(), reference([y]))


def test_update_never_reads_values_on_host() -> None:
    # Meta tensors have no values: any .item()/.tolist() or data-dependent shape would raise.
    metric = FeatureStats().to("meta")
    metric.update(torch.empty(4, 5, device="meta"))
    metric.update(torch.empty(3, dtype=torch.float16, device="meta"))
    assert metric.packed.device.type == "meta"
    assert metric.compute()["mean"].device.type == "meta"
    counts, edges = histogram(torch.empty(10, device="meta"), bins=8)
    assert counts.shape == (8,) and edges.shape == (9,) and counts.device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_host_sync_on_cuda() -> None:
    metric = FeatureStats().to("cuda")
    x = with_specials(torch.randn(1000), 9).to("cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in (x, x.half(), x[:0], x.to(torch.int32)):
            metric.update(batch)
        out = metric.compute()
        counts, edges = histogram(x, bins=32)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_stats(
        {k: v.cpu() for k, v in out.items()},
        streamed([t.cpu() for t in (x, x.half(), x[:0], x.to(torch.int32))]),
    )
    assert counts.sum().item() == torch.isfinite(x).sum().item() and edges.is_cuda


def test_inference_mode_state_updated_later_in_training() -> None:
    x, y = torch.randn(10), torch.randn(7)
    with torch.inference_mode():
        metric = FeatureStats()
        metric.update(x)
        assert_stats(metric.compute(), reference([x]))
        metric.reset()
        metric.update(x)
        assert metric.packed.is_inference()
    metric.update(y)  # used to raise "Inplace update to inference tensor outside InferenceMode"
    assert_stats(metric.compute(), reference([x, y]))
    metric.reset()
    metric.update(y)
    assert_stats(metric.compute(), reference([y]))

    created_outside = FeatureStats()
    created_outside.update(x)
    with torch.inference_mode():
        created_outside.update(y)
        created_outside.compute()
    created_outside.update(x)
    assert_stats(created_outside.compute(), reference([x, y, x]))


def test_forward_and_merge_state() -> None:
    a, b = torch.randn(30), torch.randn(12) * 3 + 2
    metric = FeatureStats()
    assert_stats(metric(a), reference([a]))  # forward: statistics of the batch
    assert_stats(metric(b), reference([b]))
    assert_stats(metric.compute(), reference([a, b]))
    other = FeatureStats()
    other.update(a)
    metric.merge_state(other)
    assert_stats(metric.compute(), reference([a, b, a]))
    metric.merge_state(other.metric_state)
    assert_stats(metric.compute(), reference([a, b, a, a]))


def test_compute_reads_the_merged_state_and_never_warns_on_no_data() -> None:
    """compute() is not cached (a merge after a compute shows in the next one), and computing a
    metric without data, or a copy or unpickled metric without data, warns nothing."""
    a = torch.randn(20)
    metric = FeatureStats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert metric.compute()["numel"].item() == 0
        for copy in (metric.clone(), pickle.loads(pickle.dumps(metric))):
            assert copy.compute()["numel"].item() == 0
    other = FeatureStats()
    other.update(a)
    before = metric.compute()
    metric.merge_state(other)
    assert before["numel"].item() == 0 and metric.compute()["numel"].item() == a.numel()
    with pytest.raises(RecorderConfigError, match=r"Expected compute_with_cache=False"):
        FeatureStats(compute_with_cache=True)
    assert FeatureStats(compute_with_cache=False).compute_with_cache is False


def test_state_follows_device_and_keeps_float64() -> None:
    metric = FeatureStats().half()  # torchmetrics does not convert state dtypes implicitly
    metric.update(torch.randn(5))
    assert metric.packed.dtype == F64 and metric.packed.device == metric.device


def test_set_dtype_keeps_the_float64_state() -> None:
    """set_dtype(torch.float16) converted the packed state: the next update's sum of squares
    overflowed, and std and abs_mean came out inf for finite data of magnitude 100."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=F64) * 100
    for metric in (FeatureStats(), StreamStates(2), BucketCounts(2, 4)):
        for dtype in (torch.float16, torch.float32, "half"):
            with pytest.raises(
                RecorderConfigError, match=r"set_dtype to keep its float64 state but got .*inf"
            ):
                metric.set_dtype(dtype)
        assert metric.set_dtype(torch.float64) is metric  # what it holds already: accepted
        assert all(t.dtype == F64 for t in metric.metric_state.values())
    stats = FeatureStats()
    with pytest.raises(RecorderConfigError):
        stats.set_dtype(torch.float16)
    stats.update(x[:500])
    stats.update(x[500:])
    out = stats.compute()
    assert torch.allclose(out["std"], x.std(), rtol=1e-12)
    assert torch.allclose(out["abs_mean"], x.abs().mean(), rtol=1e-12)


def test_errors() -> None:
    metric = FeatureStats()
    with pytest.raises(
        RecorderConfigError, match=r"Expected `x` to be a torch.Tensor but got list"
    ):
        metric.update([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(
        RecorderConfigError,
        match=r"Expected `x` to have a real dtype but got torch.complex64; pass its magnitude "
        r"\(`x.abs\(\)`\) or its real and imaginary parts \(`torch.view_as_real\(x\)`\)",
    ):
        metric.update(torch.ones(2, dtype=torch.complex64))
    for bad in (-1, True, 0.5):
        with pytest.raises(
            RecorderConfigError, match=r"Expected `correction` to be a non-negative int but"
        ):
            FeatureStats(correction=bad)  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"Expected `correction` to be a non-negative"):
        feature_stats(torch.ones(2), correction=-2)
    for bad_bins in (0, -3, 2.0, True):
        with pytest.raises(
            RecorderConfigError, match=r"Expected `bins` to be a positive int but got"
        ):
            histogram(torch.ones(3), bins=bad_bins)  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"Expected `x` to be a torch.Tensor but got"):
        histogram_raw_kwargs(None, 4)  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"Unexpected keyword arguments: `bogus`"):
        FeatureStats(bogus=1)


def test_the_metrics_across_ranks_check_their_sizes() -> None:
    """They raised torch's errors of ``torch.zeros`` ("zeros() takes 1 positional argument but
    2 were given" for 1.5 streams), or took 0 bins."""
    from lightning_recorder.stats.metric import BucketCounts, StreamStates

    for bad in (1.5, -1, "2", True):
        with pytest.raises(
            RecorderConfigError,
            match=r"Expected `streams` of StreamStates to be a non-negative int or None but got",
        ):
            StreamStates(bad)  # type: ignore[arg-type]
        with pytest.raises(
            RecorderConfigError,
            match=r"Expected `streams` of BucketCounts to be a non-negative int but got",
        ):
            BucketCounts(bad, 4)  # type: ignore[arg-type]
    for bad_bins in (0, -2, 2.0, None):
        with pytest.raises(
            RecorderConfigError, match=r"Expected `bins` of BucketCounts to be a positive int but"
        ):
            BucketCounts(1, bad_bins)  # type: ignore[arg-type]
    assert StreamStates().compute().shape == (WIDTH,)
    assert StreamStates(0).compute().shape == (0, WIDTH)
    assert BucketCounts(2, 3).compute().shape == (2, 3)


@pytest.mark.parametrize("make", [histogram, histogram_raw_kwargs])
@pytest.mark.parametrize("bad", ["no", None, 0, 1])
def test_histogram_sync_must_be_a_bool(make: Any, bad: object) -> None:
    # "no" is truthy: taken as it was, it combined every rank's data under DDP
    with pytest.raises(RecorderConfigError, match=r"Expected `sync` to be a bool but got"):
        make(torch.ones(3), 4, sync=bad)


# --- histograms -----------------------------------------------------------------------------


def check_histogram(values: torch.Tensor, bins: int) -> None:
    counts, edges = histogram(values, bins)
    finite = values.reshape(-1).to(F64)
    finite = finite[torch.isfinite(finite)]
    assert counts.shape == (bins,) and edges.shape == (bins + 1,)
    assert counts.sum().item() == finite.numel()
    lo, hi = (finite.min().item(), finite.max().item()) if finite.numel() else (0.0, 1.0)
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    assert edges[0].item() == lo and edges[-1].item() == hi
    torch.testing.assert_close(edges, torch.histogram(finite, bins, range=(lo, hi))[1])
    # torch.histogram's counts given the edges, but for values within rounding of an edge
    assert_counts_up_to_edges(counts, finite, edges, values.dtype)


@settings(max_examples=60, deadline=None)
@given(batch_lists, st.integers(1, 12))
@example([[0.0, 5e-324]], 3)  # a range one subnormal wide: edges rounded to 0, 0, 5e-324, 5e-324
def test_property_histogram_matches_torch(lists: list[list[float]], bins: int) -> None:
    check_histogram(_flat([torch.tensor(b, dtype=F64) for b in lists]), bins)


def test_histogram_random_and_edge_cases() -> None:
    x = with_specials(torch.randn(5000, generator=torch.Generator().manual_seed(5)), 5)
    check_histogram(x, 64)
    finite = x[torch.isfinite(x)].double()
    lo, hi = finite.min().item(), finite.max().item()
    # torch.histogram(range=...) places fixed-width bins by its own arithmetic (it may differ per
    # CPU): a value within rounding of an edge may land one bin over, none is lost.
    ours, theirs = histogram(x, 64)[0], torch.histogram(finite, 64, range=(lo, hi)).hist
    assert ours.sum() == theirs.sum() == finite.numel()
    assert (ours - theirs).abs().sum() <= 2 * 4  # at most a few values moved by one bin
    check_histogram(torch.full((3, 3), 2.5), 4)  # one value: range [v - 0.5, v + 0.5]
    check_histogram(torch.arange(9), 4)  # integer values exactly on edges
    check_histogram(torch.tensor([1.0, 1.0, 1.0], dtype=torch.float16), 1)
    counts, edges = histogram(torch.tensor([NAN, -math.inf]), 4)
    assert counts.tolist() == [0.0] * 4 and edges.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert histogram_raw_kwargs(torch.tensor([NAN, math.inf]), 4) is None
    assert histogram_raw_kwargs(torch.empty(0), 4) is None


def test_histogram_raw_kwargs_values() -> None:
    x = with_specials(torch.randn(300, generator=torch.Generator().manual_seed(6)), 6)
    finite = x[torch.isfinite(x)].double()
    kw = histogram_raw_kwargs(x, bins=10)
    assert kw is not None
    counts, edges = histogram(x, 10)
    assert kw["num"] == finite.numel() == 300 - 4
    assert kw["min"] == finite.min().item() and kw["max"] == finite.max().item()
    assert kw["sum"] == pytest.approx(finite.sum().item(), rel=1e-12, abs=1e-9)
    assert kw["sum_squares"] == pytest.approx(finite.square().sum().item(), rel=1e-12)
    assert kw["bucket_limits"] == edges.tolist()
    assert kw["bucket_counts"] == [0.0, *counts.tolist()]


def test_histogram_raw_kwargs_written_to_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    x = with_specials(torch.randn(40, 25, generator=torch.Generator().manual_seed(7)) * 3, 7)
    finite = x[torch.isfinite(x)].double()
    kw = histogram_raw_kwargs(x, bins=16)
    assert kw is not None
    writer = SummaryWriter(log_dir=str(tmp_path))
    writer.add_histogram_raw("layer/act", global_step=3, **kw)
    writer.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0})
    events.Reload()
    (event,) = events.Histograms("layer/act")
    value = event.histogram_value
    assert event.step == 3
    assert value.num == finite.numel() == 1000 - 4
    assert value.min == pytest.approx(finite.min().item())
    assert value.max == pytest.approx(finite.max().item())
    assert value.sum == pytest.approx(finite.sum().item())
    assert sum(value.bucket) == finite.numel()
    assert list(value.bucket_limit) == pytest.approx(kw["bucket_limits"])


# --- norms ----------------------------------------------------------------------------------


def test_norms() -> None:
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(4, 5, generator=g, dtype=F64), torch.randn(3, generator=g, dtype=F64)
    assert tensor_norm(a).dtype == F64
    torch.testing.assert_close(tensor_norm(a), torch.linalg.vector_norm(a))
    big = torch.full((300,), 60000.0, dtype=torch.float16)  # the float16 norm overflows
    assert tensor_norm(big).dtype == torch.float32
    assert tensor_norm(big).item() == pytest.approx(60000.0 * math.sqrt(300), rel=1e-6)
    assert tensor_norm(torch.tensor([3, 4])).item() == 5.0
    assert tensor_norm(torch.empty(0)).item() == 0.0
    torch.testing.assert_close(
        global_norm([a, b]), torch.linalg.vector_norm(torch.cat([a.flatten(), b]))
    )
    assert global_norm([]).item() == 0.0
    assert global_norm(iter([torch.tensor([3.0]), torch.tensor([4.0])])).item() == 5.0

    after = a + 0.01 * torch.randn(4, 5, generator=g, dtype=F64)
    expected = torch.linalg.vector_norm(after - a) / torch.linalg.vector_norm(a)
    torch.testing.assert_close(update_ratio(a, after), expected)
    zero = torch.zeros(3)
    assert update_ratio(zero, zero).item() == 0.0
    assert math.isfinite(update_ratio(zero, torch.ones(3)).item())
    with pytest.raises(
        RecorderConfigError, match=r"Expected `after` to have the shape of `before`, \(4, 5\), "
    ):
        update_ratio(a, b)
    with pytest.raises(RecorderConfigError, match=r"Expected `eps` to be a non-negative number"):
        update_ratio(a, a, eps=-1.0)
    with pytest.raises(RecorderConfigError, match=r"Expected `before` to be a torch.Tensor but"):
        update_ratio(1.0, a)  # type: ignore[arg-type]
    # a copy kept on another device failed inside torch ("Tensor on device cpu is not on the
    # expected device meta!")
    with pytest.raises(
        RecorderConfigError,
        match=r"Expected `after` on the device of `before`, cpu, but got meta; move the copy",
    ):
        update_ratio(zero, torch.ones(3, device="meta"))


def test_docstring_examples() -> None:
    result = doctest_room(stats_module)
    assert result.attempted >= 15 and result.failed == 0


# --- two processes --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_two_processes_gloo(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "helpers" / "ddp_stats_script.py"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), "2", str(port), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=300)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output

    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    data = [r["data"] for r in results]
    batches = data[0]["batches"] + data[1]["batches"]
    extras = data[0]["extra"] + data[1]["extra"]
    everything = _flat(batches)
    finite = everything[torch.isfinite(everything)]
    lo, hi = finite.min().item(), finite.max().item()
    assert not torch.equal(
        data[0]["batches"][0], data[1]["batches"][0][: len(data[0]["batches"][0])]
    )

    for rank, res in enumerate(results):
        assert_stats(res["stats"], reference(batches))
        assert_stats(res["population"], reference(batches, correction=0))
        assert_stats(res["stats_extra"], reference(batches + extras))
        assert_stats(res["only_first"], reference([data[0]["batches"][0]]))
        counts, edges = res["hist"]
        assert edges[0].item() == lo and edges[-1].item() == hi, rank
        assert counts.sum().item() == finite.numel()
        assert_counts_up_to_edges(counts, finite, edges, F64)  # the data is float64
        only_first = _flat(data[0]["batches"])
        counts0, edges0 = res["hist_only_first"]
        assert_counts_up_to_edges(counts0, only_first, edges0, F64)
        assert res["raw"]["num"] == finite.numel() and res["raw"]["min"] == lo
        assert res["raw"]["max"] == hi and res["raw"]["bucket_counts"][1:] == counts.tolist()
        assert res["raw"] == results[0]["raw"]  # identical on every rank
        local = _flat(data[rank]["batches"])
        assert res["raw_local"]["num"] == torch.isfinite(local).sum().item()
        assert res["raw_no_finite"] is None


def test_pickle_and_state_dict(tmp_path: Path) -> None:
    x = torch.randn(20)
    metric = FeatureStats(correction=0)
    metric.update(x)
    restored = pickle.loads(pickle.dumps(metric))
    restored.update(x)
    assert_stats(restored.compute(), reference([x, x], correction=0))
    metric.persistent(True)
    torch.save(metric.state_dict(), tmp_path / "stats.pt")
    fresh = FeatureStats(correction=0)
    fresh.load_state_dict(torch.load(tmp_path / "stats.pt", weights_only=True))
    assert_stats(fresh.compute(), reference([x], correction=0))


def test_scaling_page_gives_the_size_of_the_gathered_state() -> None:
    """The page on scaling out states how many numbers per module cross ranks: the packed state."""
    text = (ROOT / "docs" / "scaling.md").read_text(encoding="utf-8")
    sizes = re.findall(r"an? (\d+)-number state|`(\d+) × modules`", text)
    assert sizes and {int(a or b) for a, b in sizes} == {WIDTH}


def test_update_after_load_state_dict_adds_to_the_loaded_state() -> None:
    """A metric restored from a checkpoint goes on from the loaded state, as after a merge."""
    x, y = torch.randn(20), torch.randn(7) * 2 + 1
    metric = FeatureStats()
    metric.persistent(True)
    metric.update(x)
    restored = FeatureStats()
    restored.persistent(True)
    restored.load_state_dict(metric.state_dict())
    restored.update(y)
    assert_stats(restored.compute(), reference([x, y]))


def test_a_state_of_another_shape_is_refused_when_loaded_or_merged() -> None:
    """A state of another layout loaded silently and failed later in torch (compute: an
    IndexError, update: a RuntimeError of torch.stack); merging one failed in torch.stack."""
    from lightning_recorder.stats.metric import StreamStates

    x = torch.randn(20)
    metric = FeatureStats()
    metric.persistent(True)
    metric.update(x)
    # a state of the wrong width, and one of several streams (a StreamStates(2) saved)
    for state in ({"packed": torch.zeros(3)}, {"packed": torch.zeros(2, WIDTH)}):
        with pytest.raises(
            RecorderConfigError,
            match=rf"Expected the loaded state 'packed' of FeatureStats to be a packed state of "
            rf"shape \({WIDTH},\) .* but got \(",
        ):
            metric.load_state_dict(state)
    with pytest.raises(
        RecorderConfigError, match=r"the merged state of FeatureStats .* got \(3,\)"
    ):
        metric.merge_state({"packed": torch.zeros(3, dtype=torch.float64)})
    two = StreamStates(2)
    with pytest.raises(
        RecorderConfigError, match=rf"of shape \(2, {WIDTH}\) .* got \(3, {WIDTH}\)"
    ):
        two.merge_state(StreamStates(3))
    assert_stats(metric.compute(), reference([x]))  # the refused states left it unchanged
    # a state saved in float32 is taken in float64
    restored = FeatureStats()
    restored.load_state_dict({"packed": metric.packed.float()})
    assert restored.packed.dtype == torch.float64
    restored.update(x)
    assert restored.compute()["numel"].item() == 2 * x.numel()


class _Moves(torch.overrides.TorchFunctionMode):
    """Records every torch call whose result lies on another device than its first argument."""

    def __init__(self) -> None:
        super().__init__()
        self.moves: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        first = args[0] if args else None
        tensors = isinstance(out, torch.Tensor) and isinstance(first, torch.Tensor)
        if tensors and out.device != first.device:
            self.moves.append(getattr(func, "__name__", str(func)))
        return out


def test_channel_extremes_are_made_on_their_device_without_a_copy_from_the_host() -> None:
    """ChannelExtremes.on fills its states on the device (a copy from the host would synchronise
    with a CUDA device, inside the first logged step); made on the host and moved, the states
    are copied (the meta device stands for a GPU here)."""
    from lightning_recorder.stats.metric import ChannelExtremes

    with _Moves() as made_there:
        metric = ChannelExtremes.on(5, "meta")
    assert made_there.moves == []
    assert metric.low.device.type == metric.high.device.type == "meta"
    assert metric.device.type == "meta"  # torchmetrics' own notion of its device agrees
    metric.reset()
    assert metric.abs_low.device.type == "meta" and metric.low.shape == (5,)
    with _Moves() as moved:
        ChannelExtremes(5).to("meta")
    assert moved.moves  # the other way: copies from the host
    cpu = ChannelExtremes.on(3, "cpu")
    cpu.update(torch.tensor([[1.0, -2.0, 0.5], [3.0, 4.0, 0.5], [1.0, 0.0, 0.5]]))
    assert cpu.compute().tolist() == [[1.0, -2.0, 0.5], [3.0, 4.0, 0.5], [1.0, 0.0, 0.5]]


def _laid_out(kind: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in another layout, and the dense tensor of the values it holds."""
    if kind == "coo":
        return x.to_sparse(), x
    if kind == "csr":
        return x.to_sparse_csr(), x
    if kind == "nested":  # ragged rows, as a transformer's fast path makes them
        return torch.nested.nested_tensor([x[0], x[1, :3]]), torch.cat([x[0], x[1, :3]])
    if kind == "jagged":
        parts = [x[:2], x[:3]]
        return torch.nested.nested_tensor(parts, layout=torch.jagged), torch.cat(parts)
    q = torch.quantize_per_tensor(x, 0.05, 0, torch.qint8)
    return q, q.dequantize()


@pytest.mark.parametrize("kind", ["coo", "csr", "nested", "jagged", "quantized"])
def test_sparse_nested_and_quantized_tensors_give_the_statistics_of_their_values(
    kind: str,
) -> None:
    """A tensor that is not an ordinary dense one is read through the values it holds: a sparse
    tensor's stored values and implicit zeros, a nested tensor's components, a quantized
    tensor's dequantized values. Its statistics and histogram are those of the dense tensor of
    the same values (they crashed inside torch's reshape before)."""
    torch.manual_seed(0)
    x = torch.randn(6, 5)
    x[x.abs() < 0.6] = 0.0  # zeros for the sparse layouts to leave implicit
    laid_out, dense = _laid_out(kind, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested and sparse CSR tensors are in beta
        got, want = feature_stats(laid_out), feature_stats(dense)
        counts, limits = histogram(laid_out, bins=7)
        want_counts, want_limits = histogram(dense, bins=7)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12, msg=name)
    assert torch.equal(counts, want_counts) and torch.equal(limits, want_limits)
    metric = FeatureStats()
    metric.update(laid_out)
    torch.testing.assert_close(metric.compute()["mean"], want["mean"], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["coo", "csr", "nested", "jagged", "quantized"])
def test_norms_of_sparse_nested_and_quantized_tensors_are_those_of_their_values(
    kind: str,
) -> None:
    """A sparse gradient (``nn.Embedding(sparse=True)``), a nested or a quantized tensor has the
    norm of the values it holds (torch's vector_norm has no sparse kernel: this crashed);
    ``update_ratio`` compares element by element, so a sparse or quantized tensor is read
    dense, and a nested one (no single shape) is refused with a clear error."""
    torch.manual_seed(0)
    x = torch.randn(6, 5)
    x[x.abs() < 0.6] = 0.0
    laid_out, dense = _laid_out(kind, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested and sparse CSR tensors are in beta
        torch.testing.assert_close(tensor_norm(laid_out), torch.linalg.vector_norm(dense))
        torch.testing.assert_close(
            global_norm([laid_out, torch.ones(3)]),
            torch.linalg.vector_norm(torch.cat([dense.reshape(-1), torch.ones(3)])),
        )
        if kind in ("nested", "jagged"):
            with pytest.raises(RecorderConfigError, match="got a nested tensor"):
                update_ratio(laid_out, laid_out)
        else:
            torch.testing.assert_close(update_ratio(laid_out, laid_out), torch.tensor(0.0))
    # a COO gradient with a repeated index (as an embedding's backward makes): summed first
    repeated = torch.sparse_coo_tensor([[0, 1, 1]], torch.tensor([3.0, 1.0, 3.0]), (5,))
    assert tensor_norm(repeated).item() == 5.0
