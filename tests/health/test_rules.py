"""Each rule of HealthMonitor on hand-built inputs: where it fires, where it stays quiet, its
window or patience, its thresholds, its ``repr`` and its refusals; rules written by a user."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from lightning_recorder import (
    DeadUnitsRule,
    ExplodingGradientsRule,
    HealthEvent,
    HealthMonitor,
    HealthRule,
    LossSpikeRule,
    RecorderConfigError,
    RuleInput,
    SaturationRule,
    UpdateRatioRule,
    VanishingGradientsRule,
)
from lightning_recorder.callbacks import StatsReport

INF = math.inf


# ---------------------------------------------------------------------------- inputs
def channels(low: Sequence[float], high: Sequence[float], least: Sequence[float] | None = None):
    """A ``(3, C)`` channel table: per-unit min, max and min ``|x|``."""
    low_a, high_a = np.asarray(low, dtype=float), np.asarray(high, dtype=float)
    if least is None:  # min |x| of values spanning [low, high]
        least = np.where((low_a <= 0) & (high_a >= 0), 0.0, np.minimum(abs(low_a), abs(high_a)))
    return np.stack([low_a, high_a, np.asarray(least, dtype=float)])


def relu_table(maxima: Sequence[float]) -> np.ndarray:
    """The channel table of a ReLU output whose units reached ``maxima``."""
    return channels([0.0] * len(maxima), maxima)


NOT_CALLED = np.array([[INF, INF], [-INF, -INF], [INF, INF]])  # what a module not called gives


def unit_input(
    step: int,
    tables: Mapping[str, np.ndarray],
    modules: Mapping[str, nn.Module],
    nonfinite: Mapping[str, float] | None = None,
) -> RuleInput:
    series = tuple(tables)
    stats = {}
    if nonfinite is not None:
        stats["nonfinite"] = np.array([nonfinite.get(s, 0.0) for s in series])
    report = StatsReport("train", step, None, series, stats, channels=dict(tables))
    return RuleInput(step, report, modules=modules)


def param_input(
    step: int, figures: Mapping[str, Mapping[str, float]], shapes: Mapping[str, tuple[int, ...]]
) -> RuleInput:
    """A report of parameter figures; ``shapes`` gives the model's parameters (weights are 2-d)."""
    parameters = {name: nn.Parameter(torch.zeros(shape)) for name, shape in shapes.items()}
    report = StatsReport("train", step, None, (), {}, parameters=figures)
    return RuleInput(step, report, parameters=parameters)


MLP_SHAPES = {
    "0.weight": (8, 4), "0.bias": (8,), "2.weight": (8, 8), "2.bias": (8,),
    "4.weight": (2, 8), "4.bias": (2,),
}  # fmt: skip


def grads(first: float, last: float, middle: float = 1.0, bias: float = 1e-9) -> dict[str, Any]:
    """Gradient norms of MLP_SHAPES' weights (the biases get ``bias``, to be left out)."""
    return {
        "0.weight": {"norm": 1.0, "grad_norm": first},
        "0.bias": {"norm": 1.0, "grad_norm": bias},
        "2.weight": {"norm": 1.0, "grad_norm": middle},
        "2.bias": {"norm": 1.0, "grad_norm": bias},
        "4.weight": {"norm": 1.0, "grad_norm": last},
        "4.bias": {"norm": 1.0, "grad_norm": bias},
    }


def ratios(**by_layer: float) -> dict[str, Any]:
    """Update ratios of MLP_SHAPES' layers (``l0=...`` for ``0.weight``); biases far out."""
    found = {}
    for layer in ("0", "2", "4"):
        found[f"{layer}.weight"] = {"norm": 1.0, "update_ratio": by_layer.get(f"l{layer}", 1e-3)}
        found[f"{layer}.bias"] = {"norm": 1.0, "update_ratio": 50.0}
    return found


def kinds(events: Sequence[HealthEvent]) -> list[tuple[str, str | None]]:
    return [(e.kind, e.module) for e in events]


# ---------------------------------------------------------------------------- dead units
def test_dead_units_fire_once_a_unit_stayed_inactive_for_the_whole_window() -> None:
    rule = DeadUnitsRule(window=3, min_fraction=0.5)
    relu = nn.ReLU()
    dead_half = relu_table([0.0, 0.0, 2.0, 0.5])
    assert rule.check(unit_input(0, {"act": dead_half}, {"act": relu})) == []
    assert rule.check(unit_input(1, {"act": dead_half}, {"act": relu})) == []
    [event] = rule.check(unit_input(2, {"act": dead_half}, {"act": relu}))  # the third in a row
    assert (event.kind, event.module, event.step, event.path) == ("dead_units", "act", 2, "output")
    assert event.direction == "forward"
    assert event.details == {"units": 4, "count": 2, "fraction": 0.5, "window": 3}
    assert event.message.startswith("`act` (ReLU) has 2 of 4 units dead (50 %): none gave a value")
    assert "in the last 3 logged steps" in event.message and "kaiming_normal_" in event.message
    # a unit that fires once in the window is alive: the count starts over for it
    alive = relu_table([0.0, 1e-6, 2.0, 0.5])
    assert rule.check(unit_input(3, {"act": alive}, {"act": relu})) == []
    assert rule.check(unit_input(4, {"act": dead_half}, {"act": relu})) == []
    assert rule.check(unit_input(5, {"act": dead_half}, {"act": relu})) == []
    assert [e.step for e in rule.check(unit_input(6, {"act": dead_half}, {"act": relu}))] == [6]


