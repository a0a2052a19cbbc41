"""Checks of the statistics engine and of ``FeatureStatsMonitor`` on one device, written once.

``tests/gpu`` runs them on CUDA, with the engine compiled (Triton) and eager;
``tests/callbacks/test_device_checks.py`` runs the very same functions on the CPU in the ordinary
suite (compiled by inductor, and eager), so that every code path of the GPU checks is known to
work before a GPU runs them. What only a GPU can tell (Triton's kernels, cuBLAS, the CUDA caching
allocator, host synchronisations) is left to ``tests/gpu``.

Tolerances are those documented in :mod:`lightning_recorder.stats`: against the CPU's eager
result and against a ``float64`` reference computed by torch, counts, min and max exactly, mean,
std and abs_mean within ``1e-9`` relative (plus ``1e-12`` of the data's scale, for a mean near
zero); histogram edges and counts of :func:`~lightning_recorder.histogram` exactly.
"""

from __future__ import annotations

import contextlib
import math
import os
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader

from helpers.models import assert_counts_up_to_edges
from lightning_recorder import FeatureStats, FeatureStatsMonitor, feature_stats, histogram
from lightning_recorder.stats import _engine as engine
from lightning_recorder.stats._collect import SMALL, Collector
from lightning_recorder.stats._histogram import edges, ranges
from lightning_recorder.stats._state import F64, finalize

# Every dtype the engine compiles for; the compiled fixtures warm all of them up.
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
EXACT = ("min", "max", "zero_fraction", "nonfinite", "numel")
CLOSE = ("mean", "std", "abs_mean")
RTOL = 1e-9


# ---------------------------------------------------------------------------- engine modes
ENV = "LIGHTNING_RECORDER_COMPILE"


def warm_compiled(device: str | torch.device, dtypes: tuple[torch.dtype, ...] = DTYPES) -> None:
    """Compile the engine's graphs for ``dtypes`` on ``device`` and wait for them (at once when
    they are ready); fail the test, saying why, if the compiler failed."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, "1")
        engine.warm_up(device, dtypes, wait=True, native=False)
        status = engine.compile_status()
    if status.startswith("failed"):
        pytest.fail(f"torch.compile failed for the statistics on {device}: {status}")
    kind = torch.device(device).type
    missing = [d for d in dtypes if f"state {kind} {str(d).removeprefix('torch.')}" not in status]
    assert not missing, f"no compiled graph for {missing}: {status}"


@contextlib.contextmanager
def engine_mode(mode: str, device: str | torch.device) -> Iterator[None]:
    """``"compiled"``: compiling on and every graph of :data:`DTYPES` on ``device`` ready (the
    first use compiles them, seconds to minutes; later ones find them ready), used on this
    thread instead of the CPU kernel. ``"native"`` (CPU): the CPU kernel built and loaded (the
    default path of float32 and float64 on the CPU). ``"eager"``: the engine eager on this
    thread, and no compile started by a monitor's attach."""
    with pytest.MonkeyPatch.context() as mp:
        if mode == "compiled":
            mp.setenv(ENV, "1")
            warm_compiled(device)
            with engine.compiled_only():
                yield
        elif mode == "native":
            engine.warm_up(device, DTYPES, wait=True)
            status = engine.compile_status()
            assert "CPU kernel loaded" in status, f"the CPU kernel was not built: {status}"
            yield
        elif mode == "eager":
            mp.setenv(ENV, "0")
            with engine.eager_only():
                yield
        else:
            raise ValueError(mode)


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)``, and the global flags that a
    ``Trainer(deterministic=True)`` sets restored afterwards (Lightning leaves them set)."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark = torch.backends.cudnn.benchmark
    cublas = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)
        torch.backends.cudnn.benchmark = benchmark
        if cublas is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


# ---------------------------------------------------------------------------- data
KINDS = ("gaussian", "far", "relu", "negative", "specials", "allnan", "constant")


