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
cancellation of ``sum(x**2) - sum(x)**2 / n``: within one tensor (one chunk of 2**18 elements
on the CPU) that one-pass form is used only where it loses at most 12 of float64's 53 bits
(data whose mean is within about 64 standard deviations of zero), the sum of squared
deviations elsewhere.

Off the CPU nothing synchronises with the host. On the CPU, where reading a value is free, a
tensor whose float64 sum is finite (no NaN or infinity) skips the masking passes, and
histograms find buckets arithmetically with an exact correction against the edges instead of a
binary search: the same numbers and the same counts, several times faster.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_recorder._stats_kernels import (
    F64,
    Workspace,
    batch_state,
    empty_state,
    finalize,
    histogram_rows,
    histogram_rows_cpu,
    histograms_device,
    merge,
    raw_kwargs,
)
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


def _check_tensor(x: object, name: str = "x") -> Tensor:
    if not isinstance(x, Tensor):
        raise RecorderConfigError(
            f"Expected `{name}` to be a torch.Tensor but got {type(x).__name__}."
        )
    if x.is_complex():
        raise RecorderConfigError(f"Expected `{name}` to have a real dtype but got {x.dtype}.")
    return x


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
    return finalize(batch_state(_check_tensor(x)), _check_correction(correction))


class FeatureStats(Metric):
    """Streaming mean, std, min, max, abs-mean, zero fraction and non-finite count of tensors.

    The state is a fixed-size ``float64`` vector on the metric's device: ``update`` stores no
    tensor and, off the CPU, never synchronises with the host. Move the metric to the device of
    its inputs (``stats.to(device)``); inputs on another device are reduced there and only their
    9-number summary is copied. See the module documentation for the exact definitions.

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
        self.add_state("packed", default=empty_state(), dist_reduce_fx=merge)

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
        batch = batch_state(x).to(state.device)
        self.packed = merge(torch.stack([state, batch]))

    def compute(self) -> dict[str, Tensor]:
        """The statistics so far, over every rank (a collective call under DDP).

        Returns:
            A dictionary with the keys of :data:`STAT_NAMES`, each a 0-d ``float64`` tensor.
        """
        return finalize(self.packed, self.correction)

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
    x, bins = _check_tensor(x), _check_bins(bins)
    work = Workspace()
    state = batch_state(x, work)[None]
    if x.device.type != "cpu":
        counts, edges, *_ = histograms_device([[x]], state, bins, sync, process_group)
        return counts[0], edges[0]
    (row,) = histogram_rows_cpu([[x]], state, bins, sync, process_group, work)
    return torch.tensor(row[6 + bins :], dtype=F64), torch.tensor(row[5 : 6 + bins], dtype=F64)


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
    x, bins = _check_tensor(x), _check_bins(bins)
    work = Workspace()
    (row,) = histogram_rows([[x]], batch_state(x, work)[None], bins, sync, process_group, work)
    return raw_kwargs(row, bins)


def _norm_input(t: Tensor, name: str) -> Tensor:
    t = _check_tensor(t, name).detach()
    return t.to(F64 if t.dtype == F64 else torch.float32)


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
    dtype = F64 if any(n.dtype == F64 for n in norms) else torch.float32
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