@pytest.mark.parametrize(
    ("fraction", "dead", "units", "fires"),
    [
        (0.7, 7, 10, True),  # exactly 70 %: 0.7 * 10 is 7.000000000000001 in floating point
        (0.7, 6, 10, False),
        (0.3, 3, 10, True),  # 0.3 * 10 is 3.0000000000000004
        (0.5, 1, 2, True),
        (1.0, 3, 4, False),
        (1.0, 4, 4, True),
    ],
)
def test_dead_units_threshold_is_inclusive(
    fraction: float, dead: int, units: int, fires: bool
) -> None:
    rule = DeadUnitsRule(window=1, min_fraction=fraction)
    table = relu_table([0.0] * dead + [1.0] * (units - dead))
    found = rule.check(unit_input(0, {"act": table}, {"act": nn.ReLU()}))
    assert [e.details["count"] for e in found] == ([dead] if fires else [])


def test_dead_units_stay_quiet_on_healthy_units_and_other_modules() -> None:
    rule = DeadUnitsRule(window=1)
    healthy = relu_table([0.3, 1.2, 0.01, 5.0])
    tanh_out = channels([-0.5] * 4, [0.0] * 4)  # a max of 0: but not a ReLU
    modules = {"act": nn.ReLU(), "squash": nn.Tanh()}
    for step in range(3):
        found = rule.check(unit_input(step, {"act": healthy, "squash": tanh_out}, modules))
        assert found == []
    assert rule.check(RuleInput(3)) == []  # no report: nothing to judge


def test_dead_units_keep_their_count_over_steps_the_module_was_not_called_or_not_finite() -> None:
    rule = DeadUnitsRule(window=2, min_fraction=1.0)
    relu = nn.ReLU()
    dead = relu_table([0.0, 0.0])
    assert rule.check(unit_input(0, {"act": dead}, {"act": relu})) == []
    # not called (neutral extremes) and NaN-bearing steps are not judged: the run goes on
    assert rule.check(unit_input(1, {"act": NOT_CALLED}, {"act": relu})) == []
    nan_step = unit_input(2, {"act": relu_table([0.0, 0.0])}, {"act": relu}, {"act": 3.0})
    assert rule.check(nan_step) == []
    assert [
        e.details["count"] for e in rule.check(unit_input(3, {"act": dead}, {"act": relu}))
    ] == [2]
    # a finding in force is returned at each check while it lasts (the monitor fires it once)
    assert len(rule.check(unit_input(4, {"act": NOT_CALLED}, {"act": relu}))) == 1
    # start() forgets everything
    rule.start()
    assert rule.check(unit_input(5, {"act": dead}, {"act": relu})) == []


def test_dead_units_name_the_module_and_path_of_a_series() -> None:
    rule = DeadUnitsRule(window=1)
    blocks = nn.ModuleDict({"enc": nn.ReLU6()})
    modules = dict(blocks.named_modules())
    [event] = rule.check(unit_input(0, {"enc/0": relu_table([0.0, 0.0])}, modules))
    assert (event.module, event.path) == ("enc", "output.0")
    assert event.message.startswith("`enc/0` (ReLU6) has 2 of 2 units dead (100 %)")
    # a series of a module the model does not have is skipped
    assert rule.check(unit_input(1, {"gone": relu_table([0.0])}, modules)) == []


def test_dead_units_track_the_relu_family_or_the_chosen_types() -> None:
    class MyReLU(nn.ReLU):
        pass

    rule = DeadUnitsRule()
    assert rule.track("a", nn.ReLU()) is True and rule.track("a", MyReLU()) is True
    assert rule.track("a", nn.ReLU6()) is True
    assert rule.track("a", nn.Tanh()) is None and rule.track("a", nn.Linear(2, 2)) is None
    leaky = DeadUnitsRule(types=nn.LeakyReLU, window=1)
    assert leaky.track("a", nn.LeakyReLU()) is True and leaky.track("a", nn.ReLU()) is None
    table = channels([-0.1, -0.2], [0.0, 0.0])
    assert len(leaky.check(unit_input(0, {"a": table}, {"a": nn.LeakyReLU()}))) == 1
    # a different number of units (a new shape) starts the count over
    assert leaky.check(unit_input(1, {"a": channels([-1.0] * 3, [0.0] * 3)}, {"a": nn.LeakyReLU()}))
    assert repr(DeadUnitsRule()) == "DeadUnitsRule(window=5, min_fraction=0.7)"
    assert repr(DeadUnitsRule(window=9, min_fraction=0.25)) == (
        "DeadUnitsRule(window=9, min_fraction=0.25)"
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"window": 0}, r"`window` of DeadUnitsRule to be a positive int but got 0"),
        ({"window": 2.5}, r"`window` of DeadUnitsRule to be a positive int but got 2.5"),
        ({"min_fraction": 0}, r"`min_fraction` of DeadUnitsRule to be a number in \(0, 1\]"),
        ({"min_fraction": 1.5}, r"`min_fraction` of DeadUnitsRule to be a number in \(0, 1\]"),
        ({"min_fraction": True}, r"`min_fraction` of DeadUnitsRule .* but got True"),
        ({"min_fraction": "70%"}, r"`min_fraction` of DeadUnitsRule .* but got '70%'"),
        ({"types": []}, r"`types` of DeadUnitsRule to be a module class or a non-empty sequence"),
        ({"types": "relu"}, r"`types` of DeadUnitsRule .* but got 'relu'"),
        ({"types": [int]}, r"`types` of DeadUnitsRule .* \(torch.nn.ReLU,\)"),
    ],
)
def test_dead_units_refuse_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(RecorderConfigError, match=match):
        DeadUnitsRule(**kwargs)


