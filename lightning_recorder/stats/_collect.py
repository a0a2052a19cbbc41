"""What a monitor collects in one batch for ``m`` streams: packed states and histogram samples.

A monitor calls :meth:`Collector.add` from its forward hooks with each output of each stream,
while the output is intact (before any later in-place op), and reads the batch's results at the
batch's end:

* **Large tensors** (more than :data:`SMALL` elements), and every tensor the CPU kernel reads
  (:func:`~._engine.native_ready`: a call costs a few µs), get their packed state at once, one
  pass of the engine (:func:`~._engine.tensor_state`). On a GPU a large tensor is read as rows
  (:func:`~._engine.block_rows`) whose states are held unmerged and merged every
  :data:`_BLOCKS_HELD` tensors, all at once: kernel launches cost the host more than the
  kernels cost the GPU.
* **Small tensors** are otherwise copied and reduced at the batch's end, all those of one size
  and dtype in one call of the engine (the rows of a 2-d tensor): the cost of a compiled call
  paid per size, not per tensor.
* **Histogram samples.** Each tensor leaves at most ``sample`` evenly strided values (all of
  them when it has no more) in one row of a reused staging buffer, padded with NaN, with the
  number of elements each value stands for: one strided copy per tensor. The stride is the
  smallest prime at least ``numel / sample``, which shares no factor with the periods of
  typical layouts (channels, rows, batch items), so the sample visits every channel and
  position alike.

:meth:`Collector.states` merges the rows of each stream into ``(m, WIDTH)`` states;
:meth:`Collector.counts` buckets every sample row against its stream's edges at once
(:func:`~._engine.row_counts`), and :meth:`Collector.table` makes the whole histogram table
of the batch (ranges, edges, summaries and counts) in two compiled calls and one count
(:func:`~._engine.sampled_table`). Nothing synchronises with the host on any device (small
bookkeeping tensors go to the device with a non-blocking copy from pinned memory).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from .._core.compat import functorch_off, functorch_values, in_functorch
from ..errors import RecorderConfigError
from . import _cpu_kernel
from ._engine import (
    block_rows,
    flat_view,
    is_plain,
    native_ready,
    row_counts,
    rows_states,
    sampled_table,
    state_row,
    stored_parts,
)
from ._histogram import ranges, scaled_counts, stream_counts, stream_table
from ._state import F64, empty_states, merge, zeros_state

__all__ = ["SMALL", "Collector", "sample_stride"]

# Tensors of at most this many elements are copied and reduced at the batch's end, grouped.
SMALL = 2**16
# Floating dtypes whose samples are staged in float32 (exactly); others go to float64.
_STAGED_32 = (torch.float32, torch.float16, torch.bfloat16)

_PRIMES: dict[int, int] = {}


def sample_stride(numel: int, size: int) -> int:
    """The stride of the sample of a tensor of ``numel`` elements: 1 if it has at most ``size``,
    else the smallest prime at least ``numel / size`` (cached: a training loop asks for few)."""
    k = -(-numel // size)
    if k <= 1:
        return 1
    found = _PRIMES.get(k)
    if found is None:
        p = k
        while any(p % d == 0 for d in range(2, math.isqrt(p) + 1)):
            p += 1
        if len(_PRIMES) > 4096:
            _PRIMES.clear()
        found = _PRIMES[k] = p
    return found


def to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small host list as a tensor on ``device``: on CUDA through pinned memory and a
    non-blocking copy (a plain copy from the host would synchronise)."""
    if device.type == "cuda":
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
        return host.to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


