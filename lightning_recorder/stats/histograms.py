"""Histograms of the finite values of a tensor over their global range, summed over ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .._core.checks import check_bool, check_int, check_tensor
from .._core.compat import distributed_active
from ._engine import chunks, flat_view, row_counts, stored_parts, tensor_state
from ._histogram import ranges, stream_table
from ._state import F64

__all__ = ["HistogramRow", "histogram", "histogram_raw_kwargs"]


class HistogramRow(NamedTuple):
    """One histogram on the host: the summary of its finite values, its edges and its counts.

    ``min``/``max`` are ``inf``/``-inf`` and the counts 0 when there is no finite value.
    """

    num: float
    sum: float
    sum_squares: float
    min: float
    max: float
    edges: list[float]  # bins + 1 edges
    counts: list[float]  # bins counts

    @classmethod
    def from_flat(cls, flat: Sequence[float], bins: int) -> HistogramRow:
        """A row from ``[num, sum, sum_squares, min, max, *edges, *counts]``."""
        num, total, squares, low, high = flat[:5]
        return cls(num, total, squares, low, high, list(flat[5 : 6 + bins]), list(flat[6 + bins :]))

    def raw_kwargs(self) -> dict[str, Any] | None:
        """``SummaryWriter.add_histogram_raw`` keyword arguments (add ``tag`` and
        ``global_step``), or ``None`` without a finite value: TensorBoard cannot show an empty
        histogram. A leading empty bucket's limit is the left edge, as in TensorBoard's own."""
        if self.num == 0:
            return None
        return {
            "min": self.min,
            "max": self.max,
            "num": int(self.num),
            "sum": self.sum,
            "sum_squares": self.sum_squares,
            "bucket_limits": self.edges,
            "bucket_counts": [0.0, *self.counts],
        }


def _check_bins(bins: object) -> int:
    check_int(bins, "bins")
    return bins  # type: ignore[return-value]


def histogram(
    x: Tensor, bins: int = 64, *, sync: bool = True, process_group: Any = None
) -> tuple[Tensor, Tensor]:
    """Bucket counts of the finite values of ``x`` over their global range, summed over ranks.

    The ``bins + 1`` edges span ``[min, max]`` of the finite values of every rank (all-reduced
    first), and bucket ``i`` holds ``edges[i] <= v < edges[i + 1]``, the last one closed, as in
    :func:`torch.histogram`; buckets are found arithmetically in the data's precision (float32
    for float32, float16 and bfloat16 data, float64 otherwise), so a value within rounding of an
    edge may be counted in the bucket next to it, as with :func:`torch.histc`. A single value
    ``v`` gives the range ``[v - 0.5, v + 0.5]``, no finite value the range ``[0, 1]`` and zero
    counts. Off the CPU nothing synchronises with the host.

    When ``torch.distributed`` is initialised and ``sync`` is true this is a collective: every
    rank of ``process_group`` must call it with the same ``bins``, also a rank with no data.

    Args:
        x: a tensor of any shape and real dtype; NaN and ±inf are left out.
        bins: the number of buckets.
        sync: whether to combine the data of every rank (ignored without ``torch.distributed``).
        process_group: the group to combine over; ``None`` is the default group.

    Returns:
        ``(counts, edges)``: ``float64`` tensors of ``bins`` and ``bins + 1`` elements.

    Raises:
        RecorderConfigError: if ``x`` is not a real tensor, ``bins`` is not a positive integer
            or ``sync`` is not a bool.

    Examples:
        >>> counts, edges = histogram(torch.tensor([0.0, 1.0, 1.0, 4.0, float("nan")]), bins=4)
        >>> counts.tolist(), edges.tolist()
        ([1.0, 2.0, 0.0, 1.0], [0.0, 1.0, 2.0, 3.0, 4.0])
    """
    bins = _check_bins(bins)
    check_bool(sync, "sync")
    table = _table(check_tensor(x, "x", real=True), bins, sync, process_group)
    return table[6 + bins :], table[5 : 6 + bins]


def histogram_raw_kwargs(
    x: Tensor, bins: int = 64, *, sync: bool = True, process_group: Any = None
) -> dict[str, Any] | None:
    """The keyword arguments of ``SummaryWriter.add_histogram_raw`` for the finite values of ``x``.

    ``min``, ``max``, ``num``, ``sum`` and ``sum_squares`` describe the finite values of every
    rank; ``bucket_limits`` are the right edges of the buckets of :func:`histogram`, after a
    leading empty bucket whose limit is the left edge (as TensorBoard's own histograms do). The
    values are plain Python numbers and identical on every rank. The same collective rules as
    :func:`histogram` apply; this one also copies the result to the host once.

    Args:
        x: a tensor of any shape and real dtype; NaN and ±inf are left out.
        bins: the number of buckets.
        sync: whether to combine the data of every rank (ignored without ``torch.distributed``).
        process_group: the group to combine over; ``None`` is the default group.

    Returns:
        The keyword arguments (add ``tag`` and ``global_step``), or ``None`` when no rank has a
        finite value (TensorBoard cannot show an empty histogram).

    Raises:
        RecorderConfigError: if ``x`` is not a real tensor, ``bins`` is not a positive integer
            or ``sync`` is not a bool.

    Examples:
        >>> kw = histogram_raw_kwargs(torch.tensor([0.0, 1.0, 1.0, 4.0]), bins=2)
        >>> kw["num"], kw["min"], kw["max"], kw["sum"], kw["sum_squares"]
        (4, 0.0, 4.0, 6.0, 18.0)
        >>> kw["bucket_limits"], kw["bucket_counts"]
        ([0.0, 2.0, 4.0], [0.0, 3.0, 1.0])
    """
    bins = _check_bins(bins)
    check_bool(sync, "sync")
    table = _table(check_tensor(x, "x", real=True), bins, sync, process_group)
    return HistogramRow.from_flat(table.tolist(), bins).raw_kwargs()


_SEARCHED_32 = (torch.float32, torch.float16, torch.bfloat16)


def _table(x: Tensor, bins: int, sync: bool, group: Any) -> Tensor:
    """The histogram of every element of ``x`` (every rank's when syncing) as one ``float64``
    row ``[num, sum, sum_squares, min, max, *edges, *counts]`` on ``x``'s device: its range from
    the packed state, then the integer counts of each chunk of ``x`` (no host read)."""
    syncing = sync and distributed_active(group)
    state = tensor_state(x)[None]
    if syncing:  # the declared reductions of the metrics: merged states, summed counts
        from .metric import BucketCounts, StreamStates

        merged = StreamStates(1, process_group=group).to(x.device)
        merged.update(state)
        state = merged.compute()
    lo, hi = ranges(state)
    counts = torch.zeros(1, bins, dtype=torch.int64, device=x.device)
    parts, zeros = stored_parts(x.detach())
    if zeros:  # a sparse tensor's implicit zeros, in the bucket of 0
        counts += zeros * row_counts(torch.zeros(1, 1, dtype=F64, device=x.device), lo, hi, bins)
    for part in parts:
        if not part.numel():
            continue
        # pieces of at most CHUNK elements: views of one block of memory, else copies made one
        # at a time (a reshape of a slice with gaps, or of an expanded tensor, copied it whole)
        for piece in chunks(part, flat_view(part)):
            dtype = torch.float32 if piece.dtype in _SEARCHED_32 else F64
            counts += row_counts(piece.to(dtype).view(1, -1), lo, hi, bins)
    found = counts.to(F64)
    if syncing:
        summed = BucketCounts(1, bins, process_group=group).to(x.device)
        summed.update(found)
        found = summed.compute()
    return stream_table(state, found, bins)[0]