# ---------------------------------------------------------------------------- saturation
def test_tanh_units_are_saturated_when_every_value_is_beyond_the_bound() -> None:
    rule = SaturationRule(window=1, min_fraction=0.25)
    tanh = nn.Tanh()
    # per unit: all above +0.99, all below -0.99, both sides but never inside, exactly at the
    # bound (saturated), just inside (not), spanning zero (not)
    low = [0.995, -1.0, -1.0, 0.99, 0.9899, -0.5]
    high = [1.0, -0.992, 1.0, 0.999, 0.999, 0.5]
    least = [0.995, 0.992, 0.991, 0.99, 0.9899, 0.0]
    [event] = rule.check(unit_input(0, {"h": channels(low, high, least)}, {"h": tanh}))
    assert event.details == {"units": 6, "count": 4, "fraction": 4 / 6, "window": 1}
    assert (event.kind, event.module, event.path) == ("saturation", "h", "output")
    assert event.message.startswith("`h` (Tanh) has 4 of 6 units saturated (67 %): every value ")
    assert "beyond ±0.99" in event.message and "xavier_uniform_" in event.message


def test_sigmoid_units_are_saturated_near_zero_or_one() -> None:
    rule = SaturationRule(window=1, min_fraction=0.5)
    sig = nn.Sigmoid()
    low = [0.0, 0.99, 0.3, 0.001]
    high = [0.01, 1.0, 0.7, 0.0101]
    found = rule.check(unit_input(0, {"s": channels(low, high)}, {"s": sig}))
    assert [e.details["count"] for e in found] == [2]  # the first two, at the bounds exactly
    assert "at or below 0.01 or at or above 0.99" in found[0].message
    found = rule.check(unit_input(1, {"s": channels(low[2:], high[2:])}, {"s": sig}))
    assert found == []


def test_saturation_window_and_fraction_edges() -> None:
    rule = SaturationRule(window=2, min_fraction=0.3)
    tanh = nn.Tanh()
    # 3 of 10 saturated: exactly 30 % (0.3 * 10 is 3.0000000000000004 in floating point)
    table = channels([0.999] * 3 + [-0.2] * 7, [1.0] * 3 + [0.2] * 7)
    assert rule.check(unit_input(0, {"h": table}, {"h": tanh})) == []
    assert [e.details["count"] for e in rule.check(unit_input(1, {"h": table}, {"h": tanh}))] == [3]
    two = channels([0.999] * 2 + [-0.2] * 8, [1.0] * 2 + [0.2] * 8)
    rule.start()
    for step in range(3):
        assert rule.check(unit_input(step, {"h": two}, {"h": tanh})) == []


def test_saturation_of_hard_activations_uses_their_own_bounds() -> None:
    rule = SaturationRule(window=1, min_fraction=1.0)
    hard = nn.Hardtanh(min_val=-2.0, max_val=2.0)
    at_bounds = channels([-2.0, 2.0], [-2.0, 2.0])
    assert len(rule.check(unit_input(0, {"h": at_bounds}, {"h": hard}))) == 1
    inside = channels([-2.0, 1.0], [-2.0, 1.9])
    assert rule.check(unit_input(1, {"h": inside}, {"h": hard})) == []
    hsig = channels([0.0, 1.0], [0.0, 1.0])
    assert len(rule.check(unit_input(2, {"g": hsig}, {"g": nn.Hardsigmoid()}))) == 1
    # ReLU6 is a ReLU (DeadUnitsRule's), ReLU is not bounded: neither is tracked
    assert rule.track("r", nn.ReLU6()) is None and rule.track("r", nn.ReLU()) is None
    assert rule.track("t", nn.Tanh()) is True and rule.track("s", nn.Sigmoid()) is True

    class Squash(nn.Tanh):  # a subclass finds its bounds along its class hierarchy
        pass

    assert rule.track("q", Squash()) is True


