"""Statistics of one tensor: :data:`STAT_NAMES` and :func:`feature_stats`.

The definitions are those of :mod:`lightning_recorder.stats`.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch  # noqa: F401  (used by the examples)
from torch import Tensor

from .._core.checks import check_int, check_tensor
from ._engine import tensor_state
from ._state import finalize

__all__ = ["STAT_NAMES", "StatName", "feature_stats"]

StatName = Literal["mean", "std", "min", "max", "abs_mean", "zero_fraction", "nonfinite", "numel"]
"""The name of one statistic."""

STAT_NAMES: tuple[StatName, ...] = get_args(StatName)
"""The keys of the dictionaries returned by :class:`FeatureStats` and :func:`feature_stats`."""


def check_correction(correction: object) -> int:
    """``correction`` if it is a non-negative int, else an error naming it."""
    check_int(correction, "correction", minimum=0)
    return correction  # type: ignore[return-value]


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

    Examples:
        >>> s = feature_stats(torch.tensor([0.0, 1.0, 2.0, float("nan")]))
        >>> s["mean"].item(), s["std"].item(), s["nonfinite"].item(), s["zero_fraction"].item()
        (1.0, 1.0, 1.0, 0.25)
    """
    return finalize(tensor_state(check_tensor(x, "x", real=True)), check_correction(correction))
