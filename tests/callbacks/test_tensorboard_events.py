"""The TensorBoard event of a logging step: one ``Summary`` built with protobuf's API, runs of
empty histogram buckets collapsed, the same values as TensorBoard's own ``add_scalar`` /
``add_histogram_raw`` write, read back by TensorBoard's readers; the writers it goes through and
their fallbacks."""

from __future__ import annotations

from bisect import bisect_left
from itertools import pairwise
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers.benchmarks import load_benchmark
from helpers.models import QUIET, ProbeNet, events, features, loader, scalars
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard import data_compat
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.util import tensor_util

import lightning_recorder.callbacks.stats_monitor as monitor_module
from lightning_recorder import FeatureStatsMonitor
from lightning_recorder import TensorBoardLogger as RecorderTensorBoardLogger
from lightning_recorder.callbacks._tensorboard import (
    HistogramTable,
    collapse_empty_buckets,
    kept_buckets,
    summary_class,
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


# ----------------------------------------------- the Summary against TensorBoard's own writes
def read_values(log_dir: str | Path) -> dict[tuple[str, int], bytes]:
    """Every summary value in the event files of a directory, by ``(tag, step)``, serialized (the
    same message gives the same bytes; NaN included), as TensorBoard's reader reads them."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    found = {}
    for path in sorted(Path(log_dir).glob("events.out.tfevents.*")):
        for event in LegacyEventFileLoader(str(path)).Load():
            for value in event.summary.value:
                found[(value.tag, event.step)] = value.SerializeToString()
    return found


TAGS = st.text(alphabet="abcxyz019/._-", min_size=1, max_size=30)
VALUES = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([-0.0, 1e39, 1e-50])


@st.composite
def histogram_tables(draw: st.DrawFn) -> HistogramTable:
    """A table of 0 to 5 histograms of 1 to 12 buckets, about half of them empty, a row without
    data among them now and then."""
    bins = draw(st.integers(1, 12))
    tags = draw(st.lists(TAGS, min_size=0, max_size=5, unique=True))
    rows = []
    for _ in tags:
        counts = draw(st.lists(st.integers(0, 3), min_size=bins, max_size=bins))
        counts = [float(c if c < 2 else 0) for c in counts]
        low = draw(st.floats(-1e3, 1e3))
        edges = [low + 0.5 * i for i in range(bins + 1)]
        num = float(sum(counts))
        head = [num, draw(st.floats(-1e3, 1e3)), draw(st.floats(0, 1e6)), edges[0], edges[-1]]
        rows.append([*head, *edges, *counts])
    table = torch.tensor(rows, dtype=torch.float64).reshape(len(tags), 2 * bins + 6)
    return HistogramTable(table, bins, tags)


@settings(max_examples=25, deadline=None)
@given(st.dictionaries(TAGS, VALUES, max_size=6), histogram_tables(), st.integers(0, 10**6))
def test_summary_reads_back_as_tensorboards_own_add_scalar_and_add_histogram_raw(
    scalars_: dict[str, float], table: HistogramTable, step: int
) -> None:
    import tempfile

    from torch.utils.tensorboard import SummaryWriter

    table = HistogramTable(table.table, table.bins, [f"h/{tag}" for tag in table.tags])
    with tempfile.TemporaryDirectory() as root:
        ours, theirs = f"{root}/ours", f"{root}/theirs"
        with SummaryWriter(ours) as writer:
            assert writer.file_writer is not None
            writer.file_writer.add_summary(tensorboard_summary(scalars_, table), step)
        with SummaryWriter(theirs) as writer:  # TensorBoard's own calls, tag by tag
            for tag, value in scalars_.items():
                writer.add_scalar(tag, value, step)
            for tag, kw in table.items():
                limits, counts = collapse_empty_buckets(kw["bucket_limits"], kw["bucket_counts"])
                kw = {**kw, "bucket_limits": limits, "bucket_counts": counts}
                writer.add_histogram_raw(tag, global_step=step, **kw)
        got, want = read_values(ours), read_values(theirs)
    assert got == want  # the same messages: the same values and buckets, copied, not computed
    assert len(got) == len(scalars_) + len(table)


@settings(max_examples=100, deadline=None)
@given(histogram_tables())
def test_the_table_and_its_mapping_build_the_same_summary(table: HistogramTable) -> None:
    from_table = tensorboard_summary({"s": 1.0}, table)
    from_mapping = tensorboard_summary({"s": 1.0}, dict(table))  # collapsed list by list
    assert from_table.SerializeToString() == from_mapping.SerializeToString()
    for value in from_table.value[1:]:  # no two empty buckets in a row
        empty = [c == 0 for c in value.histo.bucket]
        assert not any(a and b for a, b in pairwise(empty))


def test_kept_buckets_of_a_table_are_those_of_each_row() -> None:
    counts = np.array([[0, 3, 0, 0, 0, 2], [0, 0, 0, 1, 0, 0], [0, 1, 2, 3, 4, 5]], dtype=float)
    keep = kept_buckets(counts)
    limits = list(range(6))
    for row, kept in zip(counts.tolist(), keep.tolist(), strict=True):
        got_limits, _ = collapse_empty_buckets(limits, row)
        assert list(got_limits) == [x for x, k in zip(limits, kept, strict=True) if k]


# ------------------------------------------------------------------ HistogramTable
def _row(num: float, bins: int = 3) -> list[float]:
    edges = [float(i) for i in range(bins + 1)]
    counts = [num, *([0.0] * (bins - 1))]
    return [num, 0.5 * num, 0.25 * num, 0.0, 1.0, *edges, *counts]


def test_histogram_table_from_a_tensor_or_an_array_and_as_a_mapping() -> None:
    rows = [_row(4.0), _row(0.0), _row(2.0)]
    tags = ("a/histogram", "empty/histogram", "b/histogram")
    from_tensor = HistogramTable(torch.tensor(rows, dtype=torch.float64), 3, tags)
    from_array = HistogramTable(np.array(rows, dtype=np.float32), 3, list(tags))
    assert from_array.table.dtype == np.float64 and from_array.tags == tags
    np.testing.assert_array_equal(from_tensor.table, from_array.table)
    assert list(from_tensor) == ["a/histogram", "b/histogram"]  # no data: no histogram
    assert from_tensor["a/histogram"] == {
        "min": 0.0,
        "max": 1.0,
        "num": 4,
        "sum": 2.0,
        "sum_squares": 1.0,
        "bucket_limits": [0.0, 1.0, 2.0, 3.0],
        "bucket_counts": [0.0, 4.0, 0.0, 0.0],  # TensorBoard's leading empty bucket first
    }
    assert list(from_tensor.prefixed("p-")) == ["p-a/histogram", "p-b/histogram"]
    summary = tensorboard_summary({}, from_tensor)
    assert [v.tag for v in summary.value] == ["a/histogram", "b/histogram"]
    assert list(summary.value[0].histo.bucket) == [0.0, 4.0, 0.0]  # the last two merged
    assert list(summary.value[0].histo.bucket_limit) == [0.0, 1.0, 3.0]


def test_histogram_table_of_the_wrong_shape_is_refused() -> None:
    with pytest.raises(ValueError, match=r"shape \(2, 12\).*bins=3.* but got \(2, 11\)"):
        HistogramTable(torch.zeros(2, 11, dtype=torch.float64), 3, ("a", "b"))
    with pytest.raises(ValueError, match=r"shape \(1, 12\).* but got \(2, 12\)"):
        HistogramTable(torch.zeros(2, 12, dtype=torch.float64), 3, ("a",))


# ------------------------------------------------------------------ the writers
@pytest.mark.parametrize("public", [True, False], ids=["package-logger", "lightning-logger"])
def test_public_logger_prefix_reaches_scalars_and_histograms(tmp_path: Path, public: bool) -> None:
    # the package's logger makes its prefix public; Lightning's keeps it private: not read
    kind = RecorderTensorBoardLogger if public else TensorBoardLogger
    logger = kind(tmp_path, name="tb", prefix="run")
    table = HistogramTable(torch.tensor([_row(4.0)], dtype=torch.float64), 3, ("m/histogram",))
    write_tensorboard(logger, {"m/mean": 0.5}, table, step=3)
    write_tensorboard(logger, {"m/std": 0.25}, {"m2/histogram": table["m/histogram"]}, step=4)
    logger.experiment.flush()
    lead = "run-" if public else ""
    assert set(read_values(logger.log_dir)) == {
        (f"{lead}m/mean", 3),
        (f"{lead}m/histogram", 3),
        (f"{lead}m/std", 4),
        (f"{lead}m2/histogram", 4),
    }
    logger.finalize("success")


class _Recording:
    """A ``SummaryWriter`` of another make: only its public per-tag methods."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.calls.append(("scalar", (tag, value, step)))

    def add_histogram_raw(self, tag: str, global_step: int, **kwargs: Any) -> None:
        self.calls.append(("histogram", (tag, global_step, kwargs)))


class _OtherWriterLogger(TensorBoardLogger):
    def __init__(self, root: Path) -> None:
        super().__init__(root, name="other")
        self.recording = _Recording()

    @property
    def experiment(self) -> Any:
        return self.recording


def test_a_writer_of_unknown_make_gets_one_public_call_per_tag(tmp_path: Path) -> None:
    logger = _OtherWriterLogger(tmp_path)
    assert summary_class(logger.experiment) is None
    row = [*_row(4.0, bins=5)]
    table = HistogramTable(torch.tensor([row], dtype=torch.float64), 5, ("m/histogram",))
    write_tensorboard(logger, {"m/mean": 0.5, "m/std": 2.0}, table, step=7)
    kinds = [kind for kind, _ in logger.recording.calls]
    assert kinds == ["scalar", "scalar", "histogram"]
    assert logger.recording.calls[0][1] == ("m/mean", 0.5, 7)
    tag, step, kwargs = logger.recording.calls[2][1]
    assert (tag, step) == ("m/histogram", 7)
    assert kwargs["bucket_counts"] == [0.0, 4.0, 0.0]  # the empty run collapsed here too
    assert kwargs["bucket_limits"] == [0.0, 1.0, 5.0]
    assert kwargs["num"] == 4 and kwargs["min"] == 0.0 and kwargs["max"] == 1.0


def test_a_closed_torch_writer_gets_the_values_through_add_scalar(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="tb")
    writer = logger.experiment
    writer.close()  # its file_writer is None until it is written to again
    assert writer.file_writer is None
    table = HistogramTable(torch.tensor([_row(4.0)], dtype=torch.float64), 3, ("m/histogram",))
    write_tensorboard(logger, {"m/mean": 0.5}, table, step=2)
    writer.flush()
    assert set(read_values(logger.log_dir)) == {("m/mean", 2), ("m/histogram", 2)}
    logger.finalize("success")


# ------------------------------------------------------------------ tensorboardX's writer
class _TensorBoardXLogger(TensorBoardLogger):
    """A TensorBoard logger writing through tensorboardX. (Lightning logs its ``hp_metric``
    summary, a message of TensorBoard's classes, which a tensorboardX writer refuses: off.)"""

    def __init__(self, root: Path, name: str) -> None:
        super().__init__(root, name=name, default_hp_metric=False)
        self.tbx: Any = None

    @property
    def experiment(self) -> Any:
        if self.tbx is None:
            from tensorboardX import SummaryWriter

            self.tbx = SummaryWriter(logdir=self.log_dir)
        return self.tbx

    def finalize(self, status: str) -> None:
        if self.tbx is not None:
            self.tbx.close()


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
        logs[name] = logger.log_dir
    assert summary_class(logger.experiment).__module__.startswith("tensorboardX")
    torch_events, tbx_events = _stats_events(logs["torch"]), _stats_events(logs["tbx"])
    assert [step for step, _ in tbx_events] == [0, 1]  # one event per logged step
    assert tbx_events == torch_events
    # the same values through the same Summary schema. The two runs may reduce an output by
    # different engine paths (eager until the CPU kernel or compiled graph built in the
    # background is ready, which under load can fall inside the first run), equal within the
    # documented tolerance, not bit for bit: values agree to a relative 1e-5, counts exactly
    got = {name: scalars(log) for name, log in logs.items()}
    stats_torch = {t: v for t, v in got["torch"].items() if t.startswith("stats/")}
    stats_tbx = {t: v for t, v in got["tbx"].items() if t.startswith("stats/")}
    assert stats_tbx.keys() == stats_torch.keys()
    for tag, value in stats_tbx.items():
        assert value == pytest.approx(stats_torch[tag], rel=1e-5, nan_ok=True), tag
    tag = "stats/train/probe/histogram"
    h_torch, h_tbx = events(logs["torch"]).Histograms(tag), events(logs["tbx"]).Histograms(tag)
    assert [e.step for e in h_tbx] == [e.step for e in h_torch] == [0, 1]
    for mine, theirs in zip(h_tbx, h_torch, strict=True):
        a, b = mine.histogram_value, theirs.histogram_value
        assert (a.num, list(a.bucket)) == (b.num, list(b.bucket))
        assert [a.min, a.max, a.sum, a.sum_squares, *a.bucket_limit] == pytest.approx(
            [b.min, b.max, b.sum, b.sum_squares, *b.bucket_limit], rel=1e-5, abs=1e-6
        )
    assert all(len(e.histogram_value.bucket) < 31 for e in h_tbx)  # collapsed there too


def test_benchmark_quick_run(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark("bench_writer")
    report = bench.main(quick=True)
    out = capsys.readouterr().out
    assert "| 16 | 7 |" in out and "| 16 | 13 |" in out
    assert len(report["build"]) == 2 + 2
    assert len(report["per KiB"]) == 2 + 2  # both checksums (the dev extra has the wheel)
    rows = report["per logged step"][2:]
    assert len(rows) == 4 and all(row.endswith("% |") for row in rows)
