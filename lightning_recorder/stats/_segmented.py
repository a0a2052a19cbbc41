"""Statistics and histograms of many small tensors at once: one flat buffer, a segment each.

A step of a monitor with many small outputs (a deep MLP, a transformer's small projections)
pays per tensor for the Python and dispatch work of a dozen reductions, far more than the data
costs. Here every small tensor of a step is one *segment* of a flat ``float64`` buffer, and
each statistic is one segmented reduction (``index_add_``, ``scatter_reduce_``,
``bincount``) over the whole buffer: the same dozen operations for 1 tensor or 1,000.

The formulas are :func:`~._kernels.masked_state`'s in float64 (NaN and infinities counted
apart, ``M2`` by the one-pass rule where it loses at most ``CANCEL_BITS`` bits, from the
deviations elsewhere), so the states are those of :func:`~._kernels.batch_state` up to the
order of the additions. Nothing synchronises with the host on any device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ._kernels import F64, device_ranges, one_pass_suffices, summed_over_ranks

__all__ = ["flatten_segments", "segmented_histograms", "segmented_states"]


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
