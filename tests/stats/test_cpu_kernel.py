"""The CPU kernel of the packed state (the custom op ``lightning_recorder::rows_state``).

It is held to what the torch definition (:func:`~lightning_recorder.stats._state.rows_state`)
computes: against a ``float64`` reference with the documented tolerance (counts, min and max
exactly, mean/std/abs_mean within ``1e-9`` relative), against the torch function within
``1e-12`` (the same float64 sums in another order), through torch's own operator checks
(``torch.library.opcheck``: schema, fake implementation, dispatch) and inside a compiled graph.
"""

from __future__ import annotations

import contextlib
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
from hypothesis import given, settings
from test_engine import FLOAT32_LISTS, KINDS, assert_close_states, assert_matches, data

from lightning_recorder.stats import _cpu_kernel
from lightning_recorder.stats import _engine as engine
from lightning_recorder.stats._collect import Collector
from lightning_recorder.stats._state import F64, WIDTH, empty_states, merge, rows_state

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def built() -> Iterator[None]:
    """The kernel built and loaded (torch's extension cache makes later builds a load)."""
    engine.warm_up("cpu", [torch.float32], wait=True)
    status = engine.compile_status()
    assert _cpu_kernel.loaded(), f"the CPU kernel was not built: {status}"
    yield


def op(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.lightning_recorder.rows_state(x)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 4095, 4096, 4097, 5000, 70_001])
def test_kernel_matches_float64_and_the_definition(kind: str, dtype: torch.dtype, n: int) -> None:
    x = data(kind, dtype, n)
    state = op(x.view(1, -1))
    assert state.shape == (1, WIDTH) and state.dtype == F64
    assert_matches(state[0], x)
    assert_close_states(state, rows_state(x.view(1, -1)))


def test_rows_with_a_stride_each_get_their_own_state() -> None:
    base = torch.stack([data(k, n=1200) for k in KINDS])  # (6, 1200)
    rows = base[:, 100:1100]  # rows of 1000 elements, 1200 apart
    assert rows.stride() == (1200, 1)
    assert_close_states(op(rows), rows_state(rows.contiguous()))
    for state, row in zip(op(rows), rows, strict=True):
        assert_matches(state, row)


def test_no_rows_and_empty_rows() -> None:
    assert op(torch.zeros(0, 5)).shape == (0, WIDTH)
    assert torch.equal(op(torch.zeros(3, 0)), empty_states(3))  # the state of no data


def test_long_rows_keep_float64_accuracy() -> None:
    """A mean far from the shift over millions of values: the block sums keep the error near a
    pairwise sum's (a single running sum would drift by about 1e-9 of the mean here)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2**23, generator=g) * 0.01 + 0.25
    x[: 2**22] += 3.0  # the shift, sampled evenly, is far from both halves
    assert_matches(op(x.view(1, -1))[0], x)
    assert_close_states(op(x.view(1, -1)), merge(rows_state(x.view(64, -1)))[None])


@settings(max_examples=60, deadline=None)
@given(FLOAT32_LISTS)
def test_any_values_match_the_definition(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    assert_matches(op(x.view(1, -1))[0], x)


def test_bad_inputs_are_refused_with_a_reason() -> None:
    with pytest.raises(RuntimeError, match="2-d tensor"):
        op(torch.zeros(2, 3, 4))
    with pytest.raises(RuntimeError, match="float32 or float64"):
        op(torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="contiguous"):
        op(torch.zeros(4, 6)[:, ::2])


def test_torch_checks_the_op() -> None:
    """torch's operator checks: schema, fake (meta) implementation, dispatch."""
    for x in (torch.randn(3, 500), data("specials", torch.float64, 900).view(3, 300)):
        torch.library.opcheck(torch.ops.lightning_recorder.rows_state.default, (x,))


def test_the_op_runs_inside_a_compiled_graph() -> None:
    def stats(x: torch.Tensor) -> torch.Tensor:
        return op(x.reshape(1, -1) * 2.0)

    x = torch.randn(8, 300)
    compiled = torch.compile(stats, fullgraph=True, dynamic=False)
    assert_close_states(compiled(x), rows_state((x * 2.0).reshape(1, -1)))


