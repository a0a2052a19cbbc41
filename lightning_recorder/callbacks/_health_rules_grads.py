"""The rules on gradients and updates: :class:`VanishingGradientsRule`,
:class:`ExplodingGradientsRule` (AutoTrainer's ratio rules) and :class:`UpdateRatioRule`.

They read the parameter figures of :class:`~lightning_recorder.FeatureStatsMonitor`
(:attr:`~lightning_recorder.callbacks.StatsReport.parameters`): the gradient norm before clipping
and the update ratio ``||Δp|| / ||p||`` of each monitored parameter its optimizer stepped in the
logged step. *Layers* are the weight tensors among them (two or more dimensions: a
``Linear``'s or a convolution's weight, an embedding; biases and normalisation scales left
out, as AutoTrainer compares kernels), in the order of ``named_parameters()``, the order in
which the model is built, its first layer first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._core.checks import check_int, check_number
from ..errors import RecorderConfigError
from ._health_event import HealthEvent
from ._health_rules import HealthRule, RuleInput, split_parameter

__all__ = ["ExplodingGradientsRule", "UpdateRatioRule", "VanishingGradientsRule", "weights"]


def weights(seen: RuleInput, figure: str) -> list[tuple[str, float]]:
    """``(parameter name, value of figure)`` of the stepped weight tensors, in model order."""
    report = seen.report
    if report is None:
        return []
    found = []
    for name, figures in report.parameters.items():
        value = figures.get(figure)
        param = seen.parameters.get(name)
        if value is not None and (param is None or param.ndim >= 2):
            found.append((name, float(value)))
    return found


class _Patient(HealthRule):
    """A rule whose condition must hold on ``patience`` logged steps in a row."""

    def __init__(self, patience: int) -> None:
        check_int(patience, "patience", type(self).__name__)
        self.patience = patience
        self._held: dict[str, int] = {}

    def start(self) -> None:
        self._held = {}

    def state_dict(self) -> dict[str, Any]:
        return {"held": dict(self._held)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._held = {str(key): int(held) for key, held in state.get("held", {}).items()}

    def _count(self, key: str, holds: bool) -> bool:
        """Count a step for ``key``; whether it has now held ``patience`` steps in a row."""
        held = self._held[key] = self._held.get(key, 0) + 1 if holds else 0
        return held >= self.patience


def _ratio(seen: RuleInput) -> tuple[str, float, str, float] | None:
    """The first and last layer's gradient norms (None with fewer than two layers)."""
    found = weights(seen, "grad_norm")
    if len(found) < 2:
        return None
    (first, top), (last, bottom) = found[0], found[-1]
    return first, top, last, bottom


def _ratio_event(
    rule: HealthRule, seen: RuleInput, found: tuple[str, float, str, float], ratio: float,
    message: str,
) -> HealthEvent:  # fmt: skip
    """The finding of a first/last gradient-norm rule, on the first layer's weight."""
    first, top, last, bottom = found
    module, leaf = split_parameter(first)
    return rule.event(
        seen, module, message, direction="backward", path=leaf, first=first, last=last,
        first_norm=top, last_norm=bottom, ratio=ratio,
    )  # fmt: skip