def test_saturation_messages_say_the_bounds_count() -> None:
    """A hard activation's saturated values sit on its bounds exactly: the message must not say
    they went beyond them, or above a bound no value can pass."""
    rule = SaturationRule(window=1, min_fraction=1.0)
    [event] = rule.check(unit_input(0, {"h": channels([1.0], [1.0])}, {"h": nn.Hardtanh()}))
    assert "every value stayed at or beyond ±1, where" in event.message
    [event] = rule.check(unit_input(1, {"g": channels([1.0], [1.0])}, {"g": nn.Hardsigmoid()}))
    assert "every value stayed at or below 0 or at or above 1, where" in event.message


def test_saturation_bounds_are_configurable() -> None:
    rule = SaturationRule(window=1, min_fraction=0.5, bounds={nn.Tanh: (-0.9, 0.9)})
    table = channels([0.95, 0.95], [0.97, 0.97])
    assert len(rule.check(unit_input(0, {"h": table}, {"h": nn.Tanh()}))) == 1
    assert rule.track("s", nn.Sigmoid()) is None  # not among the bounds given
    assert SaturationRule().check(unit_input(0, {"h": table}, {"h": nn.Tanh()})) == []
    assert repr(SaturationRule()) == "SaturationRule(window=5, min_fraction=0.5)"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"window": -1}, r"`window` of SaturationRule to be a positive int but got -1"),
        ({"min_fraction": 2}, r"`min_fraction` of SaturationRule to be a number in \(0, 1\]"),
        ({"bounds": {nn.Tanh: (0.99, -0.99)}}, r"`bounds` of SaturationRule .* low < high"),
        ({"bounds": {"tanh": (-0.9, 0.9)}}, r"`bounds` of SaturationRule .* got 'tanh'"),
        ({"bounds": {nn.Tanh: [-0.9, 0.9]}}, r"`bounds` .* \(low, high\) .* \[-0.9, 0.9\]"),
        ({"bounds": [(-0.9, 0.9)]}, r"`bounds` of SaturationRule to be a non-empty mapping"),
        ({"bounds": {}}, r"`bounds` of SaturationRule to be a non-empty mapping .* got \{\}"),
        ({"bounds": {nn.Tanh: (-0.9, None)}}, r"`bounds` .* two numbers .* \(-0.9, None\)"),
        ({"bounds": {nn.Tanh: ("-0.9", "0.9")}}, r"`bounds` .* two numbers .* \('-0.9', '0.9'\)"),
        (  # a misspelt class: named missing, with the closest, not "is NoneType"
            {"bounds": {"torch.nn.Tanhh": (-0.9, 0.9)}},
            r"'torch\.nn' has no attribute 'Tanhh'\. Closest classes in torch\.nn: 'Tanh'",
        ),
    ],
)
def test_saturation_refuses_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(RecorderConfigError, match=match):
        SaturationRule(**kwargs)


# ---------------------------------------------------------------------------- gradients
def test_vanishing_gradients_compare_the_first_and_last_weights_only() -> None:
    rule = VanishingGradientsRule()
    [event] = rule.check(param_input(3, grads(first=2e-7, last=0.05), MLP_SHAPES))
    assert (event.kind, event.module, event.path, event.step) == (
        "vanishing_gradients", "0", "weight", 3,
    )  # fmt: skip
    assert event.direction == "backward"
    assert (event.details["first"], event.details["last"]) == ("0.weight", "4.weight")
    assert event.details["ratio"] == pytest.approx(4e-6, rel=1e-9)
    assert event.message.startswith(
        "Gradients vanish: the first layer's gradient norm (0.weight) is 2e-07, 4e-06 times "
        "the last layer's (4.weight, 0.05)"
    )
    # healthy: a ratio near 1
    assert rule.check(param_input(4, grads(first=0.04, last=0.05), MLP_SHAPES)) == []
    # a small ratio with a first norm that is not small: not vanishing
    assert rule.check(param_input(5, grads(first=2e-3, last=10.0), MLP_SHAPES)) == []
    # a small first norm with a small last one too (the loss is flat): not vanishing
    assert rule.check(param_input(6, grads(first=5e-5, last=1e-3), MLP_SHAPES)) == []
    # a last layer without gradient: no ratio, nothing said
    assert rule.check(param_input(7, grads(first=0.0, last=0.0), MLP_SHAPES)) == []


def test_vanishing_gradients_thresholds_are_strict_and_configurable() -> None:
    # powers of two: the ratios are exact
    rule = VanishingGradientsRule(ratio=2.0**-10, first_norm=2.0**-9)
    at_edge = grads(first=2.0**-10, last=1.0)  # ratio == 2**-10: not below
    assert rule.check(param_input(0, at_edge, MLP_SHAPES)) == []
    below = grads(first=2.0**-11, last=1.0)
    assert len(rule.check(param_input(1, below, MLP_SHAPES))) == 1
    first_at_edge = grads(first=2.0**-9, last=2.0**3)  # first == first_norm: not below
    assert rule.check(param_input(2, first_at_edge, MLP_SHAPES)) == []
    assert repr(rule) == "VanishingGradientsRule(ratio=0.000976562, first_norm=0.00195312)"
    assert (
        repr(VanishingGradientsRule()) == "VanishingGradientsRule(ratio=0.001, first_norm=0.0001)"
    )


