"""The rules half of :class:`~lightning_recorder.HealthMonitor`: where the rules get their input,
when they run, what becomes of their findings, and the view.

**Input.** At ``setup`` the monitor finds the first
:class:`~lightning_recorder.FeatureStatsMonitor` among the Trainer's callbacks that monitors
training (it warns when none does), subscribes to its reports and asks it for the per-channel
extremes of the modules the rules track. The loss of every training step is kept on its device
(:class:`._health_rules_loss.LossLog`).

**When.** On each logged training step of that monitor, on global rank zero, once the step is
complete: whichever of the two callbacks' ``on_train_batch_end`` runs last starts the check.
Without a FeatureStatsMonitor, the rules that need no statistics run every
``log_every_n_steps`` steps. Nothing runs on the other steps but keeping the loss.

**Findings.** A finding is identified by its rule, module and path. One that was not in force
at the rule's previous check *fires*: it is appended to ``events``, counted
(``rule_events``) and reported (:meth:`._health_report.Reporter.report_rules`); one still in
force stays quiet; one no longer returned is over. ``findings`` holds those in force.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from .._core.names import named_modules, named_parameters
from ..errors import RecorderConfigError, RecorderStateError
from ._health_event import HealthEvent
from ._health_rules import HealthRule, RuleInput
from ._health_rules_grads import ExplodingGradientsRule, UpdateRatioRule, VanishingGradientsRule
from ._health_rules_loss import LossLog, LossSpikeRule, loss_of
from ._health_rules_units import DeadUnitsRule, SaturationRule
from ._health_step import finish_event
from ._health_view import HealthView
from ._lightning import completes_step, is_due, step_axis
from ._stats_report import StatsReport

if TYPE_CHECKING:
    from ._health_report import Reporter
    from .stats_monitor import FeatureStatsMonitor

__all__ = ["Diagnosis", "check_rules", "default_rules"]

FindingKey = tuple[str, "str | None", "str | None"]


def default_rules() -> list[HealthRule]:
    """A fresh instance of each rule that ships, with its defaults."""
    return [
        DeadUnitsRule(),
        SaturationRule(),
        VanishingGradientsRule(),
        ExplodingGradientsRule(),
        UpdateRatioRule(),
        LossSpikeRule(),
    ]


def check_rules(rules: object, owner: str) -> tuple[HealthRule, ...]:
    """``rules`` as a tuple of rules with unique names (``None``: :func:`default_rules`)."""
    if rules is None:
        return tuple(default_rules())
    if isinstance(rules, HealthRule):
        rules = (rules,)
    if not isinstance(rules, Sequence) or isinstance(rules, str):
        raise RecorderConfigError(
            f"Expected `rules` of {owner} to be a sequence of HealthRule objects or None (the "
            f"default rules) but got {rules!r}."
        )
    names: set[str] = set()
    for rule in rules:
        if not isinstance(rule, HealthRule):
            raise RecorderConfigError(
                f"Expected every item of `rules` of {owner} to be a HealthRule (a subclass "
                f"with a `name` and a `check` method) but got {type(rule).__name__} {rule!r}."
            )
        if not isinstance(rule.name, str) or not rule.name:
            raise RecorderConfigError(
                f"Expected the `name` of every rule of {owner} to be a non-empty string (the "
                f"`kind` of its events) but {type(rule).__name__} has {rule.name!r}."
            )
        if rule.name in names or rule.name in ("nonfinite", "amp_skipped"):
            raise RecorderConfigError(
                f"Expected the rules of {owner} to have unique names other than 'nonfinite' "
                f"and 'amp_skipped' but {rule.name!r} is taken."
            )
        names.add(rule.name)
    return tuple(rules)


class Diagnosis:
    """The rules and the view of :class:`~lightning_recorder.HealthMonitor` (a mixin)."""

    rules: tuple[HealthRule, ...]
    events: list[HealthEvent]
    counters: dict[str, int]
    _reporter: Reporter
    _view: HealthView | None

    def _init_diagnosis(self) -> None:
        #: The rule findings in force, by (rule, module, path).
        self.findings: dict[FindingKey, HealthEvent] = {}
        self._losses = LossLog()
        self._stats: FeatureStatsMonitor | None = None
        self._report: StatsReport | None = None
        self._completed = -1
        self._warned_stats = False
        self._warned_tracked: set[str] = set()
        self._warned_parameters = False
        self._trainer: pl.Trainer | None = None
        self._module: pl.LightningModule | None = None
        self._modules: dict[str, nn.Module] = {}
        self._parameters: dict[str, nn.Parameter] = {}
        self._weights: set[str] = set()
        self._order: dict[str, int] = {}  # module name -> its place in the model
        self._orders: dict[tuple[str, ...], np.ndarray | None] = {}  # series -> permutation
        self._drawn = -1  # the step the view was last drawn at
        self._restored: dict[str, Any] | None = None  # from a checkpoint, for the next fit

    # ------------------------------------------------------------------ lifecycle
    def _attach_rules(self, trainer: pl.Trainer) -> None:
        """At ``setup``: subscribe to the first FeatureStatsMonitor that monitors training (or
        the first, or warn that there is none, or that it reports no training step)."""
        from .stats_monitor import FeatureStatsMonitor

        callbacks = getattr(trainer, "callbacks", [])
        found = [cb for cb in callbacks if isinstance(cb, FeatureStatsMonitor)]
        training = [cb for cb in found if "train" in cb.stages]
        self._stats = training[0] if training else found[0] if found else None
        needy = [rule.name for rule in self.rules if rule.needs_statistics]
        if self._stats is not None:
            if self.rules or self._view is not None:
                self._stats.subscribe(self._on_report)
            tracks = any(type(rule).track is not HealthRule.track for rule in self.rules)
            if tracks and training:  # channels are kept on training steps only
                self._stats.track_channels(self._track)
            if needy and not training and not self._warned_stats:
                self._warned_stats = True
                rank_zero_warn(
                    f"HealthMonitor's rules {', '.join(needy)} read the statistics of training "
                    "steps, and the Trainer's FeatureStatsMonitor monitors none "
                    f"(stages={self._stats.stages!r}): they check nothing (the non-finite check "
                    "and the rules on the loss still work). Add 'train' to its `stages`, e.g. "
                    "FeatureStatsMonitor(..., stages=('train', 'val')), or pass "
                    "`rules=[LossSpikeRule()]` (or `rules=()`) to silence this warning."
                )
            return
        if needy and not self._warned_stats:
            self._warned_stats = True
            rank_zero_warn(
                f"HealthMonitor's rules {', '.join(needy)} read the statistics of a "
                "FeatureStatsMonitor, and the Trainer has none: they check nothing (the "
                "non-finite check and the rules on the loss still work). Add one to the "
                "Trainer's callbacks, e.g. "
                "FeatureStatsMonitor([torch.nn.Conv2d, torch.nn.Linear, torch.nn.ReLU, "
                "torch.nn.Tanh]), or pass `rules=[LossSpikeRule()]` (or `rules=()`) to silence "
                "this warning."
            )

    def _start_rules(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """At ``on_fit_start``: fresh rules, findings and view."""
        for rule in self.rules:
            rule.start()
        self.findings = {}
        self._apply_restored()
        self._losses.clear()
        self._report, self._completed = None, -1
        self._trainer, self._module = trainer, pl_module
        self._modules = named_modules(pl_module)
        self._parameters = named_parameters(pl_module)
        self._weights = {name for name, p in self._parameters.items() if p.ndim >= 2}
        self._order = {name: i for i, name in enumerate(self._modules)}
        self._orders, self._drawn = {}, -1
        stats, view = self._stats, self._view
        if view is not None and stats is not None:
            view.start(stats.stats)  # a statistic the monitor does not log: no map
            view.warn_unshown(trainer)
            view.warn_no_pillow(trainer)

    def _write_layout(self, trainer: pl.Trainer) -> None:
        """At ``on_train_start``, once every callback's ``on_fit_start`` ran (the monitor's,
        which chooses its parameters, among them): the custom-scalars layout, with charts for
        what the monitor will log only: its parameters' if it monitors any, the validation
        stage's if the fit validates."""
        stats, view = self._stats, self._view
        if view is None or stats is None:
            return
        params = stats._params  # set when the monitor attached, at its on_fit_start
        stages = [s for s in stats.stages if s != "val" or trainer.enable_validation]
        view.write_layout(
            trainer,
            stats.prefix,
            stats.stats,
            stages,
            params is not None and bool(params.params),
            stats.logger_stats,
        )

    def _rules_state(self) -> dict[str, Any]:
        """The rules' state and the findings in force (their details left out: plain values
        only, as a checkpoint loaded with ``weights_only=True`` must hold)."""
        findings = [{**event.to_dict(), "details": {}} for event in self.findings.values()]
        return {
            "rules": {rule.name: rule.state_dict() for rule in self.rules},
            "findings": findings,
        }

    def _load_rules_state(self, state: dict[str, Any]) -> None:
        """Take back the state of :meth:`_rules_state`: kept for ``on_fit_start``, where the
        rules start afresh (Lightning loads a checkpoint before it, but after it with a strategy
        that restores after setup: then at once)."""
        if "rules" in state or "findings" in state:
            self._restored = {
                "rules": state.get("rules", {}),
                "findings": state.get("findings", []),
            }
            if self._trainer is not None:  # the run has started
                self._apply_restored()

    def _apply_restored(self) -> None:
        """A resumed run: its rules' windows and counts, and the findings in force, go on."""
        restored, self._restored = self._restored, None
        if restored is None:
            return
        states = restored["rules"]
        for rule in self.rules:
            if rule.name in states:
                rule.load_state_dict(states[rule.name])
        names = set(self._rule_names())
        for data in restored["findings"]:
            event = HealthEvent.from_dict(data)
            if event.kind in names:
                self.findings[(event.kind, event.module, event.path)] = event

    def _detach_rules(self) -> None:
        self._restored = None  # loaded by `validate` or `test`: not for a later fit
        if self._stats is not None:  # a later run of the monitor without this one is as before
            self._stats.unsubscribe(self._on_report)
            self._stats.untrack_channels(self._track)
        self._report = None
        self._trainer = self._module = None

    def _end_rules(self, trainer: pl.Trainer) -> None:
        """At ``on_train_end``: the losses of the steps after the last check, checked by the
        rules that need no statistics; the last picture."""
        if self._trainer is not None and self._completed >= 0 and self._losses.pending:
            self._check(self._completed, None)
        view = self._view
        if view is not None and self._completed >= 0 and self._drawn != self._completed:
            view.write(trainer, list(self.findings.values()), self._completed, self._rule_names())

    # ------------------------------------------------------------------ when
    def _track(self, series: str, module: nn.Module) -> bool | int | None:
        """The channel selector handed to the FeatureStatsMonitor: what some rule tracks."""
        for rule in self.rules:
            wanted = rule.track(series, module)
            if wanted is not None and wanted is not False:
                return wanted
        return None

    def _on_report(self, report: StatsReport) -> None:
        """A FeatureStatsMonitor's report (rank zero): checked now if the step is complete
        here, else when this monitor's ``on_train_batch_end`` comes."""
        if report.stage != "train" or self._trainer is None:
            return
        if report.step == self._completed:
            self._check(report.step, report)
        else:
            self._report = report

    def _rules_after_batch(self, trainer: pl.Trainer, outputs: Any) -> None:
        """At ``on_train_batch_end``: keep the loss; check a complete logged step."""
        if not trainer.is_global_zero or self._trainer is None:
            return
        step = step_axis(trainer)
        if self.rules:
            loss = loss_of(outputs)
            if loss is not None:
                # Lightning divides each micro-batch's loss by `accumulate_grad_batches`, also in
                # the shorter last group of an epoch: undone here, the step's mean taken at read
                scale = trainer.accumulate_grad_batches if _automatic(trainer) else 1
                self._losses.add(step, loss, scale)
        if not completes_step(trainer):
            return
        self._completed = step
        report, self._report = self._report, None
        if report is not None and report.step == step:
            self._check(step, report)
        elif self._stats is None and self.rules and is_due(step, _log_every(trainer)):
            self._check(step, None)

    # ------------------------------------------------------------------ the check
    def _rule_names(self) -> list[str]:
        return [rule.name for rule in self.rules]

    def _check(self, step: int, report: StatsReport | None) -> None:
        trainer = self._trainer
        assert trainer is not None
        steps, losses = self._losses.read()
        seen = RuleInput(
            step, report, losses, steps, self._modules, self._parameters, trainer, self._module
        )
        if report is not None:
            self._check_tracked(report)
            self._check_parameters(report)
        fired: list[HealthEvent] = []
        for rule in self.rules:
            if report is None and rule.needs_statistics:
                continue
            found = rule.check(seen)
            if not isinstance(found, Iterable) or isinstance(found, (str, bytes, HealthEvent)):
                raise RecorderStateError(
                    f"Expected rule {rule.name!r} ({type(rule).__name__}.check) to return a list "
                    f"of HealthEvent objects (an empty one when all is well) but it returned "
                    f"{type(found).__name__} {found!r}."
                )
            fired.extend(self._judge(rule, list(found), trainer))
        self.events.extend(fired)
        self.counters["rule_events"] += len(fired)
        self._reporter.report_rules(trainer, fired, self.counters, step)
        view = self._view
        if view is not None and report is not None:
            view.add(self._in_model_order(report), self._weights)
            if view.due(bool(fired)):
                view.write(trainer, list(self.findings.values()), step, self._rule_names())
                self._drawn = step

    def _judge(
        self, rule: HealthRule, found: list[HealthEvent], trainer: pl.Trainer
    ) -> list[HealthEvent]:
        """Update the findings in force of ``rule``; return those that fired."""
        now: dict[FindingKey, HealthEvent] = {}
        fired = []
        for event in found:
            if not isinstance(event, HealthEvent) or event.kind != rule.name:
                raise RecorderStateError(
                    f"Expected rule {rule.name!r} to return HealthEvent objects of kind "
                    f"{rule.name!r} but it returned {type(event).__name__} {event!r}."
                )
            event.rank = trainer.global_rank
            if not event.message:
                finish_event(event, event.action, event.evidence)
            key = (event.kind, event.module, event.path)
            before = self.findings.get(key)
            if before is None:
                fired.append(event)
                now[key] = event
            else:  # still in force: its latest figures, since the step it fired
                now[key] = dataclasses.replace(event, step=before.step)
        for key in [k for k in self.findings if k[0] == rule.name and k not in now]:
            del self.findings[key]
        self.findings.update(now)
        return fired

    def _check_tracked(self, report: StatsReport) -> None:
        """Warn once per rule that tracks channels when the FeatureStatsMonitor monitors none
        of the modules it judges while the model has some."""
        for rule in self.rules:
            if type(rule).track is HealthRule.track or rule.name in self._warned_tracked:
                continue
            self._warned_tracked.add(rule.name)
            if any(rule.track(s, m) for s in report.channels if (m := self._find(s)) is not None):
                continue
            present = [name for name, m in self._modules.items() if name and rule.track(name, m)]
            if present:
                shown = ", ".join(present[:4]) + (" …" if len(present) > 4 else "")
                kinds = sorted({type(self._modules[n]).__name__ for n in present})
                rank_zero_warn(
                    f"HealthMonitor's rule {rule.name!r} judges modules such as {shown}, but "
                    "the FeatureStatsMonitor monitors none of them; add them to its sources "
                    f"(e.g. torch.nn.{kinds[0]})."
                )

    def _check_parameters(self, report: StatsReport) -> None:
        """Warn once when rules read parameter figures and the FeatureStatsMonitor logs those
        of none of the model's weights (they would check nothing)."""
        if self._warned_parameters:
            return
        self._warned_parameters = True
        needy = [rule.name for rule in self.rules if rule.needs_parameters]
        if not needy or not self._weights or self._weights.intersection(report.parameters):
            return
        names = ", ".join(needy)
        silence = "or leave these rules out of `rules=` to silence this warning."
        if self._stats is not None and self._stats.parameters is False:
            rank_zero_warn(
                f"HealthMonitor's rules {names} read the gradient norms and update ratios of the "
                "weights, and the FeatureStatsMonitor logs none (`parameters=False`): they check "
                "nothing. Pass `parameters=True` to the FeatureStatsMonitor (or a pattern "
                f"covering the weights, e.g. `parameters='*.weight'`), {silence}"
            )
            return
        weights = [name for name in self._parameters if name in self._weights]
        shown = ", ".join(weights[:2]) + (" …" if len(weights) > 2 else "")
        rank_zero_warn(
            f"HealthMonitor's rules {names} read the gradient norms and update ratios of the "
            f"weights, and the FeatureStatsMonitor logs those of none of the model's weights "
            f"(such as {shown}): they check nothing. Monitor the modules that hold them and "
            "pass `parameters=True` to the FeatureStatsMonitor (or a pattern covering them, "
            f"e.g. `parameters='*.weight'`), {silence}"
        )

    def _in_model_order(self, report: StatsReport) -> StatsReport:
        """``report`` with its series in the model's order (the monitor lists them by source:
        every Linear, then every ReLU …), a module's series together: the heat maps' rows."""
        if report.modules not in self._orders:  # once per run: the series do not change
            place = [self._order.get(s.split("/", 1)[0], len(self._order)) for s in report.modules]
            order = np.argsort(place, kind="stable")
            in_order = bool((order == np.arange(order.size)).all())
            self._orders[report.modules] = None if in_order else order
        perm = self._orders[report.modules]
        if perm is None:
            return report
        modules = tuple(report.modules[i] for i in perm)
        stats = {name: values[perm] for name, values in report.stats.items()}
        return dataclasses.replace(report, modules=modules, stats=stats)

    def _find(self, series: str) -> nn.Module | None:
        return self._modules.get(series.split("/", 1)[0])


def _automatic(trainer: pl.Trainer) -> bool:
    """Whether the Trainer's LightningModule uses automatic optimization."""
    module = trainer.lightning_module
    return module is None or bool(module.automatic_optimization)


def _log_every(trainer: pl.Trainer) -> int:
    """The Trainer's ``log_every_n_steps`` (1 when unknown)."""
    return max(1, int(getattr(trainer, "log_every_n_steps", 1) or 1))