class VanishingGradientsRule(_Patient):
    """Vanishing gradients: the first layer gets almost none of the gradient the last one gets.

    With ``g_1`` and ``g_L`` the gradient norms of the first and the last layer's weights in a
    logged step, the rule fires when ``g_1 / g_L < ratio`` and ``g_1 < first_norm`` on
    ``patience`` logged steps in a row: the early layers stop learning while the last ones
    still do.

    **Defaults and sources.** ``ratio=1e-3`` and ``first_norm=1e-4`` are AutoTrainer's
    (Zhang et al., ICSE 2021: ``beta_1`` and ``beta_2`` of its gradient-vanish rule, checked
    on each batch's gradients: ``norm(first kernel) / norm(last kernel) < 1e-3`` and
    ``norm(first kernel) < 1e-4``); ``patience=1``, as AutoTrainer reports a problem on its
    first sighting.

    **When it fires.** A deep network whose activations squash the signal (sigmoid or tanh in
    many layers), weights initialised too small, no normalisation or skip connections. Use
    ReLU-family activations, He/Kaiming (or Xavier for tanh) initialisation, normalisation
    layers (BatchNorm, LayerNorm) or residual connections.

    Args:
        ratio: the largest ``g_1 / g_L`` that counts as vanishing.
        first_norm: the largest ``g_1`` that counts as vanishing.
        patience: the logged steps in a row the condition must hold.

    Raises:
        RecorderConfigError: an argument is invalid.

    Examples:
        >>> from lightning_recorder.callbacks import StatsReport
        >>> grads = {"0.weight": {"grad_norm": 2e-7}, "9.weight": {"grad_norm": 0.05}}
        >>> report = StatsReport("train", 7, None, (), {}, parameters=grads)
        >>> [e.module for e in VanishingGradientsRule().check(RuleInput(7, report))]
        ['0']
    """

    name = "vanishing_gradients"
    needs_parameters = True

    def __init__(self, ratio: float = 1e-3, first_norm: float = 1e-4, patience: int = 1) -> None:
        super().__init__(patience)
        owner = type(self).__name__
        self.ratio = check_number(ratio, "ratio", owner, positive=True, allow_zero=False)
        self.first_norm = check_number(
            first_norm, "first_norm", owner, positive=True, allow_zero=False
        )

    def check(self, seen: RuleInput) -> list[HealthEvent]:
        found = _ratio(seen)
        if found is None:
            return []
        first, top, last, bottom = found
        ratio = top / bottom if bottom > 0 else float("inf")
        if not self._count("", ratio < self.ratio and top < self.first_norm):
            return []
        message = (
            f"Gradients vanish: the first layer's gradient norm ({first}) is {top:.3g}, "
            f"{ratio:.2g} times the last layer's ({last}, {bottom:.3g}), below {self.ratio:g} "
            f"with the first under {self.first_norm:g}. Use ReLU-family activations, He or "
            "Xavier initialisation, normalisation layers or residual connections."
        )
        return [_ratio_event(self, seen, found, ratio, message)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ratio={self.ratio:g}, first_norm={self.first_norm:g})"


class ExplodingGradientsRule(_Patient):
    """Exploding gradients: the first layer's gradient dwarfs the last one's.

    With ``g_1`` and ``g_L`` the gradient norms of the first and the last layer's weights, the
    rule fires when ``g_1 / g_L > ratio`` on ``patience`` logged steps in a row: the gradient
    grows as it flows back through the layers.

    **Defaults and sources.** ``ratio=70`` is AutoTrainer's (Zhang et al., ICSE 2021:
    ``beta_3`` of its gradient-explode rule, ``norm(first kernel) / norm(last kernel) > 70``);
    ``patience=1``, as AutoTrainer. Gradients that overflow to Inf or NaN are the non-finite
    check's (:class:`~lightning_recorder.HealthMonitor` names the module that made them).

    **When it fires.** Weights initialised too large for the depth, a learning rate that grew
    them, no normalisation. Clip gradients (``Trainer(gradient_clip_val=1.0)``), lower the
    learning rate, initialise with He/Kaiming or Xavier scale, add normalisation layers.

    Args:
        ratio: the smallest ``g_1 / g_L`` that counts as exploding (above 1).
        patience: the logged steps in a row the condition must hold.

    Raises:
        RecorderConfigError: an argument is invalid.

    Examples:
        >>> from lightning_recorder.callbacks import StatsReport
        >>> grads = {"0.weight": {"grad_norm": 900.0}, "9.weight": {"grad_norm": 2.0}}
        >>> report = StatsReport("train", 7, None, (), {}, parameters=grads)
        >>> [e.details["ratio"] for e in ExplodingGradientsRule().check(RuleInput(7, report))]
        [450.0]
    """

    name = "exploding_gradients"
    needs_parameters = True

    def __init__(self, ratio: float = 70.0, patience: int = 1) -> None:
        super().__init__(patience)
        owner = type(self).__name__
        self.ratio = check_number(ratio, "ratio", owner, positive=True, allow_zero=False)
        if self.ratio <= 1:
            raise RecorderConfigError(
                f"Expected `ratio` of {owner} to be above 1 (the first layer's gradient norm this "
                f"many times the last layer's counts as exploding; 70 by default) but got "
                f"{ratio!r}: a healthy network's first layer already passes it."
            )

    def check(self, seen: RuleInput) -> list[HealthEvent]:
        found = _ratio(seen)
        if found is None:
            return []
        first, top, last, bottom = found
        ratio = top / bottom if bottom > 0 else float("inf") if top > 0 else 0.0
        if not self._count("", ratio > self.ratio):
            return []
        message = (
            f"Gradients explode: the first layer's gradient norm ({first}) is {top:.3g}, "
            f"{ratio:.3g} times the last layer's ({last}, {bottom:.3g}), above {self.ratio:g}. "
            "Clip gradients (Trainer(gradient_clip_val=1.0)), lower the learning rate, use He or "
            "Xavier initialisation, or add normalisation layers."
        )
        return [_ratio_event(self, seen, found, ratio, message)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ratio={self.ratio:g})"


