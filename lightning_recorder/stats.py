"""Streaming feature statistics, histograms synchronised across ranks, and norm helpers.

Definitions used everywhere in this module, for a stream of tensors ``x_1, x_2, …`` (any shape,
any real dtype, on every rank):

* **numel** — the number of elements seen, non-finite ones included.
* **nonfinite** — the number of NaN, ``+inf`` and ``-inf`` elements. They are counted, never
  silently dropped, and they are left out of every other statistic but ``zero_fraction``.
* **mean**, **std**, **min**, **max**, **abs_mean** (mean of ``|x|``) — over the *finite*
  elements only. ``std`` is the *sample* standard deviation by default (``correction=1``, the
  default of :func:`torch.std`); pass ``correction=0`` for the population standard deviation.
  It equals ``torch.std(finite, correction=correction)`` where ``finite`` holds the finite
  elements of the concatenation of every update on every rank.
* **zero_fraction** — the number of elements exactly equal to zero divided by ``numel`` (all
  elements, non-finite ones included).

Statistics with nothing to describe are NaN: everything but ``numel``, ``nonfinite`` and
``zero_fraction`` when no finite element was seen, ``std`` when there are no more than
``correction`` finite elements, ``zero_fraction`` when ``numel`` is 0. Every value is a 0-d
``float64`` tensor; counts are exact integers up to 2**53. Inputs are upcast to ``float64``
(integers beyond 2**53 lose precision).

The streaming state is a count, a mean and a sum of squared deviations (``M2``), merged with
Chan's parallel formula across updates and across ranks, so the result does not suffer from the
cancellation of ``sum(x**2) - sum(x)**2 / n``.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric

from lightning_recorder.errors import RecorderConfigError

__all__ = [
    "STAT_NAMES",
    "FeatureStats",
    "feature_stats",
    "global_norm",
    "histogram",
    "histogram_raw_kwargs",
    "tensor_norm",
    "update_ratio",
]

STAT_NAMES: tuple[str, ...] = (
    "mean",
    "std",
    "min",
    "max",
    "abs_mean",
    "zero_fraction",
    "nonfinite",
    "numel",
)
"""The keys of the dictionaries returned by :class:`FeatureStats` and :func:`feature_stats`."""

# Layout of the packed state: one float64 vector, so that a rank's state travels in one gather.
_COUNT, _MEAN, _M2, _MIN, _MAX, _ABS_MEAN, _ZEROS, _NONFINITE, _NUMEL = range(9)
_F64 = torch.float64


def _check_tensor(x: object, name: str = "x") -> Tensor:
    if not isinstance(x, Tensor):
        raise RecorderConfigError(
            f"Expected `{name}` to be a torch.Tensor but got {type(x).__name__}."
        )
    if x.is_complex():
        raise RecorderConfigError(f"Expected `{name}` to have a real dtype but got {x.dtype}.")
    return x


def _empty_state(device: torch.device | str | None = None) -> Tensor:
    # Filled on the device: a tensor built from a Python list would be a host-to-device copy.
    state = torch.zeros(9, dtype=_F64, device=device)
    state[_MIN] = math.inf
    state[_MAX] = -math.inf
    return state


def _batch_state(x: Tensor) -> Tensor:
    """The packed state of one tensor, computed on its device without a host synchronisation."""
    numel = x.numel()
    if numel == 0:
        return _empty_state(x.device)
    v = x.detach().reshape(-1).to(_F64)
    finite = torch.isfinite(v)
    count = finite.sum(dtype=_F64)
    safe = torch.where(finite, v, 0.0)
    mean = safe.sum() / count.clamp(min=1.0)
    m2 = torch.where(finite, v - mean, 0.0).square().sum()
    parts = [
        count,
        mean,
        m2,
        torch.where(finite, v, math.inf).amin(),
        torch.where(finite, v, -math.inf).amax(),
        safe.abs().sum() / count.clamp(min=1.0),
        (v == 0).sum(dtype=_F64),
        numel - count,
        torch.full((), numel, dtype=_F64, device=v.device),
    ]
    return torch.stack(parts)


def _merge(states: Tensor) -> Tensor:
    """Merge packed states stacked along dim 0 (Chan et al.'s pairwise formula, n-way)."""
    count = states[:, _COUNT]
    total = count.sum()
    weight = count / total.clamp(min=1.0)
    mean = (weight * states[:, _MEAN]).sum()
    m2 = states[:, _M2].sum() + (count * (states[:, _MEAN] - mean).square()).sum()
    parts = [
        total,
        mean,
        m2,
        states[:, _MIN].amin(),
        states[:, _MAX].amax(),
        (weight * states[:, _ABS_MEAN]).sum(),
        states[:, _ZEROS].sum(),
        states[:, _NONFINITE].sum(),
        states[:, _NUMEL].sum(),
    ]
    return torch.stack(parts)


def _finalize(state: Tensor, correction: int) -> dict[str, Tensor]:
    count, numel = state[_COUNT], state[_NUMEL]
    nan = torch.full((), math.nan, dtype=_F64, device=state.device)
    seen = count > 0
    dof = count - correction
    return {
        "mean": torch.where(seen, state[_MEAN], nan),
        "std": torch.where(dof > 0, (state[_M2] / dof.clamp(min=1.0)).sqrt(), nan),
        "min": torch.where(seen, state[_MIN], nan),
        "max": torch.where(seen, state[_MAX], nan),
        "abs_mean": torch.where(seen, state[_ABS_MEAN], nan),
        "zero_fraction": torch.where(numel > 0, state[_ZEROS] / numel.clamp(min=1.0), nan),
        "nonfinite": state[_NONFINITE].clone(),
        "numel": numel.clone(),
    }


def _check_correction(correction: object) -> int:
    if isinstance(correction, bool) or not isinstance(correction, int) or correction < 0:
        raise RecorderConfigError(
            f"Expected `correction` to be a non-negative integer but got {correction!r}."
        )
    return correction


def feature_stats(x: Tensor, correction: int = 1) -> dict[str, Tensor]:
    """The statistics of one tensor, on this process only (no synchronisation).

    Args:
        x: a tensor of any shape and real dtype.
        correction: subtracted from the number of finite elements in the denominator of the
            variance: 1 for the sample, 0 for the population standard deviation.

    Returns:
        A dictionary with the keys of :data:`STAT_NAMES`, each a 0-d ``float64`` tensor.

    Raises:
        RecorderConfigError: if ``x`` is not a real tensor or ``correction`` is negative.

    Example:
        >>> s = feature_stats(torch.tensor([0.0, 1.0, 2.0, float("nan")]))
        >>> s["mean"].item(), s["std"].item(), s["nonfinite"].item(), s["zero_fraction"].item()
        (1.0, 1.0, 1.0, 0.25)
    """
    return _finalize(_batch_state(_check_tensor(x)), _check_correction(correction))


class FeatureStats(Metric):
    """Streaming mean, std, min, max, abs-mean, zero fraction and non-finite count of tensors.

    The state is a fixed-size ``float64`` vector on the metric's device: ``update`` stores no
    tensor and never synchronises with the host. Move the metric to the device of its inputs
    (``stats.to(device)``); inputs on another device are reduced there and only their 9-number
    summary is copied. See the module documentation for the exact definitions.

    ``compute()`` synchronises the state across ranks when ``torch.distributed`` is initialised
    (through torchmetrics), so under DDP **every rank must call it**, also a rank that saw no
    data; never call it under ``rank_zero_only``. The result is the statistic over the data of
    all ranks. With no data, ``compute()`` returns NaN statistics and ``numel`` 0, quietly.

    State created under :func:`torch.inference_mode` (a standalone ``validate()``) may be
    updated outside of it later: updates are out of place and inference tensors are cloned.

    Args:
        correction: subtracted from the number of finite elements in the denominator of the
            variance: 1 (default) for the sample, 0 for the population standard deviation.
        kwargs: the keyword arguments of :class:`torchmetrics.Metric` (``process_group``,
            ``sync_on_compute``, …).

    Raises:
        RecorderConfigError: if ``correction`` is not a non-negative integer.

    Example:
        >>> stats = FeatureStats()
        >>> stats.update(torch.tensor([[1.0, 2.0], [3.0, float("inf")]]))
        >>> stats.update(torch.tensor([0, 4]))
        >>> out = stats.compute()
        >>> out["mean"].item(), out["std"].item(), out["max"].item()
        (2.0, 1.5811388300841898, 4.0)
        >>> out["nonfinite"].item(), out["numel"].item(), out["zero_fraction"].item()
        (1.0, 6.0, 0.16666666666666666)
        >>> stats.reset()
        >>> stats.compute()["numel"].item()
        0.0
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    packed: Tensor

    def __init__(self, correction: int = 1, **kwargs: Any) -> None:
        try:
            super().__init__(**kwargs)
        except ValueError as err:  # an unknown or malformed keyword argument
            raise RecorderConfigError(str(err)) from err
        self.correction = _check_correction(correction)
        self.add_state("packed", default=_empty_state(), dist_reduce_fx=_merge)

    def update(self, x: Tensor) -> None:
        """Add the elements of ``x`` (any shape, any real dtype) to the statistics.

        Args:
            x: the tensor to add; it is detached, flattened and upcast to ``float64``.

        Raises:
            RecorderConfigError: if ``x`` is not a real tensor.
        """
        _check_tensor(x)
        state = self.packed
        if state.is_inference() and not torch.is_inference_mode_enabled():
            state = state.clone()
        batch = _batch_state(x).to(state.device)
        self.packed = _merge(torch.stack([state, batch]))

    def compute(self) -> dict[str, Tensor]:
        """The statistics so far, over every rank (a collective call under DDP).

        Returns:
            A dictionary with the keys of :data:`STAT_NAMES`, each a 0-d ``float64`` tensor.
        """
        return _finalize(self.packed, self.correction)

    def merge_state(self, incoming_state: dict[str, Any] | Metric) -> None:
        """Add the state of another :class:`FeatureStats` (or its ``metric_state``) to this one."""
        super().merge_state(incoming_state)
        self._computed = None  # torchmetrics would return the result cached before the merge

    def _wrap_compute(self, compute: Callable) -> Callable:
        # No data is a normal state for a monitored layer: skip torchmetrics' warning about it.
        wrapped = super()._wrap_compute(compute)

        @functools.wraps(compute)
        def quiet(*args: Any, **kwargs: Any) -> Any:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*called before the ``update``")
                return wrapped(*args, **kwargs)

        return quiet


def _check_bins(bins: object) -> int:
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise RecorderConfigError(f"Expected `bins` to be a positive integer but got {bins!r}.")
    return bins


def _syncing(sync: bool, group: Any) -> bool:
    return (
        sync
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size(group=group) > 1
    )


def _linspace(lo: Tensor, hi: Tensor, steps: int) -> Tensor:
    """``torch.linspace`` with tensor end points (no host sync); both ends are exact."""
    i = torch.arange(steps, dtype=_F64, device=lo.device)
    step = (hi - lo) / max(steps - 1, 1)
    return torch.where(i < steps // 2, lo + step * i, hi - step * (steps - 1 - i))


def _histogram(x: Tensor, bins: int, sync: bool, group: Any) -> tuple[Tensor, ...]:
    """Global counts, edges, finite min/max and [num, sum, sum of squares] of finite values."""
    v = _check_tensor(x).detach().reshape(-1).to(_F64)
    bins = _check_bins(bins)
    syncing = _syncing(sync, group)
    finite = torch.isfinite(v)
    if v.numel():
        neg_min = torch.where(finite, v, math.inf).amin().neg()
        bounds = torch.stack([neg_min, torch.where(finite, v, -math.inf).amax()])
    else:
        bounds = torch.full((2,), -math.inf, dtype=_F64, device=v.device)
    if syncing:
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    vmin, vmax = -bounds[0], bounds[1]
    seen = vmax >= vmin
    # The range of torch.histogram: [0, 1] for no data, widened by 0.5 for a single value.
    lo = torch.where(seen, vmin, 0.0)
    hi = torch.where(seen, vmax, 1.0)
    flat = lo == hi
    lo, hi = torch.where(flat, lo - 0.5, lo), torch.where(flat, hi + 0.5, hi)
    edges = _linspace(lo, hi, bins + 1)
    safe = torch.where(finite, v, lo)
    index = (torch.searchsorted(edges, safe, right=True) - 1).clamp(0, bins - 1)
    weight = finite.to(_F64)
    sums = torch.stack([weight.sum(), (safe * weight).sum(), (safe.square() * weight).sum()])
    counts = torch.zeros(bins, dtype=_F64, device=v.device).index_add_(0, index, weight)
    packed = torch.cat([counts, sums])
    if syncing:
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return packed[:bins], edges, vmin, vmax, packed[bins:]


def histogram(
    x: Tensor, bins: int = 64, *, sync: bool = True, process_group: Any = None
) -> tuple[Tensor, Tensor]:
    """Bucket counts of the finite values of ``x`` over their global range, summed over ranks.

    The ``bins + 1`` edges span ``[min, max]`` of the finite values of every rank (all-reduced
    first), and bucket ``i`` holds ``edges[i] <= v < edges[i + 1]``, the last one closed, as in
    :func:`torch.histogram`. A single value ``v`` gives the range ``[v - 0.5, v + 0.5]``, no
    finite value the range ``[0, 1]`` and zero counts. Nothing synchronises with the host.

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
    counts, edges, *_ = _histogram(x, bins, sync, process_group)
    return counts, edges


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
    counts, edges, vmin, vmax, sums = _histogram(x, bins, sync, process_group)
    host = torch.cat([sums, torch.stack([vmin, vmax]), edges, counts]).tolist()
    num, total, squares, low, high = host[:5]
    if num == 0:
        return None
    return {
        "min": low,
        "max": high,
        "num": int(num),
        "sum": total,
        "sum_squares": squares,
        "bucket_limits": host[5 : 6 + bins],
        "bucket_counts": [0.0, *host[6 + bins :]],
    }


def _norm_input(t: Tensor, name: str) -> Tensor:
    t = _check_tensor(t, name).detach()
    return t.to(_F64 if t.dtype == _F64 else torch.float32)


def tensor_norm(t: Tensor) -> Tensor:
    """The L2 norm of all elements of ``t``, detached, at least in ``float32``.

    Args:
        t: a tensor of any shape and real dtype (a parameter, a gradient).

    Returns:
        A 0-d tensor on ``t``'s device (``float64`` for ``float64`` input); 0 for an empty tensor,
        non-finite when ``t`` holds a non-finite value.

    Raises:
        RecorderConfigError: if ``t`` is not a real tensor.

    Example:
        >>> tensor_norm(torch.tensor([[3.0, 0.0], [0.0, 4.0]], dtype=torch.float16)).item()
        5.0
    """
    return torch.linalg.vector_norm(_norm_input(t, "t"))


def global_norm(tensors: Iterable[Tensor]) -> Tensor:
    """The L2 norm of the concatenation of ``tensors`` (the total norm of gradient clipping).

    Args:
        tensors: tensors of any shapes, for instance ``p.grad`` of every parameter that has one.

    Returns:
        A 0-d ``float32`` tensor (``float64`` if any input is), on the first tensor's device;
        0 when there is no tensor.

    Raises:
        RecorderConfigError: if an element is not a real tensor.

    Example:
        >>> global_norm([torch.tensor([3.0]), torch.tensor([[4.0]])]).item()
        5.0
    """
    norms = [tensor_norm(t) for t in tensors]
    if not norms:
        return torch.zeros(())
    dtype = _F64 if any(n.dtype == _F64 for n in norms) else torch.float32
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device, dtype) for n in norms]))


