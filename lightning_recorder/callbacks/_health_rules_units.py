"""The rules on units: :class:`DeadUnitsRule` (ReLU units that never fire) and
:class:`SaturationRule` (tanh, sigmoid … units stuck where their gradient is near zero).

Both read the per-channel extremes of the modules' outputs that
:class:`~lightning_recorder.FeatureStatsMonitor` keeps for them on logged steps
(:attr:`~lightning_recorder.callbacks.StatsReport.channels`: the minimum, maximum and minimum
``|x|`` of each channel over the step's batch, on every rank): a *unit* is a channel — dim 1 of
a convolution's 4-d output, the last dim of others (a ``Linear``'s features, a transformer's
hidden units). A unit's state is judged over a window of logged steps: one batch says little
about a unit that fires rarely, several in a row say it does not fire at all. Steps where a
module was not called, or its output held NaN/Inf (the non-finite check reports those), leave
its counts as they were.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from torch import nn

from .._core.checks import check_int
from .._core.names import resolve_type
from ..errors import RecorderConfigError
from ._health_event import HealthEvent
from ._health_rules import HealthRule, RuleInput, check_fraction, percent

__all__ = ["DeadUnitsRule", "SaturationRule"]

_RELU_FAMILY: tuple[type[nn.Module], ...] = (nn.ReLU, nn.ReLU6)
# (low, high): a unit is saturated when all its values are <= low, or all >= high, or (low ==
# -high) all beyond ±high. None: the module's own clipping bounds (Hardtanh's min_val/max_val).
_BOUNDS: dict[type[nn.Module], tuple[float, float] | None] = {
    nn.Tanh: (-0.99, 0.99),
    nn.Sigmoid: (0.01, 0.99),
    nn.Hardtanh: None,
    nn.Hardsigmoid: (0.0, 1.0),
}


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bounds_key(key: object, owner: str) -> Any:
    """A key of ``bounds``: a class, or the class an import path names (YAML keys, as
    LightningCLI passes them, are strings); anything else is returned for the caller's check."""
    if not isinstance(key, str) or "." not in key:
        return key
    try:
        return resolve_type(key)
    except RecorderConfigError as err:
        raise RecorderConfigError(
            f"Expected the keys of `bounds` of {owner} to be module classes or their import "
            f"paths (e.g. 'torch.nn.Tanh') but {key!r} names none: {err}"
        ) from err


def _check_types(types: object, owner: str) -> tuple[type[nn.Module], ...]:
    items = (types,) if isinstance(types, type) else types
    if (
        not isinstance(items, Sequence)
        or not items
        or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in items)
    ):
        raise RecorderConfigError(
            f"Expected `types` of {owner} to be a module class or a non-empty sequence of them "
            f"(e.g. (torch.nn.ReLU,)) but got {types!r}."
        )
    return tuple(items)