class _Stage:
    """A reused ``(rows, sample)`` buffer of histogram samples (NaN where a row is shorter, and
    in free rows), and the weight and stream of each row (``-1``: free)."""

    def __init__(self, dtype: torch.dtype, sample: int) -> None:
        self.dtype, self.sample = dtype, sample
        self.buffer: Tensor | None = None
        self.rows: Sequence[Tensor] = ()
        self.heads: dict[tuple[int, int], Tensor] = {}
        self._made: tuple[Any, tuple[Tensor, Tensor, Tensor]] | None = None
        self.weights: list[float] = []
        self.streams: list[int] = []
        self.free: list[int] = []
        self.width = 0  # the longest row used: the columns beyond hold NaN only
        # per buffer row, across batches: the columns from this one on hold NaN (a row is
        # refilled with NaN only where its last sample was longer than its new one)
        self.filled: list[int] = []

    def take(self, device: torch.device) -> int:
        """The index of a free row (NaN from ``filled[row]`` on), growing the buffer when it is
        full."""
        if self.free:
            return self.free.pop()
        used = len(self.streams)
        buffer = self.buffer
        if buffer is None or buffer.device != device or used >= buffer.shape[0]:
            with torch.inference_mode(False):  # reused by training after an evaluation
                grown = torch.full(
                    (max(8, 2 * used), self.sample), math.nan, dtype=self.dtype, device=device
                )
            kept = 0
            if buffer is not None and buffer.device == device and used:
                grown[:used].copy_(buffer[:used])
                kept = used
            self.buffer = grown
            self.rows = grown.unbind(0)  # a view of each row, made once
            self.heads = {}  # (row, length) -> the view of the row's first ``length`` values
            self.filled = self.filled[:kept] + [0] * (grown.shape[0] - kept)
        self.weights.append(0.0)
        self.streams.append(-1)
        return used

    def layout(self, m: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """The stream (a free row: 0) and weight (a free row: 0) of each used row, and the used
        rows of each of the ``m`` streams (``(m, k)``, padded with the number of rows), on
        ``device``: kept while they stay the same (a training loop stages the same rows every
        batch)."""
        key = (tuple(self.streams), tuple(self.weights), m, device)
        if self._made is None or self._made[0] != key:
            owners = [max(owner, 0) for owner in self.streams]
            rows: list[list[int]] = [[] for _ in range(m)]
            for row, owner in enumerate(self.streams):
                if owner >= 0:
                    rows[owner].append(row)
            width = max([1, *(len(r) for r in rows)])
            pad = len(self.streams)
            table = [r + [pad] * (width - len(r)) for r in rows]
            made = (
                to_device(owners, torch.int64, device),
                to_device(self.weights, F64, device),
                to_device(table, torch.int64, device),
            )
            self._made = (key, made)
        return self._made[1]

    def samples(self) -> Tensor | None:
        """The rows in use, up to the longest sample (free rows hold NaN), or ``None`` when no
        row holds a sample."""
        if self.buffer is None or not any(owner >= 0 for owner in self.streams):
            return None
        return self.buffer[: len(self.streams), : self.width]

    def slot(self, row: int, length: int) -> Tensor:
        """The first ``length`` values of ``row``, for a sample of that length to be written
        into, NaN after them."""
        target = self.heads.get((row, length))
        if target is None:  # a view made once per row and length (a loop repeats its sizes)
            if len(self.heads) > 4096:
                self.heads.clear()
            target = self.heads[(row, length)] = self.rows[row][:length]
        if self.filled[row] > length:  # a longer sample was here: NaN over its tail
            self.rows[row][length : self.filled[row]].fill_(math.nan)
        self.filled[row] = length
        return target

    def release(self, row: int) -> None:
        """Make ``row`` free again."""
        self.rows[row][: self.filled[row]].fill_(math.nan)
        self.filled[row] = 0
        self.weights[row], self.streams[row] = 0.0, -1
        self.free.append(row)

    def clear(self) -> None:
        """Forget the rows' owners (their data are overwritten as the rows are taken again)."""
        self.weights, self.streams, self.free = [], [], []
        self.width = 0


class _Group:
    """A reused ``(rows, n)`` buffer of copies of small tensors of ``n`` elements of one dtype,
    and the stream of each row used in this batch: reduced in one call of the engine."""

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device, inference: bool) -> None:
        self.n, self.dtype, self.device, self.inference = n, dtype, device, inference
        self.buffer: Tensor | None = None
        self.owners: list[int] = []

    def take(self) -> Tensor:
        """The next free row (contents undefined), growing the buffer when it is full."""
        used = len(self.owners)
        buffer = self.buffer
        if buffer is None or used >= buffer.shape[0]:
            with torch.inference_mode(self.inference):  # its kind of tensor, for the engine
                grown = torch.empty(max(4, 2 * used), self.n, dtype=self.dtype, device=self.device)
            if buffer is not None and used:
                grown[:used].copy_(buffer[:used])
            self.buffer = buffer = grown
        return buffer[used]


# A stream keeps at most this many sample rows in a batch: a module called more often (an RNN
# cell) has every second row dropped and the others weighted for the dropped ones' elements.
_MAX_ROWS = 4
# Copies of small tensors held before they are reduced (elements), and state rows held before
# they are merged stream by stream: a batch's memory stays bounded however many calls it has.
_SMALL_HELD = 2**19
_STATE_ROWS = 64
# The unmerged states of large tensors read as blocks (BLOCK_ROWS rows each, 45 KiB) held before
# they are merged, all at once: a few kernel launches for this many tensors, not a few each.
_BLOCKS_HELD = 8


