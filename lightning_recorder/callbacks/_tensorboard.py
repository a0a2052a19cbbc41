"""Writing one logged step to TensorBoard and Weights & Biases.

* **TensorBoard.** :func:`write_tensorboard` writes the scalars and histograms of one step as one
  event: a ``Summary`` built with protobuf's own API (:func:`tensorboard_summary`), handed to the
  writer's public ``file_writer.add_summary``. Runs of empty histogram buckets are written as one
  bucket each (:func:`collapse_empty_buckets`). Writers of unknown make get one public
  ``add_scalar`` / ``add_histogram_raw`` call per tag instead.
* **One table of histograms.** The monitor hands over the histograms of a step as one host
  table (:class:`HistogramTable`); for other loggers it is the usual mapping of
  ``add_histogram_raw`` keyword arguments.
* **Weights & Biases.** :func:`write_wandb` logs the scalars and the same histograms as
  ``wandb.Histogram`` objects (:func:`numpy_histogram` converts the buckets).
* **Loggers.** :func:`histogram_loggers` tells which loggers can show histograms;
  :func:`logger_names` the class names a logger answers to (for per-logger options);
  :func:`checksummed_in_python` whether TensorBoard's own writer checksums a logger's records.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from lightning.pytorch.loggers import Logger, TensorBoardLogger, WandbLogger

from ._lightning import logger_prefix
from .tensorboard_logger import TensorBoardLogger as RecorderTensorBoardLogger

#: TensorBoard's own writer checksums every record in pure Python, up to about this many ms per
#: KiB (``benchmarks/bench_writer.py`` under load; 0.2 on a quiet machine), on its writer
#: thread, holding the GIL.
PURE_PYTHON_CHECKSUM_MS_PER_KIB = 0.3
#: A logged step's event of more bytes than this costs that checksum about 10 ms: worth saying.
SLOW_CHECKSUM_BYTES = 32 * 1024
#: The most buckets a ``wandb.Histogram`` holds (``wandb.Histogram.MAX_LENGTH``).
WANDB_MAX_BINS = 512


class HistogramTable(Mapping[str, dict[str, Any]]):
    """The histograms of one logged step as one host table.

    Row ``i`` of ``table`` (float64, ``(len(tags), 2 * bins + 6)``) is the histogram of
    ``tags[i]``: ``[num, sum, sum_squares, min, max, *edges, *counts]`` with ``bins + 1`` edges
    and ``bins`` counts (bucket ``j`` covers ``(edges[j], edges[j + 1]]``); a row whose ``num``
    is 0 has no data and is no histogram (TensorBoard cannot show an empty one).

    As a mapping it is ``{tag: SummaryWriter.add_histogram_raw keyword arguments}`` (built on
    first use), TensorBoard's leading empty bucket included, for the loggers that take those;
    :func:`tensorboard_summary` reads the table itself, without a Python object per histogram.

    Args:
        table: the rows, a numpy array or a CPU tensor (converted to float64).
        bins: the number of buckets of every row.
        tags: one tag per row.

    Raises:
        ValueError: the table is not two-dimensional with ``len(tags)`` rows of
            ``2 * bins + 6`` numbers.
    """

    __slots__ = ("_kwargs", "bins", "table", "tags")

    def __init__(self, table: np.ndarray | torch.Tensor, bins: int, tags: Sequence[str]) -> None:
        if isinstance(table, torch.Tensor):
            table = table.detach().to("cpu", torch.float64).numpy()
        rows = np.ascontiguousarray(table, dtype=np.float64)
        tags = tuple(tags)
        if rows.ndim != 2 or rows.shape != (len(tags), 2 * bins + 6):
            raise ValueError(
                f"Expected a histogram table of shape ({len(tags)}, {2 * bins + 6}) (one row of "
                f"2 * bins + 6 numbers per tag, bins={bins}) but got {tuple(rows.shape)}."
            )
        self.table, self.bins, self.tags = rows, bins, tags
        self._kwargs: dict[str, dict[str, Any]] | None = None

    def prefixed(self, prefix: str) -> HistogramTable:
        """The same histograms with ``prefix`` before every tag."""
        return HistogramTable(self.table, self.bins, [prefix + tag for tag in self.tags])

    def _dict(self) -> dict[str, dict[str, Any]]:
        if self._kwargs is None:
            bins = self.bins
            self._kwargs = {
                tag: {
                    "min": row[3],
                    "max": row[4],
                    "num": int(row[0]),
                    "sum": row[1],
                    "sum_squares": row[2],
                    "bucket_limits": row[5 : 6 + bins],
                    "bucket_counts": [0.0, *row[6 + bins :]],
                }
                for tag, row in zip(self.tags, self.table.tolist(), strict=True)
                if row[0] != 0
            }
        return self._kwargs

    def __getitem__(self, tag: str) -> dict[str, Any]:
        return self._dict()[tag]

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._dict())


def kept_buckets(counts: np.ndarray) -> np.ndarray:
    """Which buckets :func:`collapse_empty_buckets` keeps, for each row of ``counts`` (the
    last axis is the buckets): all but the empty buckets followed by an empty bucket."""
    empty = counts == 0
    keep = np.ones(empty.shape, dtype=bool)
    np.logical_not(empty[..., :-1] & empty[..., 1:], out=keep[..., :-1])
    return keep


def collapse_empty_buckets(
    limits: Sequence[float], counts: Sequence[float]
) -> tuple[Sequence[float], Sequence[float]]:
    """The buckets of a ``HistogramProto`` with each run of consecutive empty buckets written as
    one empty bucket reaching to the run's last limit (TensorFlow's encoder with
    ``preserve_zero_buckets=False``).

    Bucket ``i`` covers ``(limits[i - 1], limits[i]]``, so the merged bucket covers exactly the
    run's range with the run's count, zero: every range holds the count it held, and the limits
    kept are a subset of the given ones. TensorBoard turns the buckets into ``[left, right,
    count]`` rows (``tensorboard.data_compat``: the empty buckets at both ends dropped,
    ``min``/``max`` as the outer edges): its non-empty rows are the same, and its empty rows
    cover the same ranges with fewer rows. Without a run of two or more empty buckets the
    inputs are returned as they are.
    """
    if len(counts) < 2 or list(counts).count(0) < 2:  # dense data: no run possible
        return limits, counts
    keep = kept_buckets(np.asarray(counts, dtype=np.float64))
    if keep.all():
        return limits, counts
    kept = keep.tolist()
    return (
        [x for x, k in zip(limits, kept, strict=True) if k],
        [x for x, k in zip(counts, kept, strict=True) if k],
    )


class _Histograms(NamedTuple):
    """Histograms ready for a ``Summary``: tags, ``(num, sum, sum_squares, min, max)`` each,
    and their collapsed buckets, concatenated (histogram ``i`` ends at ``ends[i]``)."""

    tags: tuple[str, ...]
    heads: list[list[float]]
    limits: list[float]
    counts: list[float]
    ends: list[int]


def _table_histograms(hists: HistogramTable) -> _Histograms:
    """:class:`_Histograms` of a table: the collapse found for every row at once."""
    rows, bins = hists.table, hists.bins
    has_data = rows[:, 0] != 0
    tags = hists.tags
    if not has_data.all():
        rows = rows[has_data]
        tags = tuple(t for t, kept in zip(tags, has_data.tolist(), strict=True) if kept)
    counts = np.zeros((rows.shape[0], bins + 1))  # TensorBoard's leading empty bucket first
    counts[:, 1:] = rows[:, 6 + bins :]
    keep = kept_buckets(counts)
    heads = rows[:, :5].copy()
    heads[:, 0] = np.trunc(heads[:, 0])  # `num` as the mapping's int() has it
    return _Histograms(
        tags,
        heads.tolist(),
        rows[:, 5 : 6 + bins][keep].tolist(),
        counts[keep].tolist(),
        np.cumsum(keep.sum(axis=1)).tolist(),
    )


def _mapping_histograms(hists: Mapping[str, dict[str, Any]]) -> _Histograms:
    """:class:`_Histograms` of ``{tag: add_histogram_raw keyword arguments}``."""
    heads: list[list[float]] = []
    limits: list[float] = []
    counts: list[float] = []
    ends: list[int] = []
    for kw in hists.values():
        kept_limits, kept_counts = collapse_empty_buckets(kw["bucket_limits"], kw["bucket_counts"])
        heads.append([kw["num"], kw["sum"], kw["sum_squares"], kw["min"], kw["max"]])
        limits.extend(kept_limits)
        counts.extend(kept_counts)
        ends.append(len(limits))
    return _Histograms(tuple(hists), heads, limits, counts, ends)


# The entries of each (message class, scalar tags, histogram tags) seen lately, tags only: a
# step's Summary is copied from it in one call and filled in place, which costs half of adding
# its entries one by one (the tags are not converted again).
_TEMPLATES: dict[tuple[Any, tuple[str, ...], tuple[str, ...]], Any] = {}


def _template(
    summary_type: Any, scalar_tags: tuple[str, ...], histogram_tags: tuple[str, ...]
) -> Any:
    key = (summary_type, scalar_tags, histogram_tags)
    found = _TEMPLATES.get(key)
    if found is None:
        if len(_TEMPLATES) >= 16:  # a bound, for runs that invent tags
            _TEMPLATES.clear()
        found = summary_type()
        add = found.value.add
        for tag in scalar_tags + histogram_tags:
            add(tag=tag)
        _TEMPLATES[key] = found
    return found


def tensorboard_summary(
    scalars: Mapping[str, float], hists: Mapping[str, dict[str, Any]], summary_type: Any = None
) -> Any:
    """One ``Summary`` of scalars (``simple_value``) and histograms (``HistogramProto``, runs of
    empty buckets collapsed): what ``add_scalar`` and ``add_histogram_raw`` write, as one event.

    Args:
        scalars: ``{tag: value}``.
        hists: a :class:`HistogramTable` or ``{tag: add_histogram_raw keyword arguments}``.
        summary_type: the ``Summary`` message class (:func:`summary_class`); ``None`` is
            TensorBoard's.

    Returns:
        The message, the scalars first, in the order given.
    """
    if summary_type is None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary_type = Summary
    if isinstance(hists, HistogramTable):
        histograms = _table_histograms(hists)
    else:
        histograms = _mapping_histograms(hists)
    summary = summary_type()
    summary.CopyFrom(_template(summary_type, tuple(scalars), histograms.tags))
    values = iter(summary.value)
    # the scalars first (`values` goes on with the histograms: zip stops on the scalars)
    for scalar, value in zip(scalars.values(), values, strict=False):
        value.simple_value = scalar
    limits, counts, start = histograms.limits, histograms.counts, 0
    for value, head, end in zip(values, histograms.heads, histograms.ends, strict=True):
        histo = value.histo
        histo.num, histo.sum, histo.sum_squares, histo.min, histo.max = head
        histo.bucket_limit.extend(limits[start:end])
        histo.bucket.extend(counts[start:end])
        start = end
    return summary


def summary_class(writer: object) -> Any:
    """The ``Summary`` message class of a ``SummaryWriter``: TensorBoard's for
    ``torch.utils.tensorboard`` writers (and their subclasses), tensorboardX's own for
    tensorboardX (the same schema, another Python class), ``None`` for other writers."""
    make = _writer_make(writer)
    if make == "torch":
        from tensorboard.compat.proto.summary_pb2 import Summary

        return Summary
    if make == "tensorboardX":
        from tensorboardX.proto.summary_pb2 import Summary as SummaryX

        return SummaryX
    return None


def _writer_make(writer: object) -> str | None:
    """``"torch"`` for a ``torch.utils.tensorboard`` writer (or a subclass), ``"tensorboardX"``
    for tensorboardX's, ``None`` for a writer of another make."""
    modules = [cls.__module__ for cls in type(writer).__mro__]
    if any(m.startswith("torch.utils.tensorboard") for m in modules):
        return "torch"
    if any(m.startswith("tensorboardX") for m in modules):
        return "tensorboardX"
    return None


