"""The C encoder of a logging step's ``Summary`` entries: the same message as protobuf's own
Python API builds, for every table of histograms and every scalar; the Python path where the
encoder is not built; a real run's event read back."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.models import events, scalars
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.compat.proto.summary_pb2 import Summary

from lightning_recorder._core import native, summary_proto
from lightning_recorder.callbacks._lightning import (
    HistogramTable,
    python_scalar_bytes,
    scalar_bytes,
    tensorboard_summary,
    write_tensorboard,
)
from lightning_recorder.stats.batched import HistogramRow

pytestmark = pytest.mark.skipif(not summary_proto.available(), reason="no C compiler to build with")


def python_dict(table: torch.Tensor, bins: int, tags: tuple[str, ...]) -> dict[str, Any]:
    """The ``{tag: add_histogram_raw kwargs}`` of a table, built row by row in Python."""
    found = {}
    for tag, row in zip(tags, table.tolist(), strict=True):
        kwargs = HistogramRow.from_flat(row, bins).raw_kwargs()
        if kwargs is not None:
            found[tag] = kwargs
    return found


@st.composite
def tables(draw: st.DrawFn) -> tuple[torch.Tensor, int, tuple[str, ...]]:
    bins = draw(st.integers(1, 40))
    m = draw(st.integers(0, 6))
    rows = []
    for _ in range(m):
        # about half the buckets empty: runs of every length, at both ends too
        counts = draw(st.lists(st.sampled_from([0.0, 0.0, 1.0, 7.0, 1e6, 0.25]), min_size=bins))
        counts = counts[:bins]
        low = draw(st.floats(-1e30, 1e30))
        width = draw(st.floats(1e-6, 1e6))
        edges = [low + width * i for i in range(bins + 1)]
        num = draw(st.sampled_from([0.0, 3.0, 12.75, 2.0**40 + 0.5, sum(counts)]))
        stats = draw(st.lists(st.floats(allow_nan=False, width=64), min_size=2, max_size=2))
        rows.append([num, *stats, edges[0], edges[-1], *edges, *counts])
    tags = tuple(
        draw(st.lists(st.text(min_size=1, max_size=200), min_size=m, max_size=m, unique=True))
    )
    table = torch.tensor(rows, dtype=torch.float64).reshape(m, 2 * bins + 6)
    return table, bins, tags


@settings(max_examples=150, deadline=None)
@given(tables())
def test_histogram_entries_are_the_python_summary(
    drawn: tuple[torch.Tensor, int, tuple[str, ...]],
) -> None:
    table, bins, tags = drawn
    hists = HistogramTable(table, bins, tags)
    ours = tensorboard_summary({}, hists)  # the C entries, parsed
    theirs = tensorboard_summary({}, python_dict(table, bins, tags))  # protobuf's Python API
    assert ours.SerializeToString() == theirs.SerializeToString()
    assert dict(hists) == python_dict(table, bins, tags)  # the mapping the other loggers get
    assert len(ours.value) == sum(1 for row in table.tolist() if row[0] != 0)


def test_histogram_entry_of_one_row_field_by_field() -> None:
    edges = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    counts = [4.0, 0.0, 0.0, 0.0, 2.0]  # a run of three empty buckets, one kept
    table = torch.tensor([[6.5, 10.0, 30.0, 0.25, 4.5, *edges, *counts]], dtype=torch.float64)
    (value,) = tensorboard_summary({}, HistogramTable(table, 5, ("a/histogram",))).value
    histo = value.histo
    assert value.tag == "a/histogram"
    assert (histo.min, histo.max, histo.num, histo.sum, histo.sum_squares) == (
        0.25,
        4.5,
        6.0,  # truncated, as int() does in the Python path
        10.0,
        30.0,
    )
    assert list(histo.bucket_limit) == [0.0, 1.0, 4.0, 5.0]
    assert list(histo.bucket) == [0.0, 4.0, 0.0, 2.0]


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(
        st.text(min_size=1, max_size=300),
        st.floats(allow_nan=False) | st.sampled_from([-0.0, 1e39, -1e39, 1e-50, 3.4028235e38]),
        min_size=1,
        max_size=40,
    )
)
def test_scalar_entries_are_the_python_bytes(values: dict[str, float]) -> None:
    assert scalar_bytes(values) == python_scalar_bytes(values)
    built = Summary()
    for tag, value in values.items():
        built.value.add(tag=tag, simple_value=value)
    assert scalar_bytes(values) == built.SerializeToString()


def test_a_nan_scalar_stays_nan() -> None:
    (value,) = Summary.FromString(scalar_bytes({"x": math.nan})).value
    assert math.isnan(value.simple_value)


def test_prefixed_table_and_a_logger_prefix_read_back(tmp_path: Path) -> None:
    edges = [float(i) for i in range(4)]
    table = torch.tensor(
        [[3.0, 3.0, 5.0, 0.0, 2.0, *edges, 1.0, 1.0, 1.0], [0.0] * 5 + edges + [0.0] * 3],
        dtype=torch.float64,
    )
    hists = HistogramTable(table, 3, ("m/histogram", "empty/histogram"))
    assert list(hists.prefixed("p/")) == ["p/m/histogram"]  # the row without data left out
    logger = TensorBoardLogger(tmp_path, name="tb", prefix="run")
    write_tensorboard(logger, {"m/mean": 1.0}, hists, step=4)
    logger.experiment.flush()
    acc = events(logger.log_dir)
    assert acc.Tags()["histograms"] == ["run-m/histogram"]
    (event,) = acc.Histograms("run-m/histogram")
    assert event.step == 4
    assert event.histogram_value.num == 3 and list(event.histogram_value.bucket) == [0, 1, 1, 1]
    assert scalars(logger.log_dir)["run-m/mean"] == {4: 1.0}


def test_bad_tables_are_refused() -> None:
    tags = summary_proto.Tags(["a", "b"])
    with pytest.raises(ValueError, match=r"shape \(2, 7\).*expected \(m, 8\)"):
        summary_proto.histogram_entries(torch.zeros(2, 7, dtype=torch.float64), 1, tags)
    with pytest.raises(ValueError, match="contiguous float64"):
        summary_proto.histogram_entries(torch.zeros(2, 8, dtype=torch.float32), 1, tags)
    with pytest.raises(ValueError, match="3 values and 2 tags"):
        summary_proto.scalar_entries([1.0, 2.0, 3.0], tags)


def test_the_python_path_without_the_encoder(monkeypatch: pytest.MonkeyPatch) -> None:
    edges = [0.0, 1.0, 2.0]
    table = torch.tensor([[2.0, 1.0, 1.0, 0.0, 2.0, *edges, 0.0, 2.0]], dtype=torch.float64)
    hists = HistogramTable(table, 2, ("h",))
    with_c = tensorboard_summary({"s": 0.5}, hists).SerializeToString()
    monkeypatch.setenv("LIGHTNING_RECORDER_NATIVE", "0")
    native.reset()
    try:
        assert not summary_proto.available()
        without = tensorboard_summary({"s": 0.5}, hists).SerializeToString()
    finally:
        monkeypatch.delenv("LIGHTNING_RECORDER_NATIVE")
        native.reset()
    assert without == with_c
    assert summary_proto.available()
