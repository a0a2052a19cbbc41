"""Telling people about a health event: Python logging, the Trainer's loggers, an alert.

On global rank zero only (nothing here is a collective):

* **Python logging** — the logger ``"lightning_recorder.health"``: ``WARNING`` for the first
  event of a run of consecutive non-finite steps and for rule findings, ``INFO`` for steps the
  AMP grad scaler skipped, ``DEBUG`` for the later steps of a run (counted, not repeated);
  under ``"skip"``, ``WARNING`` for a skipped step only when none blamed on its module was
  noticed for ``alert_interval_s`` seconds (as rule findings), ``DEBUG`` otherwise, and the
  next notice says how many skipped steps went without one;
* **the Trainer's loggers** — the counters as scalars through ``log_metrics`` on every event
  (``health/nonfinite_steps``, ``health/skipped_steps``, ``health/amp_skipped_steps``,
  ``health/rule_events`` and the event's ``health/nan``, ``health/posinf``, ``health/neginf``
  counts: integers, so loggers that refuse non-finite metrics take them), and the message as a
  text entry (``health/events``) where the logger can show text: TensorBoard (``add_text``)
  and Weights & Biases (``log_text``);
* **an alert** — an optional callable given each loud event, at most once per
  ``alert_interval_s`` seconds; an alert that raises is reported and otherwise ignored.

**Rule findings** (:meth:`Reporter.report_rules`) are rate-limited per rule and module: a
finding is loud (a ``WARNING``, a text entry, an alert) when its rule has not spoken of its
module for ``alert_interval_s`` seconds, and ``DEBUG`` otherwise. The loud findings of one rule
at one check make *one* message: the first finding's, followed by the other modules (one per
side of a band: ``update_ratio``'s layers that move too fast apart from those that barely move).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_warn

from .._core.checks import listing
from ._health_event import HealthEvent, describe
from ._lightning import prefixed_tag

__all__ = ["LOGGER_NAME", "Reporter"]

LOGGER_NAME = "lightning_recorder.health"
log = logging.getLogger(LOGGER_NAME)


class Reporter:
    """Sends events to Python logging, the Trainer's loggers and the alert (rank zero)."""

    def __init__(self, alert: Callable[[HealthEvent], Any] | None, alert_interval_s: float) -> None:
        self.alert, self.interval = alert, alert_interval_s
        self._last_alert = -math.inf
        self._last_rule: dict[tuple[str, str | None], float] = {}
        self.suppressed_alerts = 0
        self.start()

    def start(self) -> None:
        """A new run (``on_fit_start``): no message written at any step yet, no skipped step
        noticed."""
        self._text_step: int | None = None
        self._texts: list[HealthEvent] = []
        self._last_skip: dict[str | None, float] = {}
        self._unnoticed_skips = 0

    def _skip_notice(self, event: HealthEvent) -> bool:
        """Whether a skipped step is worth a notice (a warning, a text entry, an alert): as a
        rule's findings, when no skipped step blamed on its module (or on none) was noticed for
        ``alert_interval_s`` seconds. A notice says how many skipped steps went without one
        since the last."""
        now = time.monotonic()
        if now - self._last_skip.get(event.module, -math.inf) < self.interval:
            self._unnoticed_skips += 1
            return False
        self._last_skip[event.module] = now
        if self._unnoticed_skips:
            event.details["skipped_since_notice"] = self._unnoticed_skips
            event.message = describe(event)
            self._unnoticed_skips = 0
        return True

    def _of_step(self, events: Sequence[HealthEvent], step: int) -> list[HealthEvent]:
        """The events whose messages went to the loggers at ``step`` so far, ``events`` last:
        TensorBoard shows the last text of a tag and step only, so each entry of a step repeats
        the earlier ones (a non-finite step and a rule finding at one logged step)."""
        if step != self._text_step:
            self._text_step, self._texts = step, []
        self._texts.extend(events)
        return list(self._texts)

    def report(
        self,
        trainer: pl.Trainer,
        event: HealthEvent,
        counters: dict[str, int],
        log_step: int,
        loud: bool,
    ) -> None:
        """Report ``event`` (``loud``: the first of its run, worth a warning and an alert)."""
        if not trainer.is_global_zero:
            return
        if loud and event.action == "skipped":
            loud = self._skip_notice(event)
        if event.kind == "amp_skipped":
            level = logging.INFO
        else:
            level = logging.WARNING if loud else logging.DEBUG
        log.log(level, event.message)
        metrics: dict[str, float] = {f"health/{k}": float(v) for k, v in counters.items()}
        metrics.update({f"health/{k}": float(v) for k, v in event.counts.items()})
        texts = loud or event.kind == "amp_skipped"
        shown = self._of_step([event], log_step) if texts else []
        for logger in trainer.loggers:
            try:
                logger.log_metrics(metrics, step=log_step)
                if texts:
                    _text(logger, [event], shown, log_step)
            except Exception as err:  # a logger's failure must not stop training
                rank_zero_warn(f"HealthMonitor could not write to {type(logger).__name__}: {err}")
        if loud and self.alert is not None and event.kind != "amp_skipped":
            now = time.monotonic()
            if now - self._last_alert < self.interval:
                self.suppressed_alerts += 1
                return
            self._last_alert = now
            try:
                self.alert(event)
            except Exception as err:
                rank_zero_warn(f"HealthMonitor's `alert` raised {type(err).__name__}: {err}")

    def report_rules(
        self,
        trainer: pl.Trainer,
        events: Sequence[HealthEvent],
        counters: dict[str, int],
        log_step: int,
    ) -> None:
        """Report the rule findings that fired at one check (rank zero): the counters to the
        loggers, and for each rule (and side of a band) one message of its findings not
        reported lately."""
        if not trainer.is_global_zero or not events:
            return
        metrics = {f"health/{k}": float(v) for k, v in counters.items()}
        by_rule: dict[str, list[HealthEvent]] = {}
        for event in events:
            by_rule.setdefault(event.kind, []).append(event)
        now = time.monotonic()
        loud: list[HealthEvent] = []
        for kind, found in by_rule.items():
            fresh = []
            for event in found:
                key = (kind, event.module)
                if now - self._last_rule.get(key, -math.inf) >= self.interval:
                    self._last_rule[key] = now
                    fresh.append(event)
                else:
                    log.debug(event.message)
            # findings on the two sides of a band (update_ratio's "high" and "low") say
            # opposite things: a message for each side
            sides: dict[Any, list[HealthEvent]] = {}
            for event in fresh:
                sides.setdefault(event.details.get("side"), []).append(event)
            loud.extend(_together(same) for same in sides.values())
        for event in loud:
            log.warning(event.message)
        shown = self._of_step(loud, log_step) if loud else []
        for logger in trainer.loggers:
            try:
                logger.log_metrics(metrics, step=log_step)
                if loud:
                    _text(logger, loud, shown, log_step)
            except Exception as err:  # a logger's failure must not stop training
                rank_zero_warn(f"HealthMonitor could not write to {type(logger).__name__}: {err}")
        if self.alert is None:
            return
        for event in loud:
            try:
                self.alert(event)
            except Exception as err:
                rank_zero_warn(f"HealthMonitor's `alert` raised {type(err).__name__}: {err}")