class UpdateRatioRule(_Patient):
    """Update-to-weight ratios outside a band around 1e-3: layers that move too fast or not at all.

    The update ratio of a layer is ``||Δw|| / ||w||`` of its weight tensor in one optimizer
    step. The rule fires for a layer whose ratio stays above ``high`` (or below ``low``) on
    ``patience`` logged steps in a row, one finding per layer, saying which side. A step with
    no ratio for a layer (its norm before the step was 0: undefined; or the AMP grad scaler
    skipped the step: nothing updated) is no data for it, neither inside nor outside the band:
    the run of steps outside goes on across it.

    **Defaults and sources.** The ratio "should be somewhere around 1e-3. If it is lower than
    this then the learning rate might be too low. If it is higher then the learning rate is
    likely too high" (Karpathy, CS231n notes, "Neural Networks Part 3", ratio of weights:
    updates). A healthy run wanders an order of magnitude or more around it (Adam moves each
    weight by about the learning rate, a ratio near ``lr * sqrt(fan_in)``), so the band spans
    two decades above and three below: ``high=0.1`` (a tenth of the weight in one step) and
    ``low=1e-6``; ``patience=3`` logged steps, so that one large step (the first steps of
    training, a restart of the learning-rate schedule) does not fire it.

    **When it fires.** Above: the learning rate is too high for the layer (expect loss spikes,
    dead units); lower it or add warm-up. Below: the layer barely learns: the learning rate is
    too small, the layer is frozen in effect, or its gradient vanished
    (:class:`VanishingGradientsRule`); pass ``low=None`` when that is intended (the end of a
    decaying schedule).

    Args:
        high: the largest healthy ratio (``None``: no upper limit).
        low: the smallest healthy ratio (``None``: no lower limit).
        patience: the logged steps in a row a layer must stay outside the band.

    Raises:
        RecorderConfigError: an argument is invalid.

    Examples:
        >>> from lightning_recorder.callbacks import StatsReport
        >>> figures = {"fc.weight": {"update_ratio": 0.4}, "out.weight": {"update_ratio": 2e-3}}
        >>> report = StatsReport("train", 3, None, (), {}, parameters=figures)
        >>> [(e.module, e.details["side"]) for e in UpdateRatioRule(patience=1).check(
        ...     RuleInput(3, report))]
        [('fc', 'high')]
    """

    name = "update_ratio"
    needs_parameters = True

    def __init__(
        self, high: float | None = 0.1, low: float | None = 1e-6, patience: int = 3
    ) -> None:
        super().__init__(patience)
        owner = type(self).__name__
        if high is not None:
            high = check_number(high, "high", owner, positive=True, allow_zero=False)
        if low is not None:
            low = check_number(low, "low", owner, positive=True)
        if high is None and low is None:
            raise RecorderConfigError(
                f"Expected `high` or `low` of {owner} to be a number but both are None: the rule "
                "would judge nothing. Leave it out of `rules=` to judge no update ratio."
            )
        if high is not None and low is not None and not low < high:
            raise RecorderConfigError(
                f"Expected `low` < `high` of {owner} but got low={low!r}, high={high!r}."
            )
        self.high, self.low = high, low

    def check(self, seen: RuleInput) -> list[HealthEvent]:
        found = []
        for name, ratio in weights(seen, "update_ratio"):
            side = None
            if self.high is not None and ratio > self.high:
                side = "high"
            elif self.low is not None and ratio < self.low:
                side = "low"
            # each side counted apart: a layer that jumps from too fast to too slow starts over
            high = self._count(f"{name}>", side == "high")
            low = self._count(f"{name}<", side == "low")
            if not (high or low):
                continue
            module, leaf = split_parameter(name)
            if side == "high":
                what = f"above {self.high:g}: the learning rate is likely too high for it"
                advice = "lower the learning rate or add warm-up"
            else:
                what = f"below {self.low:g}: it barely learns"
                advice = "raise the learning rate, or check that its gradient reaches it"
            message = (
                f"`{name}` moves {ratio:.3g} of its norm per step (||Δw|| / ||w||), {what} "
                f"(around 1e-3 is healthy); {advice}."
            )
            found.append(
                self.event(
                    seen, module, message, direction="parameter", path=leaf, ratio=ratio, side=side
                )
            )
        return found

    def __repr__(self) -> str:
        return f"{type(self).__name__}(high={self.high!r}, low={self.low!r})"
