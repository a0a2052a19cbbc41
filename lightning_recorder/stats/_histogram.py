"""The one histogram: ranges from packed states, then integer bucket counts of many rows at once.

**Ranges.** A stream's histogram spans ``[min, max]`` of its finite values (its packed state,
merged over every rank first), with the rule of :func:`torch.histogram`: ``[v - 0.5, v + 0.5]``
around a single value, ``[0, 1]`` without data; the ``bins + 1`` edges are those of
``torch.linspace`` with both ends exact (:func:`edges`).

**Buckets.** :func:`bucket_index` finds the bucket of every value of ``R`` rows (padded with
NaN, which is never counted, like every non-finite value) arithmetically in the values' own
precision, as :func:`torch.histc` does — bucket ``i`` holds ``edges[i] <= v < edges[i + 1]``,
the last bucket closed, up to rounding at the edges — in one pass (a kernel of the engine,
compiled where it can be, offset by its row's place in the same pass: :func:`bucket_keys`), and
:func:`tally` counts them with one integer count for every row
(``bincount`` on the CPU, ``index_add_`` elsewhere): no per-row Python, no floating-point
atomics, the same counts on every device and under ``torch.use_deterministic_algorithms(True)``.

**Streams from rows.** A stream may have several rows (a module called twice, or samples of
different sizes), each standing for ``weight`` elements per value: :func:`stream_counts` adds
the weighted rows of each stream, gathered by a table of each stream's rows and summed in a
fixed order (no atomics, no matrix product: nothing that depends on the device's libraries).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._state import COUNT, F64, M2, MAX, MEAN, MIN

__all__ = [
    "add_ones",
    "bucket_index",
    "bucket_keys",
    "count_keys",
    "edges",
    "ranges",
    "sample_keys",
    "sample_table",
    "scaled_counts",
    "stream_counts",
    "stream_table",
    "summaries",
    "tally",
]


def ranges(states: Tensor) -> tuple[Tensor, Tensor]:
    """The ranges ``lo``, ``hi`` (``float64``, shaped like ``states[..., 0]``) of the histograms
    of packed states, with the rule of :func:`torch.histogram`."""
    low, high = states[..., MIN], states[..., MAX]
    seen = high >= low
    lo = torch.where(seen, low, 0.0)
    hi = torch.where(seen, high, 1.0)
    flat = lo == hi
    return torch.where(flat, lo - 0.5, lo), torch.where(flat, hi + 0.5, hi)


def edges(lo: Tensor, hi: Tensor, bins: int) -> Tensor:
    """``torch.linspace(lo, hi, bins + 1)`` for tensors of end points (no host read), ``(...,
    bins + 1)``; both ends are exact: the first half counts up from ``lo``, the second down
    from ``hi``."""
    steps = bins + 1
    i = torch.arange(steps, dtype=F64, device=lo.device)
    lo, hi = lo.unsqueeze(-1), hi.unsqueeze(-1)
    # a range wider than float64 holds (ends of both signs beyond half its largest value) is
    # spanned at half scale: halving is exact, and 1 for every other range changes nothing
    half = halving(lo, hi, F64)
    lo, hi = lo * half, hi * half
    step = (hi - lo) / bins
    return torch.where(i < steps // 2, lo + step * i, hi - step * (steps - 1 - i)) / half


def halving(lo: Tensor, hi: Tensor, dtype: torch.dtype) -> Tensor:
    """``0.5`` for a range ``[lo, hi]`` (``float64``) too wide for ``hi - lo`` in ``dtype`` (more
    than half its largest finite value: the difference could overflow), else ``1.0``; the
    factor by which :func:`edges` and :func:`bucket_index` scale the values first."""
    return torch.where(hi - lo > torch.finfo(dtype).max / 2, 0.5, 1.0)


def bucket_index(values: Tensor, lo: Tensor, hi: Tensor, bins: int) -> Tensor:
    """The bucket of each value of the rows of ``values`` ``(R, S)`` (float32 or float64) over its
    row's range ``[lo, hi]`` (``(R,)``, ``float64``): ``floor((v - lo) * bins / (hi - lo))`` in
    the values' own precision, the last bucket closed; ``bins`` for a value that is not counted
    (non-finite, or outside its row's range). An ``int32`` tensor of ``values``' shape. A kernel
    of the engine (compiled where it can be: one pass, no gather).

    As with :func:`torch.histc`, a value within rounding of a bucket edge (about ``1e-7`` of
    the range's magnitude for float32 values, ``1e-16`` for float64) may be counted in the
    bucket next to it; every counted value lands in one bucket of its range.
    """
    dtype = values.dtype
    start, end = lo.to(dtype).unsqueeze(1), hi.to(dtype).unsqueeze(1)
    # A range too wide for v - lo in the values' precision (ends of both signs near its largest
    # value, as in a diverging run) is bucketed from halved values and a halved width: halving
    # is exact (but for subnormal values, whose rounding cannot move a bucket of such a range),
    # and the factor is exactly 1 for every other range
    half = halving(lo, hi, dtype)
    width = hi * half - lo * half
    # bins / width in two factors that each fit the values' precision: a range of subnormal
    # width has a scale beyond float32's largest value (one factor, ``near``, for every
    # ordinary range: the other is then exactly 1). A float64 range narrower than about
    # bins * 2**-1024 has a scale beyond float64's largest value too: its second factor is
    # then taken from the width times ``near`` (exact, a power of two), which float64 holds
    scale = bins / width
    near = scale.clamp(max=2.0**64)
    then = torch.where(scale == near, 1.0, bins / (width * near))
    start_scale, then = near.to(dtype).unsqueeze(1), then.to(dtype).unsqueeze(1)
    half = half.to(dtype).unsqueeze(1)
    position = (values * half - start * half) * start_scale * then
    # NaN (0 * inf, should a scale still overflow) as 0, as nan_to_num has it: a comparison,
    # which compiles to vector code where isnan does not
    position = torch.where(position == position, position, 0.0).clamp(0, bins - 1)
    inside = (values >= start) & (values <= end)  # NaN and values outside: False
    return torch.where(inside, position.to(torch.int32), bins)


def bucket_keys(values: Tensor, lo: Tensor, hi: Tensor, base: Tensor, bins: int) -> Tensor:
    """:func:`bucket_index` of each value offset by its row's ``base`` (``(R,)``, ``int64``:
    ``row * (bins + 1)`` for :func:`tally`): keys of one integer count for every row, made in
    the same pass as the buckets (a kernel of the engine)."""
    return bucket_index(values, lo, hi, bins).to(base.dtype) + base.unsqueeze(1)


def row_bases(rows: int, bins: int, device: torch.device) -> Tensor:
    """The ``base`` of :func:`bucket_keys` of ``rows`` rows: ``row * (bins + 1)``, ``int64``."""
    return torch.arange(rows, dtype=torch.int64, device=device) * (bins + 1)


def tally(keys: Tensor, bins: int) -> Tensor:
    """Integer counts ``(R, bins)`` of the keys ``(R, S)`` of :func:`bucket_keys` (bases of
    :func:`row_bases`; a row's key ``base + bins``: not counted), in one integer count of every
    row's keys: the same counts in any order, on any device, deterministic or not."""
    rows = keys.shape[0]
    return count_keys(keys.reshape(-1), rows * (bins + 1)).view(rows, bins + 1)[:, :bins]


def count_keys(key: Tensor, size: int) -> Tensor:
    """How often each of ``0 .. size - 1`` occurs in ``key`` (1-d, integers in that range), as
    ``int64`` ``(size,)``: :func:`torch.bincount` on the CPU (a third of the time of an
    ``index_add_`` there); elsewhere an integer ``index_add_`` of ones (CUDA's ``bincount`` reads
    the largest key on the host: a synchronisation)."""
    if key.device.type == "cpu":
        return torch.bincount(key, minlength=size)
    return add_ones(key, size)


def add_ones(key: Tensor, size: int) -> Tensor:
    """:func:`count_keys` by an integer ``index_add_`` of ones (any device)."""
    flat = torch.zeros(size, dtype=torch.int64, device=key.device)
    ones = torch.ones((), dtype=torch.int64, device=key.device).expand(key.shape)
    return flat.index_add_(0, key, ones)  # integer additions: the same counts in any order


def stream_counts(counts: Tensor, weights: Tensor, rows_of_stream: Tensor) -> Tensor:
    """The ``float64`` counts ``(m, bins)`` of ``m`` streams from the integer counts of their
    rows ``(R, bins)``: each row weighted (``weights`` ``(R,)``, the elements each counted value
    stands for), and the rows of stream ``i`` (``rows_of_stream[i]``, ``(m, k)`` indices of
    rows; ``R`` pads) added in order."""
    weighted = counts.to(F64) * weights.to(F64).unsqueeze(1)
    padded = torch.cat([weighted, weighted.new_zeros(1, weighted.shape[1])])
    return padded[rows_of_stream].sum(1)


def scaled_counts(found: Tensor, states: Tensor) -> Tensor:
    """The ``float64`` counts ``found`` ``(m, bins)`` of sampled values scaled to the count of
    finite values of each stream's packed state (``states`` ``(m, WIDTH)``); a stream whose
    sample counted nothing keeps its zeros."""
    total = found.sum(1, keepdim=True)
    scale = states[:, COUNT].unsqueeze(1) / total.clamp(min=1e-300)
    return torch.where(total > 0, found * scale, found)


def stream_table(states: Tensor, counts: Tensor, bins: int) -> Tensor:
    """The histograms of ``m`` streams as one ``float64`` table ``(m, 2 * bins + 6)``, rows
    ``[num, sum, sum_squares, min, max, *edges, *counts]``: the summaries and :func:`edges` of
    the packed ``states`` ``(m, WIDTH)`` (every rank's, merged) and the ``counts`` ``(m,
    bins)``."""
    lo, hi = ranges(states)
    return torch.cat([summaries(states), edges(lo, hi, bins), counts.to(F64)], 1)


def sample_keys(values: Tensor, every: Tensor, stream: Tensor, bins: int) -> Tensor:
    """:func:`bucket_keys` of sample rows ``values`` ``(R, S)`` over the ranges of their streams
    (row ``r`` belongs to stream ``stream[r]``; ``every`` ``(m, WIDTH)``, the streams' packed
    states over every rank): the first half of a sampled histogram, up to the count (a kernel of
    the engine)."""
    lo, hi = ranges(every)
    bases = row_bases(values.shape[0], bins, values.device)
    return bucket_keys(values, lo[stream], hi[stream], bases, bins)


def sample_table(
    counted: Tensor,
    every: Tensor,
    states: Tensor,
    weights: Tensor,
    rows_of_stream: Tensor,
    bins: int,
) -> Tensor:
    """The second half of a sampled histogram (a kernel of the engine): the :func:`stream_table`
    of the streams whose sample rows have the integer counts ``counted`` (``(R, bins + 1)``:
    :func:`count_keys` of :func:`sample_keys`, the last column not counted), each row weighted
    and added to its stream (:func:`stream_counts`), scaled to this rank's ``states``
    (:func:`scaled_counts`), with the summaries and edges of ``every``."""
    found = stream_counts(counted[:, :bins], weights, rows_of_stream)
    return stream_table(every, scaled_counts(found, states), bins)


def summaries(states: Tensor) -> Tensor:
    """``(m, 5)`` ``[num, sum, sum of squares, min, max]`` of the finite values of packed states
    ``(m, WIDTH)``: the summary of a TensorBoard histogram."""
    count, mean = states[:, COUNT], states[:, MEAN]
    return torch.stack(
        [count, count * mean, states[:, M2] + count * mean * mean, states[:, MIN], states[:, MAX]],
        1,
    )
