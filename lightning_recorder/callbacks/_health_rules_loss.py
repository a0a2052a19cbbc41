"""The rule on the loss: :class:`LossSpikeRule` (Lightning's ``SpikeDetection`` rule), and the
per-step losses it reads (:class:`LossLog`).

**No synchronisation on the steps between checks.** The loss of every training step is kept
where it was computed (a detached scalar tensor, appended to a list) and the list is brought to
the host in one copy at the next check, a logged step that synchronises anyway.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import torch

from .._core.checks import check_int, check_number, check_option
from ..errors import RecorderConfigError
from ._health_event import HealthEvent
from ._health_rules import HealthRule, RuleInput

__all__ = ["LossLog", "LossSpikeRule", "loss_of"]

# Losses kept unread before they are brought to the host anyway (a bound for runs whose checks
# are rare): one copy per this many steps.
_MAX_UNREAD = 4096


def loss_of(outputs: Any) -> torch.Tensor | None:
    """The loss in what ``training_step`` returned (a scalar tensor, or a dict's ``"loss"``)."""
    if isinstance(outputs, Mapping):
        outputs = outputs.get("loss")
    if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
        return outputs.detach()
    return None


class LossLog:
    """The training loss of every step, on its device until read."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._steps: list[int] = []
        self._values: list[torch.Tensor] = []
        self._scales: list[float] = []
        self._host_steps: list[np.ndarray] = []
        self._host_values: list[np.ndarray] = []

    @property
    def pending(self) -> bool:
        """Whether some loss was kept and not read yet."""
        return bool(self._values or self._host_values)

    def add(self, step: int, loss: torch.Tensor, scale: float = 1.0) -> None:
        """Keep ``loss`` of optimizer step ``step``, times ``scale`` (the micro-batches of a
        step are averaged when read)."""
        self._steps.append(step)
        self._values.append(loss)
        self._scales.append(scale)
        if len(self._values) >= _MAX_UNREAD:
            self._to_host()

    def _to_host(self) -> None:
        if not self._values:
            return
        values = torch.stack([v.reshape(()).float() for v in self._values]).cpu().numpy()
        self._host_values.append(values.astype(np.float64) * np.asarray(self._scales))
        self._host_steps.append(np.asarray(self._steps, dtype=np.int64))
        self._steps, self._values, self._scales = [], [], []

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """``(steps, losses)`` since the last read (one copy to the host), one per optimizer
        step: the mean of its micro-batches' losses."""
        self._to_host()
        if not self._host_values:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        steps, values = np.concatenate(self._host_steps), np.concatenate(self._host_values)
        self._host_steps, self._host_values = [], []
        unique, where = np.unique(steps, return_inverse=True)
        if unique.size == steps.size:
            return steps, values
        summed = np.zeros(unique.size)
        np.add.at(summed, where, values)
        return unique, summed / np.bincount(where, minlength=unique.size)


class LossSpikeRule(HealthRule):
    """Loss spikes: Lightning's ``SpikeDetection`` rule, on every training step's loss.

    A step's loss is a *spike* when it is not below the previous step's loss and differs from
    the mean of the last ``window`` losses by at least ``rtol`` times that mean (and by at least
    ``atol``, when given), after ``warmup`` steps. Every step is judged, not only logged ones:
    the losses wait on their device and are read at each check. Non-finite losses are left to
    the non-finite check. The spikes found at one check make one finding, at the first
    spike's step; while it is in force, spikes found at the next checks stay quiet (they update
    it); a check without a spike ends it.

    **Defaults and sources.** ``window=10``, ``rtol=2.0``, ``warmup=1``, ``mode="min"`` are
    those of Lightning's ``SpikeDetection`` (``lightning.fabric.utilities.spike``): a loss three
    times its running mean, and higher than the last one. ``atol=1.0`` is not Lightning's
    (``None``): a spike must also be at least 1 above the mean, e.g. a cross-entropy 1 nat above
    it. Without it the rule fires on noise once a loss is near 0: on healthy runs that had fit
    their data (``benchmarks/health_false_alarms.py``, which counts both), Lightning's
    thresholds found 3 "spikes" in 10,000 steps of a CNN on scikit-learn's digits (batch losses
    around 1e-5), and hundreds in 10,000 steps of a transformer encoder (losses around 0.007),
    against a false-alarm budget of 1 per 10,000 steps; ``atol=1.0`` found none. Pass
    ``atol=None`` for Lightning's rule, or an ``atol`` in the units of your loss. Lightning
    stops training at a spike; here training goes on, so the spike then joins the running mean
    (a loss that settles at a higher level stops being a spike after about ``window`` steps).

    **When it fires.** A learning rate too high (the loss jumps, then usually diverges), a bad
    batch (mislabelled or corrupted data), an optimizer state that blew up (Adam with a tiny
    ``eps``). Lower the learning rate, add warm-up or gradient clipping
    (``Trainer(gradient_clip_val=1.0)``), look at the batches of the spike's steps.

    Args:
        window: the number of earlier losses whose mean is the reference.
        rtol: the relative distance from the mean that makes a spike (``None``: not used).
        atol: the absolute distance from the mean that makes a spike (``None``: not used; one
            of ``rtol`` and ``atol`` must be positive).
        warmup: the first steps that are never spikes.
        mode: ``"min"`` when the loss should fall (a spike is a rise), ``"max"`` otherwise.

    Raises:
        RecorderConfigError: an argument is invalid.

    Examples:
        >>> import numpy as np
        >>> rule = LossSpikeRule()
        >>> losses = np.array([1.0, 0.9, 0.8, 4.0, 0.8])
        >>> seen = RuleInput(step=4, losses=losses, loss_steps=np.arange(5))
        >>> [(e.step, round(e.details["ratio"], 2)) for e in rule.check(seen)]
        [(3, 4.44)]
    """

    name = "loss_spike"
    needs_statistics = False

    def __init__(
        self,
        window: int = 10,
        rtol: float | None = 2.0,
        atol: float | None = 1.0,
        warmup: int = 1,
        mode: Literal["min", "max"] = "min",
    ) -> None:
        owner = type(self).__name__
        check_int(window, "window", owner)
        if rtol is not None:
            rtol = check_number(rtol, "rtol", owner, positive=True)
        if atol is not None:
            atol = check_number(atol, "atol", owner, positive=True)
        if not ((rtol is not None and rtol > 0) or (atol is not None and atol > 0)):
            raise RecorderConfigError(
                f"Expected `rtol` or `atol` of {owner} to be a positive number but got "
                f"rtol={rtol!r}, atol={atol!r}: every rise of the loss would be a spike. Pass "
                "atol=None alone for Lightning's rule (rtol=2.0), or leave the rule out of "
                "`rules=`."
            )
        check_int(warmup, "warmup", owner, minimum=0)
        check_option("mode", mode, ("min", "max"), owner)
        self.window, self.rtol, self.atol, self.warmup, self.mode = window, rtol, atol, warmup, mode
        self.start()

    def start(self) -> None:
        self._recent: deque[float] = deque(maxlen=self.window)
        self._last: float | None = None
        self._seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self._recent), "last": self._last, "seen": self._seen}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._recent = deque(state.get("recent", ()), maxlen=self.window)
        self._last, self._seen = state.get("last"), int(state.get("seen", 0))

    def _is_spike(self, loss: float) -> tuple[bool, float]:
        if self._seen < self.warmup or not self._recent:
            return False, math.nan
        mean = sum(self._recent) / len(self._recent)
        last = 0.0 if self._last is None else self._last
        if (loss <= last) if self.mode == "min" else (loss >= last):
            return False, mean
        gap = abs(loss - mean)
        spike = (self.atol is None or gap >= self.atol) and (
            self.rtol is None or gap >= abs(self.rtol * mean)
        )
        return spike, mean

    def check(self, seen: RuleInput) -> list[HealthEvent]:
        spikes: list[tuple[int, float, float, int]] = []
        for step, loss in zip(seen.loss_steps.tolist(), seen.losses.tolist(), strict=True):
            if not math.isfinite(loss):
                continue
            spike, mean = self._is_spike(loss)
            if spike:  # the mean of the steps kept so far (fewer than `window` early on)
                spikes.append((int(step), loss, mean, len(self._recent)))
            self._recent.append(loss)
            self._last = loss
            self._seen += 1
        if not spikes:
            return []
        step, loss, mean, before = spikes[0]
        ratio = loss / mean if mean else math.inf
        more = (
            f"; {len(spikes) - 1} more spike(s) by step {spikes[-1][0]}" if len(spikes) > 1 else ""
        )
        message = (
            f"The training loss spiked at step {step}: {loss:.4g}, {ratio:.3g} times the mean "
            f"{mean:.4g} of {_steps(before)} before{more}. Lower the learning rate, add "
            "warm-up or gradient clipping (Trainer(gradient_clip_val=1.0)), or look at the "
            "batches of those steps."
        )
        event = self.event(
            seen,
            None,
            message,
            direction="loss",
            loss=loss,
            mean=mean,
            ratio=ratio,
            spikes=[[s, v, m] for s, v, m, _ in spikes[:16]],
        )
        event.step = step
        return [event]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(window={self.window}, rtol={self.rtol}, atol={self.atol})"


def _steps(n: int) -> str:
    """``n`` logged steps, in words: "the step", "the 10 steps"."""
    return "the step" if n == 1 else f"the {n} steps"