def test_gradient_rules_need_two_stepped_weight_tensors() -> None:
    rule = VanishingGradientsRule()
    one = {"0.weight": {"norm": 1.0, "grad_norm": 1e-9}, "0.bias": {"grad_norm": 1.0}}
    assert rule.check(param_input(0, one, {"0.weight": (4, 4), "0.bias": (4,)})) == []
    # a weight its optimizer did not step (no grad_norm) is not a layer of this step
    frozen = grads(first=1e-9, last=1.0)
    del frozen["0.weight"]["grad_norm"]
    found = rule.check(param_input(1, frozen, MLP_SHAPES))
    assert found == []  # 2.weight (1.0) against 4.weight (1.0): fine
    assert rule.check(RuleInput(2)) == [] and ExplodingGradientsRule().check(RuleInput(2)) == []


def test_patience_counts_logged_steps_in_a_row() -> None:
    rule = VanishingGradientsRule(patience=2)
    bad, good = grads(first=1e-8, last=1.0), grads(first=0.5, last=1.0)
    assert rule.check(param_input(0, bad, MLP_SHAPES)) == []
    assert rule.check(param_input(1, good, MLP_SHAPES)) == []  # the run is broken
    assert rule.check(param_input(2, bad, MLP_SHAPES)) == []
    assert [e.step for e in rule.check(param_input(3, bad, MLP_SHAPES))] == [3]
    assert [e.step for e in rule.check(param_input(4, bad, MLP_SHAPES))] == [4]  # in force
    rule.start()
    assert rule.check(param_input(5, bad, MLP_SHAPES)) == []


def test_exploding_gradients_above_the_ratio() -> None:
    rule = ExplodingGradientsRule()
    assert rule.check(param_input(0, grads(first=140.0, last=2.0), MLP_SHAPES)) == []  # 70: not
    [event] = rule.check(param_input(1, grads(first=141.0, last=2.0), MLP_SHAPES))
    assert (event.kind, event.module, event.path) == ("exploding_gradients", "0", "weight")
    assert event.details["ratio"] == 70.5
    assert event.message.startswith(
        "Gradients explode: the first layer's gradient norm (0.weight) is 141, 70.5 times the "
        "last layer's (4.weight, 2), above 70."
    )
    assert "gradient_clip_val=1.0" in event.message
    # a last layer with no gradient at all while the first has some: infinitely larger
    [event] = rule.check(param_input(2, grads(first=1.0, last=0.0), MLP_SHAPES))
    assert event.details["ratio"] == INF
    assert rule.check(param_input(3, grads(first=0.0, last=0.0), MLP_SHAPES)) == []
    assert rule.check(param_input(4, grads(first=0.3, last=0.2), MLP_SHAPES)) == []  # healthy
    custom = ExplodingGradientsRule(ratio=10.0, patience=2)
    mild = grads(first=30.0, last=2.0)
    assert custom.check(param_input(0, mild, MLP_SHAPES)) == []
    assert len(custom.check(param_input(1, mild, MLP_SHAPES))) == 1
    assert repr(ExplodingGradientsRule()) == "ExplodingGradientsRule(ratio=70)"


def test_gradient_rules_read_layers_in_model_order_without_a_model() -> None:
    """Without the model's parameters (a report alone), every stepped tensor is a layer."""
    figures = {"a.weight": {"grad_norm": 1e-8}, "b.weight": {"grad_norm": 1.0}}
    report = StatsReport("train", 0, None, (), {}, parameters=figures)
    [event] = VanishingGradientsRule().check(RuleInput(0, report))
    assert (event.module, event.details["last"]) == ("a", "b.weight")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: VanishingGradientsRule(ratio=0), r"`ratio` of VanishingGradientsRule to be a fin"),
        (lambda: VanishingGradientsRule(ratio=math.nan), r"`ratio` .* finite positive .* nan"),
        (lambda: VanishingGradientsRule(first_norm=-1.0), r"`first_norm` of VanishingGradients"),
        (lambda: VanishingGradientsRule(patience=0), r"`patience` of VanishingGradientsRule to "),
        (lambda: ExplodingGradientsRule(ratio=0.0), r"`ratio` of ExplodingGradientsRule to be a "),
        (lambda: ExplodingGradientsRule(ratio=0.5), r"`ratio` of Exploding.* above 1 .* got 0.5"),
        (lambda: ExplodingGradientsRule(ratio=1), r"`ratio` of Exploding.* to be above 1"),
        (lambda: ExplodingGradientsRule(ratio="70"), r"`ratio` of Exploding.* but got '70'"),
        (lambda: ExplodingGradientsRule(patience=1.5), r"`patience` of ExplodingGradientsRule"),
    ],
)
def test_gradient_rules_refuse_bad_arguments(make: Any, match: str) -> None:
    with pytest.raises(RecorderConfigError, match=match):
        make()