class _UnitRule(HealthRule):
    """Counts, per unit, the consecutive logged steps a condition held (shared by both rules)."""

    window: int
    min_fraction: float

    def __init__(self, window: int, min_fraction: float) -> None:
        owner = type(self).__name__
        check_int(window, "window", owner)
        self.window = window
        self.min_fraction = check_fraction(min_fraction, "min_fraction", owner)
        self._runs: dict[str, np.ndarray] = {}

    def start(self) -> None:
        self._runs = {}

    def state_dict(self) -> dict[str, Any]:
        return {"runs": {series: run.tolist() for series, run in self._runs.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        runs = state.get("runs", {})
        self._runs = {series: np.asarray(run, dtype=np.int64) for series, run in runs.items()}

    def _holds(self, module: nn.Module, table: np.ndarray) -> np.ndarray | None:
        """Which units meet the condition in this step (``None``: the module is not judged)."""
        raise NotImplementedError

    def _message(self, series: str, module: nn.Module, count: int, units: int) -> str:
        raise NotImplementedError

    def check(self, seen: RuleInput) -> list[HealthEvent]:
        report = seen.report
        if report is None:
            return []
        found = []
        nonfinite = report.stats.get("nonfinite")
        for series, table in report.channels.items():
            module = seen.module_of(series)
            if module is None:
                continue
            index = report.modules.index(series) if series in report.modules else -1
            called = bool(np.isfinite(table[0]).any() or np.isfinite(table[1]).any())
            bad = nonfinite is not None and index >= 0 and nonfinite[index] > 0
            holds = None if bad or not called else self._holds(module, table)
            run = self._runs.get(series)
            if holds is None:
                if run is None:
                    continue
            else:
                if run is None or run.shape != holds.shape:
                    run = np.zeros(holds.shape, dtype=np.int64)
                run = self._runs[series] = np.where(holds, run + 1, 0)
            count = int((run >= self.window).sum())
            units = int(run.size)
            if units and count / units >= self.min_fraction:  # not `* units`: 0.7 * 10 > 7
                name, _, path = series.partition("/")
                found.append(
                    self.event(
                        seen,
                        name,
                        self._message(series, module, count, units),
                        direction="forward",
                        path=f"output.{path}" if path else "output",
                        units=units,
                        count=count,
                        fraction=count / units,
                        window=self.window,
                    )
                )
        return found


class DeadUnitsRule(_UnitRule):
    """Dead ReLU units: units that gave 0 for every input over a window of logged steps.

    A unit (channel) of a ReLU-family module's output is *active* in a logged step when its
    largest value over the step's batch is above 0; it is *dead* when it was not active in any
    of the last ``window`` logged steps in a row. A dead unit passes no gradient to the weights
    that feed it, so it cannot come back by itself. The rule fires for a module when at least
    ``min_fraction`` of its units are dead, and names how many.

    **Defaults and sources.** ``min_fraction=0.7``: AutoTrainer's dying-ReLU threshold (Zhang
    et al., "AUTOTRAINER: An Automatic DNN Training Problem Detection and Repair System", ICSE
    2021: a problem when 70 % of the gradients are zero, ``gamma=0.7``), applied here to units,
    which is what its zero gradients come from. ``window=5`` logged steps: five batches in
    which a unit never fired (160 examples at a batch of 32).

    **When it fires.** A learning rate too large for the layer (an update pushed the bias far
    negative), or an initialisation that starts units dead. Lower the learning rate (or add
    warm-up), initialise with ``nn.init.kaiming_normal_``, put a normalisation layer before the
    activation, or use LeakyReLU/GELU, whose units cannot die.

    Args:
        window: the logged steps in a row a unit must stay inactive to count as dead.
        min_fraction: the fraction of a module's units that must be dead for the rule to fire.
        types: the module classes whose outputs are judged (their subclasses too), one or a
            list.

    Raises:
        RecorderConfigError: an argument is invalid.

    Examples:
        >>> import numpy as np, torch
        >>> from lightning_recorder.callbacks import StatsReport
        >>> rule = DeadUnitsRule(window=2)
        >>> relu = torch.nn.ReLU()
        >>> table = np.array([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.5], [0.0, 0.0, 0.0, 0.0]])
        >>> def seen(step):
        ...     report = StatsReport("train", step, None, ("act",), {}, channels={"act": table})
        ...     return RuleInput(step, report, modules={"act": relu})
        >>> rule.check(seen(0))  # one step is not enough
        []
        >>> [e.message for e in rule.check(seen(1))]  # doctest: +ELLIPSIS
        ['`act` (ReLU) has 3 of 4 units dead (75 %): none gave a value above 0 ...']
    """

    name = "dead_units"

    def __init__(
        self,
        window: int = 5,
        min_fraction: float = 0.7,
        types: type[nn.Module] | Sequence[type[nn.Module]] = _RELU_FAMILY,
    ) -> None:
        super().__init__(window, min_fraction)
        self.types = _check_types(types, type(self).__name__)

    def track(self, series: str, module: nn.Module) -> bool | None:
        return True if isinstance(module, self.types) else None

    def _holds(self, module: nn.Module, table: np.ndarray) -> np.ndarray | None:
        if not isinstance(module, self.types):
            return None
        return ~(table[1] > 0)

    def _message(self, series: str, module: nn.Module, count: int, units: int) -> str:
        return (
            f"`{series}` ({type(module).__name__}) has {count} of {units} units dead "
            f"({percent(count, units)}): none gave a value above 0 for any input in the last "
            f"{self.window} logged steps. Lower the learning rate or add warm-up, initialise "
            "with nn.init.kaiming_normal_, normalise before the activation, or use LeakyReLU."
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(window={self.window}, min_fraction={self.min_fraction})"


class SaturationRule(_UnitRule):
    """Saturated units of bounded activations (tanh, sigmoid, hard tanh, hard sigmoid).

    A unit (channel) is *saturated* in a logged step when every value it took over the step's
    batch lies where the activation is flat: for ``Tanh`` at or beyond ±0.99 (its gradient
    ``1 - y²`` is then under 2 % of its largest), for ``Sigmoid`` at or below 0.01 or at or
    above 0.99 (``y (1 - y)`` under 4 % of its largest), for ``Hardtanh`` and ``Hardsigmoid``
    at their clipping bounds (gradient exactly 0). The rule fires for a module when at least
    ``min_fraction`` of its units stayed saturated in each of the last ``window`` logged steps.

    **Defaults and sources.** The bounds are where the derivative falls to a few percent of its
    largest, the saturation Glorot & Bengio describe ("Understanding the difficulty of training
    deep feedforward neural networks", AISTATS 2010: sigmoid units of the top layer stuck at 0
    for most of training). ``min_fraction=0.5``: half the layer no longer learns.
    ``window=5`` logged steps, as :class:`DeadUnitsRule`.

    **When it fires.** The inputs of the activation are too large: unnormalised data, weights
    initialised too large, or a learning rate that grew them. Normalise the inputs or add a
    normalisation layer before the activation, initialise with Xavier/Glorot's scale
    (``nn.init.xavier_uniform_``), lower the learning rate.

    Args:
        window: the logged steps in a row a unit must stay saturated.
        min_fraction: the fraction of a module's units that must be saturated to fire.
        bounds: ``{module class: (low, high)}``: a unit is saturated when all its values are
            ``<= low``, or all ``>= high``, or (when ``low == -high``) all beyond ``±high``;
            ``None`` takes the module's own ``min_val``/``max_val`` (``Hardtanh``). A class may
            be given by its import path (``"torch.nn.Tanh"``, as in a YAML config). Looked up
            along each module's class hierarchy; the defaults: ``Tanh`` ``(-0.99, 0.99)``,
            ``Sigmoid`` ``(0.01, 0.99)``, ``Hardtanh`` its own, ``Hardsigmoid`` ``(0, 1)``.

    Raises:
        RecorderConfigError: an argument is invalid.

    Examples:
        >>> import numpy as np, torch
        >>> from lightning_recorder.callbacks import StatsReport
        >>> rule = SaturationRule(window=1)
        >>> low, high = [-1.0, 0.995, -0.2], [-0.992, 1.0, 0.3]
        >>> table = np.array([low, high, [0.992, 0.995, 0.0]])  # min, max, min |x|
        >>> report = StatsReport("train", 0, None, ("h",), {}, channels={"h": table})
        >>> seen = RuleInput(0, report, modules={"h": torch.nn.Tanh()})
        >>> [e.details["count"] for e in rule.check(seen)]
        [2]
    """

    name = "saturation"

    def __init__(
        self,
        window: int = 5,
        min_fraction: float = 0.5,
        bounds: Mapping[type[nn.Module], tuple[float, float] | None] | None = None,
    ) -> None:
        super().__init__(window, min_fraction)
        owner = type(self).__name__
        if bounds is not None and (not isinstance(bounds, Mapping) or not bounds):
            raise RecorderConfigError(
                f"Expected `bounds` of {owner} to be a non-empty mapping of module classes to "
                f"(low, high), e.g. {{torch.nn.Tanh: (-0.99, 0.99)}}, or None but got {bounds!r}."
            )
        given = _BOUNDS if bounds is None else bounds
        chosen = {_bounds_key(cls, owner): pair for cls, pair in given.items()}
        for cls, pair in chosen.items():
            good = isinstance(cls, type) and issubclass(cls, nn.Module)
            if pair is not None:
                good = good and isinstance(pair, tuple) and len(pair) == 2
                good = good and all(_is_number(b) for b in pair) and pair[0] < pair[1]
            if not good:
                raise RecorderConfigError(
                    f"Expected `bounds` of {owner} to map module classes (or their import "
                    "paths) to (low, high) of two numbers with low < high, or None, e.g. "
                    "{torch.nn.Tanh: (-0.99, 0.99)} or {'torch.nn.Tanh': (-0.99, 0.99)}, but "
                    f"got {cls!r}: {pair!r}."
                )
        self.bounds = chosen

    def _bounds_of(self, module: nn.Module) -> tuple[float, float] | None:
        if isinstance(module, nn.ReLU6) and nn.ReLU6 not in self.bounds:
            return None  # a ReLU, judged by DeadUnitsRule
        for cls in type(module).__mro__:
            if cls in self.bounds:
                pair = self.bounds[cls]
                if pair is None:
                    low, high = getattr(module, "min_val", None), getattr(module, "max_val", None)
                    if isinstance(low, (int, float)) and isinstance(high, (int, float)):
                        return float(low), float(high)
                    return None
                return pair
        return None

    def track(self, series: str, module: nn.Module) -> bool | None:
        return True if self._bounds_of(module) is not None else None

    def _holds(self, module: nn.Module, table: np.ndarray) -> np.ndarray | None:
        pair = self._bounds_of(module)
        if pair is None:
            return None
        low, high = pair
        stuck = (table[1] <= low) | (table[0] >= high)
        if low == -high:
            stuck |= table[2] >= high
        return np.asarray(stuck)

    def _message(self, series: str, module: nn.Module, count: int, units: int) -> str:
        pair = self._bounds_of(module)
        low, high = pair if pair is not None else (float("nan"), float("nan"))
        # the bounds count (a hard activation's saturated values sit on them exactly)
        where = (
            f"at or beyond ±{high:g}"
            if low == -high
            else f"at or below {low:g} or at or above {high:g}"
        )
        return (
            f"`{series}` ({type(module).__name__}) has {count} of {units} units saturated "
            f"({percent(count, units)}): every value stayed {where}, where the gradient is near 0, "
            f"in each of the last {self.window} logged steps. Normalise its inputs (or add a "
            "normalisation layer before it), initialise with nn.init.xavier_uniform_, or "
            "lower the learning rate."
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(window={self.window}, min_fraction={self.min_fraction})"