def _together(events: Sequence[HealthEvent]) -> HealthEvent:
    """One event saying what several findings of one rule say: the first one's, with the
    modules of the others (the first event itself when alone)."""
    if len(events) == 1:
        return events[0]
    others = [f"`{e.module}`" if e.module else "the model" for e in events[1:]]
    message = f"{events[0].message} The same on {listing(others)}."
    return dataclasses.replace(events[0], message=message)


def _text(
    logger: Any, events: Sequence[HealthEvent], shown: Sequence[HealthEvent], step: int
) -> None:
    """The messages of ``events`` for a logger: for TensorBoard, which shows one text per tag
    and step, one entry of every message of the step so far (``shown``, one paragraph each);
    for W&B, one table of the rows of ``events``."""
    if isinstance(logger, TensorBoardLogger):
        text = "\n\n".join(event.message for event in shown)
        tag = prefixed_tag(logger, "health/events")  # after a prefix the logger makes public
        logger.experiment.add_text(tag, text, global_step=step)
    elif isinstance(logger, WandbLogger):
        rows: list[list[Any]] = [
            [e.step, e.kind, e.module or "", e.direction or "", e.message] for e in events
        ]
        logger.log_text(
            key="health/events",
            columns=["step", "kind", "module", "direction", "message"],
            data=rows,
            step=step,
        )
