"""Streaming statistics as torchmetrics ``Metric`` s: the one place where states cross ranks.

:class:`StreamStates` holds the packed states of ``m`` streams and declares how ranks combine
them (:func:`~lightning_recorder.stats._state.merge` of the gathered states);
:class:`BucketCounts` holds histogram counts and declares their sum. Every cross-rank reduction
of the package's statistics goes through them, under DDP and FSDP alike: torchmetrics gathers on
``compute()``, which every rank must therefore call. :class:`FeatureStats` is the public metric
of one stream.

This is the only module of the room that imports torchmetrics; ``lightning_recorder.stats``
loads it on first use of :class:`FeatureStats`.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from .._core.checks import check_int, check_tensor
from ..errors import RecorderConfigError
from ._engine import tensor_state
from ._state import F64, empty_states, finalize, merge
from .features import check_correction

__all__ = ["BucketCounts", "ChannelCounts", "ChannelExtremes", "FeatureStats", "StreamStates"]


def _merge_ranks(gathered: Tensor) -> Tensor:
    """The reduction of packed states gathered from every rank (stacked along dim 0)."""
    return merge(gathered, 0)


class _Quiet(Metric):
    """A metric that may be computed before any update (no data is a normal state here), whose
    ``compute()`` reads the merged state afresh every time (``compute_with_cache=False``: a cached
    result would outlive a ``merge_state``)."""

    def __init__(self, **kwargs: Any) -> None:
        if kwargs.get("compute_with_cache", False) is not False:
            raise RecorderConfigError(
                f"Expected compute_with_cache=False (or no such argument) for "
                f"{type(self).__name__} but got {kwargs['compute_with_cache']!r}: its compute() "
                "reads the merged state, and a cached result would outlive merge_state()."
            )
        kwargs["compute_with_cache"] = False
        try:
            super().__init__(**kwargs)
        except ValueError as err:  # an unknown or malformed keyword argument
            raise RecorderConfigError(str(err)) from err
        self._quiet_compute()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # a copy or an unpickled metric: compute() wrapped afresh
        self._quiet_compute()

    def set_dtype(self, dst_type: str | torch.dtype) -> Metric:
        """Refuse any dtype but ``float64``: the states are ``float64`` sums and extremes (a
        float16 state overflowed to ``inf`` at a sum of squares above 65,504, a float32 one
        rounded counts above 2**24), and the results are ``float64`` whatever the data's dtype.

        Raises:
            RecorderConfigError: ``dst_type`` is not ``torch.float64`` (or ``"double"``).
        """
        found = getattr(torch, dst_type, None) if isinstance(dst_type, str) else dst_type
        if found is not F64:
            raise RecorderConfigError(
                f"Expected {type(self).__name__}.set_dtype to keep its float64 state but got "
                f"{dst_type!r}: its sums and counts stay exact only in float64 (in float16 a "
                "sum of squares overflows to inf above 65,504). Its results are float64 "
                "whatever the data's dtype; convert them instead, e.g. "
                "`{k: v.to(torch.float16) for k, v in stats.compute().items()}`."
            )
        return super().set_dtype(dst_type)

    def _quiet_compute(self) -> None:
        """Wrap the public ``compute`` (torchmetrics' wrapper included) so that a compute before
        any update does not warn."""
        compute = self.compute

        @functools.wraps(compute)
        def quiet(*args: Any, **kwargs: Any) -> Any:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*called before the ``update``")
                return compute(*args, **kwargs)

        self.compute = quiet  # type: ignore[method-assign]


class StreamStates(_Quiet):
    """The packed states of ``streams`` streams (``None``: one stream, a vector), merged over
    every rank by ``compute()``.

    ``update(states)`` merges packed states of the same shape (computed by the engine) into the
    metric's; ``compute()`` returns the states over every rank.

    Raises:
        RecorderConfigError: if ``streams`` is not a non-negative int or ``None``.
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    packed: Tensor

    def __init__(self, streams: int | None = None, **kwargs: Any) -> None:
        check_int(streams, "streams", type(self).__name__, minimum=0, allow_none=True)
        super().__init__(**kwargs)
        shape = () if streams is None else (streams,)
        self.add_state("packed", default=empty_states(*shape), dist_reduce_fx=_merge_ranks)
        self._packed_shape = self.packed.shape
        self._fresh = True  # nothing merged in since the last reset

    def _check_packed(self, packed: object, what: str) -> None:
        """Raise unless ``packed`` is a state of this metric's shape (a state of another metric,
        or of a checkpoint of another layout, loaded or merged in, failed later in torch)."""
        shape = tuple(self._packed_shape)
        if not isinstance(packed, Tensor) or packed.shape != self._packed_shape:
            got = tuple(packed.shape) if isinstance(packed, Tensor) else type(packed).__name__
            raise RecorderConfigError(
                f"Expected {what} of {type(self).__name__} to be a packed state of shape {shape} "
                f"(the `packed` state of a {type(self).__name__} of this layout) but got {got}."
            )

    def update(self, states: Tensor) -> None:
        """Merge packed states (the shape of the metric's) into the metric's."""
        state = self.packed
        states = states.to(device=state.device, dtype=F64)
        if self._fresh and states.shape == state.shape:
            self.packed = states.clone()  # what merging into the empty state gives, exactly
        else:
            if state.is_inference() and not torch.is_inference_mode_enabled():
                state = state.clone()  # created under inference_mode (a standalone validate)
            self.packed = merge(torch.stack([state, states]), 0)
        self._fresh = False

    def reset(self) -> None:
        """Back to the state of no data."""
        super().reset()
        self._fresh = True

    def compute(self) -> Tensor:
        """The packed states over every rank (a collective under DDP)."""
        return self.packed

    def merge_state(self, incoming_state: dict[str, Any] | Metric) -> None:
        """Add the states of another metric of this kind (or its ``metric_state``) to these.

        Raises:
            RecorderConfigError: if the incoming ``packed`` state has another shape.
        """
        state = incoming_state.metric_state if isinstance(incoming_state, Metric) else None
        if isinstance(incoming_state, dict):
            state = incoming_state
        if state is not None and "packed" in state:
            self._check_packed(state["packed"], "the merged state")
        super().merge_state(incoming_state)  # nothing cached to go stale (compute_with_cache=False)
        self._fresh = False

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        key = prefix + "packed"
        if key in state_dict:
            self._check_packed(state_dict[key], f"the loaded state {key!r}")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.packed = self.packed.to(F64)  # a state saved in another dtype
        self._fresh = False  # a loaded state (a checkpoint) is added to, not replaced


class BucketCounts(_Quiet):
    """Histogram counts ``(streams, bins)`` summed over every rank by ``compute()``.

    Raises:
        RecorderConfigError: if ``streams`` is not a non-negative int or ``bins`` not a positive
            int.
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    counts: Tensor

    def __init__(self, streams: int, bins: int, **kwargs: Any) -> None:
        check_int(streams, "streams", type(self).__name__, minimum=0)
        check_int(bins, "bins", type(self).__name__)
        super().__init__(**kwargs)
        self.add_state(
            "counts", default=torch.zeros(streams, bins, dtype=F64), dist_reduce_fx="sum"
        )

    def update(self, counts: Tensor) -> None:
        """Add counts of the metric's shape."""
        self.counts = self.counts + counts.to(device=self.counts.device, dtype=F64)

    def compute(self) -> Tensor:
        """The counts summed over every rank (a collective under DDP)."""
        return self.counts


class ChannelCounts(_Quiet):
    """The number of channels of each of ``streams`` tracked streams, the largest over every rank
    by ``compute()``: 0 for a stream no rank has seen yet. A rank that never called a module
    learns its channel count from the ranks that did, so that every rank lays out the channels of
    :class:`ChannelExtremes` alike.

    Raises:
        RecorderConfigError: if ``streams`` is not a non-negative int.
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    sizes: Tensor

    def __init__(self, streams: int, **kwargs: Any) -> None:
        check_int(streams, "streams", type(self).__name__, minimum=0)
        super().__init__(**kwargs)
        self.add_state("sizes", default=torch.zeros(streams, dtype=F64), dist_reduce_fx="max")

    def update(self, sizes: Tensor) -> None:
        """Take the larger of the known and the given channel counts, stream by stream."""
        self.sizes = torch.maximum(self.sizes, sizes.to(device=self.sizes.device, dtype=F64))

    def compute(self) -> Tensor:
        """The channel counts over every rank (a collective under DDP)."""
        return self.sizes


class ChannelExtremes(_Quiet):
    """Per-channel extremes of outputs, ``(3, channels)`` [min, max, min ``|x|``] (the channels of
    every tracked stream side by side), combined over every rank by ``compute()`` (min, max,
    min)."""

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    low: Tensor
    high: Tensor
    abs_low: Tensor

    def __init__(self, channels: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        inf = torch.full((channels,), math.inf, dtype=F64)
        self.add_state("low", default=inf.clone(), dist_reduce_fx="min")
        self.add_state("high", default=-inf, dist_reduce_fx="max")
        self.add_state("abs_low", default=inf.clone(), dist_reduce_fx="min")

    @classmethod
    def on(cls, channels: int, device: torch.device | str) -> ChannelExtremes:
        """A metric of ``channels`` channels whose states are made on ``device`` (filled there):
        made on the host and moved, they would be copied from the host, which synchronises with
        a CUDA device."""
        with torch.device(device):
            metric = cls(channels)
        return metric.to(device)  # the states are there: only the metric's device is set

    def update(self, extremes: Tensor) -> None:
        """Merge ``(3, channels)`` extremes into the metric's."""
        extremes = extremes.to(device=self.low.device, dtype=F64)
        self.low = torch.minimum(self.low, extremes[0])
        self.high = torch.maximum(self.high, extremes[1])
        self.abs_low = torch.minimum(self.abs_low, extremes[2])

    def compute(self) -> Tensor:
        """The ``(3, channels)`` extremes over every rank (a collective under DDP)."""
        return torch.stack([self.low, self.high, self.abs_low])


class FeatureStats(StreamStates):
    """Streaming mean, std, min, max, abs-mean, zero fraction and non-finite count of tensors.

    The state is a fixed-size ``float64`` vector on the metric's device: ``update`` stores no
    tensor and, off the CPU, never synchronises with the host. Move the metric to the device of
    its inputs (``stats.to(device)``); inputs on another device are reduced there and only their
    summary is copied. See the module documentation of :mod:`lightning_recorder.stats` for the
    exact definitions. The state stays ``float64``: ``set_dtype`` to another dtype raises a
    ``RecorderConfigError`` (convert the results instead).

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
        RecorderConfigError: if ``correction`` is not a non-negative integer, or a keyword
            argument is not one of torchmetrics.

    Examples:
        >>> stats = FeatureStats()
        >>> stats.update(torch.tensor([[1.0, 2.0], [3.0, float("inf")]]))
        >>> stats.update(torch.tensor([0, 4]))
        >>> out = stats.compute()
        >>> out["mean"].item(), round(out["std"].item(), 9), out["max"].item()
        (2.0, 1.58113883, 4.0)
        >>> out["nonfinite"].item(), out["numel"].item(), out["zero_fraction"].item()
        (1.0, 6.0, 0.16666666666666666)
        >>> stats.reset()
        >>> stats.compute()["numel"].item()
        0.0
    """

    def __init__(self, correction: int = 1, **kwargs: Any) -> None:
        super().__init__(None, **kwargs)
        self.correction = check_correction(correction)

    def update(self, x: Tensor) -> None:
        """Add the elements of ``x`` (any shape, any real dtype) to the statistics.

        Args:
            x: the tensor to add; it is read as it is (detached, in its own dtype, its sums
                taken in ``float64``).

        Raises:
            RecorderConfigError: if ``x`` is not a real tensor.
        """
        check_tensor(x, "x", real=True)
        super().update(tensor_state(x))

    def compute(self) -> dict[str, Tensor]:  # type: ignore[override]
        """The statistics so far, over every rank (a collective under DDP).

        Returns:
            A dictionary with the keys of :data:`~lightning_recorder.stats.STAT_NAMES`, each a
            0-d ``float64`` tensor.
        """
        return finalize(self.packed, self.correction)
