"""The TensorBoard event of a logging step: runs of empty histogram buckets collapsed, read back
by TensorBoard's own reader as the same histogram."""

from __future__ import annotations

from bisect import bisect_left
from itertools import pairwise
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers.models import QUIET, ProbeNet, events, features, loader, scalars
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard import data_compat
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.util import tensor_util

import lightning_recorder.callbacks.stats_monitor as monitor_module
from lightning_recorder import FeatureStatsMonitor
from lightning_recorder.callbacks._lightning import (
    collapse_empty_buckets,
    scalar_bytes,
    tensorboard_summary,
    write_tensorboard,
)


def cumulative(limits: list[float], counts: list[float], at: list[float]) -> list[float]:
    """The count of the values up to each point of ``at`` (a limit of the buckets): bucket ``i``
    covers ``(limits[i - 1], limits[i]]``."""
    totals = np.cumsum(counts).tolist()
    return [totals[bisect_left(limits, x)] for x in at]


def assert_same_histogram(
    limits: list[float], counts: list[float], got_limits: list[float], got_counts: list[float]
) -> None:
    """``got`` holds the same count in every range of the original buckets, its limits are some
    of the original ones, and it has no two empty buckets in a row."""
    assert set(got_limits) <= set(limits) and got_limits == sorted(got_limits)
    assert got_limits[-1] == limits[-1]
    # counts are whole numbers: sums of them are exact in float64
    assert cumulative(got_limits, got_counts, limits) == np.cumsum(counts).tolist()
    empty = [c <= 0 for c in got_counts]
    assert not any(a and b for a, b in pairwise(empty))


def shown(limits: list[float], counts: list[float], low: float, high: float) -> np.ndarray:
    """The ``[left, right, count]`` rows TensorBoard shows for an old-style histogram, as its
    ``data_compat`` migration computes them, with the empty rows left out."""
    value = Summary.Value(tag="h")
    value.histo.min, value.histo.max = low, high
    value.histo.num = float(sum(counts))
    value.histo.bucket_limit.extend(limits)
    value.histo.bucket.extend(counts)
    rows = tensor_util.make_ndarray(data_compat.migrate_value(value).tensor)
    return rows[rows[:, 2] > 0]


# ------------------------------------------------------------------ collapse_empty_buckets
@pytest.mark.parametrize(
    ("counts", "want_limits", "want_counts"),
    [
        ([0, 3, 0, 0, 0, 2], [0, 1, 4, 5], [0, 3, 0, 2]),
        ([0, 0, 0, 1, 0, 0], [2, 3, 5], [0, 1, 0]),
        ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]),
        ([0, 0, 0, 0, 0, 0], [5], [0]),
        ([1, 0, 1, 0, 0, 1], [0, 1, 2, 4, 5], [1, 0, 1, 0, 1]),
    ],
)
def test_collapse_examples(
    counts: list[float], want_limits: list[float], want_counts: list[float]
) -> None:
    limits = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    got_limits, got_counts = collapse_empty_buckets(limits, [float(c) for c in counts])
    assert list(got_limits) == want_limits and list(got_counts) == want_counts


def test_collapse_without_empty_run_returns_the_inputs() -> None:
    limits, counts = [0.0, 1.0, 2.0], [0.0, 4.0, 1.0]  # only the leading empty bucket
    got = collapse_empty_buckets(limits, counts)
    assert got[0] is limits and got[1] is counts
    assert collapse_empty_buckets([], []) == ([], [])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=2, max_size=40).map(
        lambda c: [0.0, *(float(x if x < 2 else 0) for x in c)]  # about half the buckets empty
    ),
    st.floats(-1e6, 1e6),
    st.floats(1e-3, 1e3),
)
def test_collapse_keeps_every_range_and_what_tensorboard_shows(
    counts: list[float], low: float, width: float
) -> None:
    limits = [low + width * i for i in range(len(counts))]
    if sum(counts) == 0:
        counts[-1] = 1.0  # TensorBoard shows no histogram without a value
    got_limits, got_counts = map(list, collapse_empty_buckets(limits, counts))
    assert_same_histogram(limits, counts, got_limits, got_counts)
    first = next(i for i, c in enumerate(counts) if c > 0)
    low, high = limits[max(first - 1, 0)], limits[-1]  # min and max inside the outer buckets
    np.testing.assert_array_equal(
        shown(got_limits, got_counts, low, high), shown(limits, counts, low, high)
    )  # the same float32 rows from the same float64 inputs


def test_summary_is_smaller_with_empty_runs() -> None:
    limits = [float(i) for i in range(31)]
    counts = [0.0, 5.0, *([0.0] * 27), 1.0, 2.0]
    hist = {"min": 0.5, "max": 30.0, "num": 8, "sum": 50.0, "sum_squares": 900.0}
    hists = {"h": {**hist, "bucket_limits": limits, "bucket_counts": counts}}
    histo = tensorboard_summary({"s": 1.0}, hists).value[1].histo
    assert list(histo.bucket) == [0.0, 5.0, 0.0, 1.0, 2.0]
    assert list(histo.bucket_limit) == [0.0, 1.0, 28.0, 29.0, 30.0]
    assert (histo.min, histo.max, histo.num, histo.sum, histo.sum_squares) == (
        0.5,
        30.0,
        8,
        50.0,
        900.0,
    )


# ------------------------------------------------------------------ the scalars' wire bytes
@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(
        st.text(min_size=1, max_size=300),  # tags of more than 127 bytes: two-byte lengths
        st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([-0.0, 1e39, 1e-50]),
        min_size=1,
        max_size=8,
    )
)
def test_scalar_bytes_are_the_summary_protobuf_builds(values: dict[str, float]) -> None:
    built = Summary()
    for tag, value in values.items():
        built.value.add(tag=tag, simple_value=value)  # protobuf's own encoder, value by value
    ours = scalar_bytes(values)
    assert Summary.FromString(ours).SerializeToString() == built.SerializeToString()
    assert ours == built.SerializeToString()  # the very bytes, in the same order