def sample(kind: str, dtype: torch.dtype, n: int, seed: int = 0) -> Tensor:
    """``n`` values of a kind, on the CPU, exact in ``dtype`` (the half types get data they can
    hold: no value far from zero relative to its spread beyond their range)."""
    g = torch.Generator().manual_seed(seed * 7919 + KINDS.index(kind))
    base = torch.randn(n, generator=g, dtype=F64)
    half = dtype in (torch.float16, torch.bfloat16)
    if kind == "gaussian":
        x = base * 3 + 1.5
    elif kind == "far":  # mean far from zero relative to the spread: cancellation
        x = base * 3 + 50 if half else base + 1e6
    elif kind == "relu":
        x = base.clamp(min=0)
    elif kind == "negative":
        x = -base.abs() - 1
    elif kind == "specials":
        x = base.clone()
        x[::97], x[1::211], x[2::307], x[3::401] = 0.0, math.nan, math.inf, -math.inf
    elif kind == "allnan":
        x = torch.full((n,), math.nan, dtype=F64)
    elif kind == "constant":
        x = torch.full((n,), 2.5, dtype=F64)
    else:
        raise ValueError(kind)
    return x.to(dtype)


def cases() -> list[tuple[str, int]]:
    """``(kind, numel)``: every kind at one size, two of them over several chunks, and one kind
    across the sizes that pick different paths (one element, short rows run eagerly, small
    outputs grouped, eager chunks)."""
    sizes = (1, 5, 127, 128, SMALL + 1, engine.CHUNK + 17)
    return (
        [(k, 5000) for k in KINDS]
        + [(k, 3 * engine.CHUNK + 5) for k in ("far", "specials")]
        + [("specials", n) for n in sizes]
    )


