"""`FeatureStats`: the streaming statistics as a torchmetrics ``Metric`` (synchronised by DDP).

This is the only module of the room that imports torchmetrics; ``lightning_recorder.stats``
loads it on first use of :class:`FeatureStats`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from .._core.checks import check_tensor
from ..errors import RecorderConfigError
from ._kernels import batch_state, empty_state, finalize, merge
from .features import check_correction

__all__ = ["FeatureStats"]


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
        self.correction = check_correction(correction)
        self.add_state("packed", default=empty_state(), dist_reduce_fx=merge)

    def update(self, x: Tensor) -> None:
        """Add the elements of ``x`` (any shape, any real dtype) to the statistics.

        Args:
            x: the tensor to add; it is detached, flattened and upcast to ``float64``.

        Raises:
            RecorderConfigError: if ``x`` is not a real tensor.
        """
        check_tensor(x, "x", real=True)
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
