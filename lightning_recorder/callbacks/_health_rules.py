"""`HealthRule`: what a rule of :class:`~lightning_recorder.HealthMonitor` is, and what it reads.

A rule looks at one *logged* training step — the :class:`~lightning_recorder.callbacks.StatsReport`
a :class:`~lightning_recorder.FeatureStatsMonitor` logged, and the training losses of every step
since the previous check — and returns what is wrong *now* as
:class:`~lightning_recorder.HealthEvent` s whose ``kind`` is the rule's ``name``. Nothing is
checked on the other steps.

The monitor keeps the findings in force: a finding that was not there at the previous check
*fires* (it becomes an event of ``monitor.events``, a message, an alert), one that goes on stays
quiet (it is shown in the findings table), one that is no longer returned is over. A finding
is identified by its rule, ``module`` and ``path``. A rule therefore says what it sees at each
check and keeps no record of what it already said; what it needs to remember between checks
(a window of logged steps, a running mean) is its own state, cleared by :meth:`HealthRule.start`
at the start of each run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import nn

from ..errors import RecorderConfigError
from ._health_event import Direction, HealthEvent

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from ._stats_report import StatsReport

__all__ = ["HealthRule", "RuleInput", "check_fraction", "percent", "split_parameter"]


@dataclass(frozen=True)
class RuleInput:
    """What a rule reads at one logged training step (on global rank zero).

    Attributes:
        step: the logged step: Lightning's global step of its optimizer step (as
            :attr:`HealthEvent.step`).
        report: the statistics a :class:`~lightning_recorder.FeatureStatsMonitor` logged at this
            step, or ``None`` when the Trainer has none (rules that need statistics then find
            nothing).
        losses: the training loss of each optimizer step since the previous check, oldest first
            (with gradient accumulation, the mean over the step's micro-batches).
        loss_steps: the steps of ``losses``.
        modules: the LightningModule's modules by name (as in ``named_modules()``).
        parameters: the LightningModule's parameters by name (as in ``named_parameters()``).
        trainer: the Trainer.
        pl_module: the LightningModule.
    """

    step: int
    report: StatsReport | None = None
    losses: np.ndarray = field(default_factory=lambda: np.zeros(0))
    loss_steps: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    modules: Mapping[str, nn.Module] = field(default_factory=dict)
    parameters: Mapping[str, nn.Parameter] = field(default_factory=dict)
    trainer: pl.Trainer | None = None
    pl_module: pl.LightningModule | None = None

    def module_of(self, series: str) -> nn.Module | None:
        """The module behind a monitored series (``"bert/last_hidden_state"`` is ``bert``'s)."""
        return self.modules.get(series.split("/", 1)[0])


class HealthRule:
    """Base class of a health rule: a ``name``, what it needs, and :meth:`check`.

    Subclasses set ``name`` (the ``kind`` of their events) and override :meth:`check`; a rule
    that reads the per-channel extremes of some modules' outputs says which in :meth:`track`;
    one that keeps state between checks clears it in :meth:`start`, and returns it from
    :meth:`state_dict` (taken back by :meth:`load_state_dict`) to keep it over a resume.

    Examples:
        >>> class LossAbove(HealthRule):
        ...     name = "loss_above"
        ...     needs_statistics = False
        ...     def __init__(self, limit: float) -> None:
        ...         self.limit = limit
        ...     def check(self, seen: RuleInput) -> list[HealthEvent]:
        ...         if seen.losses.size and seen.losses[-1] > self.limit:
        ...             return [self.event(seen, None, f"The loss {seen.losses[-1]:g} is above "
        ...                                f"{self.limit:g}.", direction="loss")]
        ...         return []
        >>> import numpy as np
        >>> rule = LossAbove(2.0)
        >>> [e.message for e in rule.check(RuleInput(step=9, losses=np.array([1.0, 3.0])))]
        ['The loss 3 is above 2.']
    """

    name: str = "rule"
    """The rule's name: the ``kind`` of its events; unique among a monitor's rules."""

    needs_statistics: bool = True
    """Whether the rule reads a :class:`~lightning_recorder.FeatureStatsMonitor`'s report (the
    monitor warns once when the Trainer has none)."""

    needs_parameters: bool = False
    """Whether the rule reads the parameter figures of the report
    (:attr:`~lightning_recorder.callbacks.StatsReport.parameters`: gradient norms, update
    ratios); the monitor warns once when the FeatureStatsMonitor logs those of none of the
    model's weights (``parameters=False``, or a pattern that selects none of them)."""

    def start(self) -> None:
        """Forget what earlier checks left (called at the start of each ``fit``)."""

    def state_dict(self) -> dict[str, Any]:
        """What the rule keeps between checks, as plain values (lists, numbers, strings): saved
        in the Trainer's checkpoints with the monitor's state, so that a resumed run goes on
        with its windows and patience counts; ``{}`` by default."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take back what :meth:`state_dict` returned (called after :meth:`start` when a run
        resumes from a checkpoint)."""

    def track(self, series: str, module: nn.Module) -> bool | int | None:
        """Whether the per-channel extremes of ``module``'s outputs are needed (``True``, or the
        channel dimension), as :meth:`~lightning_recorder.FeatureStatsMonitor.track_channels`
        asks; ``None`` by default."""
        return None

    def check(self, seen: RuleInput) -> Iterable[HealthEvent]:
        """The findings in force at this logged step (none by default)."""
        return ()

    def event(
        self,
        seen: RuleInput,
        module: str | None,
        message: str,
        *,
        direction: Direction | None = None,
        path: str | None = None,
        **details: Any,
    ) -> HealthEvent:
        """A finding of this rule at ``seen.step``, with ``details`` as plain values."""
        return HealthEvent(
            self.name,
            seen.step,
            None,
            module=module,
            direction=direction,
            message=message,
            path=path,
            details=details,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def check_fraction(value: object, name: str, owner: str, *, open_low: bool = True) -> float:
    """``value`` as a float in (0, 1] (``[0, 1]`` unless ``open_low``), or a clear error."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    number = float(value) if ok else float("nan")  # type: ignore[arg-type]
    low_ok = number > 0 if open_low else number >= 0
    if not (low_ok and number <= 1):
        span = "(0, 1]" if open_low else "[0, 1]"
        raise RecorderConfigError(
            f"Expected `{name}` of {owner} to be a number in {span} but got {value!r}."
        )
    return number


def split_parameter(name: str) -> tuple[str, str]:
    """``("features.0", "weight")`` from ``"features.0.weight"`` (module ``""``: the root's)."""
    module, _, leaf = name.rpartition(".")
    return module, leaf


def percent(part: float, whole: float) -> str:
    """``"75 %"``: ``part`` of ``whole`` as a whole percentage."""
    return f"{100 * part / whole:.0f} %" if whole else "0 %"