def reference(x: Tensor) -> dict[str, float]:
    """The statistics as torch defines them, in ``float64`` on the CPU."""
    v = x.detach().reshape(-1).to("cpu", F64)
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


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def assert_stats_agree(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    """Statistics (tensors or floats) within the documented tolerance of ``want``."""
    g = {k: float(v) for k, v in got.items()}
    w = {k: float(v) for k, v in want.items()}
    scale = abs(w["abs_mean"]) if math.isfinite(w["abs_mean"]) else 0.0
    for name in EXACT:
        assert _same(g[name], w[name]), f"{what}: {name} {g[name]!r} != {w[name]!r}"
    for name in CLOSE:
        if math.isnan(w[name]):
            assert math.isnan(g[name]), f"{what}: {name} {g[name]!r}, expected NaN"
        else:
            assert g[name] == pytest.approx(w[name], rel=RTOL, abs=1e-12 * scale), (
                f"{what}: {name} {g[name]!r} != {w[name]!r}"
            )


LAYOUTS: dict[str, Callable[[Tensor], Tensor]] = {
    "channels-last": lambda t: t.to(memory_format=torch.channels_last),
    "transposed": lambda t: t.transpose(1, 3),
    "offset": lambda t: t[1:],
    "strided": lambda t: t[:, :, ::2],
}


def on_cpu_eagerly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn`` of CPU copies of the tensor arguments, with the eager engine: the CPU's result."""
    moved = [a.cpu() if isinstance(a, Tensor) else a for a in args]
    with engine.eager_only():
        return fn(*moved, **kwargs)


# ---------------------------------------------------------------------------- statistics
def check_stats_match_cpu(device: torch.device, dtype: torch.dtype) -> None:
    """``feature_stats``, the ``FeatureStats`` metric and a ``Collector`` on ``device`` against
    the CPU's eager results and a ``float64`` reference."""
    for kind, n in cases():
        x = sample(kind, dtype, n)
        got = feature_stats(x.to(device))
        assert all(v.device.type == device.type for v in got.values())
        what = f"{kind} {dtype} n={n} on {device.type}"
        assert_stats_agree(got, on_cpu_eagerly(feature_stats, x), what + " vs the CPU")
        assert_stats_agree(got, reference(x), what + " vs float64")
    # memory layouts that are one block (channels-last, transposed, an offset) and one that is not
    base = sample("specials", dtype, 8 * 6 * 40 * 41).view(8, 6, 40, 41)
    on_device = base.to(device)
    for name, view in LAYOUTS.items():
        got = feature_stats(view(on_device))
        what = f"{name} {dtype} on {device.type}"
        assert_stats_agree(got, on_cpu_eagerly(feature_stats, view(base)), what + " vs the CPU")
        assert_stats_agree(got, reference(view(base)), what + " vs float64")
    # streaming: the metric over several updates
    parts = [sample(k, dtype, 3000 + 17 * i, seed=i) for i, k in enumerate(KINDS[:5])]
    metric = FeatureStats().to(device)
    for part in parts:
        metric.update(part.to(device))
    assert_stats_agree(metric.compute(), reference(torch.cat(parts)), f"metric {dtype}")
    # the monitor's collector: grouped small tensors, large ones, several calls of a stream;
    # on a GPU large tensors are read as rows, held unmerged and merged several at once (more
    # tensors here than are held before a merge, of a whole number of rows and not)
    streams = [
        [sample("gaussian", dtype, 7 * 9, seed=1), sample("relu", dtype, 7 * 9, seed=2)],
        [sample("specials", dtype, SMALL + 3)],
        [sample("negative", dtype, 300), sample("far", dtype, 5000)],
        [sample("allnan", dtype, 40)],
        [sample(("far", "specials")[i % 2], dtype, 2**17 + 5 * i, seed=i) for i in range(10)],
    ]
    collector = Collector(len(streams), 2**10, device)
    for i, tensors in enumerate(streams):
        for t in tensors:
            collector.add(i, t.to(device))
    states = collector.states()
    assert states.device.type == device.type
    for i, tensors in enumerate(streams):
        stats = {k: v[i] for k, v in finalize(states, 1).items()}
        assert_stats_agree(stats, reference(torch.cat(tensors)), f"collector stream {i} {dtype}")


# ---------------------------------------------------------------------------- histograms
def assert_edges_close(got: Tensor, want: Tensor, what: str) -> None:
    """Histogram edges ``(..., bins + 1)`` of two devices from the same exact min and max: the
    ends equal (they are the min and the max), the inner edges within four units of rounding
    of the range's magnitude (a device may round the float64 arithmetic differently: CUDA
    divides by a scalar through its reciprocal)."""
    assert torch.equal(got[..., [0, -1]], want[..., [0, -1]]), what
    magnitude = want.abs().amax(-1, keepdim=True)
    close = (got - want).abs() <= 4 * torch.finfo(F64).eps * magnitude
    assert bool((close | (got == want)).all()), (what, got, want)


def check_histograms_match_cpu(device: torch.device, dtype: torch.dtype) -> None:
    """``histogram`` on ``device``: the same edges and counts as the CPU's, those of
    :func:`torch.histogram` over the same edges; a collector's wholly sampled histograms too."""
    for kind, n in cases():
        x = sample(kind, dtype, n)
        for bins in (1, 7, 30) if n == 5000 else (30,) if n > engine.CHUNK else (1, 30):
            counts, limits = histogram(x.to(device), bins=bins)
            assert counts.device.type == device.type
            want_counts, want_limits = on_cpu_eagerly(histogram, x, bins=bins)
            what = f"{kind} {dtype} n={n} bins={bins} on {device.type}"
            # the same float64 formula from the same exact min and max
            assert_edges_close(limits.cpu(), want_limits, what)
            # buckets in the data's precision: torch.histogram's counts but for values within
            # rounding of an edge (another device may round such a value the other way)
            assert_counts_up_to_edges(counts.cpu(), x, want_limits, x.dtype)
            assert_counts_up_to_edges(want_counts, x, want_limits, x.dtype)
    # the collector: tensors of at most the sample's size are histogrammed whole (exact)
    tensors = [sample(k, dtype, 200 + 31 * i, seed=i) for i, k in enumerate(KINDS)]
    counted, tables = [], []
    for where in (device, torch.device("cpu")):
        collector = Collector(len(tensors), 2**10, where)
        for i, t in enumerate(tensors):
            collector.add(i, t.to(where))
        states = collector.states()
        lo, hi = ranges(states)
        limits = edges(lo, hi, 30)
        counted.append((collector.counts(lo, hi, 30, states).cpu(), limits.cpu()))
        tables.append(collector.table(states, states, 30).cpu())  # what the monitor writes
    (got, got_limits), (want, want_limits) = counted
    what = f"collector {dtype} on {device.type}"
    assert_edges_close(got_limits, want_limits, what)
    for i, t in enumerate(tensors):
        # integer counts scaled by the count of finite values over their sum (1)
        assert_counts_up_to_edges(got[i], t, want_limits[i], t.dtype)
        assert_counts_up_to_edges(want[i], t, want_limits[i], t.dtype)
    # the step's table: [num, sum, sum_squares, min, max, *edges, *counts] of every stream
    table, cpu_table = tables
    assert table.shape == (len(tensors), 2 * 30 + 6), what
    torch.testing.assert_close(table[:, :5], cpu_table[:, :5], rtol=1e-6, atol=0, equal_nan=True)
    assert_edges_close(table[:, 5:36], want_limits, what)
    for i, t in enumerate(tensors):
        assert_counts_up_to_edges(table[i, 36:], t, want_limits[i], t.dtype)


# ---------------------------------------------------------------------------- recompiles
WORKLOAD_SIZES = (1, 2, 3, 63, 64, 65, 127, 128, 129, 1000, 4095, 4097, 65536, 65537)
WORKLOAD_SIZES += (2**18 - 1, 2**18 + 1, 10**6 + 3)


def engine_workload(
    device: torch.device, dtypes: tuple[torch.dtype, ...], sizes: tuple[int, ...] = WORKLOAD_SIZES
) -> None:
    """What a training run asks of the engine, across many sizes, layouts and modes."""
    for dtype in dtypes:
        for n in sizes:
            x = sample("specials" if n > 5 else "gaussian", dtype, n).to(device)
            feature_stats(x)
            histogram(x, bins=30)
            histogram(x, bins=7)
            collector = Collector(4, 2**10, device)
            collector.add(0, x)
            collector.add(1, x[: n // 2 + 1])
            collector.add(2, x.view(1, -1))
            collector.add(2, x[::2])
            collector.add(3, x[1:])  # an offset into the storage
            states = collector.states()
            collector.counts(*ranges(states), 30, states)
            collector.table(states, states, 30)
            collector.table(states, states, 7)
            with torch.inference_mode():
                y = x.clone()
                feature_stats(y)
                inference = Collector(2, 2**10, device)
                inference.add(0, y)
                inference.add(1, y)
                s = inference.states()
                inference.counts(*ranges(s), 30, s)
                inference.table(s, s, 30)
        # layouts of real outputs, under autocast and with autograd on (global state)
        conv = sample("relu", dtype, 16 * 32 * 12 * 12).view(16, 32, 12, 12).to(device)
        with torch.enable_grad(), torch.autocast(device.type, enabled=device.type == "cuda"):
            feature_stats(conv.to(memory_format=torch.channels_last))
            feature_stats(conv.transpose(1, 3))
            feature_stats(conv[:, ::2])


class EagerCalls:
    """Records the eager runs of the engine's state kernel on rows whose compiled graph is ready
    (and long enough to run compiled): there should be none."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[tuple[int, ...], torch.dtype, bool]] = []
        fn = engine._KERNELS["state"]

        def spy(x: Tensor, finite: bool = False) -> Tensor:
            key = engine._key("state", x, x.shape[0] > 1, not finite)
            if x.shape[1] >= engine.MIN_COMPILED_LENGTH and key in engine._COMPILER._ready:
                self.calls.append((tuple(x.shape), x.dtype, not finite))
            return fn(x, finite)

        monkeypatch.setitem(engine._KERNELS, "state", spy)


def check_no_recompiles(
    device: torch.device,
    dtypes: tuple[torch.dtype, ...],
    monkeypatch: pytest.MonkeyPatch,
    sizes: tuple[int, ...] = WORKLOAD_SIZES,
) -> None:
    """With the compiled engine warmed up for ``dtypes``: the workload compiles nothing more
    (``error_on_recompile``; a failed graph would fall back with a warning, made an error), and
    no state whose graph is ready runs eagerly. (States of rows shorter than
    ``MIN_COMPILED_LENGTH``, and on the CPU the masked second pass over rows with a NaN or an
    infinity, have no ready graph: eager by design.)"""
    import torch._dynamo

    spy = EagerCalls(monkeypatch)
    with torch._dynamo.config.patch(error_on_recompile=True), warnings.catch_warnings():
        warnings.simplefilter("error")
        engine_workload(device, dtypes, sizes)
    assert not engine.compile_status().startswith("failed"), engine.compile_status()
    assert not spy.calls, f"states run eagerly although compiled: {spy.calls[:5]}"


# ---------------------------------------------------------------------------- training runs
class ConvNet(pl.LightningModule):
    """A tiny CNN; its loss is a mean squared error (the CUDA NLL loss has no deterministic
    implementation), and its step synchronises nothing."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
        )
        self.head = nn.Linear(2 * width, 4)
        self.spare = nn.Linear(4, 4)  # never called: a monitored module with nothing recorded

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x).mean((2, 3)))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return (self(x) - y).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def batches(n: int, shape: tuple[int, ...], device: torch.device, seed: int = 0) -> list[Any]:
    """``n`` batches already on ``device`` (the loader then copies nothing from the host)."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(shape, generator=g).to(device),
            torch.randn(shape[0], 4, generator=g).to(device),
        )
        for _ in range(n)
    ]


def loader(items: list[Any]) -> DataLoader:
    return DataLoader(items, batch_size=None)  # each item is a whole batch


def trainer(
    logdir: Path, accelerator: str, steps: int, callbacks: list[pl.Callback], **kwargs: Any
) -> pl.Trainer:
    options: dict[str, Any] = {
        "accelerator": accelerator,
        "devices": 1,
        "max_steps": steps,
        "logger": TensorBoardLogger(str(logdir), name="", version=""),
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)


def accelerator_of(device: torch.device) -> str:
    return "gpu" if device.type == "cuda" else device.type


def read_events(logdir: Path) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """``(scalars, histograms)`` of a run directory: ``{tag: [(step, value), ...]}`` and ``{tag:
    [(step, min, max, num, sum, sum_squares, limits, counts), ...]}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()
    scalars = {t: [(e.step, e.value) for e in events.Scalars(t)] for t in tags["scalars"]}
    hists = {}
    for tag in tags["histograms"]:
        rows = []
        for e in events.Histograms(tag):
            h = e.histogram_value
            rows.append(
                (
                    e.step,
                    h.min,
                    h.max,
                    h.num,
                    h.sum,
                    h.sum_squares,
                    list(h.bucket_limit),
                    list(h.bucket),
                )
            )
        hists[tag] = rows
    return scalars, hists