# ---------------------------------------------------------------------------- update ratio
def test_update_ratio_outside_the_band_for_patience_steps() -> None:
    rule = UpdateRatioRule()  # high=0.1, low=1e-6, patience=3
    fast = ratios(l2=0.5)
    assert rule.check(param_input(0, fast, MLP_SHAPES)) == []
    assert rule.check(param_input(1, fast, MLP_SHAPES)) == []
    [event] = rule.check(param_input(2, fast, MLP_SHAPES))  # biases (50.0) are not layers
    assert (event.kind, event.module, event.path, event.step) == ("update_ratio", "2", "weight", 2)
    assert event.details == {"ratio": 0.5, "side": "high"}
    assert event.direction == "parameter"
    assert event.message == (
        "`2.weight` moves 0.5 of its norm per step (||Δw|| / ||w||), above 0.1: the learning "
        "rate is likely too high for it (around 1e-3 is healthy); lower the learning rate or "
        "add warm-up."
    )
    rule = UpdateRatioRule(patience=1)
    found = rule.check(param_input(0, ratios(l0=1e-8, l4=0.2), MLP_SHAPES))
    assert [(e.module, e.details["side"]) for e in found] == [("0", "low"), ("4", "high")]
    assert "below 1e-06: it barely learns" in found[0].message


def test_update_ratio_band_edges_are_healthy_and_configurable() -> None:
    rule = UpdateRatioRule(patience=1)
    assert rule.check(param_input(0, ratios(l0=0.1, l2=1e-6, l4=1e-3), MLP_SHAPES)) == []
    assert len(rule.check(param_input(1, ratios(l0=0.1000001), MLP_SHAPES))) == 1
    no_low = UpdateRatioRule(low=None, patience=1)
    assert no_low.check(param_input(0, ratios(l0=0.0), MLP_SHAPES)) == []
    no_high = UpdateRatioRule(high=None, low=1e-4, patience=1)
    assert no_high.check(param_input(0, ratios(l0=1e3), MLP_SHAPES)) == []
    assert [e.module for e in no_high.check(param_input(1, ratios(l4=1e-5), MLP_SHAPES))] == ["4"]
    assert repr(UpdateRatioRule()) == "UpdateRatioRule(high=0.1, low=1e-06)"
    assert repr(no_low) == "UpdateRatioRule(high=0.1, low=None)"


def test_update_ratio_counts_each_side_apart() -> None:
    """Two steps too fast then one too slow are not three steps outside the band."""
    rule = UpdateRatioRule(patience=2)
    assert rule.check(param_input(0, ratios(l0=0.5), MLP_SHAPES)) == []
    assert rule.check(param_input(1, ratios(l0=1e-9), MLP_SHAPES)) == []
    [event] = rule.check(param_input(2, ratios(l0=1e-9), MLP_SHAPES))
    assert event.details["side"] == "low"


def test_a_step_without_an_update_ratio_is_no_data_for_the_layer() -> None:
    """A weight with no ``update_ratio`` in a step (its norm before the step was 0: undefined)
    is neither inside nor outside the band there: the run of steps outside goes on across it."""
    rule = UpdateRatioRule(patience=2)
    missing = ratios(l0=1e-9)
    del missing["0.weight"]["update_ratio"]  # "norm" and "grad_norm" only
    assert rule.check(param_input(0, ratios(l0=0.5), MLP_SHAPES)) == []
    assert rule.check(param_input(1, missing, MLP_SHAPES)) == []
    [event] = rule.check(param_input(2, ratios(l0=0.5), MLP_SHAPES))
    assert (event.module, event.details["side"]) == ("0", "high")
    rule = UpdateRatioRule(patience=1)
    assert rule.check(param_input(0, missing, MLP_SHAPES)) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"high": 0.0}, r"`high` of UpdateRatioRule to be a finite positive number but got 0.0"),
        ({"low": -1e-6}, r"`low` of UpdateRatioRule to be a finite non-negative number"),
        ({"low": 0.5, "high": 0.1}, r"`low` < `high` of UpdateRatioRule but got low=0.5, high=0.1"),
        ({"patience": 0}, r"`patience` of UpdateRatioRule to be a positive int but got 0"),
        ({"high": None, "low": None}, r"`high` or `low` of UpdateRatioRule to be a number but"),
    ],
)
def test_update_ratio_refuses_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(RecorderConfigError, match=match):
        UpdateRatioRule(**kwargs)


# ---------------------------------------------------------------------------- loss spikes
def losses(values: Sequence[float], first_step: int = 0) -> RuleInput:
    steps = np.arange(first_step, first_step + len(values))
    return RuleInput(int(steps[-1]), losses=np.asarray(values, dtype=float), loss_steps=steps)