def write_tensorboard(
    logger: TensorBoardLogger,
    scalars: Mapping[str, float],
    hists: Mapping[str, dict[str, Any]],
    step: int,
) -> Any:
    """Write scalars and histograms as one TensorBoard event (one queue put, not one per tag).

    Writing each scalar through ``add_scalar`` costs a queue hand-off to the writer thread per
    tag, two orders of magnitude more than one ``Summary`` with many values. The event goes
    through the writer's public ``file_writer`` (``torch.utils.tensorboard`` and tensorboardX
    writers, :class:`~lightning_recorder.TensorBoardLogger`'s); a writer of another make, or one
    whose ``file_writer`` is closed, gets one ``add_scalar`` / ``add_histogram_raw`` call per
    tag. A logger's public ``prefix`` (:class:`~lightning_recorder.TensorBoardLogger`'s) is
    applied as its ``log_metrics`` would; Lightning's ``TensorBoardLogger`` keeps its own to
    itself, and there the tags are written as given. Call on rank 0 only.

    Args:
        logger: the TensorBoard logger.
        scalars: ``{tag: value}``.
        hists: ``{tag: keyword arguments of SummaryWriter.add_histogram_raw}``, or a
            :class:`HistogramTable`.
        step: the ``global_step`` of every value.

    Returns:
        The ``Summary`` written as one event, or ``None`` (nothing to write, or a writer that
        took one call per tag).
    """
    prefix = logger_prefix(logger)
    if prefix:
        join = getattr(logger, "LOGGER_JOIN_CHAR", "-")
        scalars = {f"{prefix}{join}{k}": v for k, v in scalars.items()}
        if isinstance(hists, HistogramTable):
            hists = hists.prefixed(f"{prefix}{join}")
        else:
            hists = {f"{prefix}{join}{k}": v for k, v in hists.items()}
    writer = logger.experiment
    summary_type = summary_class(writer)
    file_writer = None if summary_type is None else getattr(writer, "file_writer", None)
    if file_writer is None:  # a writer of unknown make, or closed: its public API, per tag
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, step)
        for tag, kwargs in hists.items():
            limits, counts = collapse_empty_buckets(
                kwargs["bucket_limits"], kwargs["bucket_counts"]
            )
            kwargs = {**kwargs, "bucket_limits": limits, "bucket_counts": counts}
            writer.add_histogram_raw(tag, global_step=step, **kwargs)
        return None
    summary = tensorboard_summary(scalars, hists, summary_type)
    if not summary.value:
        return None
    file_writer.add_summary(summary, step)
    return summary