# ---------------------------------------------------------------------------- determinism
def _deterministic_fit(logdir: Path, device: torch.device) -> tuple[dict, dict]:
    torch.manual_seed(0)
    model = ConvNet()
    monitor = FeatureStatsMonitor(["features.0", "features.2", "head"], every_n_steps=2)
    run = trainer(
        logdir, accelerator_of(device), 4, [monitor], deterministic=True, log_every_n_steps=2
    )
    run.fit(model, loader(batches(4, (16, 3, 12, 12), device)))
    assert monitor.logged_steps == 2
    return read_events(logdir)


def check_deterministic(tmp_path: Path, device: torch.device) -> None:
    """Under ``torch.use_deterministic_algorithms(True)`` (``Trainer(deterministic=True)``) a
    monitor's fit runs (no operation without a deterministic implementation) and gives the
    same histograms and statistics twice, bit for bit (the same computation, repeated); so does
    ``histogram``."""
    with deterministic_algorithms():
        first = _deterministic_fit(tmp_path / "first", device)
        second = _deterministic_fit(tmp_path / "second", device)
        x = sample("specials", torch.float32, 3 * engine.CHUNK + 5).to(device)
        runs = [histogram(x, bins=30) for _ in range(2)]
        y = sample("gaussian", torch.bfloat16, 200_000).to(device)
        runs_bf16 = [histogram(y, bins=64) for _ in range(2)]
    scalars, hists = first
    assert "stats/train/head/histogram" in hists and len(hists["stats/train/head/histogram"]) == 2
    assert "stats/train/features.0/mean" in scalars
    assert first == second
    for a, b in (runs, runs_bf16):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------------------- memory
