"""The histogram table of a batch's samples (``Collector.table``, the engine's ``sampled_table``):
the same table compiled and eager, the same as its parts composed one by one, and one compile
for every size a training run asks for."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch

from lightning_recorder.stats import _engine as engine
from lightning_recorder.stats._collect import Collector
from lightning_recorder.stats._histogram import ranges, stream_table
from lightning_recorder.stats._state import COUNT, F64

BINS = 30


def _collector(sizes: list[int], dtype: torch.dtype = torch.float32, seed: int = 0) -> Collector:
    """A collector of ``len(sizes)`` streams, one output each (sampled when larger than 512)."""
    gen = torch.Generator().manual_seed(seed)
    c = Collector(len(sizes), 512, torch.device("cpu"))
    for i, n in enumerate(sizes):
        c.add(i, (torch.randn(n, generator=gen) * (i + 1) + i).to(dtype))
    return c


def _composed(c: Collector, every: torch.Tensor, states: torch.Tensor, bins: int) -> torch.Tensor:
    """The table from its parts one by one: the collector's scaled counts, then the rows."""
    return stream_table(every, c.counts(*ranges(every), bins, states), bins)


def assert_same_table(got: torch.Tensor, want: torch.Tensor, bins: int) -> None:
    """Summaries and edges within 1e-12 relative; counts summing to the same totals, and no
    bucket off by more than two sampled values (a value within rounding of an edge may land in
    the bucket next to it, a kernel compiled or not)."""
    assert got.shape == want.shape and got.dtype == want.dtype == F64
    torch.testing.assert_close(got[:, : bins + 6], want[:, : bins + 6], rtol=1e-12, atol=0)
    counts, wanted = got[:, -bins:], want[:, -bins:]
    torch.testing.assert_close(counts.sum(1), wanted.sum(1), rtol=1e-12, atol=0)
    weight = (wanted.sum(1, keepdim=True) / 512).clamp(min=1)  # elements per sampled value
    assert ((counts - wanted).abs() <= 2 * weight + 1e-9).all()


@pytest.fixture
def compiled_tables(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The engine with the sampled histogram's CPU graphs compiled (float32 and float64)."""
    monkeypatch.setenv("LIGHTNING_RECORDER_COMPILE", "1")
    engine.reset_compiled()
    engine.warm_up("cpu", [torch.float32, torch.float64], wait=True, native=False)
    if engine.compile_status().startswith("failed"):
        pytest.fail(f"torch.compile failed on this machine: {engine.compile_status()}")
    yield
    monkeypatch.undo()
    engine.reset_compiled()


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The kernels of the sampled histogram that run compiled, in order."""
    calls: list[str] = []
    compiled = engine._compiled

    def spy(key: engine.Key, x: torch.Tensor, *args: object) -> torch.Tensor | None:
        if key[0] in ("keys", "table"):
            calls.append(key[0])
        return compiled(key, x, *args)

    monkeypatch.setattr(engine, "_compiled", spy)
    return calls


def test_the_table_is_its_parts_composed_eagerly() -> None:
    """Without compiled graphs: the same table as the scaled counts and rows composed."""
    c = _collector([5000, 300, 70_000, 2])
    states = c.states()
    every = states.clone()
    every[:, 3] -= 1.0  # another rank's smaller minimum: ranges from ``every``, counts' scale not
    with engine.eager_only():
        got = c.table(every, states, BINS)
    assert_same_table(got, _composed(c, every, states, BINS), BINS)
    torch.testing.assert_close(got[:, -BINS:].sum(1), states[:, COUNT], rtol=1e-12, atol=0)


@pytest.mark.slow
def test_compiled_table_equals_eager_and_never_recompiles(
    compiled_tables: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch._dynamo

    status = engine.compile_status()
    for graph in ("keys cpu float32 rows", "table cpu int64,", "table cpu int64 rows"):
        assert graph in status + ",", status
    calls = _spy(monkeypatch)
    cases = [
        ([5000, 300, 70_000, 9000], torch.float32, BINS),
        ([4096] * 7 + [100_000] * 5, torch.float32, 7),  # other counts, another bin count
        ([2000, 2000], torch.float64, 64),
        ([600, 700, 800], torch.float64, BINS),
        ([5000, 300, 9000], torch.float32, BINS, [800, 3000]),  # stream 1 called three times
        ([3000] * 6, torch.float32, 7, [100, 2000]),
    ]
    with torch._dynamo.config.patch(error_on_recompile=True), warnings.catch_warnings():
        warnings.simplefilter("error")  # a graph failing at run time would warn and go eager
        for seed, (sizes, dtype, bins, *again) in enumerate(cases):
            c = _collector(sizes, dtype, seed)
            for n in again[0] if again else []:
                c.add(1, torch.randn(n, dtype=dtype))
            states = c.states()
            calls.clear()
            got = c.table(states, states, bins)
            assert calls == ["keys", "table"], (sizes, dtype, calls)
            with engine.eager_only():
                eager = c.table(states, states, bins)
            assert_same_table(got, eager, bins)
            assert_same_table(got, _composed(c, states, states, bins), bins)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["one stream", "short rows"])
def test_the_table_runs_eagerly_where_a_graph_would_recompile(
    compiled_tables: None, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """One stream (a size of 1 is specialised by torch.compile) and rows shorter than the
    compiled minimum run eagerly, with the same table."""
    calls = _spy(monkeypatch)
    c = _collector([5000]) if case == "one stream" else _collector([3, 2, 5])
    states = c.states()
    got = c.table(states, states, BINS)
    assert calls == []
    assert_same_table(got, _composed(c, states, states, BINS), BINS)


def test_samples_of_two_dtypes_are_tabled_buffer_by_buffer() -> None:
    """Outputs of float32 and float64 stage their samples apart: their table is the counts of
    both buffers, scaled, with the rows of every stream."""
    c = Collector(3, 512, torch.device("cpu"))
    c.add(0, torch.randn(4000))
    c.add(1, torch.randn(4000, dtype=F64) * 3)
    c.add(2, torch.randn(100, dtype=F64))
    states = c.states()
    got = c.table(states, states, BINS)
    assert_same_table(got, _composed(c, states, states, BINS), BINS)
    torch.testing.assert_close(got[:, -BINS:].sum(1), states[:, COUNT], rtol=1e-12, atol=0)
