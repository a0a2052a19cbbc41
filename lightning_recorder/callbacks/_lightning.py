"""Small Lightning helpers shared by the callbacks: stages, Lightning's step axis, step gating.

Everything that reads a private attribute of a Lightning loop lives here, behind a fallback, so
that a change in Lightning touches one file.

* **Step axis.** Lightning logs ``self.log`` metrics of training step ``k`` (0-based, counted in
  optimizer steps) at ``step=k``, and validation metrics at the number of optimizer steps done so
  far. :func:`step_axis` returns that number, so callbacks log on the same x axis. (During
  ``on_train_batch_end`` ``trainer.global_step`` is already ``k + 1``, and it counts one step per
  optimizer, so it is not that axis.)
* **TensorBoard.** :func:`write_tensorboard` writes many scalars and histograms of one step as
  one event, runs of empty buckets collapsed (:func:`collapse_empty_buckets`); the histograms of
  a :class:`HistogramTable` are encoded in C (:mod:`lightning_recorder._core.summary_proto`);
  :func:`native_checksums` gives a logger's event file the C CRC-32C
  (:mod:`lightning_recorder._core.crc32c`) in place of TensorBoard's pure-Python one, and
  :func:`restore_checksums` takes it back.
* **Weights & Biases.** :func:`write_wandb` logs the scalars and the same histograms as
  ``wandb.Histogram`` objects (:func:`numpy_histogram` converts the buckets).
* **Loggers.** :func:`histogram_loggers` tells which loggers can show histograms;
  :func:`logger_names` the class names a logger answers to (for per-logger options).
* **Gating.** "Every N steps" counts optimizer steps, not micro-batches: with gradient
  accumulation every micro-batch of a due optimizer step is recorded (:func:`is_due`), and the
  step is complete on the micro-batch that steps (:func:`completes_step`). Due steps are those
  where ``(k + 1) % N == 0`` — the rule of ``Trainer(log_every_n_steps=N)``, so that statistics
  land on the same steps as the loss.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.loggers import Logger, TensorBoardLogger, WandbLogger

from .._core import crc32c, summary_proto
from ..errors import RecorderConfigError

Stage = Literal["train", "val", "test", "predict"]
"""A loop of the Trainer, as it appears in tags: ``train``, ``val``, ``test`` or ``predict``."""

STAGES: tuple[Stage, ...] = get_args(Stage)


def check_stages(stages: object, owner: str) -> tuple[Stage, ...]:
    """Validate the ``stages`` option: one stage name or a sequence of them (order kept).

    Raises:
        RecorderConfigError: a name is not one of :data:`STAGES`.
    """
    items = (stages,) if isinstance(stages, str) else stages
    if not isinstance(items, Sequence) or isinstance(items, bytes):
        raise RecorderConfigError(
            f"Expected `stages` of {owner} to be a sequence of {', '.join(map(repr, STAGES))} "
            f"but got {stages!r}."
        )
    found: list[Stage] = []
    for item in items:
        if item not in STAGES:
            raise RecorderConfigError(
                f"Expected `stages` of {owner} to hold only {', '.join(map(repr, STAGES))} "
                f"but got {item!r}."
            )
        if item not in found:
            found.append(item)
    return tuple(found)


def step_axis(trainer: pl.Trainer) -> int:
    """Lightning's x axis for logged metrics: optimizer steps completed before this batch."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    value = getattr(loop, "_batches_that_stepped", None)
    return value if isinstance(value, int) else int(trainer.global_step)