class Meter:
    """The peak memory of a window: on CUDA the caching allocator's peak of allocated bytes
    (``torch.cuda.max_memory_allocated``, reset at the window's start); on the CPU the peak
    resident set size above the window's start (``VmHWM``, reset through
    ``/proc/self/clear_refs``: memory the allocator kept from earlier steps is not the
    window's)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._start = 0

    @staticmethod
    def available(device: torch.device) -> bool:
        return device.type == "cuda" or os.access("/proc/self/clear_refs", os.W_OK)

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"{key} not in /proc/self/status")

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self._start = self._status("VmRSS:")

    def peak(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated()
        return self._status("VmHWM:") - self._start


class Widen(nn.Module):
    """``(B, 64)`` to ``(B, 64, width)``: one large output, elementwise (cheap on any device)."""

    def __init__(self, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(-1, 1, width, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return x.unsqueeze(-1) * self.scale


class BigOutput(pl.LightningModule):
    """A model whose monitored output ``widen`` has ``rows * 64 * width`` elements of ``dtype``;
    records the peak memory of the forward (the monitor's hook included) of each step."""

    def __init__(self, width: int, dtype: torch.dtype, meter: Meter) -> None:
        super().__init__()
        self.widen = Widen(width, dtype)
        self.meter = meter
        self.forward_peaks: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        out = self.widen(batch[0])
        self.forward_peaks.append(self.meter.peak())
        return out.mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepPeaks(pl.Callback):
    """The peak memory of each training step, from its batch start to its batch end."""

    def __init__(self, meter: Meter) -> None:
        self.meter = meter
        self.peaks: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.meter.reset()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.peaks.append(self.meter.peak())


def check_engine_memory(
    device: torch.device, numel: int = 2**26, dtype: torch.dtype = torch.bfloat16
) -> int:
    """The engine alone on one output of ``numel`` elements (its state, then what a monitor's
    logging step does with it: state, sample, histogram): at most a tenth of the output's size
    of memory above what was there before. Returns the bytes added."""
    x = sample("gaussian", dtype, numel).to(device)
    size = x.numel() * x.element_size()
    collector = Collector(1, 2**14, device)
    collector.add(0, x[:100_000])  # first use: staging buffers, caches, kernels
    collector.clear()
    meter = Meter(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    meter.reset()
    before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    state = feature_stats(x)
    collector.add(0, x.view(-1, 4096))
    states = collector.states()
    counts = collector.counts(*ranges(states), 30, states)
    if device.type == "cuda":
        torch.cuda.synchronize()
    added = meter.peak() - before
    assert float(state["numel"]) == numel and float(counts.sum()) > 0
    assert added <= size / 10, (added, size)
    return added


MEMORY_STEPS, MEMORY_EVERY = 4, 2  # the monitor logs steps 1 and 3


def step_peaks(
    tmp_path: Path, device: torch.device, numel: int, dtype: torch.dtype, monitored: bool
) -> tuple[list[int], list[int]]:
    """Per step: the peak of the whole step and of its forward, with or without a monitor."""
    width = 4096
    rows = numel // (64 * width)
    assert rows * 64 * width == numel
    meter = Meter(device)
    torch.manual_seed(0)
    model = BigOutput(width, dtype, meter)
    peaks = StepPeaks(meter)
    callbacks: list[pl.Callback] = [peaks]
    if monitored:
        callbacks.append(FeatureStatsMonitor("widen", every_n_steps=MEMORY_EVERY))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(rows, 64, generator=g).to(device, dtype),) for _ in range(2)]
    run = trainer(
        tmp_path / ("monitored" if monitored else "plain"),
        accelerator_of(device),
        MEMORY_STEPS,
        callbacks,
        log_every_n_steps=MEMORY_EVERY,
    )
    run.fit(model, loader([data[i % 2] for i in range(MEMORY_STEPS)]))
    assert len(peaks.peaks) == len(model.forward_peaks) == MEMORY_STEPS
    return peaks.peaks, model.forward_peaks