def update_ratio(before: Tensor, after: Tensor, eps: float = 1e-12) -> Tensor:
    """The update-to-parameter ratio ``||after - before|| / (||before|| + eps)``.

    Take ``before`` as a copy of a parameter before ``optimizer.step()`` and ``after`` as the
    parameter after it; healthy training typically shows ratios around ``1e-3``.

    Args:
        before: the tensor before the update.
        after: the tensor after the update, of the same shape.
        eps: added to the denominator, so a zero ``before`` gives a finite ratio.

    Returns:
        A 0-d tensor, as :func:`tensor_norm`.

    Raises:
        RecorderConfigError: if the shapes differ, an argument is not a real tensor, or ``eps``
            is negative.

    Example:
        >>> update_ratio(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5])).item()
        0.10000000149011612
    """
    b, a = _norm_input(before, "before"), _norm_input(after, "after")
    if a.shape != b.shape:
        raise RecorderConfigError(
            f"Expected `after` to have the shape of `before`, {tuple(b.shape)}, "
            f"but got {tuple(a.shape)}."
        )
    if not eps >= 0:
        raise RecorderConfigError(f"Expected `eps` to be a non-negative number but got {eps!r}.")
    return torch.linalg.vector_norm(a - b) / (torch.linalg.vector_norm(b) + eps)
