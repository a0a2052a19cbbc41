"""Statistics and histograms of many small tensors at once: one flat buffer, a segment each.

A step of a monitor with many small outputs (a deep MLP, a transformer's small projections)
pays per tensor for the Python and dispatch work of a dozen reductions, far more than the data
costs. Here every small tensor of a step is one *segment* of a flat ``float64`` buffer, and
each statistic is one segmented reduction (``index_add_``, ``scatter_reduce_``,
``bincount``) over the whole buffer: the same dozen operations for 1 tensor or 1,000.

Where the fused CPU kernels run (:mod:`._native`) and every tensor is float32 (float16,
bfloat16), :func:`native_segments` and :func:`native_segmented_histograms` do the same in one
call each over a flat float32 buffer, with the precision of
:func:`~._kernels.native_state`.

The formulas of the torch path are :func:`~._kernels.masked_state`'s in float64 (NaN and
infinities counted apart, ``M2`` by the one-pass rule where it loses at most ``CANCEL_BITS``
bits, from the deviations elsewhere), so the states are those of
:func:`~._kernels.batch_state` up to the order of the additions. Nothing synchronises with
the host on any device.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import _native
from ._kernels import (
    EXACT_IN_32,
    F64,
    NATIVE_CANCEL_BITS,
    Workspace,
    device_ranges,
    finished_row,
    one_pass_suffices,
    summed_over_ranks,
)

_FLOAT_32 = frozenset(EXACT_IN_32)

__all__ = [
    "flatten_segments",
    "native_segmented_histograms",
    "native_segmented_table",
    "native_segments",
    "segmented_histograms",
    "segmented_states",
]


def flatten_segments(groups: Sequence[Sequence[Tensor]], device: Any) -> tuple[Tensor, Tensor]:
    """The elements of the tensors of each group in one flat float64 buffer, and the group index
    of each element (``int64``); group ``i``'s tensors are segment ``i``."""
    flat = [t.reshape(-1) for tensors in groups for t in tensors]
    sizes = [sum(t.numel() for t in tensors) for tensors in groups]
    values = torch.cat([t.to(device=device, dtype=F64) for t in flat]) if flat else None
    if values is None:
        values = torch.zeros(0, dtype=F64, device=device)
    ids = torch.arange(len(groups), device=device)
    seg = torch.repeat_interleave(ids, torch.tensor(sizes, device=device))
    return values, seg


def segmented_states(v: Tensor, seg: Tensor, m: int) -> Tensor:
    """The ``(m, 9)`` packed states of the ``m`` segments of ``v`` (empty segments: the empty
    state)."""

    def total(x: Tensor) -> Tensor:
        return torch.zeros(m, dtype=F64, device=v.device).index_add_(0, seg, x)

    finite = torch.isfinite(v)
    safe = torch.where(finite, v, 0.0)
    numel = torch.bincount(seg, minlength=m).to(F64)
    count = total(finite.to(F64))
    sums = total(safe)
    mean = sums / count.clamp(min=1.0)
    squares = total(safe * safe)
    m2 = squares - sums * mean
    deviation = torch.where(finite, v - mean[seg], 0.0)
    m2 = torch.where(one_pass_suffices(squares, m2), m2, total(deviation * deviation))
    low = torch.full((m,), math.inf, dtype=F64, device=v.device)
    low.scatter_reduce_(0, seg, torch.where(finite, v, math.inf), "amin")
    high = torch.full((m,), -math.inf, dtype=F64, device=v.device)
    high.scatter_reduce_(0, seg, torch.where(finite, v, -math.inf), "amax")
    abs_mean = total(safe.abs()) / count.clamp(min=1.0)
    zeros = total((safe == 0).to(F64)) - (numel - count)  # non-finite ones read as zero
    return torch.stack([count, mean, m2, low, high, abs_mean, zeros, numel - count, numel], 1)


