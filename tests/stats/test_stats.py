"""Tests of lightning_recorder.stats against direct torch computations on concatenated data."""

from __future__ import annotations

import math
import os
import pickle
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers.docs import doctest_room
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_recorder.stats as stats_module
import lightning_recorder.stats._kernels as K
import lightning_recorder.stats._segmented as K_seg
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
    assert metric.packed.shape == (9,) and metric.packed.dtype == F64
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


def test_state_follows_device_and_keeps_float64() -> None:
    metric = FeatureStats().half()  # torchmetrics does not convert state dtypes implicitly
    metric.update(torch.randn(5))
    assert metric.packed.dtype == F64 and metric.packed.device == metric.device


def test_errors() -> None:
    metric = FeatureStats()
    with pytest.raises(
        RecorderConfigError, match=r"Expected `x` to be a torch.Tensor but got list"
    ):
        metric.update([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"Expected `x` to have a real dtype but got "):
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
    # Same bucket rule as torch.histogram, exactly, given the edges.
    assert torch.equal(counts, torch.histogram(finite, edges).hist)


@settings(max_examples=60, deadline=None)
@given(batch_lists, st.integers(1, 12))
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
        assert torch.equal(counts, torch.histogram(finite, edges).hist)
        only_first = _flat(data[0]["batches"])
        counts0, edges0 = res["hist_only_first"]
        assert torch.equal(
            counts0, torch.histogram(only_first[torch.isfinite(only_first)], edges0).hist
        )
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


# --- CPU kernels: fast paths against the general ones -----------------------------------------

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values with zeros, of ``dtype``, far from overflow and mixed in sign."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=F64) * 50 + 3
    x.view(-1)[::7] = 0.0
    if dtype == torch.bool:
        return x > 3
    return x.to(dtype)


def assert_same_state(a: torch.Tensor, b: torch.Tensor) -> None:
    """Two packed states of the same data computed by two code paths (the fast and the masked
    kernels, chunked or whole). Counts, min and max are exact in both; mean, M2 and mean |x|
    are float64 sums of up to ~1e6 terms that BLAS may add in another order: 1e-12 relative is
    about 4500 ulps, far below any real disagreement and far above reordering error."""
    exact = [K.COUNT, K.MIN, K.MAX, K.ZEROS, K.NONFINITE, K.NUMEL]
    assert torch.equal(a[..., exact], b[..., exact])
    sums = [K.MEAN, K.M2, K.ABS_MEAN]
    torch.testing.assert_close(a[..., sums], b[..., sums], rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("dtype", [*FLOATS, torch.int32, torch.bool])
@pytest.mark.parametrize("shape", [(1,), (7,), (1000,), (300, 301)])
def test_finite_fast_path_agrees_with_masked_path(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    x = sample(shape, dtype, seed=sum(shape))
    v = K.flat64(x)
    fast = K.finite_state(v, v.sum().item(), K.Workspace(), x.reshape(-1))
    assert_same_state(fast, K.masked_state(v))
    assert torch.equal(K.batch_state(x), fast)  # the same path: the CPU's for finite data
    assert_stats(K.finalize(fast, 1), reference([x]))


@pytest.mark.parametrize(
    "transform",
    [torch.relu, lambda x: -torch.relu(x), lambda x: x.abs() + 1, lambda x: -x.abs() - 1],
    ids=["non-negative", "non-positive", "positive", "negative"],
)
@pytest.mark.parametrize("dtype", [torch.float32, F64, torch.bfloat16])
def test_data_of_one_sign_takes_shortcuts_with_the_same_numbers(transform, dtype) -> None:
    x = transform(sample((5000,), F64, seed=3)).to(dtype)
    v = K.flat64(x)
    fast = K.finite_state(v, v.sum().item(), K.Workspace(), x.reshape(-1))
    assert_same_state(fast, K.masked_state(v))
    assert_stats(K.finalize(fast, 1), reference([x]))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_data_far_from_zero_sums_squared_deviations(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    x = (1e4 + torch.randn(20000, generator=g, dtype=F64) * 1e-2).to(dtype)
    v = K.flat64(x)
    total = v.sum().item()
    squares, mean = torch.dot(v, v).item(), total / v.numel()
    assert (squares - total * mean) * 2.0**K.CANCEL_BITS < squares  # the fallback is taken
    fast = K.finite_state(v, total, K.Workspace(), x)
    assert_same_state(fast, K.masked_state(v))
    exact = torch.std(v).item()  # two passes over the same float64 values
    assert K.finalize(fast, 1)["std"].item() == pytest.approx(exact, rel=1e-12)


def test_one_pass_sum_of_squares_stays_within_its_bound() -> None:
    g = torch.Generator().manual_seed(6)
    for offset in (0.0, 3.0, 40.0):  # mean / std up to 40: 2**10.6 of cancellation at most
        v = (torch.randn(K.CHUNK, generator=g, dtype=F64) + offset).float().double()
        state = K.batch_state(v)
        exact = torch.std(v).item()
        got = K.finalize(state, 1)["std"].item()
        assert got == pytest.approx(exact, rel=2.0 ** (K.CANCEL_BITS - 53) * 2**10)


@pytest.mark.parametrize("laned", [False, True])
@pytest.mark.parametrize("size", [31, K.MAX_LANED + 1])
def test_tally_in_lanes_counts_like_bincount(laned: bool, size: int) -> None:
    g = torch.Generator().manual_seed(size)
    index = torch.randint(0, size, (10007,), generator=g, dtype=torch.int32)
    index[::2] = 0  # half the values in one bucket, as after a ReLU
    expected = torch.bincount(index, minlength=size)
    assert torch.equal(K.tally(index.clone(), size, K.Workspace(), laned), expected)


def test_histograms_of_relu_outputs_equal_torch_histogram() -> None:
    work = K.Workspace()
    for n in (1, 9, 4099, K.CHUNK + 5):
        relu = torch.relu(sample((n,), torch.float32, seed=n))
        on_edges = edge_data(torch.float32, 0.0, 7.0, 30, seed=n)  # values on bucket edges
        x = torch.cat([relu.clamp(max=7.0), on_edges, torch.zeros(n + on_edges.numel())])
        state = K.batch_state(x, work)
        assert state[K.ZEROS].item() >= K.LANED_ZEROS * x.numel()  # takes the laned tally
        row = K.histogram_rows([[x]], state[None], 30, sync=False, group=None, work=work)[0]
        edges = torch.tensor(row.edges, dtype=F64)
        assert row.counts == torch.histogram(x.double(), edges).hist.tolist()


def test_large_tensors_are_chunked_and_merged() -> None:
    n = 2 * K.CHUNK + 12345
    x = sample((n,), torch.float32, seed=4)
    x[K.CHUNK + 17] = math.nan  # only the second chunk takes the masked path
    x[-1] = -math.inf
    parts = [K.masked_state(K.flat64(c)) for c in torch.split(x, K.CHUNK)]
    state = K.batch_state(x)
    assert_same_state(state, K.merge(torch.stack(parts)))
    assert_stats(K.finalize(state, 1), reference([x]))
    assert_stats(K.finalize(K.batch_state(x.double()), 0), reference([x], correction=0))


def test_float64_sum_overflow_takes_the_masked_path() -> None:
    x = torch.tensor([1e308, 1e308, -1e308, 5.0], dtype=F64)  # finite, but the sum is not
    assert not math.isfinite(x.sum().item())
    state = K.batch_state(x)
    assert torch.equal(state, K.masked_state(x))
    assert state[K.NONFINITE].item() == 0 and state[K.MAX].item() == 1e308


def test_workspace_reuses_buffers_and_stays_right() -> None:
    work = K.Workspace()
    small = work.get("v", 10, F64)
    assert work.get("v", 10, F64) is small and small.is_contiguous()
    assert work.get("v", 5000, F64).data_ptr() != small.data_ptr()  # grown: a new buffer
    assert work.get("v", 10, F64).data_ptr() == work.get("v", 5000, F64).data_ptr()
    for i, n in enumerate([10, 3000, 10, 70000, 5, 70000, 0]):
        x = sample((n,), FLOATS[i % 4], seed=i)
        assert torch.equal(K.batch_state(x, work), K.batch_state(x))
        counts, edges = histogram(x, 16)
        state = K.batch_state(x, work)[None]
        rows = K.histogram_rows([[x]], state, 16, sync=False, group=None, work=work)
        assert rows[0].counts == counts.tolist() and rows[0].edges == edges.tolist()
    for i in range(300):  # sizes that change at every call do not pile up cached views
        work.get("v", i, F64)
    assert len(work._views) <= 256


def test_finalize_host_equals_finalize() -> None:
    states = [
        K.empty_state(),
        K.batch_state(torch.tensor([2.0])),
        K.batch_state(sample((9,), F64, 1)),
    ]
    states.append(K.batch_state(torch.tensor([math.nan, 1.0, 3.0])))
    for state in states:
        for correction in (0, 1, 2):
            host = K.finalize_host(state.tolist(), correction)
            tensors = K.finalize(state, correction)
            assert list(host) == list(STAT_NAMES)
            for name in STAT_NAMES:
                # Two code paths (Python floats on the host, torch kernels): the same arithmetic,
                # but math.sqrt is correctly rounded while torch's vectorised sqrt may be one ulp
                # off on some CPUs (seen on AVX-512 Xeons); 1e-15 relative is under 5 ulps.
                expected = tensors[name].item()
                assert host[name] == pytest.approx(expected, nan_ok=True, rel=1e-15, abs=0)


# --- CPU kernels: arithmetic bucketing ----------------------------------------------------------


def edge_data(dtype: torch.dtype, lo: float, hi: float, bins: int, seed: int) -> torch.Tensor:
    """``lo``, ``hi``, every edge rounded to ``dtype`` and its neighbours, and random values."""
    edges = torch.tensor(K.linspace_host(lo, hi, bins + 1), dtype=F64)
    near = edges.to(dtype) if dtype.is_floating_point else edges.round().to(dtype)
    if dtype.is_floating_point:
        up = torch.nextafter(near, torch.full_like(near, math.inf))
        down = torch.nextafter(near, torch.full_like(near, -math.inf))
        near = torch.cat([near, up, down])
    g = torch.Generator().manual_seed(seed)
    inside = (lo + (hi - lo) * torch.rand(500, generator=g, dtype=F64)).to(dtype)
    values = torch.cat([near, inside]).to(F64).clamp(lo, hi)
    return torch.cat([torch.tensor([lo, hi], dtype=F64), values]).to(dtype)


# (dtype, lo, hi, bins, the path of bucket_cpu); lo and hi are exact in the dtype.
BUCKET_CASES = [
    (torch.float32, -3.75, 11.25, 64, "float32"),
    (torch.float32, 0.0, 1.0, 1, "float32"),
    (torch.float32, -1.0, 1.0, 2, "float32"),  # an edge at zero, -0.0 and 0.0 in the data
    (torch.float32, -9.0, -2.0, 5, "float32"),
    (torch.float32, -(2.0**-99), 2.0**-99, 8, "float32"),
    (torch.float32, -(2.0**101), 3 * 2.0**98, 64, "float32"),
    (torch.float32, 10000.0, 10000.5, 64, "float64"),  # narrow for float32 arithmetic
    (torch.float32, 10000.0, 10000.0009765625, 3, "float64"),
    (torch.float16, -2.0, 3.0, 16, "float32"),
    (torch.bfloat16, -100.0, 100.0, 7, "float32"),
    (torch.float64, -5.5, 123.25, 1000, "float64"),
    (torch.float64, -1e300, 1e300, 10, "float64"),
    (torch.float64, 1e9, 1e9 + 2.0**-10, 64, "search"),  # narrow for float64 arithmetic
    (torch.float64, 0.0, 5e-300, 8, "search"),  # tiny: its width would be subnormal
    (torch.float64, 0.0, 2.225073858507e-311, 1, "search"),
    (torch.int64, -40.0, 1000.0, 13, "float64"),
]


@pytest.mark.parametrize(("dtype", "lo", "hi", "bins", "path"), BUCKET_CASES)
def test_arithmetic_bucketing_equals_torch_histogram_at_the_edges(
    dtype: torch.dtype, lo: float, hi: float, bins: int, path: str
) -> None:
    x = edge_data(dtype, lo, hi, bins, seed=bins)
    values = x.to(F64)
    assert (values.min().item(), values.max().item()) == (lo, hi)
    assert K.bucket_path(x.dtype, lo, hi, bins) == path
    counts, edges = histogram(x, bins)
    assert edges[0].item() == lo and edges[-1].item() == hi
    assert torch.equal(
        edges, K.linspace(torch.tensor(lo, dtype=F64), torch.tensor(hi, dtype=F64), bins + 1)
    )
    assert torch.equal(counts, torch.histogram(values, edges).hist)
    if dtype == torch.float32 and path == "float32":  # -0.0 and 0.0 bucket alike
        signed = torch.cat([x, torch.tensor([-0.0, 0.0])]) if lo <= 0 <= hi else x
        assert torch.equal(histogram(signed, bins)[0], torch.histogram(signed.double(), edges).hist)


def test_arithmetic_bucketing_on_random_ranges() -> None:
    g = torch.Generator().manual_seed(11)
    for trial in range(150):
        dtype = (torch.float32, torch.float64, torch.float16)[trial % 3]
        scale = 10.0 ** float(torch.randint(-6, 7, (1,), generator=g))
        offset = (
            scale
            * float(torch.randn((), generator=g))
            * 10.0 ** float(torch.randint(0, 4, (1,), generator=g))
        )
        ends = (offset + scale * torch.randn(2, generator=g, dtype=F64)).to(dtype).to(F64)
        lo, hi = sorted(ends.tolist())
        if lo == hi or not all(map(math.isfinite, (lo, hi))):
            continue
        bins = int(torch.randint(1, 130, (1,), generator=g))
        x = edge_data(dtype, lo, hi, bins, seed=trial)
        counts, edges = histogram(x, bins)
        assert torch.equal(counts, torch.histogram(x.to(F64), edges).hist), (dtype, lo, hi, bins)


def test_ceil32_is_the_smallest_float32_above() -> None:
    g = torch.Generator().manual_seed(12)
    edges = torch.cat(
        [
            torch.randn(1000, generator=g, dtype=F64)
            * 10.0 ** torch.randint(-30, 30, (1000,), generator=g),
            torch.tensor([0.0, -0.0, 1.5, -(2.0**-140)]),
        ]
    )
    up = K.ceil32(edges)
    assert up.dtype == torch.float32
    assert bool((up.to(F64) >= edges).all())
    below = torch.nextafter(up, torch.full_like(up, -math.inf)).to(F64)
    assert bool((below < edges).all())


def test_host_and_device_histograms_give_the_same_rows() -> None:
    g = torch.Generator().manual_seed(13)
    sets = [
        [torch.randn(500, generator=g)],
        [with_specials(torch.randn(300, generator=g, dtype=F64) * 4, 3)],
        [torch.randn(40, generator=g), torch.randn(7, 3, generator=g).half() * 9],
        [torch.empty(0)],
        [torch.full((5,), 2.5)],
        [torch.tensor([math.nan, math.inf])],
        [torch.arange(-20, 21)],
    ]
    states = torch.stack([K.merge(torch.stack([K.batch_state(t) for t in s])) for s in sets])
    for bins in (1, 5, 64):
        host = K.histogram_rows_cpu(sets, states, bins, sync=False, group=None, work=K.Workspace())
        device = K.raw_rows(*K.histograms_device(sets, states, bins, sync=False, group=None))
        assert host == device
        for s, row in zip(sets, host, strict=True):
            values = _flat(s)
            finite = values[torch.isfinite(values)]
            assert row.num == finite.numel() and sum(row.counts) == finite.numel()


# ---------------------------------------------------------------- native precision (the monitor)
def _native_cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    gauss = torch.randn(64, 32, 8, 8, generator=g)
    return {
        "gaussian": gauss * 0.7 + 0.1,
        "relu": torch.relu(gauss),
        "negative": -torch.rand(5000, generator=g) - 0.5,
        "far from zero": torch.randn(3000, generator=g) * 1e-3 + 7.0,  # the two-pass M2
        "float16": (gauss[:4] * 3).half(),
        "bfloat16": gauss[:4].bfloat16(),
        "several chunks": torch.randn(K.CHUNK * 2 + 123, generator=g) + 0.5,
        "zeros": torch.zeros(100),
        "one value": torch.tensor([2.5]),
    }


@pytest.mark.parametrize("name", list(_native_cases()))
def test_native_state_is_within_float32_precision_of_the_exact_state(name: str) -> None:
    x = _native_cases()[name]
    work = K.Workspace()
    got, exact = K.native_state(x, work), K.batch_state(x, work)
    for i in (K.COUNT, K.MIN, K.MAX, K.ZEROS, K.NONFINITE, K.NUMEL):  # exact
        assert got[i].item() == exact[i].item(), i
    scale = exact[K.ABS_MEAN].item()  # the mean's error is relative to the magnitudes summed
    assert got[K.MEAN].item() == pytest.approx(exact[K.MEAN].item(), rel=1e-6, abs=1e-6 * scale)
    assert got[K.ABS_MEAN].item() == pytest.approx(scale, rel=1e-6)
    std, exact_std = (K.finalize(s, 0)["std"].item() for s in (got, exact))
    assert std == pytest.approx(exact_std, rel=2e-6, abs=1e-12)


def test_native_state_takes_the_exact_path_for_what_float32_cannot_sum() -> None:
    work = K.Workspace()
    cases = [
        torch.tensor([1.0, math.nan, -2.0, math.inf, 0.0]),  # counted, not summed
        torch.full((8,), 3e38),  # finite values whose float32 sum overflows
        torch.randn(100, dtype=F64),  # float64 data: float64 arithmetic
        torch.arange(10),  # integers
    ]
    for x in cases:
        assert torch.equal(K.native_state(x, work), K.batch_state(x, work)), x


def _edge_band(x: torch.Tensor, edges: torch.Tensor, tolerance: float) -> int:
    """How many values lie within ``tolerance`` of an inner edge."""
    inner = edges[1:-1].to(F64)
    distance = (x.reshape(-1, 1).to(F64) - inner).abs()
    return int((distance <= tolerance).any(1).sum())


@pytest.mark.parametrize("name", list(_native_cases()))
def test_native_bucketing_differs_from_the_exact_rule_only_at_the_edges(name: str) -> None:
    x = _native_cases()[name]
    work = K.Workspace()
    state = K.batch_state(x, work)[None]
    exact = K.histogram_rows([[x]], state, 30, sync=False, group=None, work=work)[0]
    native = K.histogram_rows([[x]], state, 30, sync=False, group=None, work=work, exact=False)[0]
    assert native[:6] == exact[:6]  # sums, range and edges
    counts, exact_counts = native.counts, exact.counts
    assert sum(counts) == sum(exact_counts) == state[0, K.COUNT].item()
    reach = max(abs(exact.min), abs(exact.max))
    band = _edge_band(x, torch.tensor(exact.edges), 4 * 2.0**-24 * reach)
    moved = sum(abs(a - b) for a, b in zip(counts, exact_counts, strict=True)) / 2
    assert moved <= band, (moved, band)


def test_native_bucketing_of_values_on_the_edges() -> None:
    # Every value sits on an edge: each may move one bucket at most, and none is lost.
    x = torch.linspace(-3.0, 3.0, 31).repeat(100)
    work = K.Workspace()
    state = K.batch_state(x, work)[None]
    row = K.histogram_rows([[x]], state, 30, sync=False, group=None, work=work, exact=False)[0]
    counts = row.counts
    exact = torch.histogram(x.double(), 30).hist.tolist()
    assert sum(counts) == sum(exact) == 3100
    assert all(abs(a - b) <= 100 for a, b in zip(counts, exact, strict=True))


def test_native_bucketing_of_a_narrow_range_takes_float64_positions() -> None:
    # Values of magnitude 1000 spread over 4e-3: float32 positions would be off by buckets.
    assert K.bucket_path(torch.float32, 1000.0, 1000.0 + 63 * 2.0**-14, 30) == "float64"
    x = 1000.0 + torch.arange(0, 64, dtype=torch.float32) * 2.0**-14
    work = K.Workspace()
    state = K.batch_state(x, work)[None]
    row = K.histogram_rows([[x]], state, 30, sync=False, group=None, work=work, exact=False)[0]
    counts = row.counts
    assert counts == torch.histogram(x.double(), 30).hist.tolist()


def test_parameter_norms_follow_tensor_norm() -> None:
    from lightning_recorder.stats import tensor_norm
    from lightning_recorder.stats.batched import foreach_norms

    tensors = [
        torch.full((300,), 60000.0, dtype=torch.float16),  # its float16 norm overflows
        torch.randn(5, dtype=torch.float64),
        torch.randn(3, 4),
        torch.ones(2, dtype=torch.bfloat16),
    ]
    norms = foreach_norms(tensors)
    for tensor, norm in zip(tensors, norms, strict=True):
        expected = tensor_norm(tensor)
        assert norm.dtype == expected.dtype
        torch.testing.assert_close(norm, expected)
    assert foreach_norms([]) == []


# --- the monitor's step kernels: one-read squares, samples, segments -------------------------


def test_square_sum_is_float32_one_read_within_1e7() -> None:
    g = torch.Generator().manual_seed(0)
    for n in (1, 4095, 4096, 2**18 + 3):
        x = torch.randn(n, generator=g) + 0.5
        exact = torch.dot(x.double(), x.double())
        # rows of 4096 products summed in float32, then the rows pairwise: a relative error of
        # a few 1e-8 in practice; 1e-6 is the documented precision of the monitor's statistics
        torch.testing.assert_close(K.square_sum(x).double(), exact, rtol=1e-6, atol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # not lowered to bfloat16
        x = torch.randn(2**14, generator=g)
        torch.testing.assert_close(
            K.square_sum(x).double(), torch.dot(x.double(), x.double()), rtol=1e-6, atol=0
        )


def test_sample_of_is_small_strided_and_weighted() -> None:
    x = torch.arange(10.0).reshape(2, 5)
    kept, weight = K.sample_of(x, 16)  # small: a copy of everything
    assert torch.equal(kept, x.reshape(-1)) and weight == 1.0
    assert kept.data_ptr() != x.data_ptr()
    big = torch.arange(100_000.0)
    kept, weight = K.sample_of(big, 1000)
    stride = 101  # the smallest prime >= 100
    assert torch.equal(kept, big[::stride]) and weight == pytest.approx(100_000 / kept.numel())
    assert kept.numel() <= 1000


def test_segmented_states_equal_batch_states() -> None:
    g = torch.Generator().manual_seed(1)
    groups = [
        [torch.randn(7, generator=g), torch.randn(3, 2, generator=g) * 100 + 1e4],
        [],
        [torch.tensor([0.0, math.nan, 2.0, -math.inf, 0.0])],
        [torch.relu(torch.randn(50, generator=g)).half()],
    ]
    values, seg = K_seg.flatten_segments(groups, "cpu")
    got = K_seg.segmented_states(values, seg, len(groups))
    for row, tensors in zip(got, groups, strict=True):
        flat = torch.cat([t.reshape(-1).double() for t in tensors]) if tensors else None
        expected = K.empty_state() if flat is None else K.batch_state(flat)
        # both float64 with the same formulas, summed in a different order: a few ulps
        torch.testing.assert_close(row, expected, rtol=1e-12, atol=1e-9)


def test_segmented_histograms_count_every_finite_value() -> None:
    g = torch.Generator().manual_seed(2)
    groups = [[torch.randn(1000, generator=g)], [torch.tensor([1.0, 1.0, math.nan])], []]
    values, seg = K_seg.flatten_segments(groups, "cpu")
    states = K_seg.segmented_states(values, seg, 3)
    counts, edges, vmin, vmax, sums = K_seg.segmented_histograms(
        values, seg, states, 8, sync=False, group=None
    )
    x = groups[0][0].double()
    assert counts.sum(1).tolist() == [1000.0, 2.0, 0.0]
    assert (vmin[0].item(), vmax[0].item()) == (x.min().item(), x.max().item())
    # float64 bucket arithmetic: only a value within rounding of an edge could move, and
    # Gaussian data has none at this distance; torch.histogram is the reference rule
    assert counts[0].tolist() == torch.histogram(x, edges[0]).hist.tolist()
    assert counts[1].tolist() == [0.0] * 4 + [2.0] + [0.0] * 3  # one value: [v - .5, v + .5]
    torch.testing.assert_close(sums[0, 1], x.sum(), rtol=1e-12, atol=1e-9)


def test_weighted_histogram_rows_scale_to_the_finite_count() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2**16, generator=g)
    state = K.batch_state(x)[None]
    kept, weight = K.sample_of(x, 2**10)
    (row,) = K.histogram_rows_cpu(
        [[kept]], state, 16, sync=False, group=None, work=K.Workspace(), weights=[[weight]]
    )
    assert sum(row.counts) == pytest.approx(2**16, rel=1e-12)
    exact = torch.histogram(x.double(), torch.tensor(row.edges, dtype=torch.float64)).hist
    # 1,008 sampled values: a fraction's standard error is at most 0.5 / sqrt(1008) = 0.016;
    # 0.06 is 3.8 of them
    torch.testing.assert_close(
        torch.tensor(row.counts, dtype=torch.float64) / 2**16, exact / 2**16, rtol=0, atol=0.06
    )
