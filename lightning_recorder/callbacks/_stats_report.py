"""`StatsReport`: what a :class:`~lightning_recorder.FeatureStatsMonitor` logged at one step, on the
host, for code that reads the statistics rather than charts them (health rules, your own
callbacks): :meth:`FeatureStatsMonitor.subscribe` hands one to a listener after each logged
training step and each evaluation epoch, on rank zero.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = ["StatsReport"]


@dataclass(frozen=True)
class StatsReport:
    """The statistics of one logged step (or evaluation epoch) of a monitor, over every rank.

    Attributes:
        stage: ``"train"``, ``"val"``, ``"test"`` or ``"predict"``.
        step: Lightning's step axis value the statistics were logged at.
        dataloader: the evaluation dataloader's index when the loop has several (and they are
            not pooled), else ``None``.
        modules: the monitored series, in the monitor's order (module names, with ``/path``).
        stats: every statistic of :data:`~lightning_recorder.stats.STAT_NAMES` (whichever the
            monitor logs), an array with one value per module (NaN for a module not called).
        parameters: for each monitored parameter, ``{"norm": ...}`` and, for those its optimizer
            stepped in this step, ``"grad_norm"`` and ``"update_ratio"`` (training only; no
            ``"update_ratio"`` where the parameter's norm before the step was 0, for which it
            is undefined, nor where the AMP grad scaler skipped the step: nothing updated).
        channels: for each module whose per-channel extremes were asked for
            (:meth:`~lightning_recorder.FeatureStatsMonitor.track_channels`), a ``(3, C)`` array
            of the minimum, maximum and minimum ``|x|`` of each channel of its outputs in this
            step (training only).
        histograms: the histogram table, one row a module, ``[num, sum, sum_squares, min, max,
            *edges, *counts]``, or ``None`` when no histogram was taken.
    """

    stage: str
    step: int
    dataloader: int | None
    modules: tuple[str, ...]
    stats: Mapping[str, np.ndarray]
    parameters: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    channels: Mapping[str, np.ndarray] = field(default_factory=dict)
    histograms: np.ndarray | None = None

    def stat(self, name: str, module: str) -> float:
        """One statistic of one module (``KeyError`` naming the known ones otherwise)."""
        if module not in self.modules:
            raise KeyError(f"{module!r} is not a monitored module; they are {list(self.modules)}")
        return float(self.stats[name][self.modules.index(module)])
