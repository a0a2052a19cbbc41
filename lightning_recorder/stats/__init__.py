"""Streaming feature statistics, histograms synchronised across ranks, and norm helpers.

The room's modules: :mod:`.features` (:data:`STAT_NAMES`, :func:`feature_stats`),
:mod:`.metric` (:class:`FeatureStats`, and the metrics through which every statistic crosses
ranks; the only module that imports torchmetrics, loaded on first use), :mod:`.histograms`,
:mod:`.norms` and :mod:`.sharded`. The private modules hold the one definition of the state
(``_state``), the engine that runs it compiled or eagerly (``_engine``), the one histogram
(``_histogram``) and what a monitor collects in a batch (``_collect``).

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
``float64`` tensor; counts are exact integers up to 2**53.

**Precision.** Each tensor is read once; every value is converted to ``float64`` as it is read
(no copy of the tensor is made) and every sum is taken in ``float64``, of the deviations from a
shift near the mean (the mean of a few values spread over the tensor), so ``std`` does not
suffer from the cancellation of ``sum(x**2) - sum(x)**2 / n``. Streams and ranks merge with
Chan's parallel formula. Against a ``float64`` reference computed on the concatenated data,
mean, std and abs_mean agree within ``1e-9`` (relative, plus ``1e-12`` of the data's scale for
the mean) and min, max and the counts exactly. Histograms count with the rule of
:func:`torch.histogram`, the bucket of a value found arithmetically in the data's precision (a
value within rounding of an edge may land in the bucket next to it, as with
:func:`torch.histc`).

**Where.** The statistics run on the tensor's device, compiled by ``torch.compile`` where it can
(Triton on CUDA, inductor on the CPU; in the background, eager until ready; see
``LIGHTNING_RECORDER_COMPILE``) and eagerly elsewhere: the same function. Off the CPU nothing
synchronises with the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._engine import compile_status
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
    "compile_status",
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
