"""Histograms of the finite values of a tensor over their global range, summed over ranks."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._core.checks import check_int, check_tensor
from ._kernels import (
    F64,
    HistogramRow,
    Workspace,
    batch_state,
    histogram_rows,
    histogram_rows_cpu,
    histograms_device,
)

__all__ = ["HistogramRow", "histogram", "histogram_raw_kwargs"]


def _check_bins(bins: object) -> int:
    check_int(bins, "bins")
    return bins  # type: ignore[return-value]


def histogram(
    x: Tensor, bins: int = 64, *, sync: bool = True, process_group: Any = None
) -> tuple[Tensor, Tensor]:
    """Bucket counts of the finite values of ``x`` over their global range, summed over ranks.

    The ``bins + 1`` edges span ``[min, max]`` of the finite values of every rank (all-reduced
    first), and bucket ``i`` holds ``edges[i] <= v < edges[i + 1]``, the last one closed, as in
    :func:`torch.histogram`. A single value ``v`` gives the range ``[v - 0.5, v + 0.5]``, no
    finite value the range ``[0, 1]`` and zero counts. Off the CPU nothing synchronises with
    the host.

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
        RecorderConfigError: if ``x`` is not a real tensor or ``bins`` is not a positive integer.

    Example:
        >>> counts, edges = histogram(torch.tensor([0.0, 1.0, 1.0, 4.0, float("nan")]), bins=4)
        >>> counts.tolist(), edges.tolist()
        ([1.0, 2.0, 0.0, 1.0], [0.0, 1.0, 2.0, 3.0, 4.0])
    """
    x, bins = check_tensor(x, "x", real=True), _check_bins(bins)
    work = Workspace()
    state = batch_state(x, work)[None]
    if x.device.type != "cpu":
        counts, edges, *_ = histograms_device([[x]], state, bins, sync=sync, group=process_group)
        return counts[0], edges[0]
    (row,) = histogram_rows_cpu([[x]], state, bins, sync=sync, group=process_group, work=work)
    return torch.tensor(row.counts, dtype=F64), torch.tensor(row.edges, dtype=F64)


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
        RecorderConfigError: if ``x`` is not a real tensor or ``bins`` is not a positive integer.

    Example:
        >>> kw = histogram_raw_kwargs(torch.tensor([0.0, 1.0, 1.0, 4.0]), bins=2)
        >>> kw["num"], kw["min"], kw["max"], kw["sum"], kw["sum_squares"]
        (4, 0.0, 4.0, 6.0, 18.0)
        >>> kw["bucket_limits"], kw["bucket_counts"]
        ([0.0, 2.0, 4.0], [0.0, 3.0, 1.0])
    """
    x, bins = check_tensor(x, "x", real=True), _check_bins(bins)
    work = Workspace()
    state = batch_state(x, work)[None]
    (row,) = histogram_rows([[x]], state, bins, sync=sync, group=process_group, work=work)
    return row.raw_kwargs()