def completes_step(trainer: pl.Trainer) -> bool:
    """Whether the current training batch ends with an optimizer step (false while accumulating)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    should_accumulate = getattr(loop, "_should_accumulate", None)
    return True if should_accumulate is None else not should_accumulate()


def is_due(step: int, every_n_steps: int) -> bool:
    """Whether optimizer step ``step`` (0-based) is one of every ``every_n_steps`` steps."""
    return (step + 1) % every_n_steps == 0


def write_tensorboard(
    logger: TensorBoardLogger,
    scalars: dict[str, float],
    hists: Mapping[str, dict[str, Any]],
    step: int,
) -> None:
    """Write scalars and histograms as one TensorBoard event (one queue put, not one per tag).

    Writing each scalar through ``add_scalar`` costs a queue hand-off to the writer thread per
    tag, two orders of magnitude more than building one ``Summary`` with many values. Runs of
    empty histogram buckets are written as one bucket each (:func:`collapse_empty_buckets`):
    TensorBoard shows the same histogram from fewer bytes (which its writer thread checksums, in
    Python unless :func:`native_checksums` gave it the C checksum). The logger's ``prefix`` is
    applied as its ``log_metrics`` would. The writers of ``torch.utils.tensorboard`` and of
    tensorboardX get the one event (tensorboardX checksums it in C when the ``crc32c`` package is
    installed); other writers get one call per tag. Call on rank 0 only.

    Args:
        logger: the TensorBoard logger.
        scalars: ``{tag: value}``.
        hists: ``{tag: keyword arguments of SummaryWriter.add_histogram_raw}``, or a
            :class:`HistogramTable` (encoded in C where the encoder is built).
        step: the ``global_step`` of every value.
    """
    prefix = getattr(logger, "_prefix", "")
    if prefix:
        join = getattr(logger, "LOGGER_JOIN_CHAR", "-")
        scalars = {f"{prefix}{join}{k}": v for k, v in scalars.items()}
        if isinstance(hists, HistogramTable):
            hists = hists.prefixed(f"{prefix}{join}")
        else:
            hists = {f"{prefix}{join}{k}": v for k, v in hists.items()}
    writer = logger.experiment
    summary_type = summary_class(writer)
    if summary_type is None:  # a writer of unknown make: its public API, one call per tag
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, step)
        for tag, kwargs in hists.items():
            limits, counts = collapse_empty_buckets(
                kwargs["bucket_limits"], kwargs["bucket_counts"]
            )
            kwargs = {**kwargs, "bucket_limits": limits, "bucket_counts": counts}
            writer.add_histogram_raw(tag, global_step=step, **kwargs)
        return
    summary = tensorboard_summary(scalars, hists, summary_type)
    if summary.value:
        writer._get_file_writer().add_summary(summary, step)


_LENGTH = struct.Struct("<Q")
_CHECKSUM = struct.Struct("<I")


def write_record(file: Any, data: bytes) -> None:
    """TensorBoard's ``RecordWriter.write`` (length, its masked CRC-32C, the data, its masked
    CRC-32C) with the checksums computed in C."""
    header = _LENGTH.pack(len(data))
    masked = crc32c.masked_crc32c
    file.write(
        b"".join((header, _CHECKSUM.pack(masked(header)), data, _CHECKSUM.pack(masked(data))))
    )


def native_checksums(logger: TensorBoardLogger) -> Any:
    """Make the event file of ``logger`` (a ``torch.utils.tensorboard`` writer) checksum its
    records with the C CRC-32C; return the record writer changed, for
    :func:`restore_checksums`, or ``None`` where nothing was changed.

    TensorBoard's record writer computes both checksums of every record in pure Python (about
    0.24 ms per KiB) on its writer thread, holding the GIL the training thread needs. Only that
    one writer object changes (its ``write``, as an instance attribute): the bytes written are
    the same, and nothing else in TensorBoard is touched. Nothing changes where the C checksum
    is not built here, for another writer (tensorboardX checksums in C itself when the
    ``crc32c`` package is installed), for a TensorBoard whose writer is laid out otherwise, or
    for a record writer whose ``write`` was already replaced. Call on rank 0 only.
    """
    if not crc32c.available():
        return None
    writer = logger.experiment
    if not type(writer).__module__.startswith("torch.utils.tensorboard"):
        return None
    try:
        from tensorboard.summary.writer.record_writer import RecordWriter

        record_writer = writer._get_file_writer().event_writer._async_writer._writer
        file = record_writer._writer
    except (ImportError, AttributeError):
        return None
    if type(record_writer) is not RecordWriter or "write" in vars(record_writer):
        return None
    record_writer.write = partial(write_record, file)
    return record_writer


def restore_checksums(record_writer: Any) -> None:
    """Give a record writer changed by :func:`native_checksums` back its own ``write`` (unless
    something else has replaced it since)."""
    write = vars(record_writer).get("write")
    if isinstance(write, partial) and write.func is write_record:
        del record_writer.write


def summary_class(writer: object) -> Any:
    """The ``Summary`` message class of a ``SummaryWriter``: TensorBoard's for
    ``torch.utils.tensorboard``, tensorboardX's own for tensorboardX (the same schema, another
    Python class), ``None`` for other writers."""
    module = type(writer).__module__
    if module.startswith("torch.utils.tensorboard"):
        from tensorboard.compat.proto.summary_pb2 import Summary

        return Summary
    if module.startswith("tensorboardX"):
        from tensorboardX.proto.summary_pb2 import Summary as SummaryX

        return SummaryX
    return None


class HistogramTable(Mapping[str, dict[str, Any]]):
    """The histograms of one logged step as one host table: row ``i`` of ``table`` (a contiguous
    float64 CPU tensor of :func:`~lightning_recorder.stats._kernels.raw_table`'s rows, ``bins``
    buckets) is the histogram of ``tags[i]``; rows without data are not histograms.

    As a mapping it is the ``{tag: add_histogram_raw keyword arguments}`` of the others
    (:meth:`HistogramRow.raw_kwargs`, built on first use); :func:`tensorboard_summary` encodes
    its rows in C instead (:func:`histogram_entries`), without a Python object per histogram.
    """

    __slots__ = ("_kwargs", "bins", "table", "tags")

    def __init__(self, table: torch.Tensor, bins: int, tags: tuple[str, ...]) -> None:
        self.table, self.bins, self.tags = table, bins, tags
        self._kwargs: dict[str, dict[str, Any]] | None = None

    def prefixed(self, prefix: str) -> HistogramTable:
        """The same histograms with ``prefix`` before every tag."""
        return HistogramTable(self.table, self.bins, tuple(prefix + tag for tag in self.tags))

    def _dict(self) -> dict[str, dict[str, Any]]:
        if self._kwargs is None:
            from ..stats._kernels import HistogramRow

            self._kwargs = {}
            for tag, row in zip(self.tags, self.table.tolist(), strict=True):
                kwargs = HistogramRow.from_flat(row, self.bins).raw_kwargs()
                if kwargs is not None:
                    self._kwargs[tag] = kwargs
        return self._kwargs

    def __getitem__(self, tag: str) -> dict[str, Any]:
        return self._dict()[tag]

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._dict())


_TAG_BYTES: dict[tuple[str, ...], summary_proto.Tags] = {}  # each table's tags, encoded


def _encoded_tags(tags: tuple[str, ...]) -> summary_proto.Tags:
    found = _TAG_BYTES.get(tags)
    if found is None:
        if len(_TAG_BYTES) >= 64:  # a bound, for runs that invent tags
            _TAG_BYTES.clear()
        found = _TAG_BYTES[tags] = summary_proto.Tags(tags)
    return found


def histogram_entries(hists: HistogramTable) -> bytes | None:
    """The serialized ``Summary.value`` entries of ``hists`` (runs of empty buckets collapsed, as
    :func:`tensorboard_summary` collapses them), or ``None`` where the C encoder is not built."""
    if not summary_proto.available():
        return None
    return summary_proto.histogram_entries(hists.table, hists.bins, _encoded_tags(hists.tags))


def tensorboard_summary(
    scalars: dict[str, float], hists: Mapping[str, dict[str, Any]], summary_type: Any = None
) -> Any:
    """One ``Summary`` of scalars (``simple_value``) and histograms (``HistogramProto``, runs of
    empty buckets collapsed) — the event :func:`write_tensorboard` writes. ``summary_type`` is
    the message class (:func:`summary_class`); ``None`` is TensorBoard's. The histograms of a
    :class:`HistogramTable` are encoded in C where the encoder is built."""
    if summary_type is None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary_type = Summary
    if isinstance(hists, HistogramTable):
        entries = histogram_entries(hists)
        if entries is not None:  # scalars and histograms parsed from their wire bytes at once
            return summary_type.FromString(scalar_bytes(scalars) + entries)
    # the scalars parsed from their wire bytes (one C call), then the histograms added in place
    summary = summary_type.FromString(scalar_bytes(scalars)) if scalars else summary_type()
    add = summary.value.add  # filling the message in place is twice as fast as building values
    for tag, kw in hists.items():
        histo = add(tag=tag).histo
        histo.min, histo.max, histo.num = kw["min"], kw["max"], kw["num"]
        histo.sum, histo.sum_squares = kw["sum"], kw["sum_squares"]
        limits, counts = collapse_empty_buckets(kw["bucket_limits"], kw["bucket_counts"])
        histo.bucket_limit.extend(limits)
        histo.bucket.extend(counts)
    return summary


# The protobuf wire format of a scalar in a TensorBoard ``Summary``
# (tensorboard/compat/proto/summary.proto): an entry of ``Summary.value`` (field 1, length
# delimited) holding ``tag`` (field 1, a string) and ``simple_value`` (field 2, a little-endian
# float32). A key byte is ``field << 3 | wire type`` (2: length-delimited, 5: 32-bit).
_SCALAR_PREFIXES: dict[str, bytes] = {}  # tag -> its entry's bytes up to the float


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _scalar_prefix(tag: str) -> bytes:
    prefix = _SCALAR_PREFIXES.get(tag)
    if prefix is None:
        name = tag.encode()
        inner = b"\x0a" + _varint(len(name)) + name + b"\x15"
        prefix = b"\x0a" + _varint(len(inner) + 4) + inner
        if len(_SCALAR_PREFIXES) >= 2**16:  # a bound, for runs that invent tags
            _SCALAR_PREFIXES.clear()
        _SCALAR_PREFIXES[tag] = prefix
    return prefix


def scalar_bytes(scalars: dict[str, float]) -> bytes:
    """The serialized ``Summary`` of ``scalars`` as ``simple_value`` s: each value rounded to
    float32 as protobuf rounds it (beyond its range to an infinity); the tags' bytes are cached,
    a monitor writing the same tags on every logged step (encoded in C where it is built)."""
    if scalars and summary_proto.available():
        return summary_proto.scalar_entries(list(scalars.values()), _encoded_tags(tuple(scalars)))
    return python_scalar_bytes(scalars)


def python_scalar_bytes(scalars: dict[str, float]) -> bytes:
    """:func:`scalar_bytes` without the C encoder."""
    with np.errstate(over="ignore"):
        raw = np.asarray(list(scalars.values()), dtype=np.float64).astype("<f4").tobytes()
    return b"".join([_scalar_prefix(tag) + raw[4 * i : 4 * i + 4] for i, tag in enumerate(scalars)])


# Two or more empty buckets in a row, in a string of one byte per bucket (0: empty).
_EMPTY_RUN = re.compile(b"\x00{2,}")


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
    cover the same ranges with fewer rows. Counts are never negative, so a bucket is empty when
    its count is zero. The runs are found by a regular expression over one byte per bucket (a
    few microseconds for 31 buckets, about what the writer thread's pure-Python checksum spends
    on one or two of the 16-byte buckets saved); without a run of two or more empty buckets the
    inputs are returned as they are.
    """
    if counts.count(0.0) < 2:  # the common case of dense data: no run possible
        return limits, counts
    runs = [m.span() for m in _EMPTY_RUN.finditer(bytes(map(bool, counts)))]
    if not runs:
        return limits, counts
    kept_limits, kept_counts = list(limits), list(counts)
    for first, end in reversed(runs):  # from the right: the indices of the others stay
        del kept_limits[first : end - 1], kept_counts[first : end - 1]  # keep the run's last
    return kept_limits, kept_counts


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
    scalars: dict[str, float],
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


def predict_batch_indices(
    trainer: pl.Trainer, batch_idx: int, dataloader_idx: int
) -> list[int] | None:
    """The dataset indices of a predict batch, from the batch sampler Lightning wraps."""
    loader = getattr(getattr(trainer, "predict_loop", None), "_combined_loader", None)
    try:
        dataloader = loader.flattened[dataloader_idx]  # type: ignore[union-attr]
        seen = dataloader.batch_sampler.seen_batch_indices
        return list(seen[batch_idx])
    except (AttributeError, IndexError, TypeError):
        return None
