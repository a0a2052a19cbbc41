"""The kernels behind :mod:`lightning_recorder.stats`: packed streaming states and histograms.

**Packed state.** The statistics of a stream of tensors travel as one ``float64`` vector of 9
numbers (:data:`COUNT` … :data:`NUMEL`): the count, mean and sum of squared deviations
(``M2``) of the finite elements, their min, max and mean ``|x|``, the number of zeros, of
non-finite elements and of all elements. States merge with Chan's parallel formula
(:func:`merge`), along any leading dimension, so one gather carries every module of a step.

**CPU fast path.** On the CPU, where reading a value costs nothing, a tensor is processed in
chunks of :data:`CHUNK` elements in reused buffers (:class:`Workspace`). A chunk whose float64
sum is finite holds no NaN or infinity (they propagate through a sum) and takes the unmasked
path (:func:`finite_state`); the others take :func:`masked_state`, which is also the path of
every other device (no host synchronisation there). Both paths evaluate the same formulas in
float64 on the same values, so they agree to the last bit: ``M2`` is ``sum(x**2) - sum(x) *
mean`` where that loses at most :data:`CANCEL_BITS` bits to cancellation and the sum of squared
deviations elsewhere (:func:`sum_of_squares`); the count of non-zeros is a dot product of signs;
data of one sign has ``sum |x| = ±sum(x)`` and, away from zero, no zeros.

**Histograms.** :func:`histogram_rows` counts the finite values of a set of tensors over its
global range ``[min, max]`` (all-reduced across ranks) in ``bins`` buckets with the rule of
:func:`torch.histogram`: bucket ``i`` holds ``edges[i] <= v < edges[i + 1]``, the last bucket
closed, the edges those of ``torch.linspace(min, max, bins + 1)``. On the CPU the bucket index
is computed arithmetically and settled exactly against the edges (:func:`bucket_cpu`), and
mostly-zero data is tallied in interleaved lanes (:func:`tally`); other devices use
:func:`torch.searchsorted` (:func:`histograms_device`). Both give the same rows.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
from torch import Tensor

from .._core.compat import distributed_active
from . import _native

# Layout of the packed state: one float64 vector, so that a rank's state travels in one gather.
COUNT, MEAN, M2, MIN, MAX, ABS_MEAN, ZEROS, NONFINITE, NUMEL = range(9)
F64 = torch.float64


def empty_state(device: torch.device | str | None = None) -> Tensor:
    """The packed state of no data, filled on the device (no host-to-device copy)."""
    state = torch.zeros(9, dtype=F64, device=device)
    # fill_ through a view: ``state[MIN] = math.inf`` copies the scalar from the host (a
    # synchronising copy on CUDA)
    state.select(0, MIN).fill_(math.inf)
    state.select(0, MAX).fill_(-math.inf)
    return state


def flat64(x: Tensor) -> Tensor:
    """The elements of ``x``, detached, flattened and in ``float64`` (``x``'s memory if it can)."""
    v = x.detach().reshape(-1)
    return v if v.dtype == F64 else v.to(F64)


# On the CPU, tensors are processed in chunks of this many elements, in reused buffers.
CHUNK = 2**18
# Bucket counts of data with at least LANED_ZEROS zeros (a ReLU's output) are tallied in this
# many interleaved lanes when there are at most MAX_LANED buckets (see :func:`tally`).
LANES = 8
MAX_LANED = 1024
LANED_ZEROS = 0.25


class Workspace:
    """Scratch memory for the CPU kernels, reused from call to call.

    Fresh memory costs a page fault per 4 KiB on first touch, several times the arithmetic of
    the passes over it; a caller that computes statistics repeatedly (the monitor) keeps one
    workspace: named arenas of ``8 * CHUNK`` bytes (2 MiB) at most, carved into typed views
    (two arenas for float32 data, three for float64). Statistics and histograms share the
    arenas, so a logged step touches little memory that is not already in cache. Views are
    cached too: a training loop asks for the same sizes at every logged step.
    """

    def __init__(self) -> None:
        self._arenas: dict[str, Tensor] = {}
        self._views: dict[tuple[str, int, torch.dtype, int], Tensor] = {}
        self._lanes: dict[int, Tensor] = {}

    def lanes(self, n: int, stride: int) -> Tensor:
        """``n`` int32 lane offsets ``(i % LANES) * stride`` (cached: the contents are kept)."""
        pattern = self._lanes.get(stride)
        if pattern is None or pattern.numel() < n:
            size = max(n, pattern.numel() * 2 if pattern is not None else 0, 4096)
            lane = torch.arange(LANES, dtype=torch.int32) * stride
            pattern = self._lanes[stride] = lane.repeat(-(-size // LANES))
        return pattern[:n]

    def get(self, name: str, n: int, dtype: torch.dtype, part: int = 0) -> Tensor:
        """``n`` elements of ``dtype`` in arena ``name``, the ``part``-th such slice of it.

        Slices of one arena with different ``dtype`` or ``part`` may overlap: a caller uses,
        at a time, views that it knows to be disjoint. Contents are undefined.
        """
        key = (name, n, dtype, part)
        view = self._views.get(key)
        if view is not None:
            return view
        size = dtype.itemsize
        arena = self._arenas.get(name)
        if arena is None or arena.numel() < (part + 1) * n * size:
            arena = self._arenas[name] = torch.empty(
                max((part + 1) * n * size, 8192), dtype=torch.uint8
            )
            self._views = {k: v for k, v in self._views.items() if k[0] != name}
        if len(self._views) >= 256:  # sizes that vary from batch to batch
            self._views.clear()
        view = self._views[key] = arena[part * n * size : (part + 1) * n * size].view(dtype)
        return view


def chunks(x: Tensor) -> Iterator[Tensor]:
    """The elements of a CPU tensor, detached and flat, in chunks of at most ``CHUNK``."""
    flat = x.detach().reshape(-1)
    if flat.numel() <= CHUNK:
        yield flat
        return
    for start in range(0, flat.numel(), CHUNK):
        yield flat[start : start + CHUNK]


def as64(chunk: Tensor, work: Workspace) -> Tensor:
    """A chunk in float64: itself if it is, else converted into the workspace."""
    return chunk if chunk.dtype == F64 else work.get("v", chunk.numel(), F64).copy_(chunk)


# The sum of squared deviations is taken as ``sum(v**2) - sum(v) * mean`` when that loses at
# most CANCEL_BITS of float64's 53 bits to cancellation (``sum(v**2) <= 2**CANCEL_BITS * M2``);
# otherwise from the deviations ``v - mean``, a pass more (data far from zero relative to its
# spread). See :func:`sum_of_squares`.
CANCEL_BITS = 12


def exact_counter(raw: Tensor, v: Tensor) -> Tensor:
    """The values in which zeros are counted with a float dot product of signs: ``raw`` if its
    float dtype sums ``CHUNK`` ones exactly (float32, float64), else the float64 ``v``."""
    return raw if raw.dtype in (torch.float32, F64) else v


def one_pass_suffices(squares: Any, m2: Any, bits: int = CANCEL_BITS) -> Any:
    """Whether ``m2 = squares - total * mean`` is taken as ``M2``: ``squares`` (the sum of
    squares) did not overflow and cancellation cost at most ``bits`` bits. Python floats give a
    bool, tensors a boolean tensor: the one rule of both CPU paths."""
    return (squares < math.inf) & (m2 * 2.0**bits >= squares)


def sum_of_squares(squares: float, total: float, mean: float, v: Tensor, work: Workspace) -> float:
    """``M2`` of non-empty finite float64 CPU values from ``sum(v**2)``, ``sum(v)`` and the mean.

    ``squares - total * mean`` loses at most ``CANCEL_BITS`` of float64's 53 bits to
    cancellation when it is at least ``2**-CANCEL_BITS * squares``: the common case, and a pass
    cheaper. Otherwise (or if ``squares`` overflowed) the squared deviations are summed.
    :func:`masked_state` makes the same choice.
    """
    m2 = squares - total * mean
    if one_pass_suffices(squares, m2):
        return m2
    deviation = torch.sub(v, mean, out=work.get("work", v.numel(), F64))
    return torch.dot(deviation, deviation).item()


def finite_state(v: Tensor, total: float, work: Workspace, raw: Tensor) -> Tensor:
    """The packed state of non-empty float64 CPU values that are all finite: no masking pass.

    The same formulas as :func:`masked_state`, so the same numbers on the same values;
    ``raw`` holds the same values in their own dtype (the extremes, and the signs whose count
    is the number of non-zeros, are read from it: fewer bytes, the same numbers). Data of one
    sign skips the pass of ``|v|`` (its sum is ``±sum(v)``) and, away from zero, the count of
    zeros.
    """
    n = v.numel()
    mean = total / n
    ends = raw if raw.is_floating_point() else v
    low, high, squares = torch.stack([ends.amin(), ends.amax(), torch.dot(v, v)]).tolist()
    if low >= 0 or high <= 0:
        abs_sum = total if low >= 0 else -total
    else:
        abs_sum = torch.abs(v, out=work.get("work", n, F64)).sum().item()
    if low > 0 or high < 0:
        zeros = 0.0
    else:
        counter = exact_counter(raw, v)
        sign = torch.sign(counter, out=work.get("work", n, counter.dtype))
        zeros = n - torch.dot(sign, sign).item()
    m2 = sum_of_squares(squares, total, mean, v, work)
    return torch.tensor([n, mean, m2, low, high, abs_sum / n, zeros, 0, n], dtype=F64)


def masked_state(v: Tensor) -> Tensor:
    """The packed state of non-empty float64 values, NaN and infinities counted apart.

    The formulas of :func:`finite_state` on the finite values (the others replaced by zeros),
    vectorised without a host synchronisation: both candidates for ``M2`` are computed and
    :func:`sum_of_squares`' rule picks one.
    """
    finite = torch.isfinite(v)
    count = finite.sum(dtype=F64)
    safe = torch.where(finite, v, 0.0)
    total = safe.sum()
    mean = total / count.clamp(min=1.0)
    squares = torch.dot(safe, safe)
    m2 = squares - total * mean
    deviation = torch.where(finite, v - mean, 0.0)
    exact = one_pass_suffices(squares, m2)
    sign = torch.sign(safe)
    parts = [
        count,
        mean,
        torch.where(exact, m2, torch.dot(deviation, deviation)),
        torch.where(finite, v, math.inf).amin(),
        torch.where(finite, v, -math.inf).amax(),
        safe.abs().sum() / count.clamp(min=1.0),
        count - torch.dot(sign, sign),
        v.numel() - count,
        torch.full((), v.numel(), dtype=F64, device=v.device),
    ]
    return torch.stack(parts)


def batch_state(x: Tensor, work: Workspace | None = None) -> Tensor:
    """The packed state of one tensor, computed on its device.

    Off the CPU nothing synchronises with the host. On the CPU, where reading a value costs
    nothing, each chunk whose float64 sum is finite has no NaN or infinity (they propagate
    through a sum), and its state is computed without the masking passes; a non-finite sum (a
    NaN, an infinity, or float64 values whose sum overflows) takes the masked path.
    """
    if x.numel() == 0:
        return empty_state(x.device)
    if x.device.type != "cpu":
        return masked_state(flat64(x))
    work = work or Workspace()
    return merged([exact_chunk(chunk, work) for chunk in chunks(x)])


def exact_chunk(chunk: Tensor, work: Workspace) -> Tensor:
    """:func:`batch_state` of one CPU chunk: unmasked if its float64 sum is finite."""
    v = as64(chunk, work)
    total = v.sum().item()
    return finite_state(v, total, work, chunk) if math.isfinite(total) else masked_state(v)


def merged(states: Sequence[Tensor]) -> Tensor:
    """One packed state for a non-empty list of them (the only one, or their merge)."""
    return states[0] if len(states) == 1 else merge(torch.stack(list(states)))


# Native precision (the monitor's kernels). Float32 sums of squares are good to about 1e-7;
# the one-pass M2 may lose at most NATIVE_CANCEL_BITS bits of them (a mean within about 2.6
# standard deviations of zero), which keeps the std within about 1e-6 of its exact value.
NATIVE_CANCEL_BITS = 3


# Sums of squares in float32 are taken as dot products of rows of this many elements (one read,
# nothing written), the rows' results summed: each dot accumulates few terms, so the sum stays
# within about ``1e-7`` (relative) where one dot over a whole chunk drifts to ``1e-6`` and more.
SQUARE_ROW = 4096


def square_sum(v: Tensor) -> Tensor:
    """``sum(v**2)`` of a flat float32 CPU tensor in one read: a batched dot of rows of
    :data:`SQUARE_ROW` elements, then their sum (a 0-d tensor), in float32 also under autocast
    (which would run the batched product in bfloat16)."""
    if torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return square_sum(v)
    rows = v.numel() // SQUARE_ROW
    head = v[: rows * SQUARE_ROW].view(rows, 1, SQUARE_ROW)
    total = torch.bmm(head, head.transpose(1, 2)).sum()
    if rows * SQUARE_ROW < v.numel():
        tail = v[rows * SQUARE_ROW :]
        total = total + torch.dot(tail, tail)
    return total


def sample_of(x: Tensor, size: int) -> tuple[Tensor, float]:
    """A copy of at most ``size`` evenly strided elements of ``x`` (all of them if it has no more),
    and the number of elements each one stands for (``numel / len(sample)``).

    The stride is the smallest prime at least ``numel / size``: it shares no factor with the
    periods of typical layouts (channels, rows, batch items: products of small numbers), so the
    sample visits every channel and position alike instead of aliasing onto a few of them.
    """
    flat = x.detach().reshape(-1)
    n = flat.numel()
    if n <= size:
        return flat.clone(), 1.0
    stride = _prime_at_least(-(-n // size))
    sample = flat[::stride].clone()
    return sample, n / sample.numel()


_PRIMES: dict[int, int] = {}


def _prime_at_least(k: int) -> int:
    """The smallest prime ``>= k`` (``k >= 2``; cached: a training loop asks for few sizes)."""
    found = _PRIMES.get(k)
    if found is None:
        p = max(k, 2)
        while any(p % d == 0 for d in range(2, math.isqrt(p) + 1)):
            p += 1
        if len(_PRIMES) > 4096:
            _PRIMES.clear()
        found = _PRIMES[k] = p
    return found


def native_chunk(chunk: Tensor, work: Workspace) -> Tensor:
    """The packed state of a non-empty CPU chunk of float32 (float16, bfloat16: upcast exactly),
    its sums taken in float32.

    The formulas of :func:`finite_state`, on the data's own precision: no float64 copy, a
    quarter of the memory traffic. Torch's float32 sums are pairwise (cascade), good to about
    ``1e-7`` relative; min, max and the counts are exact. When the float32 sum or sum of
    squares is not finite (a NaN, an infinity, or an overflow) the chunk takes the exact masked
    path.
    """
    v = chunk
    if chunk.dtype != torch.float32:
        v = work.get("v", chunk.numel(), torch.float32).copy_(chunk)
    n = v.numel()
    scratch = work.get("work", n, torch.float32)
    low_t, high_t = torch.aminmax(v)
    total, low, high, squares = torch.stack([v.sum(), low_t, high_t, square_sum(v)]).tolist()
    if not (math.isfinite(total) and math.isfinite(squares)):
        return masked_state(flat64(chunk))
    mean = total / n
    one_sign = low >= 0 or high <= 0
    abs_sum = abs(total) if one_sign else torch.abs(v, out=scratch).sum().item()
    if low > 0 or high < 0:
        zeros = 0.0
    else:  # float32 sums of at most CHUNK ones are exact
        sign = torch.sign(v, out=scratch)
        zeros = n - torch.dot(sign, sign).item()
    m2 = squares - total * mean
    if not one_pass_suffices(squares, m2, NATIVE_CANCEL_BITS):
        # Deviations from the mean rounded to float32 (as torch applies a Python scalar to a
        # float32 tensor), corrected for that rounding.
        mean32 = struct.unpack("f", struct.pack("f", mean))[0]
        deviation = torch.sub(v, mean32, out=scratch)
        squared = torch.mul(deviation, deviation, out=scratch)
        m2 = squared.sum().item() - n * (mean - mean32) ** 2
        m2 = max(m2, 0.0)
    return torch.tensor([n, mean, m2, low, high, abs_sum / n, zeros, 0, n], dtype=F64)


def fused_state(
    v: Tensor, work: Workspace, sample: Tensor | None = None, stride: int = 1
) -> Tensor:
    """The packed state of a non-empty flat float32 CPU tensor from the fused kernel
    (:func:`lightning_recorder.stats._native.moments`: one read of the data).

    The sums are of the deviations ``d`` from a shift ``k`` near the mean (the mean of a few of
    the elements, to 8 significant bits), so ``M2 = sum(d**2) - sum(d)**2 / n`` cancels little;
    where it would lose more than :data:`NATIVE_CANCEL_BITS` bits the deviations from the mean
    are summed in a second pass, as in :func:`native_chunk`. A NaN, an infinity or an overflow
    takes the exact masked path.
    """
    return torch.tensor(fused_row(v, work, sample, stride), dtype=F64)


def fused_row(
    v: Tensor, work: Workspace, sample: Tensor | None = None, stride: int = 1
) -> list[float]:
    """:func:`fused_state` as a host list of 9 floats (no tensor built). ``v`` may have any
    shape, as long as it is contiguous (the kernel reads its memory in order)."""
    n = v.numel()
    if n < _native.PARALLEL_MIN:  # one call computes the state too
        row, flag = _native.state_row(v, sample, stride, NATIVE_CANCEL_BITS)
    else:  # the sums of parts taken on several threads: the same state from them
        shift, total, squares, abs_sum, low, high, zeros = _native.moments(v, sample, stride)
        m2 = squares - total * total / n
        row = [n, shift + total / n, m2, low, high, abs_sum / n, zeros, 0.0, n]
        if not (math.isfinite(total) and math.isfinite(squares)):
            flag = 1
        else:
            flag = 0 if one_pass_suffices(squares, m2, NATIVE_CANCEL_BITS) else 2
    return row if flag == 0 else finished_row(v, row, flag, work)


def finished_row(v: Tensor, row: list[float], flag: int, work: Workspace) -> list[float]:
    """The packed state of the contiguous float32 CPU values ``v`` from the fused kernel's
    ``row`` and its flag: the row itself (0); the exact masked path where its sums are not
    finite (1); its ``M2`` summed from the deviations where one pass lost too many bits to
    cancellation (2)."""
    if flag == 0:
        return row
    flat = v.detach().reshape(-1)
    if flag == 1:
        return masked_state(flat64(flat)).tolist()
    row[M2] = deviations_m2(flat, row[MEAN], work)
    return row


def deviations_m2(v: Tensor, mean: float, work: Workspace) -> float:
    """``M2`` of flat float32 CPU values as the sum of their squared deviations from ``mean``
    rounded to float32 (as torch applies a Python scalar to a float32 tensor), corrected for that
    rounding; chunk by chunk in the workspace."""
    mean32 = struct.unpack("f", struct.pack("f", mean))[0]
    m2 = 0.0
    for chunk in chunks(v):
        scratch = work.get("work", chunk.numel(), torch.float32)
        deviation = torch.sub(chunk, mean32, out=scratch)
        m2 += square_sum(deviation).item()
    return max(m2 - v.numel() * (mean - mean32) ** 2, 0.0)


def native_state(x: Tensor, work: Workspace) -> Tensor:
    """The packed state of one tensor in the data's own precision (the monitor's kernel).

    CPU tensors of float32 (and float16 / bfloat16, upcast exactly) are summed in float32: in
    one read by the fused kernel where it is built (:func:`fused_state`), else by torch, chunk by
    chunk (:func:`native_chunk`); anything else takes :func:`batch_state`'s exact float64 path,
    and so do tensors with a NaN, an infinity or an overflowing float32 sum. Mean, std and mean
    ``|x|`` are within about ``1e-6`` (relative) of the exact values, the precision at which
    TensorBoard stores a scalar; min, max and the counts are exact.
    """
    if x.device.type != "cpu" or x.numel() == 0 or x.dtype not in EXACT_IN_32:
        return batch_state(x, work)
    if _native.available():
        flat = x.detach().reshape(-1)
        if _native.usable(flat):
            return fused_state(flat, work)
        if type(flat) in (Tensor, torch.nn.Parameter) and flat.dtype != torch.float32:
            return merged(
                [
                    fused_state(work.get("v", c.numel(), torch.float32).copy_(c), work)
                    for c in chunks(flat)
                ]
            )
    return merged([native_chunk(chunk, work) for chunk in chunks(x)])


def sampled_state(x: Tensor, work: Workspace, size: int) -> tuple[Tensor, Tensor, float]:
    """:func:`native_state` of ``x`` and :func:`sample_of` it (``size > 0`` elements at most) --
    in one read where the fused kernel takes ``x`` (:func:`sampled_row`): the sample is copied
    while the statistics are summed."""
    fused = sampled_row(x, work, size)
    if fused is not None:
        row, sample, weight = fused
        return torch.tensor(row, dtype=F64), cast(Tensor, sample), weight
    kept, weight = sample_of(x, size)
    return native_state(x, work), kept, weight


def sampled_row(
    x: Tensor, work: Workspace, size: int, buffer: Callable[[int], Tensor] | None = None
) -> tuple[list[float], Tensor | None, float] | None:
    """The state of ``x`` as a host row (:func:`fused_row`) and, for ``size > 0``, its sample
    (``x[::stride]``, at most ``size`` elements, all of them when ``x`` has no more) and weight,
    in one pass of the fused kernel; ``None`` (nothing done) where the kernel does not take ``x``
    (not a float32 CPU tensor, no kernel). ``buffer(n)`` gives the sample's memory (a flat
    float32 CPU tensor of ``n`` elements); by default it is allocated."""
    # a contiguous tensor is read as it is (the kernel sees its memory, in order); another
    # one is copied into a flat one
    flat = x if x.is_contiguous() else x.detach().reshape(-1)
    n = flat.numel()
    if n == 0 or not (_native.usable(flat) and _native.available()):
        return None
    if size <= 0:
        return fused_row(flat, work), None, 1.0
    stride = _prime_at_least(-(-n // size)) if n > size else 1
    count = -(-n // stride)
    sample = torch.empty(count, dtype=torch.float32) if buffer is None else buffer(count)
    return fused_row(flat, work, sample, stride), sample, n / count


def merge(states: Tensor) -> Tensor:
    """Merge packed states stacked along dim 0 (Chan et al.'s pairwise formula, n-way).

    ``states`` has the shape ``(k, ..., 9)``; the result ``(..., 9)`` merges along the first dim.
    """
    count = states[..., COUNT]
    total = count.sum(0)
    weight = count / total.clamp(min=1.0)
    mean = (weight * states[..., MEAN]).sum(0)
    m2 = states[..., M2].sum(0) + (count * (states[..., MEAN] - mean).square()).sum(0)
    parts = [
        total,
        mean,
        m2,
        states[..., MIN].amin(0),
        states[..., MAX].amax(0),
        (weight * states[..., ABS_MEAN]).sum(0),
        states[..., ZEROS].sum(0),
        states[..., NONFINITE].sum(0),
        states[..., NUMEL].sum(0),
    ]
    return torch.stack(parts, -1)


def finalize(state: Tensor, correction: int) -> dict[str, Tensor]:
    """The statistics of packed states of shape ``(..., 9)``, as tensors of shape ``...``."""
    count, numel = state[..., COUNT], state[..., NUMEL]
    nan = torch.full((), math.nan, dtype=F64, device=state.device)
    seen = count > 0
    dof = count - correction
    return {
        "mean": torch.where(seen, state[..., MEAN], nan),
        "std": torch.where(dof > 0, (state[..., M2] / dof.clamp(min=1.0)).sqrt(), nan),
        "min": torch.where(seen, state[..., MIN], nan),
        "max": torch.where(seen, state[..., MAX], nan),
        "abs_mean": torch.where(seen, state[..., ABS_MEAN], nan),
        "zero_fraction": torch.where(numel > 0, state[..., ZEROS] / numel.clamp(min=1.0), nan),
        "nonfinite": state[..., NONFINITE].clone(),
        "numel": numel.clone(),
    }


def finalize_host(row: Sequence[float], correction: int) -> dict[str, float]:
    """:func:`finalize` of one packed state read to the host (a list of 9 floats)."""
    count, numel = row[COUNT], row[NUMEL]
    seen, dof = count > 0, count - correction
    return {
        "mean": row[MEAN] if seen else math.nan,
        "std": math.sqrt(row[M2] / dof) if dof > 0 else math.nan,
        "min": row[MIN] if seen else math.nan,
        "max": row[MAX] if seen else math.nan,
        "abs_mean": row[ABS_MEAN] if seen else math.nan,
        "zero_fraction": row[ZEROS] / numel if numel > 0 else math.nan,
        "nonfinite": row[NONFINITE],
        "numel": numel,
    }


def sync_active(sync: bool, group: Any) -> bool:
    """Whether to combine the ranks of ``group``: asked to, and more than one of them."""
    return sync and distributed_active(group)


def linspace(lo: Tensor, hi: Tensor, steps: int) -> Tensor:
    """``torch.linspace`` with tensor end points (no host sync); both ends are exact.

    ``lo`` and ``hi`` of shape ``(m,)`` give ``(m, steps)`` rows; 0-d ones give ``(steps,)``.
    """
    i = torch.arange(steps, dtype=F64, device=lo.device)
    lo, hi = lo.unsqueeze(-1), hi.unsqueeze(-1)
    step = (hi - lo) / max(steps - 1, 1)
    return torch.where(i < steps // 2, lo + step * i, hi - step * (steps - 1 - i))


# Arithmetic bucketing is used when the range exceeds ``bins * max(|lo|, |hi|) * narrow``, with
# ``narrow`` 2**-40 in float64 and 2**-18 in float32 (values of at most 24 significant bits).
NARROW_64 = 2.0**-40
NARROW_32 = 2.0**-18
EXACT_IN_32 = (torch.float32, torch.float16, torch.bfloat16)


def ceil32(edges: Tensor) -> Tensor:
    """The smallest float32 >= each float64 edge: for a float32 ``v``, ``v < e`` exactly when
    ``v < ceil32(e)``, as no float32 lies in ``[e, ceil32(e))``."""
    e32 = edges.to(torch.float32)
    up = torch.nextafter(e32, torch.full_like(e32, math.inf))
    return torch.where(e32.to(F64) < edges, up, e32)


def bucket_path(dtype: torch.dtype, lo: float, hi: float, bins: int) -> str:
    """How :func:`bucket_cpu` buckets values of ``dtype`` in ``[lo, hi]``: ``"float32"`` or
    ``"float64"`` arithmetic, or ``"search"`` (ranges narrow relative to their magnitude, or
    extreme ones)."""
    span = hi - lo
    reach = max(abs(lo), abs(hi))
    if (
        dtype in EXACT_IN_32
        and span > bins * reach * NARROW_32
        and span > 2.0**-100
        and reach < 2.0**120
        and bins < 2**20
    ):
        return "float32"
    if arithmetic_64(lo, hi, bins) and bins < 2**30:
        return "float64"
    return "search"


def arithmetic_64(lo: Any, hi: Any, bins: int) -> Any:
    """Whether ``[lo, hi]`` is wide enough, relative to its magnitude, for float64 positions
    (the ``"float64"`` rule of :func:`bucket_path`, ``bins`` aside): Python floats give a bool,
    tensors of ranges a boolean tensor. The comparisons are False for an infinite or NaN span.
    The fused kernel's table (``lr_sets_table_f32``) applies the same rule in C."""
    span = hi - lo
    if isinstance(span, Tensor):
        reach: Any = torch.maximum(lo.abs(), hi.abs())
    else:
        reach = max(abs(lo), abs(hi))
    return (span > bins * reach * NARROW_64) & (span > 2.0**-900) & (span < 2.0**1000)


def bucket_cpu(
    x: Tensor,
    edges: Tensor,
    bits32: Tensor,
    lo: float,
    hi: float,
    work: Workspace,
    laned: bool = False,
) -> Tensor:
    """Bucket counts (``bins + 1`` of them, ``int64``) of finite CPU values ``lo <= x <= hi``.

    The rule is :func:`torch.histogram`'s for the given float64 ``edges``: bucket ``i`` holds
    ``edges[i] <= v < edges[i + 1]``; the extra last count holds the values equal to
    ``edges[-1]``, which belong to the last (closed) bucket. Instead of a binary search per
    value, ``k = floor((v - lo) / width + 1/2)`` is computed and lowered by one where
    ``v < edges[k]``: six vectorised passes, and exact.

    Why exact: with ``u`` the unit roundoff of the arithmetic (``2**-24`` or ``2**-53``),
    ``M = max(|lo|, |hi|)`` and ``w`` the bucket width, the computed position is within
    ``u * (2 * M / w + 2 * bins + 2)`` of ``(v - lo) / w + 1/2`` and each edge within
    ``7 * 2**-53 * M`` of ``lo + i * w``. :func:`bucket_path` keeps both far below half a
    bucket (``M / w < 2**18`` and ``bins < 2**20`` in float32, ``M / w < 2**40`` in float64),
    so ``k`` is the bucket of ``v`` or the next one, and the comparison with the very edges
    returned settles which. Values exact in float32 are bucketed in float32 (half the memory
    traffic) against the edges rounded up (:func:`ceil32`, passed as raw bits ``bits32``),
    which keeps the comparison exact. Other ranges use :func:`torch.searchsorted`. ``laned``:
    the values crowd into one bucket, count them in lanes (:func:`tally`).
    """
    bins = edges.numel() - 1
    n = x.numel()
    path = bucket_path(x.dtype, lo, hi, bins)
    # scratch holds the positions, then (written through ``lower``, its raw bits) the lower
    # edges; index and down are disjoint from it and from v. float32 data needs no new arena.
    if path == "float32":
        v = x if x.dtype == torch.float32 else work.get("v", n, torch.float32, 1).copy_(x)
        table, scratch = bits32, work.get("work", n, torch.float32)
        lower = work.get("work", n, torch.int32)
        scale = struct.unpack("f", struct.pack("f", bins / (hi - lo)))[0]  # exact in float32
        index, down = work.get("work", n, torch.int32, 1), work.get("v", n, torch.int32)
    elif path == "float64":
        v = as64(x, work)
        table, scratch = edges.view(torch.int64), work.get("work", n, F64)
        lower = work.get("work", n, torch.int64)
        scale = bins / (hi - lo)
        index, down = work.get("aux", n, torch.int32), work.get("aux", n, torch.int32, 1)
    else:
        index = torch.searchsorted(edges, as64(x, work), right=True).sub_(1)
        return torch.bincount(index, minlength=bins + 1)
    shift = torch.full((), 0.5 - lo * scale, dtype=v.dtype)
    position = torch.add(shift, v, alpha=scale, out=scratch)  # (v - lo) / width + 1/2, >= 0
    index.copy_(position)  # truncation: floor
    # The lower edge of each value's bucket, gathered as raw bits (the faster kernel).
    torch.index_select(table, 0, index, out=lower)
    index -= torch.lt(v, scratch, out=down)
    return tally(index, bins + 1, work, laned)


def bucket_native(
    x: Tensor, limits: Sequence[float], lo: float, hi: float, work: Workspace, laned: bool = False
) -> Tensor:
    """:func:`bucket_cpu`'s counts with the bucket of each value computed in its own precision.

    ``k = floor((v - lo) / width)`` in float32 (float64 for float64 data) and nothing more: two
    passes and the count. A value within the rounding of that arithmetic of an edge (about
    ``1e-7 * max(|lo|, |hi|)`` for float32 data, the data's own precision) may be counted in
    the bucket next to it, as :func:`torch.histc` would; the counts still add up to the number
    of values. Ranges too narrow for float32 positions (relative to their magnitude, see
    :func:`bucket_path`) take float64 ones, and ranges too narrow for those the exact
    :func:`bucket_cpu`.
    """
    bins = len(limits) - 1
    n = x.numel()
    path = bucket_path(x.dtype, lo, hi, bins)
    if path == "search":
        edges = torch.tensor(limits, dtype=F64)
        return bucket_cpu(x, edges, ceil32(edges).view(torch.int32), lo, hi, work, laned)
    dtype = torch.float32 if path == "float32" else F64
    v = x if x.dtype == dtype else work.get("v", n, dtype, 1).copy_(x)
    scale = bins / (hi - lo)
    position = work.get("work", n, dtype)
    torch.add(torch.full((), -lo * scale, dtype=dtype), v, alpha=scale, out=position)
    # |error| < 1 bucket: positions lie in (-1, bins + 1) and truncate into [0, bins]; the
    # float32 positions turn into int32 in place (same size, element for element).
    in_place = dtype == torch.float32
    index = position.view(torch.int32) if in_place else work.get("aux", n, torch.int32)
    index.copy_(position)
    return tally(index, bins + 1, work, laned)


def tally(index: Tensor, size: int, work: Workspace, laned: bool) -> Tensor:
    """``torch.bincount(index, minlength=size)`` for an int32 ``index`` in ``[0, size)``,
    modified in place.

    ``bincount`` adds one to a counter per value; where most values fall in one bucket (the
    zeros after a ReLU), each addition waits for the previous one. If ``laned`` and with few
    buckets, element ``i`` is counted in lane ``i % LANES`` (its index offset by
    ``lane * size``) and the lanes are summed: independent counters, twice as fast there (and
    a pass slower on values spread over the buckets, hence the choice).
    """
    if not laned or size > MAX_LANED:
        return torch.bincount(index, minlength=size)
    index += work.lanes(index.numel(), size)
    return torch.bincount(index, minlength=LANES * size).view(LANES, size).sum(0)


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


def histogram_range(vmin: float, vmax: float) -> tuple[float, float]:
    """The range of :func:`torch.histogram`: ``[0, 1]`` without data, ±0.5 around one value."""
    lo, hi = (vmin, vmax) if vmax >= vmin else (0.0, 1.0)
    return (lo - 0.5, hi + 0.5) if lo == hi else (lo, hi)


def linspace_host(lo: float, hi: float, steps: int) -> list[float]:
    """:func:`linspace` in Python floats: the same operations, so the same numbers."""
    step = (hi - lo) / max(steps - 1, 1)
    half = steps // 2
    return [lo + step * i if i < half else hi - step * (steps - 1 - i) for i in range(steps)]


def native_buckets(x: Tensor, lo: float, hi: float, bins: int) -> list[int] | None:
    """:func:`bucket_native`'s counts by the fused kernel's bucketing (one pass, no scratch), or
    ``None`` where it does not apply (no kernel, not float32, a range too narrow for float64
    positions)."""
    flat = x.reshape(-1)
    if not (_native.available() and _native.usable(flat) and flat.numel()):
        return None
    if bucket_path(F64, lo, hi, bins) == "search":
        return None
    return _native.bucket(flat, lo, hi, bins)


def histogram_rows_cpu(
    parts: Sequence[Sequence[Tensor]],
    states: Tensor,
    bins: int,
    *,
    sync: bool,
    group: Any,
    work: Workspace,
    exact: bool = True,
    weights: Sequence[Sequence[float]] | None = None,
) -> list[HistogramRow]:
    """:func:`histogram_rows` of CPU tensors: scalar work in Python, few passes per value.

    ``weights``: for each set, the number of elements each element of each of its tensors
    stands for (samples, see :func:`sample_of`); the weighted counts are then scaled to add up
    to the set's count of finite values (its state's, all-reduced), before the sum over ranks.
    """
    rows = states.tolist()
    syncing = sync_active(sync, group)
    bounds = [[-row[MIN], row[MAX]] for row in rows]
    if syncing:
        reduced = torch.tensor(bounds, dtype=F64)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
        bounds = reduced.tolist()
    ranges = [histogram_range(-neg_min, vmax) for neg_min, vmax in bounds]
    edges = [linspace_host(lo, hi, bins + 1) for lo, hi in ranges]
    if exact:
        table = torch.tensor(edges, dtype=F64)
        bits32 = ceil32(table).view(torch.int32)
    found: list[list[float]] = []
    for m, (row, (lo, hi), tensors) in enumerate(zip(rows, ranges, parts, strict=True)):
        counted: Tensor | None = None
        direct: list[float] | None = None  # counts of the fused kernel, on the host
        laned = row[ZEROS] >= LANED_ZEROS * row[NUMEL]
        if row[COUNT] > 0:  # else no finite value here: nothing to count
            for i, x in enumerate(tensors):
                native = None if exact else native_buckets(x, lo, hi, bins)
                if native is not None:
                    weight = 1.0 if weights is None else weights[m][i]
                    if direct is None:
                        direct = [c * weight for c in native]
                    else:
                        direct = [d + c * weight for d, c in zip(direct, native, strict=True)]
                    continue
                for chunk in chunks(x):
                    finite = chunk[torch.isfinite(chunk)] if row[NONFINITE] else chunk
                    if exact:
                        part = bucket_cpu(finite, table[m], bits32[m], lo, hi, work, laned)
                    else:
                        part = bucket_native(finite, edges[m], lo, hi, work, laned)
                    if weights is not None:
                        part = part.to(F64) * weights[m][i]
                    counted = part if counted is None else counted + part
        values = [0.0] * (bins + 1) if counted is None else counted.to(F64).tolist()
        if direct is not None:
            values = [a + b for a, b in zip(values, direct, strict=True)]
        if weights is not None and any(w != 1.0 for w in weights[m]):
            found_total = sum(values)
            if found_total > 0:
                values = [v * (row[COUNT] / found_total) for v in values]
        found.append(values)
    sums = [[r[COUNT], r[COUNT] * r[MEAN], r[M2] + r[COUNT] * (r[MEAN] * r[MEAN])] for r in rows]
    counts = found
    if syncing:
        reduced = torch.tensor([s + c for s, c in zip(sums, counts, strict=True)], dtype=F64)
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
        packed = reduced.tolist()
        sums, counts = [p[:3] for p in packed], [p[3:] for p in packed]
    out = []
    for head, found_counts, (neg_min, vmax), limits in zip(
        sums, counts, bounds, edges, strict=True
    ):
        found_counts[bins - 1] += found_counts.pop()  # values equal to the last edge
        total, first, second = head
        out.append(HistogramRow(total, first, second, -neg_min, vmax, limits, found_counts))
    return out


def scaled_to(counts: Tensor, total: float | Tensor) -> Tensor:
    """Weighted float64 counts scaled to add up to ``total`` (unchanged when they add up to 0)."""
    found = counts.sum()
    return torch.where(found > 0, counts * (total / found.clamp(min=1e-300)), counts)


def histograms_device(
    parts: Sequence[Sequence[Tensor]],
    states: Tensor,
    bins: int,
    *,
    sync: bool,
    group: Any,
    weights: Sequence[Sequence[float]] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Histograms of ``m`` sets of tensors, on their device, without a host synchronisation.

    ``weights`` as in :func:`histogram_rows_cpu` (counts scaled to each set's finite count).

    Returns:
        ``counts (m, bins)``, ``edges (m, bins + 1)``, finite ``vmin (m,)`` and ``vmax (m,)``
        (``inf``/``-inf`` for an empty set), and ``(m, 3)`` [num, sum, sum of squares] of the
        finite values, all ``float64``.
    """
    vmin, vmax, lo, edges = device_ranges(states, bins, sync=sync, group=group)
    count = states[:, COUNT]
    counts = torch.zeros(len(parts), bins, dtype=F64, device=states.device)
    for m, tensors in enumerate(parts):
        for i, x in enumerate(tensors):
            v = flat64(x)
            finite = torch.isfinite(v)
            safe = torch.where(finite, v, lo[m])
            index = (torch.searchsorted(edges[m], safe, right=True) - 1).clamp(0, bins - 1)
            ones = finite.to(F64)
            counts[m].index_add_(0, index, ones if weights is None else ones * weights[m][i])
        if weights is not None:
            counts[m] = scaled_to(counts[m], count[m])
    counts, sums = summed_over_ranks(counts, states, sync=sync, group=group)
    return counts, edges, vmin, vmax, sums


def native_histograms(
    parts: Sequence[Sequence[Tensor]],
    states: Tensor,
    bins: int,
    weights: Sequence[Sequence[float]] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None:
    """:func:`histograms_device`'s histograms of CPU tensors in one pass of the fused kernel
    over each, for one process (no collective): :func:`native_histogram_table` split into
    :func:`raw_table`'s parts; ``None`` (nothing done) where it does not apply."""
    table = native_histogram_table(parts, states, bins, weights)
    if table is None:
        return None
    return (
        table[:, 6 + bins :],
        table[:, 5 : 6 + bins],
        table[:, 3],
        table[:, 4],
        table[:, :3],
    )


def native_histogram_table(
    parts: Sequence[Sequence[Tensor]],
    states: Tensor,
    bins: int,
    weights: Sequence[Sequence[float]] | None = None,
) -> Tensor | None:
    """The :func:`raw_table` of :func:`histograms_device`'s histograms of CPU tensors, for one
    process (no collective), in one call of the fused kernel (ranges, edges, buckets, scaling
    and sums of every set; no Python per set); ``None`` (nothing done) where it does not apply:
    no kernel, a tensor that is not float32 (see
    :func:`~lightning_recorder.stats._native.usable`), or a range too narrow for arithmetic
    bucketing. The buckets are :func:`histogram_rows_cpu`'s with ``exact=False``: float32
    positions, the last bucket closed, weighted counts scaled to each set's count of finite
    values."""
    if not _native.available():
        return None
    tensors, sets, scale_of = [], [], []
    for m, group in enumerate(parts):
        for i, x in enumerate(group):
            if not _native.usable(x):
                return None
            if x.numel():
                tensors.append(x)
                sets.append(m)
                scale_of.append(1.0 if weights is None else weights[m][i])
    return _native.sets_table(tensors, sets, scale_of, states.to(F64).contiguous(), bins)


def device_ranges(
    states: Tensor, bins: int, *, sync: bool, group: Any
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The global ranges of ``m`` histograms from their packed states ``(m, 9)``, on the device
    (one all-reduce of the bounds when syncing): finite ``vmin``/``vmax`` (``inf``/``-inf``
    for an empty set), the left edges ``lo`` and the ``(m, bins + 1)`` edges, with the rule of
    :func:`histogram_range` (``[0, 1]`` without data, ±0.5 around one value)."""
    bounds = torch.stack([states[:, MIN].neg(), states[:, MAX]], 1)
    if sync_active(sync, group):
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    vmin, vmax = -bounds[:, 0], bounds[:, 1]
    seen = vmax >= vmin
    lo = torch.where(seen, vmin, 0.0)
    hi = torch.where(seen, vmax, 1.0)
    flat = lo == hi
    lo, hi = torch.where(flat, lo - 0.5, lo), torch.where(flat, hi + 0.5, hi)
    return vmin, vmax, lo, linspace(lo, hi, bins + 1)


def summed_over_ranks(
    counts: Tensor, states: Tensor, *, sync: bool, group: Any
) -> tuple[Tensor, Tensor]:
    """``counts (m, bins)`` and the ``(m, 3)`` [num, sum, sum of squares] of the finite values
    of ``states``, summed over the ranks in one all-reduce when syncing."""
    count, mean = states[:, COUNT], states[:, MEAN]
    sums = torch.stack([count, count * mean, states[:, M2] + count * (mean * mean)], 1)
    packed = torch.cat([counts.to(F64), sums], 1)
    if sync_active(sync, group):
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    bins = counts.shape[1]
    return packed[:, :bins], packed[:, bins:]


def raw_table(counts: Tensor, edges: Tensor, vmin: Tensor, vmax: Tensor, sums: Tensor) -> Tensor:
    """The rows of :func:`histogram_rows` as one ``(m, 2 * bins + 6)`` tensor on the device,
    from the tensors of :func:`histograms_device` (read it to the host with one copy); each row
    is ``[num, sum, sum_squares, min, max, *edges, *counts]`` (:meth:`HistogramRow.from_flat`)."""
    return torch.cat([sums, vmin[:, None], vmax[:, None], edges, counts], 1)


def raw_rows(
    counts: Tensor, edges: Tensor, vmin: Tensor, vmax: Tensor, sums: Tensor
) -> list[HistogramRow]:
    """The rows of :func:`histogram_rows` from the tensors of :func:`histograms_device`."""
    flat = raw_table(counts, edges, vmin, vmax, sums).tolist()
    bins = counts.shape[1]
    return [HistogramRow.from_flat(row, bins) for row in flat]


def histogram_rows(
    parts: Sequence[Sequence[Tensor]],
    states: Tensor,
    bins: int,
    *,
    sync: bool,
    group: Any,
    work: Workspace | None = None,
    exact: bool = True,
) -> list[HistogramRow]:
    """Histograms of ``m`` sets of tensors, each set over its own global range, on the host.

    Args:
        parts: for each set, its tensors (the union of their elements is histogrammed).
        states: ``(m, 9)``, the packed state of each set (its min, max, count, mean and M2).
        bins: the number of buckets.
        sync: whether to combine the sets of every rank (two all-reduces for all ``m`` sets).
        group: the process group.
        work: CPU scratch buffers to reuse.
        exact: bucket CPU values by :func:`torch.histogram`'s rule to the last bit
            (:func:`bucket_cpu`); ``False`` computes buckets in the data's own precision
            (:func:`bucket_native`, the monitor's choice). Other devices are always exact.

    Returns:
        One :class:`HistogramRow` per set, identical on every rank.
    """
    if states.device.type == "cpu":
        return histogram_rows_cpu(
            parts, states, bins, sync=sync, group=group, work=work or Workspace(), exact=exact
        )
    return raw_rows(*histograms_device(parts, states, bins, sync=sync, group=group))
