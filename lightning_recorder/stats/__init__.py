"""Streaming feature statistics, histograms synchronised across ranks, and norm helpers.

The room's modules: :mod:`.features` (:data:`STAT_NAMES`, :func:`feature_stats`),
:mod:`.metric` (:class:`FeatureStats`, the only one that imports torchmetrics, loaded on first
use), :mod:`.histograms`, :mod:`.norms`, and :mod:`.batched` (many streams at once, the way
:class:`~lightning_recorder.FeatureStatsMonitor` uses them); ``_kernels`` holds the arithmetic.

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

from typing import TYPE_CHECKING, Any

from .features import STAT_NAMES, StatName, feature_stats
from .histograms import HistogramRow, histogram, histogram_raw_kwargs
from .norms import global_norm, tensor_norm, update_ratio

if TYPE_CHECKING:
    from .metric import FeatureStats

__all__ = [
    "STAT_NAMES",
    "FeatureStats",
    "HistogramRow",
    "StatName",
    "feature_stats",
    "global_norm",
    "histogram",
    "histogram_raw_kwargs",
    "tensor_norm",
    "update_ratio",
]


def __getattr__(name: str) -> Any:
    # FeatureStats needs torchmetrics: imported on first use, not with the room.
    if name == "FeatureStats":
        from .metric import FeatureStats

        return FeatureStats
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