def test_loss_spike_is_lightnings_rule() -> None:
    """Lightning's SpikeDetection: not better than the last loss, and at least rtol times the
    running mean away from it (with atol, that far too)."""
    rule = LossSpikeRule(window=3)
    # mean of [1, 1, 1] is 1: 3.0 is exactly rtol * mean above it (and atol=1.0): a spike (>=)
    [event] = rule.check(losses([1.0, 1.0, 1.0, 3.0]))
    assert (event.kind, event.module, event.step, event.direction) == (
        "loss_spike",
        None,
        3,
        "loss",
    )
    assert event.details["loss"] == 3.0 and event.details["mean"] == 1.0
    assert event.details["ratio"] == 3.0
    assert event.message.startswith(
        "The training loss spiked at step 3: 3, 3 times the mean 1 of the 3 steps before."
    )
    # the running mean goes on from one check to the next: [1, 1, 3], a mean of 5/3
    assert [e.step for e in rule.check(losses([5.5], 4))] == [4]
    assert rule.check(losses([2.0, 1.0], 5)) == []  # lower than the last: never a spike
    rule = LossSpikeRule(window=3)
    assert rule.check(losses([1.0, 1.0, 1.0, 2.999])) == []  # just under
    # before the window fills, the mean is of the steps seen, and the message says how many
    [event] = LossSpikeRule(window=10).check(losses([1.0, 1.0, 4.0]))
    assert "4 times the mean 1 of the 2 steps before." in event.message
    [event] = LossSpikeRule(window=10).check(losses([1.0, 4.0]))
    assert "4 times the mean 1 of the step before." in event.message
    rule = LossSpikeRule(window=2, rtol=2.0, atol=5.0)  # both tolerances must be passed
    assert rule.check(losses([1.0, 1.0, 4.0])) == []  # 2 * mean away, not atol
    assert [e.step for e in rule.check(losses([8.0], 3))] == [3]  # both: mean 2.5, 5.5 away


def test_loss_spike_warmup_mode_window_and_non_finite_losses() -> None:
    # the first loss is never a spike (warmup=1), nor is a loss lower than the last one
    assert LossSpikeRule().check(losses([100.0])) == []
    assert LossSpikeRule(warmup=3).check(losses([1.0, 1.0, 9.0, 1.0])) == []
    assert LossSpikeRule().check(losses([9.0, 1.0, 1.0, 0.5])) == []
    # mode "max": a spike is a fall (an accuracy, a reward)
    [event] = LossSpikeRule(mode="max", rtol=0.5, atol=None).check(losses([0.9, 0.9, 0.9, 0.1]))
    assert event.step == 3
    # window: only the last `window` losses make the mean
    rule = LossSpikeRule(window=2)
    assert [e.step for e in rule.check(losses([100.0, 100.0, 1.0, 1.0, 3.5]))] == [4]
    # NaN/Inf are the non-finite check's: skipped, and kept out of the mean
    assert LossSpikeRule().check(losses([1.0, math.nan, math.inf, 1.0, 1.0])) == []


def test_loss_spikes_of_one_check_make_one_event_at_the_first() -> None:
    rule = LossSpikeRule(window=3)
    [event] = rule.check(losses([1.0, 1.0, 1.0, 5.0, 1.0, 1.0, 30.0]))
    assert event.step == 3 and event.path is None
    assert "; 1 more spike(s) by step 6." in event.message
    assert [s[0] for s in event.details["spikes"]] == [3, 6]
    # the next check's spike is returned too (the monitor keeps it quiet while one is in force)
    [later] = rule.check(losses([12.0, 300.0], 7))
    assert later.step == 8
    assert rule.check(losses([1.0], 9)) == []


def test_loss_spike_atol_keeps_small_losses_out() -> None:
    """The default atol=1.0 (this project's): a loss near zero that triples is no spike;
    atol=None is Lightning's rule exactly."""
    small = [0.01, 0.01, 0.01, 0.04]
    assert LossSpikeRule().check(losses(small)) == []
    assert [e.step for e in LossSpikeRule(atol=None).check(losses(small))] == [3]
    assert repr(LossSpikeRule()) == "LossSpikeRule(window=10, rtol=2.0, atol=1.0)"
    assert repr(LossSpikeRule(atol=None)) == "LossSpikeRule(window=10, rtol=2.0, atol=None)"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"window": 0}, r"`window` of LossSpikeRule to be a positive int but got 0"),
        ({"rtol": -2.0}, r"`rtol` of LossSpikeRule to be a finite non-negative number"),
        ({"atol": math.inf}, r"`atol` of LossSpikeRule to be a finite non-negative number"),
        ({"warmup": -1}, r"`warmup` of LossSpikeRule to be a non-negative int but got -1"),
        ({"mode": "up"}, r"`mode` of LossSpikeRule to be one of 'min', 'max' but got 'up'"),
        # no tolerance at all: every rise of the loss (2.29 after 2.28) would be a spike
        ({"rtol": None, "atol": None}, r"`rtol` or `atol` .* rtol=None, atol=None: every rise"),
        ({"rtol": 0.0, "atol": None}, r"`rtol` or `atol` .* positive number but got rtol=0.0,"),
        ({"rtol": None, "atol": 0}, r"`rtol` or `atol` .* rtol=None, atol=0.0: every rise"),
    ],
)
def test_loss_spike_refuses_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(RecorderConfigError, match=match):
        LossSpikeRule(**kwargs)


# ---------------------------------------------------------------------------- rules of a user
class MeanAbove(HealthRule):
    """A rule a user might write: a module's mean output above a limit."""

    name = "mean_above"

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.started = 0

    def start(self) -> None:
        self.started += 1

    def check(self, seen: RuleInput) -> list[HealthEvent]:
        report = seen.report
        if report is None:
            return []
        means = report.stats["mean"]
        return [
            self.event(seen, name, f"`{name}` has a mean of {mean:g}.", mean=float(mean))
            for name, mean in zip(report.modules, means, strict=True)
            if mean > self.limit
        ]