def test_the_sampling_overload_runs_inside_a_compiled_graph() -> None:
    """The overload that writes the sample composes with torch.compile too: the graph writes
    the caller's buffer, as the eager call does."""

    def stats(x: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        return _cpu_kernel.rows_state(x.reshape(1, -1) * 2.0, sample, 7)

    x = torch.randn(8, 300)
    got, expected = torch.full((343,), 123.0), torch.full((343,), 123.0)
    compiled = torch.compile(stats, fullgraph=True, dynamic=False)
    assert_close_states(
        compiled(x, got), _cpu_kernel.rows_state((x * 2.0).reshape(1, -1), expected, 7)
    )
    # the sample is a copy of x * 2.0, which is exact in float32 (a power of two), so the
    # compiled and eager copies agree exactly; the states above are held to a tolerance
    assert torch.equal(got, expected)
    assert torch.equal(got, (x * 2.0).reshape(-1)[::7])


def test_the_engine_takes_the_kernel_for_float32_and_float64_on_the_cpu() -> None:
    x = data("specials", n=300_000)
    assert engine.native_ready(x) and engine.native_ready(x.double())
    assert not engine.native_ready(x.bfloat16())  # the compiled or eager function
    with engine.compiled_only():
        assert not engine.native_ready(x)
    with engine.eager_only():
        assert not engine.native_ready(x)
        eager = engine.tensor_state(x)
    assert_close_states(engine.tensor_state(x), eager)
    # a layout that is not one block: pieces copied, each reduced by the kernel
    y = data("relu", n=6 * 40 * 41).view(6, 40, 41)[:, ::2]
    assert engine.flat_view(y) is None
    assert_matches(engine.tensor_state(y), y)


def test_the_collector_reduces_small_tensors_at_once_without_copies() -> None:
    collector = Collector(2, 64, torch.device("cpu"))
    small = [data("gaussian", n=96).view(8, 12), data("relu", n=40)]
    collector.add(0, small[0])
    collector.add(1, small[1])
    collector.add(0, small[0] * 3)
    assert not collector._groups  # no copy held for a grouped reduction
    states = collector.states()
    assert_matches(states[0], torch.cat([small[0].reshape(-1), (small[0] * 3).reshape(-1)]))
    assert_matches(states[1], small[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("n", "stride"), [(1, 1), (50, 1), (5000, 7), (32768, 11), (70_001, 17)])
def test_the_op_takes_the_strided_sample_in_the_same_call(
    dtype: torch.dtype, n: int, stride: int
) -> None:
    """With a sample buffer the op also copies the row's elements at the stride into it (the
    histogram sample), exactly, and the state is the same as without it."""
    x = data("specials", dtype, n)
    length = -(-n // stride)
    sample = torch.full((length,), 123.0, dtype=dtype)
    state = _cpu_kernel.rows_state(x.view(1, -1), sample, stride)
    assert torch.equal(sample.nan_to_num(nan=7.0), x[::stride].nan_to_num(nan=7.0))
    assert torch.equal(state, op(x.view(1, -1)))
    shorter = torch.full((length - 1,), 123.0, dtype=dtype)  # a shorter buffer: its length only
    _cpu_kernel.rows_state(x.view(1, -1), shorter, stride)
    assert torch.equal(shorter.nan_to_num(nan=7.0), x[::stride][:-1].nan_to_num(nan=7.0))


def test_a_bad_sample_is_refused_with_a_reason_and_nothing_written() -> None:
    x = torch.randn(1, 100)
    for sample, stride, reason in (
        (torch.zeros(20), 10, "does not fit in a row of 100"),  # 19 * 10 >= 100
        (torch.zeros(10), 0, "does not fit"),
        (torch.zeros(10, dtype=torch.float64), 10, "of the row's dtype"),
        (torch.zeros(20)[::2], 10, "contiguous 1-d sample"),
        (torch.zeros(2, 5), 10, "contiguous 1-d sample"),
    ):
        before = sample.clone()
        with pytest.raises(RuntimeError, match=reason):
            _cpu_kernel.rows_state(x, sample, stride)
        assert torch.equal(sample, before)
    with pytest.raises(RuntimeError, match="samples one row"):
        _cpu_kernel.rows_state(torch.randn(2, 50), torch.zeros(5), 10)


def test_torch_checks_the_op_with_a_sample() -> None:
    """torch's operator checks of the mutating form (the schema declares the sample written)."""
    for x in (torch.randn(1, 500), data("specials", torch.float64, 900).view(1, -1)):
        sample = torch.zeros(-(-x.shape[1] // 7), dtype=x.dtype)
        torch.library.opcheck(torch.ops.lightning_recorder.rows_state.sampled, (x, sample, 7))


def test_the_collector_samples_in_the_kernel_call_as_it_would_apart() -> None:
    """The collector's samples and histogram counts are the same whether the kernel takes the
    sample (the default on the CPU) or the engine's own function and a strided copy do."""
    xs = [data(k, torch.float32, n) for k, n in (("relu", 32768), ("specials", 5000))]
    xs.append(data("gaussian", torch.float64, 9009).view(9, 1001))
    found = []
    for no_native in (False, True):
        collector = Collector(3, 512, torch.device("cpu"))
        with engine.compiled_only() if no_native else contextlib.nullcontext():
            for i, x in enumerate(xs):
                collector.add(i, x)
                collector.add(i, x * 2)  # two rows of samples for each stream
            states = collector.states()
            lo, hi = states[:, 3].clamp(max=0.0), states[:, 4].clamp(min=1.0)
            found.append((states, collector.counts(lo, hi, 16, states)))
    (native_states, native_counts), (plain_states, plain_counts) = found
    assert_close_states(native_states, plain_states)
    assert torch.equal(native_counts, plain_counts)
    assert native_counts.sum() > 0


def test_a_failed_build_warns_once_and_the_statistics_stay_right(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compiler = engine._Compiler()  # a fresh engine state: nothing built yet in it
    monkeypatch.setattr(_cpu_kernel, "_loaded", False)  # as in a process without the kernel

    def broken() -> None:
        raise RuntimeError("Ninja is required to load C++ extensions\nmore detail")

    monkeypatch.setattr(_cpu_kernel, "build", broken)
    monkeypatch.setattr(engine, "_COMPILER", compiler)
    monkeypatch.setenv("LIGHTNING_RECORDER_COMPILE", "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.warm_up("cpu", [torch.float32], wait=True)
        engine.warm_up("cpu", [torch.float32], wait=True)  # asked again: no second warning
    ours = [w for w in caught if "could not build its CPU statistics kernel" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    message = str(ours[0].message)
    assert "Ninja is required" in message and "LIGHTNING_RECORDER_NATIVE=0" in message
    assert "more detail" not in message
    assert "CPU kernel not built: RuntimeError: Ninja is required" in engine.compile_status()
    x = data("specials", n=100_000)
    assert not engine.native_ready(x)
    assert_matches(engine.tensor_state(x), x)


BUILD_OUTPUT = (
    "Error building extension 'lightning_recorder_cpu_state_0123': [1/2] c++ -MMD -MF "
    "_cpu_state.o.d -DTORCH_EXTENSION_NAME=lightning_recorder_cpu_state_0123 "
    "-DTORCH_API_INCLUDE_EXTENSION_H " + "-isystem /site-packages/torch/include " * 8 + "-fPIC "
    "-std=c++20 -O3 -c /pkg/_cpu_state.cpp -o _cpu_state.o \nFAILED: _cpu_state.o \nc++ -MMD -MF "
    "_cpu_state.o.d -DTORCH_EXTENSION_NAME=lightning_recorder_cpu_state_0123 "
    "-DTORCH_API_INCLUDE_EXTENSION_H -c /pkg/_cpu_state.cpp -o _cpu_state.o \n"
    "/bin/sh: 1: c++: not found\nninja: build stopped: subcommand failed.\n"
)


def test_a_failed_build_is_reported_by_the_line_that_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's extension builder puts the compile command first and the reason (here: no C++
    compiler) lines later: the warning quoted the first 300 characters of the command."""
    monkeypatch.setattr(engine, "_COMPILER", engine._Compiler())
    monkeypatch.setattr(_cpu_kernel, "_loaded", False)

    def broken() -> None:
        raise RuntimeError(BUILD_OUTPUT)

    monkeypatch.setattr(_cpu_kernel, "build", broken)
    monkeypatch.setenv("LIGHTNING_RECORDER_COMPILE", "0")
    with pytest.warns(UserWarning, match="could not build its CPU statistics kernel") as caught:
        engine.warm_up("cpu", [torch.float32], wait=True)
    quoted = (
        "RuntimeError: Error building extension 'lightning_recorder_cpu_state_0123': "
        "/bin/sh: 1: c++: not found"
    )
    assert any(f"({quoted})" in str(w.message) for w in caught)
    assert engine.compile_status().endswith(f"; CPU kernel not built: {quoted}")


def test_an_unwritable_cache_is_named_in_both_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only cache directory is not a missing compiler: the warnings said to install a
    C++ compiler and ninja; they name the variable that moves the cache."""
    monkeypatch.setattr(engine, "_COMPILER", engine._Compiler())
    monkeypatch.setattr(_cpu_kernel, "_loaded", False)
    monkeypatch.setenv("LIGHTNING_RECORDER_COMPILE", "1")

    def read_only(*args: object) -> None:
        raise PermissionError(13, "Permission denied", "/read-only/cache")

    monkeypatch.setattr(_cpu_kernel, "build", read_only)
    monkeypatch.setattr(engine._Compiler, "function", read_only)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.warm_up("cpu", [torch.float16], wait=True)
    messages = [str(w.message) for w in caught if "lightning_recorder" in str(w.message)]
    native = [m for m in messages if "could not build its CPU statistics kernel" in m]
    compiled = [m for m in messages if "torch.compile failed" in m]
    assert len(native) == 1 and len(compiled) == 1, messages
    assert "set TORCH_EXTENSIONS_DIR to one" in native[0]
    assert "C++ compiler" not in native[0]
    assert "set TORCHINDUCTOR_CACHE_DIR to one" in compiled[0]
    assert "LIGHTNING_RECORDER_COMPILE=0" in compiled[0]


def test_with_compiling_off_the_kernel_is_still_built_as_the_docs_say(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The troubleshooting page told to set LIGHTNING_RECORDER_COMPILE=0 alone for a short
    script not to wait at its end: the background thread still builds the CPU kernel then."""
    monkeypatch.setattr(engine, "_COMPILER", engine._Compiler())
    monkeypatch.setattr(_cpu_kernel, "_loaded", False)
    monkeypatch.setenv("LIGHTNING_RECORDER_COMPILE", "0")
    built: list[str] = []
    monkeypatch.setattr(_cpu_kernel, "build", lambda: built.append(threading.current_thread().name))
    engine.warm_up("cpu", [torch.float32], wait=True)
    assert built == ["lightning_recorder-compile"]  # in the thread a script waits for at exit
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    advice = page.split("## The first logged steps, and a short script", 1)[1].split("\n## ")[0]
    assert "`LIGHTNING_RECORDER_COMPILE=0` and\n`LIGHTNING_RECORDER_NATIVE=0`" in advice


def test_a_failed_compile_says_that_the_cpu_kernel_still_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel is built before the graphs: when they then fail to compile, float32 and
    float64 statistics on the CPU still take it, one pass each; the warning said that every
    statistic runs eagerly, several passes over each output."""
    monkeypatch.setattr(engine, "_COMPILER", engine._Compiler())
    monkeypatch.setattr(_cpu_kernel, "_loaded", False)
    monkeypatch.setenv("LIGHTNING_RECORDER_COMPILE", "1")

    def built() -> None:
        monkeypatch.setattr(_cpu_kernel, "_loaded", True)

    def broken(self: object, key: object) -> object:
        raise RuntimeError("no working C++ compiler for inductor")

    monkeypatch.setattr(_cpu_kernel, "build", built)
    monkeypatch.setattr(engine._Compiler, "function", broken)
    with pytest.warns(UserWarning, match="computes feature statistics eagerly") as caught:
        engine.warm_up("cpu", [torch.float32], wait=True)
    message = next(str(w.message) for w in caught if "torch.compile failed" in str(w.message))
    assert "float32 and float64 outputs on the CPU still take the CPU kernel" in message
    assert engine.native_ready(torch.ones(3))


def test_the_kernel_can_be_turned_off() -> None:
    script = textwrap.dedent(
        """
        import warnings
        import torch
        warnings.simplefilter("error")
        from lightning_recorder.stats import _engine as engine, _cpu_kernel
        engine.warm_up("cpu", [torch.float32], wait=True)
        x = torch.randn(1000)
        assert not _cpu_kernel.loaded() and not engine.native_ready(x), engine.compile_status()
        print(engine.compile_status())
        """
    )
    env = {
        **os.environ,
        "LIGHTNING_RECORDER_NATIVE": "0",
        "LIGHTNING_RECORDER_COMPILE": "0",
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    # the status says that both are off, and by which variable
    assert done.stdout.strip() == (
        "off (LIGHTNING_RECORDER_COMPILE=0); CPU kernel off (LIGHTNING_RECORDER_NATIVE=0)"
    )