class Collector:
    """The states and histogram samples of ``streams`` streams in one batch, on ``device``.

    Memory stays bounded however many times a stream is called in a batch: copies of small
    tensors are reduced once they exceed :data:`_SMALL_HELD` elements, state rows merged once
    there are :data:`_STATE_ROWS` (or four per stream), the unmerged rows of large tensors once
    those of :data:`_BLOCKS_HELD` tensors are held, and a stream keeps at most :data:`_MAX_ROWS`
    sample rows.

    Args:
        streams: the number of streams (``add`` takes their index).
        sample: the most values of one tensor kept for its stream's histogram.
        device: where the batch's results are gathered (the model's device).
    """

    def __init__(self, streams: int, sample: int, device: torch.device) -> None:
        self.m, self.sample = streams, sample
        # the device as tensors report it ("cuda" names the current index: "cuda:0"), so that
        # buffers made on it compare equal to it
        self.device = torch.empty(0, device=device).device
        self._stages: dict[torch.dtype, _Stage] = {}
        # copies of small tensors, by (numel, dtype, device, made under inference mode)
        self._groups: dict[tuple[int, torch.dtype, torch.device, bool], _Group] = {}
        #: stream -> the dimension of its outputs whose per-channel extremes are kept
        #: (:meth:`extremes`); ``None`` picks dim 1 of 4-d and larger outputs (N, C, H, W),
        #: the last dim of others (features of a linear layer, of a transformer's tokens)
        self.channels: dict[int, int | None] = {}
        self.clear()

    def clear(self) -> None:
        """Forget this batch's data (the staging buffers are kept for the next one)."""
        self._rows: list[Tensor] = []  # blocks of state rows, (k, WIDTH) each
        self._owners: list[int] = []  # the stream of each state row, block after block
        # the unmerged (BLOCK_ROWS, WIDTH) states of large tensors (block_rows), and their streams
        self._blocks: list[Tensor] = []
        self._block_owners: list[int] = []
        if len(self._groups) > 32:  # sizes that vary from batch to batch: start afresh
            self._groups = {}
        for group in self._groups.values():
            group.owners = []
        self._small_held = 0
        self._samples: dict[int, list[tuple[_Stage, int]]] = {}
        self._extremes: dict[int, Tensor] = {}
        for stage in self._stages.values():
            stage.clear()

    @property
    def empty(self) -> bool:
        return not (self._rows or self._blocks or self._small_held or self._extremes)

    def nbytes(self) -> int:
        """Bytes of this batch's data held (copies, state rows, used sample rows)."""
        held = sum(len(g.owners) * g.n * g.dtype.itemsize for g in self._groups.values())
        held += sum(t.numel() * t.element_size() for t in [*self._rows, *self._blocks])
        for stage in self._stages.values():
            used = sum(1 for owner in stage.streams if owner >= 0)
            held += used * stage.sample * stage.dtype.itemsize
        return held

    def add(self, stream: int, x: Tensor, sample: bool = True) -> None:
        """Add one tensor (any shape, real dtype) to ``stream``: its state, and a sample of it
        for the histogram if ``sample``."""
        if in_functorch():  # a hook inside torch.func.vmap / grad: the whole batch, unwrapped,
            with functorch_off():  # is added to buffers the transforms must not see
                self._add(stream, functorch_values(x), sample)
            return
        self._add(stream, x, sample)

    def _add(self, stream: int, x: Tensor, sample: bool) -> None:
        x = x.detach()
        n = x.numel()
        if n == 0:
            return
        if not is_plain(x):  # sparse, nested, quantized: the stored values (implicit zeros)
            parts, zeros = stored_parts(x)
            for part in parts:
                self._add(stream, part, sample)
            self._add_zeros(stream, zeros, sample)
            return
        if stream in self.channels and x.dim():
            self._add_extremes(stream, x)
        flat = flat_view(x)
        native = native_ready(x)
        if n <= SMALL and not native:
            inference = torch.is_inference_mode_enabled()
            key = (n, x.dtype, x.device, inference)
            group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = _Group(n, x.dtype, x.device, inference)
            group.take().view(x.shape).copy_(x)
            group.owners.append(stream)
            self._small_held += n
            if self._small_held > _SMALL_HELD:
                self._reduce_small()
        elif native and flat is not None and sample and self.device.type == "cpu":
            # the CPU kernel: the state, and the sample in the same call (the output read once,
            # then its sampled elements while it is in the cache)
            target, stride = self._sample_slot(stream, x.dtype, n)
            self._add_rows(_cpu_kernel.rows_state(flat.view(1, n), target, stride), [stream])
            return
        else:
            blocks = block_rows(x, flat, native)  # a large tensor on a GPU: rows, unmerged
            if blocks is None:  # on the CPU, the kernel (a few µs): float32 and float64
                self._add_rows(state_row(x, flat, native), [stream])
            else:
                rows, rest = blocks
                self._add_block(rows, stream)
                if rest is not None:
                    self._add_rows(rest, [stream])
        if sample:
            self._sample(stream, x, n, flat=flat)

    def _add_extremes(self, stream: int, x: Tensor) -> None:
        """Keep the per-channel minimum, maximum and minimum of ``|x|`` of ``x`` (``(3, C)``,
        float32 or float64), merged with those of the stream's earlier calls of the same
        width (NaN propagates, as in ``amin``)."""
        dim = self.channels[stream]
        if dim is None:
            dim = 1 if x.dim() >= 4 else x.dim() - 1
        if x.dim() and not -x.dim() <= dim < x.dim():
            raise RecorderConfigError(
                f"Expected the dimension a `track_channels` selector returned to be one of the "
                f"module's outputs, which have {x.dim()} (shape {tuple(x.shape)}), so from "
                f"{-x.dim()} to {x.dim() - 1}, but got {dim}."
            )
        dim %= x.dim()
        others = [d for d in range(x.dim()) if d != dim]
        v = x if x.dtype == F64 else x.float()
        found = (
            torch.stack([v.amin(others), v.amax(others), v.abs().amin(others)]).to(self.device)
            if others
            else torch.stack([v, v, v.abs()]).to(self.device)
        )
        before = self._extremes.get(stream)
        if before is not None and before.shape == found.shape:
            low = torch.minimum(before[[0, 2]], found[[0, 2]])
            found = torch.stack([low[0], torch.maximum(before[1], found[1]), low[1]])
        self._extremes[stream] = found

    def extremes(self) -> dict[int, Tensor]:
        """The per-channel ``(3, C)`` [min, max, min ``|x|``] of this batch's outputs of every
        stream in :attr:`channels` that was called (on the collector's device)."""
        return dict(self._extremes)

    def _add_rows(self, rows: Tensor, owners: list[int]) -> None:
        self._rows.append(rows if rows.device == self.device else rows.to(self.device))
        self._owners.extend(owners)
        if len(self._owners) > max(_STATE_ROWS, 4 * self.m):  # merged stream by stream: m rows
            merged = self._merged()
            self._rows, self._owners = [merged], list(range(self.m))

    def _add_block(self, rows: Tensor, stream: int) -> None:
        """Hold the unmerged ``(BLOCK_ROWS, WIDTH)`` states of one tensor of ``stream``; every
        :data:`_BLOCKS_HELD` tensors, merge them all at once (:meth:`_merge_blocks`)."""
        self._blocks.append(rows if rows.device == self.device else rows.to(self.device))
        self._block_owners.append(stream)
        if len(self._blocks) >= _BLOCKS_HELD:
            self._merge_blocks()

    def _merge_blocks(self) -> None:
        """The held blocks' states, each tensor's rows merged, as state rows of their streams."""
        if self._blocks:
            self._add_rows(merge(torch.stack(self._blocks), 1), self._block_owners)
            self._blocks, self._block_owners = [], []

    def _reduce_small(self) -> None:
        """The states of the held copies, each group of one size and dtype in one call."""
        self._small_held = 0
        for (_, _, _, inference), group in self._groups.items():
            if group.owners:
                with torch.inference_mode(inference):
                    rows = cast(Tensor, group.buffer)[: len(group.owners)]
                    self._add_rows(rows_states(rows), group.owners)
                group.owners = []

    def _add_zeros(self, stream: int, zeros: int, sample: bool) -> None:
        """Add ``zeros`` elements equal to 0 (the implicit elements of a sparse tensor)."""
        if zeros <= 0:
            return
        self._add_rows(zeros_state(zeros, self.device)[None], [stream])
        if sample:
            self._sample(stream, torch.zeros(1, device=self.device), 1, weight=float(zeros))

    def _sample(
        self,
        stream: int,
        x: Tensor,
        n: int,
        weight: float | None = None,
        flat: Tensor | None = None,
    ) -> None:
        """Stage a sample of ``x`` (``n`` elements; ``flat``: its :func:`flat_view`, if known)."""
        target, stride = self._sample_slot(stream, x.dtype, n, weight)
        flat = flat if flat is not None else flat_view(x)
        if flat is not None:
            target.copy_(flat[::stride])
        else:  # not one block of memory: the sampled elements, in logical order
            target.copy_(torch.take(x, torch.arange(0, n, stride, device=x.device)))

    def _sample_slot(
        self, stream: int, dtype: torch.dtype, n: int, weight: float | None = None
    ) -> tuple[Tensor, int]:
        """A staged row for the sample of a tensor of ``dtype`` and ``n`` elements of
        ``stream`` (each value standing for ``weight`` elements, by default ``n`` over the
        sample's length), and the stride to sample at: the sample is written into the row
        (:meth:`_sample`, or the CPU kernel in the same call as the state)."""
        staged = torch.float32 if dtype in _STAGED_32 else F64
        stage = self._stages.get(staged)
        if stage is None:
            stage = self._stages[staged] = _Stage(staged, self.sample)
        rows = self._samples.setdefault(stream, [])
        if len(rows) >= _MAX_ROWS:
            self._thin(rows)
        stride = sample_stride(n, self.sample)
        length = -(-n // stride)
        index = stage.take(self.device)
        stage.weights[index] = n / length if weight is None else weight
        stage.streams[index] = stream
        stage.width = max(stage.width, length)
        rows.append((stage, index))
        return stage.slot(index, length), stride

    @staticmethod
    def _thin(rows: list[tuple[_Stage, int]]) -> None:
        """Drop every second row of a stream; the others carry the dropped rows' weight."""
        total = sum(stage.weights[i] for stage, i in rows)
        kept, dropped = rows[0::2], rows[1::2]
        for stage, i in dropped:
            stage.release(i)
        left = sum(stage.weights[i] for stage, i in kept)
        for stage, i in kept:
            stage.weights[i] *= total / left
        rows[:] = kept

    def _merged(self) -> Tensor:
        """The rows held merged stream by stream into ``(m, WIDTH)`` (empty for no data)."""
        owners = self._owners
        if not owners:
            return empty_states(self.m, device=self.device)
        table = torch.cat([*self._rows, empty_states(1, device=self.device)])
        if len(owners) == self.m and sorted(owners) == list(range(self.m)):
            order = sorted(range(self.m), key=owners.__getitem__)  # one row per stream
            return table[to_device(order, torch.int64, self.device)]
        slots: list[list[int]] = [[] for _ in range(self.m)]
        for row, owner in enumerate(owners):
            slots[owner].append(row)
        width = max(len(s) for s in slots)
        pad = len(owners)  # the empty row
        index = [s + [pad] * (width - len(s)) for s in slots]
        return merge(table[to_device(index, torch.int64, self.device)], 1)

    def states(self) -> Tensor:
        """The ``(m, WIDTH)`` packed states of this batch (the empty state for a stream that got
        nothing), on the collector's device."""
        self._merge_blocks()
        self._reduce_small()
        return self._merged()

    def counts(self, lo: Tensor, hi: Tensor, bins: int, states: Tensor) -> Tensor:
        """The ``float64`` histogram counts ``(m, bins)`` of this batch's samples over each
        stream's range ``[lo, hi]`` (``(m,)``), scaled to the count of finite values of the
        stream's packed state in ``states`` ``(m, WIDTH)`` (this batch's, this rank's)."""
        found = torch.zeros(self.m, bins, dtype=F64, device=self.device)
        for stage, values in self._staged():
            index, weights, rows = stage.layout(self.m, self.device)
            counted = row_counts(values, lo[index], hi[index], bins)
            found = found + stream_counts(counted, weights, rows)
        return scaled_counts(found, states)

    def table(self, every: Tensor, states: Tensor, bins: int) -> Tensor:
        """This batch's histograms as one ``float64`` table ``(m, 2 * bins + 6)``
        (:func:`~._histogram.stream_table`): each stream's range and summary from ``every``
        (its packed state over every rank, ``(m, WIDTH)``), its counts from this batch's
        samples as :meth:`counts` has them (scaled to this rank's ``states``). The samples of
        one staging buffer, the usual case, take the engine's :func:`~._engine.sampled_table`
        (compiled: two graph calls and one count)."""
        staged = self._staged()
        if len(staged) != 1:  # samples of two dtypes (or none): buffer by buffer
            return stream_table(every, self.counts(*ranges(every), bins, states), bins)
        stage, values = staged[0]
        return sampled_table(values, every, states, *stage.layout(self.m, self.device), bins)

    def _staged(self) -> list[tuple[_Stage, Tensor]]:
        """Each staging buffer that holds samples, with its rows in use."""
        found = [(stage, stage.samples()) for stage in self._stages.values()]
        return [(stage, values) for stage, values in found if values is not None]