# ------------------------------------------------------------------ a real run, read back
def test_trainer_run_reads_back_the_same_histograms_and_scalars(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[tuple[int, dict[str, float], dict[str, dict[str, Any]]]] = []

    def spy(logger: TensorBoardLogger, scalars_: Any, hists: Any, step: int) -> None:
        written.append((step, dict(scalars_), {t: dict(kw) for t, kw in hists.items()}))
        write_tensorboard(logger, scalars_, hists, step)

    monkeypatch.setattr(monitor_module, "write_tensorboard", spy)
    logger = TensorBoardLogger(tmp_path, name="tb")
    monitor = FeatureStatsMonitor(["probe", "body.1"], every_n_steps=1, bins=30)
    x = features(12, seed=2)
    x[::4, 0] = 40.0  # an outlier in every batch: most of the 30 buckets stay empty
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=3, callbacks=[monitor])
    trainer.fit(ProbeNet(lr=1e-3), loader(x))

    assert [step for step, _, _ in written] == [0, 1, 2]
    acc = events(logger.log_dir)
    got_scalars = scalars(logger.log_dir)
    assert set(acc.Tags()["histograms"]) == {
        "stats/train/probe/histogram",
        "stats/train/body.1/histogram",
    }
    collapsed = 0
    for step, sent_scalars, sent_hists in written:
        for tag, value in sent_scalars.items():
            # simple_value is a float32: the value read back is the one sent, rounded to it
            assert got_scalars[tag][step] == pytest.approx(value, rel=2**-23, abs=1e-30)
        for tag, kw in sent_hists.items():
            (h,) = [e.histogram_value for e in acc.Histograms(tag) if e.step == step]
            # the same doubles, stored and read back as doubles
            assert (h.min, h.max, h.num, h.sum, h.sum_squares) == (
                kw["min"],
                kw["max"],
                kw["num"],
                kw["sum"],
                kw["sum_squares"],
            )
            limits, counts = list(kw["bucket_limits"]), list(kw["bucket_counts"])
            assert_same_histogram(limits, counts, list(h.bucket_limit), list(h.bucket))
            np.testing.assert_array_equal(
                shown(list(h.bucket_limit), list(h.bucket), h.min, h.max),
                shown(limits, counts, h.min, h.max),
            )
            collapsed += len(h.bucket) < len(counts)
    assert collapsed >= 3  # the outliers leave runs of empty buckets to collapse


def test_benchmark_quick_run(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_writer.py"
    spec = importlib.util.spec_from_file_location("bench_writer", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = bench.main(["--quick", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "| 16 | on | before |" in out and "| 16 | on | now |" in out
    assert "| 16 | on | C, one table |" in out
    assert len(report["event"]) == 2 + 6 and len(report["histogram"]) == 2 + 4


# ------------------------------------------------------------------ tensorboardX's writer
class _TensorBoardXLogger(TensorBoardLogger):
    """A TensorBoard logger writing through tensorboardX (the way to its C checksum: Lightning
    picks ``torch.utils.tensorboard`` whenever TensorBoard is installed)."""

    @property
    def experiment(self) -> Any:
        if self._experiment is None:
            from tensorboardX import SummaryWriter

            self._experiment = SummaryWriter(logdir=self.log_dir)
        return self._experiment


def _stats_events(log_dir: str) -> list[tuple[int, list[str]]]:
    """``(step, tags)`` of every event file record holding monitor values, in file order."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    found = []
    for path in sorted(Path(log_dir).glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            tags = [v.tag for v in event.summary.value if v.tag.startswith("stats/")]
            if tags:
                found.append((event.step, tags))
    return found


def test_tensorboardx_writer_gets_the_same_single_event(tmp_path: Path) -> None:
    pytest.importorskip("tensorboardX", reason="tensorboardX is an optional writer")
    x = features(8, seed=4)
    x[::4, 1] = -30.0
    logs = {}
    for name, cls in (("torch", TensorBoardLogger), ("tbx", _TensorBoardXLogger)):
        logger = cls(tmp_path, name=name)
        monitor = FeatureStatsMonitor(["probe", "body.1"], every_n_steps=1, bins=30)
        trainer = pl.Trainer(**QUIET, logger=logger, max_steps=2, callbacks=[monitor])
        torch.manual_seed(0)  # the same model in both runs
        trainer.fit(ProbeNet(lr=1e-3), loader(x))
        logger.experiment.flush()
        logs[name] = logger.log_dir
    torch_events, tbx_events = _stats_events(logs["torch"]), _stats_events(logs["tbx"])
    assert [step for step, _ in tbx_events] == [0, 1]  # one event per logged step
    assert tbx_events == torch_events
    got = {name: scalars(log) for name, log in logs.items()}
    assert {t: v for t, v in got["tbx"].items() if t.startswith("stats/")} == {
        t: v for t, v in got["torch"].items() if t.startswith("stats/")
    }  # the same float32 values through the same Summary schema
    tag = "stats/train/probe/histogram"
    h_torch, h_tbx = events(logs["torch"]).Histograms(tag), events(logs["tbx"]).Histograms(tag)
    assert [(e.step, e.histogram_value) for e in h_tbx] == [
        (e.step, e.histogram_value) for e in h_torch
    ]
    assert all(len(e.histogram_value.bucket) < 31 for e in h_tbx)  # collapsed there too