def segmented_histograms(
    v: Tensor, seg: Tensor, states: Tensor, bins: int, *, sync: bool, group: Any
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`~._kernels.histograms_device`'s histograms of the segments of ``v`` over the
    ranges of ``states`` (``(m, 9)``, those of the segments or of more data), in one bincount.

    A bucket is ``floor((v - lo) / width)`` in float64 (the last one closed): a value within
    float64 rounding of an edge may land in the bucket next to it, as with :func:`torch.histc`.
    """
    m = states.shape[0]
    vmin, vmax, lo, edges = device_ranges(states, bins, sync=sync, group=group)
    hi = edges[:, -1]
    finite = torch.isfinite(v)
    start = lo[seg]
    position = (torch.where(finite, v, start) - start) * (bins / (hi - lo))[seg]
    bucket = position.floor_().clamp_(0, bins - 1).to(torch.int64)
    index = seg * bins + bucket
    counts = torch.bincount(index, weights=finite.to(F64), minlength=m * bins).view(m, bins)
    counts, sums = summed_over_ranks(counts, states, sync=sync, group=group)
    return counts, edges, vmin, vmax, sums


def native_segments(
    groups: Sequence[Sequence[Tensor]], sizes: Sequence[int] | None = None
) -> tuple[Tensor, Tensor, Tensor] | None:
    """The tensors of each group in one flat float32 CPU buffer, the ``(m + 1,)`` segment
    offsets and the ``(m, 9)`` packed states of the segments, by the fused kernel in one call;
    ``None`` (nothing done) where it does not apply: no kernel, a tensor off the CPU or of
    another dtype than float32, float16 or bfloat16. ``sizes``: the number of elements of each
    group, when the caller knows them."""
    if not _native.available():
        return None
    flat = [t if t.dim() == 1 else t.reshape(-1) for tensors in groups for t in tensors]
    if not {t.dtype for t in flat} <= _FLOAT_32:  # float64, integers: the exact torch path
        return None
    if not flat:
        values = torch.zeros(0)
    else:
        try:
            values = torch.cat(flat)  # promotes to the widest dtype: float64 data declines
        except RuntimeError:  # tensors on several devices
            return None
    if values.device.type != "cpu":
        return None
    if values.dtype != torch.float32:
        values = values.float()
    if sizes is None:
        sizes = [sum(t.numel() for t in tensors) for tensors in groups]
    starts = [0, *itertools.accumulate(sizes)]
    offsets = torch.tensor(starts, dtype=torch.int64)
    # the states with one pass (non-finite values: none counted here; such segments are redone)
    states, redo = _native.segment_states(values, offsets, NATIVE_CANCEL_BITS)
    if redo is None:
        return values, offsets, states
    work = Workspace()
    for i, why in enumerate(redo.tolist()):  # rare: non-finite values, or cancellation
        if why:
            segment = values[starts[i] : starts[i] + sizes[i]]
            row = finished_row(segment, states[i].tolist(), why, work)
            states[i] = torch.tensor(row, dtype=F64)
    return values, offsets, states


def native_segmented_histograms(
    values: Tensor, offsets: Tensor, states: Tensor, bins: int, *, sync: bool, group: Any
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`segmented_histograms` of the segments of :func:`native_segments`, counted by the
    fused kernel in one call (float32 positions: a value within rounding of an edge may land in
    the bucket next to it); the same collectives, in the same order."""
    vmin, vmax, lo, edges = device_ranges(states, bins, sync=sync, group=group)
    scale = (bins / (edges[:, -1] - lo)).contiguous()
    counts = _native.segment_buckets(values, offsets, lo.contiguous(), scale, bins)
    counts[:, bins - 1] += counts[:, bins]  # values at the top edge: the last bucket is closed
    counts, sums = summed_over_ranks(counts[:, :bins], states, sync=sync, group=group)
    return counts, edges, vmin, vmax, sums


def native_segmented_table(values: Tensor, offsets: Tensor, states: Tensor, bins: int) -> Tensor:
    """:func:`native_segmented_histograms` for one process (no collective), as the table of
    :func:`~._kernels.raw_table`, in one call of the fused kernel: ranges, edges (linspace's
    operations), buckets and sums of every segment."""
    return _native.segment_table(values, offsets, states.contiguous(), bins)