def check_memory(
    tmp_path: Path, device: torch.device, numel: int = 2**26, dtype: torch.dtype = torch.bfloat16
) -> dict[str, Any]:
    """A monitored output of ``numel`` elements: the peak memory of each logging step (and of
    its forward, where the monitor's hook runs) is at most a tenth of the output's size above
    that of the same step of the same model without the monitor. Returns the figures."""
    size = numel * dtype.itemsize
    plain, plain_forward = step_peaks(tmp_path, device, numel, dtype, monitored=False)
    ours, ours_forward = step_peaks(tmp_path, device, numel, dtype, monitored=True)
    logging = [s for s in range(MEMORY_STEPS) if (s + 1) % MEMORY_EVERY == 0]
    figures = {
        "output_bytes": size,
        "step_added": [ours[s] - plain[s] for s in range(MEMORY_STEPS)],
        "forward_added": [ours_forward[s] - plain_forward[s] for s in range(MEMORY_STEPS)],
        "logging_steps": logging,
    }
    for s in logging:
        assert ours[s] - plain[s] <= size / 10, (s, figures)
        assert ours_forward[s] - plain_forward[s] <= size / 10, (s, figures)
    return figures


# ---------------------------------------------------------------------------- synchronisations
class SyncCounter:
    """Counts synchronising CUDA calls between :meth:`begin` and :meth:`end`, with stacks:
    ``torch.cuda.set_sync_debug_mode("warn")`` makes every one warn (on CUDA; elsewhere only
    warnings raised by the test itself are seen, which checks the counting)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.stacks: list[str] | None = None
        self._catcher: Any = None

    def begin(self) -> None:
        self._catcher = warnings.catch_warnings()
        self._catcher.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show
        self.stacks = []
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")

    def _show(self, message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        if self.stacks is not None and "synchroniz" in str(message):
            self.stacks.append("".join(traceback.format_stack()[-12:-2]))

    def end(self) -> list[str]:
        if self.cuda:
            torch.cuda.set_sync_debug_mode(0)
        self._catcher.__exit__(None, None, None)
        stacks, self.stacks = self.stacks or [], None
        return stacks


class WindowStart(pl.Callback):
    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.counter.begin()


class WindowEnd(pl.Callback):
    """Closes the window; records the stacks of each step."""

    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter
        self.steps: list[list[str]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.steps.append(self.counter.end())

    def on_exception(self, *args: Any) -> None:
        if self.counter.stacks is not None:
            self.counter.end()


SYNC_STEPS, SYNC_EVERY = 13, 4  # the monitor logs steps 3, 7 and 11
SYNC_LOGGING = {3, 7, 11}


def sync_run(
    tmp_path: Path, device: torch.device, callbacks: list[pl.Callback], model: pl.LightningModule
) -> list[list[str]]:
    """The synchronisations of each step of a fit (forward, backward, optimizer step and every
    callback hook, from the first callback's batch start to the last one's batch end)."""
    counter = SyncCounter(device.type == "cuda")
    end = WindowEnd(counter)
    run = trainer(
        tmp_path,
        accelerator_of(device),
        SYNC_STEPS,
        [WindowStart(counter), *callbacks, end],
        log_every_n_steps=SYNC_EVERY,
    )
    data = batches(SYNC_STEPS, (16, 3, 12, 12), device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    run.fit(model, loader(data))
    assert len(end.steps) == SYNC_STEPS
    return end.steps


def excess(ours: list[list[str]], bare: list[list[str]], step: int) -> int:
    return len(ours[step]) - len(bare[step])


def report(ours: list[list[str]], step: int) -> str:
    return f"step {step}: {len(ours[step])} syncs\n" + "\n----\n".join(ours[step])


def monitor_for_syncs(channels: bool = False) -> FeatureStatsMonitor:
    """The monitor of the synchronisation checks (``channels``: with per-channel extremes of
    every monitored module, as HealthMonitor's dead-unit rules ask for)."""
    monitor = FeatureStatsMonitor(
        ["features.0", "features.2", "head", "spare"], every_n_steps=SYNC_EVERY, parameters=True
    )
    if channels:
        monitor.track_channels(lambda name, module: True)
    return monitor


def check_monitor_syncs(
    tmp_path: Path,
    device: torch.device,
    bare: list[list[str]],
    extra: list[pl.Callback] = (),  # type: ignore[assignment]
    on_logging: int = 1,
    channels: bool = False,
) -> None:
    """0 synchronisations added to a non-logging step, ``on_logging`` (1: statistics,
    histograms and norms reach the host in one copy) to a logging step. Step 0 is left out:
    what the first step of a process synchronises (lazy initialisation) depends on what ran
    before it. ``extra`` callbacks run inside the window (tests of the counting itself);
    ``channels``: the monitor keeps per-channel extremes too."""
    torch.manual_seed(0)
    monitor = monitor_for_syncs(channels)
    ours = sync_run(tmp_path, device, [monitor, *extra], ConvNet())
    assert monitor.logged_steps == 3 and monitor.last_logged_step == 11
    assert bool(monitor._channel_sizes) == channels  # extremes kept exactly when asked for
    for step in range(1, SYNC_STEPS):
        expected = on_logging if step in SYNC_LOGGING else 0
        assert excess(ours, bare, step) == expected, report(ours, step)