def checksummed_in_python(logger: TensorBoardLogger) -> bool:
    """Whether TensorBoard's own writer checksums the records of ``logger`` (in pure Python,
    :data:`PURE_PYTHON_CHECKSUM_MS_PER_KIB`): Lightning's ``TensorBoardLogger`` writing through
    ``torch.utils.tensorboard``. ``False`` for :class:`~lightning_recorder.TensorBoardLogger`
    (in C with the ``google-crc32c`` wheel; without it, it says so itself when made) and for
    tensorboardX's writer (which uses the ``crc32c`` wheel where installed)."""
    if isinstance(logger, RecorderTensorBoardLogger):
        return False
    return _writer_make(logger.experiment) == "torch"


def histogram_loggers(loggers: Sequence[Logger]) -> tuple[list[Logger], list[Logger]]:
    """The loggers that can show histograms (TensorBoard, W&B), and the others."""
    able: list[Logger] = [lg for lg in loggers if isinstance(lg, (TensorBoardLogger, WandbLogger))]
    return able, [lg for lg in loggers if lg not in able]


def logger_names(logger: Logger) -> set[str]:
    """The class names a logger answers to: its class and its base classes."""
    return {cls.__name__ for cls in type(logger).__mro__}


def numpy_histogram(kwargs: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, edges)``, as :func:`numpy.histogram` returns them, from the
    ``add_histogram_raw`` keyword arguments the monitor writes to TensorBoard: the same buckets
    (``bins`` counts, ``bins + 1`` edges; TensorBoard's leading empty bucket dropped)."""
    edges = np.asarray(kwargs["bucket_limits"], dtype=np.float64)
    counts = np.asarray(kwargs["bucket_counts"][1:], dtype=np.float64)
    if edges.ndim != 1 or counts.shape[0] != edges.shape[0] - 1:
        raise ValueError(
            f"Expected bins + 1 bucket limits for bins + 1 bucket counts (a leading empty one) "
            f"but got {edges.shape[0]} limits and {len(kwargs['bucket_counts'])} counts."
        )
    return counts, edges


def write_wandb(
    logger: WandbLogger,
    scalars: Mapping[str, float],
    hists: Mapping[str, dict[str, Any]],
    step: int,
) -> None:
    """Log scalars and histograms (``wandb.Histogram`` from the very buckets written to
    TensorBoard) in one ``log_metrics`` call. Call on rank 0 only."""
    values: dict[str, Any] = dict(scalars)
    if hists:
        import wandb

        for tag, kwargs in hists.items():
            values[tag] = wandb.Histogram(np_histogram=numpy_histogram(kwargs))
    if values:
        logger.log_metrics(values, step=step)