def test_the_rules_state_goes_over_to_a_fresh_rule() -> None:
    """What a resumed run gives back: a window, a patience count, a running mean, in plain
    values, taken up where they were by a fresh rule of the same settings."""
    import pickle

    relu = nn.ReLU()
    dead = DeadUnitsRule(window=3, min_fraction=0.5)
    for step in range(2):
        assert dead.check(unit_input(step, {"r": relu_table([0.0, 0.0, 1.0])}, {"r": relu})) == []
    ratio = UpdateRatioRule(patience=3)
    for step in range(2):
        assert ratio.check(param_input(step, ratios(l2=1e-7), MLP_SHAPES)) == []
    spike = LossSpikeRule(window=3)
    assert spike.check(losses([1.0, 1.0, 1.0])) == []
    states = [rule.state_dict() for rule in (dead, ratio, spike)]
    # plain values only: a checkpoint loaded with weights_only=True holds nothing else
    assert pickle.loads(pickle.dumps(states)) == states
    assert "numpy" not in repr(states)
    fresh = [DeadUnitsRule(3, 0.5), UpdateRatioRule(patience=3), LossSpikeRule(window=3)]
    for rule, state in zip(fresh, states, strict=True):
        rule.start()
        rule.load_state_dict(state)
    [event] = fresh[0].check(unit_input(2, {"r": relu_table([0.0, 0.0, 1.0])}, {"r": relu}))
    assert event.details == {"units": 3, "count": 2, "fraction": 2 / 3, "window": 3}
    assert kinds(fresh[1].check(param_input(2, ratios(l2=1e-7), MLP_SHAPES))) == [
        ("update_ratio", "2")
    ]
    [event] = fresh[2].check(losses([3.0], 3))  # the mean 1 of the 3 losses before
    assert event.details["mean"] == 1.0 and "of the 3 steps before" in event.message
    assert HealthRule().state_dict() == {}  # a rule that keeps nothing


def test_a_rule_of_a_user_gets_the_helpers_of_the_base_class() -> None:
    rule = MeanAbove(1.0)
    report = StatsReport("train", 4, None, ("a", "b"), {"mean": np.array([0.5, 2.0])})
    [event] = rule.check(RuleInput(4, report))
    assert (event.kind, event.step, event.module, event.message) == (
        "mean_above", 4, "b", "`b` has a mean of 2.",
    )  # fmt: skip
    assert event.details == {"mean": 2.0} and event.path is None and event.direction is None
    assert repr(rule) == "MeanAbove(name='mean_above')"
    assert rule.needs_statistics is True and HealthRule().check(RuleInput(0)) == ()
    assert HealthRule().track("x", nn.ReLU()) is None
    seen = RuleInput(0, modules={"enc": nn.Linear(2, 2)})
    assert isinstance(seen.module_of("enc/last_hidden_state"), nn.Linear)
    assert seen.module_of("dec") is None


def test_default_rules_are_fresh_and_configured_as_documented() -> None:
    first, second = HealthMonitor.default_rules(), HealthMonitor.default_rules()
    assert [r.name for r in first] == [
        "dead_units", "saturation", "vanishing_gradients", "exploding_gradients",
        "update_ratio", "loss_spike",
    ]  # fmt: skip
    assert all(a is not b for a, b in zip(first, second, strict=True))
    assert [r.name for r in HealthMonitor().rules] == [r.name for r in first]
    assert HealthMonitor(rules=()).rules == ()
    single = LossSpikeRule()
    assert HealthMonitor(rules=single).rules == (single,)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("rules", "match"),
    [
        ("dead_units", r"`rules` of HealthMonitor to be a sequence of HealthRule objects or None"),
        ([DeadUnitsRule, LossSpikeRule()], r"every item of `rules` .* but got type <class"),
        ([LossSpikeRule(), LossSpikeRule(window=3)], r"unique names .* 'loss_spike' is taken"),
        ([MeanAbove(1.0), MeanAbove(2.0)], r"unique names .* 'mean_above' is taken"),
    ],
)
def test_monitor_refuses_bad_rules(rules: Any, match: str) -> None:
    with pytest.raises(RecorderConfigError, match=match):
        HealthMonitor(rules=rules)


@pytest.mark.parametrize("name", [5, "", None])
def test_a_rule_name_must_be_a_non_empty_string(name: Any) -> None:
    rule = MeanAbove(1.0)
    rule.name = name
    with pytest.raises(RecorderConfigError, match=rf"`name` of every rule .* has {name!r}"):
        HealthMonitor(rules=[rule])


@pytest.mark.parametrize("taken", ["nonfinite", "amp_skipped"])
def test_rule_names_of_the_non_finite_check_are_taken(taken: str) -> None:
    rule = MeanAbove(1.0)
    rule.name = taken
    with pytest.raises(RecorderConfigError, match=rf"other than 'nonfinite' .* {taken!r} is taken"):
        HealthMonitor(rules=[rule])
