"""Statistics of many streams at once, the way a monitor computes them on every logged step.

One packed ``float64`` state of 9 numbers per stream (count, mean, ``M2``, min, max, mean
``|x|``, zeros, non-finite, numel), stacked ``(m, 9)`` for ``m`` streams, so that a step's
states cross ranks in one gather and reach the host in one copy:

* :func:`native_state` / :func:`merged` — the state of a tensor (in its own precision on the CPU)
  and of several;
* :func:`merge` — Chan's merge along the leading dimension; :func:`gather_merged` — the same over
  every rank (a collective);
* :func:`finalize` — states to the statistics of :data:`STAT_NAMES`, where they are (a tensor a
  statistic); :func:`finalize_host` — the same from a host row of a state;
* :func:`histogram_rows` — the histograms of ``m`` sets of tensors as :class:`HistogramRow` s
  (:func:`histogram_rows_cpu` on the host, :func:`histograms_device` and :func:`raw_table` on
  the data's device without reading anything back; :func:`native_histogram_table` the table of
  those of float32 CPU tensors in one call of the fused kernel, :func:`native_histograms` its
  parts);
* :func:`flatten_segments`, :func:`segmented_states`, :func:`segmented_histograms` — the
  states and histograms of many small tensors in one flat buffer, a few operations in all;
* :func:`sample_of` — a small strided copy of a tensor, for approximate histograms (the
  weights of :func:`histogram_rows_cpu` / :func:`histograms_device` scale its counts);
  :func:`sampled_state` — the state and the sample together, in one read where the fused CPU
  kernel runs;
* :func:`foreach_norms` / :func:`host_floats` — norms of many tensors in one call, and 0-d
  tensors to the host in one copy;
* :func:`fused_kernels` / :func:`fused_kernels_status` — whether the fused CPU kernels run
  here, and why not;
* :func:`copy_with_norms` / :func:`change_norms` — a parameter statistics' two passes (the copy
  before the optimizer step, the change after it) with their norms, fused on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._core import native
from .._core.compat import distributed_active, foreach_norm
from . import _native
from ._kernels import (
    HistogramRow,
    Workspace,
    empty_state,
    finalize,
    finalize_host,
    histogram_rows,
    histogram_rows_cpu,
    histograms_device,
    merge,
    merged,
    native_histogram_table,
    native_histograms,
    native_state,
    raw_table,
    sample_of,
    sampled_row,
    sampled_state,
)
from ._segmented import (
    flatten_segments,
    native_segmented_histograms,
    native_segmented_table,
    native_segments,
    segmented_histograms,
    segmented_states,
)

__all__ = [
    "HistogramRow",
    "Workspace",
    "change_norms",
    "copy_with_norms",
    "empty_state",
    "finalize",
    "finalize_host",
    "flatten_segments",
    "foreach_norms",
    "fused_kernels",
    "fused_kernels_status",
    "gather_merged",
    "histogram_rows",
    "histogram_rows_cpu",
    "histograms_device",
    "host_floats",
    "merge",
    "merged",
    "native_histogram_table",
    "native_histograms",
    "native_segmented_histograms",
    "native_segmented_table",
    "native_segments",
    "native_state",
    "raw_table",
    "sample_of",
    "sampled_row",
    "sampled_state",
    "segmented_histograms",
    "segmented_states",
    "upcast",
]


def gather_merged(state: Tensor, group: Any = None) -> Tensor:
    """``state`` ``(m, 9)`` merged over every rank of ``group`` (one all-gather, every rank).

    Without a running process group (or with one rank) the state is returned as is.
    """
    if not distributed_active(group):
        return state
    gathered = [torch.empty_like(state) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, state, group=group)
    return merge(torch.stack(gathered))


def upcast(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Tensors below float32 converted to it, as :func:`~lightning_recorder.stats.tensor_norm`."""
    return [t if t.dtype in (torch.float32, torch.float64) else t.float() for t in tensors]


def foreach_norms(tensors: Sequence[Tensor]) -> list[Tensor]:
    """:func:`~lightning_recorder.stats.tensor_norm` of each tensor, in one foreach call."""
    return foreach_norm(upcast(tensors)) if tensors else []


def host_floats(tensors: Sequence[Tensor]) -> list[float]:
    """The elements of tensors of any shapes (on one device, or moved to the first one's), in
    order, as floats: one device-to-host copy for all of them.

    Float32 (and narrower) values convert to float64 exactly, so each float is the tensor's value.
    """
    if not tensors:
        return []
    device = tensors[0].device
    flat = [t.reshape(-1).to(device=device, dtype=torch.float64) for t in tensors]
    return torch.cat(flat).tolist()


def fused_kernels() -> bool:
    """Whether the fused CPU kernels run here: built on the first call (about 0.2 s with the
    system's C compiler, then loaded from the cache directory), ``False`` where they cannot be
    (see :mod:`lightning_recorder._core.native`); the torch path is taken then.

    >>> from lightning_recorder.stats.batched import fused_kernels, fused_kernels_status
    >>> fused_kernels() == fused_kernels_status().startswith("loaded from ")
    True
    """
    return _native.available()


def fused_kernels_status() -> str:
    """Why the fused CPU kernels run or not: ``"loaded from <file>"``, or the reason they are
    not used (``"disabled by LIGHTNING_RECORDER_NATIVE"``, ``"no C compiler found (set CC)"``,
    ``"build failed: ..."``); builds them first if no one asked yet."""
    _native.available()
    return native.status().get(_native.LIBRARY, "not asked for")


def copy_with_norms(
    buffers: Sequence[Tensor], params: Sequence[Tensor], grads: Sequence[Tensor | None]
) -> tuple[list[float], list[float]] | None:
    """Copy each parameter into its buffer and return the squared norms of the parameters and of
    their gradients (``nan`` for a ``None`` one), in one pass over the three by the fused CPU
    kernel; ``None`` (nothing done) where it does not take them all (no kernel, not float32 CPU
    tensors, not contiguous)."""
    tensors = (*buffers, *params, *(g for g in grads if g is not None))
    if not (_native.available() and all(map(_native.usable, tensors))):
        return None
    return _native.copy_sumsq(list(buffers), list(params), list(grads))


def change_norms(
    params: Sequence[Tensor], buffers: Sequence[Tensor]
) -> tuple[list[float], list[float]] | None:
    """The squared norms of ``params - buffers`` (the change since the copy) and of ``params``,
    in one pass over the two by the fused CPU kernel, the difference written nowhere; ``None``
    where it does not take them all."""
    if not (_native.available() and all(map(_native.usable, (*buffers, *params)))):
        return None
    return _native.diff_sumsq(list(params), list(buffers))
