"""Health at a glance: what :class:`~lightning_recorder.HealthMonitor` draws for the loggers.

On global rank zero, from the training reports of the Trainer's
:class:`~lightning_recorder.FeatureStatsMonitor`:

* **one chart per statistic, every layer on it** — TensorBoard's custom-scalars layout
  (``SummaryWriter.add_custom_scalars``), written once when training starts: a Multiline chart
  per statistic whose regular expression matches the tag of every layer
  (``stats/train/.+/zero_fraction``), grouped as ``layers: train``, ``parameters: train``,
  ``layers: val`` and ``health`` (the monitor's counters);
* **the heat maps** — per chosen statistic an image, rows the layers in model order, columns
  the last logged steps, the findings in force written beside their layer
  (:mod:`._health_heatmap`), tag ``health/heatmap/<stat>``;
* **the findings table** — the rule findings in force, as a markdown table (tag
  ``health/findings``).

The images and the table are written at the first logged step, every ``every`` logged steps,
when a rule fires, and when training ends. TensorBoard gets all three (``add_image``,
``add_text``); Weights & Biases the images (``log_image``) and the table (``log_table``);
other loggers nothing (they show neither images nor text).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_warn

from ._health_event import HealthEvent
from ._health_heatmap import render
from ._health_rules import percent
from ._lightning import logger_prefix
from ._stats_report import StatsReport

__all__ = ["PARAMETER_STATS", "HealthView", "layout", "table"]

PARAMETER_STATS = ("grad_norm", "update_ratio", "norm")
_COLUMNS = ["rule", "module", "since step", "finding"]


def _prefixed(logger: Any, tag: str) -> str:
    prefix = logger_prefix(logger)
    return f"{prefix}{getattr(logger, 'LOGGER_JOIN_CHAR', '-')}{tag}" if prefix else tag


def layout(
    prefix: str, stats: Sequence[str], stages: Sequence[str], parameters: bool, lead: str = ""
) -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars layout: ``{category: {chart title: ["Multiline", [regex]]}}``.

    ``lead`` is the logger's own prefix with its join character, before every tag.
    """
    head = re.escape(lead)
    found: dict[str, dict[str, list[Any]]] = {}
    for stage in stages:
        if stage not in ("train", "val", "test"):
            continue
        suffix = r"(/dataloader_idx_\d+)?" if stage != "train" else ""
        where = rf"^{head}{re.escape(prefix)}/{stage}/.+/"
        found[f"layers: {stage}"] = {
            f"{stat} of every layer ({stage})": ["Multiline", [f"{where}{stat}{suffix}$"]]
            for stat in stats
        }
        if stage == "train" and parameters:
            found["parameters: train"] = {
                f"{stat} of every parameter": ["Multiline", [f"{where}{stat}$"]]
                for stat in PARAMETER_STATS
            }
    found["health"] = {
        "rule findings and non-finite steps": [
            "Multiline",
            [rf"^{head}health/(rule_events|nonfinite_steps|skipped_steps|amp_skipped_steps)$"],
        ]
    }
    return found


def _short(event: HealthEvent) -> str:
    """A finding in a few words, for the heat map."""
    details = event.details
    if "count" in details and "units" in details:
        count, units = details["count"], details["units"]
        return f"{event.kind}: {count} of {units} units ({percent(count, units)})"
    if "ratio" in details:
        return f"{event.kind}: ratio {details['ratio']:.3g}"
    return event.kind


def table(findings: Sequence[HealthEvent], step: int, rules: Sequence[str]) -> str:
    """The findings in force as a markdown table (a sentence when there are none)."""
    if not findings:
        return f"No rule finding in force at step {step} (rules: {', '.join(rules) or 'none'})."
    lines = [
        f"**{len(findings)} finding(s) in force at step {step}**",
        "",
        "| " + " | ".join(_COLUMNS) + " |",
        "|" + "---|" * len(_COLUMNS),
    ]
    for event in findings:
        cells = [event.kind, f"`{event.module}`" if event.module else "-", str(event.step)]
        cells.append(event.message.replace("|", "\\|").replace("\n", " "))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


class HealthView:
    """Collects the logged steps of the chosen statistics and draws them (rank zero)."""

    def __init__(self, stats: Sequence[str], every: int, steps: int) -> None:
        self.stats, self.every, self.steps = tuple(stats), every, steps
        self.start()

    def start(self) -> None:
        self._steps: deque[int] = deque(maxlen=self.steps)
        self._columns: deque[dict[str, tuple[tuple[str, ...], np.ndarray]]] = deque(
            maxlen=self.steps
        )
        self._seen = 0
        self._warned = False

    # ------------------------------------------------------------------ writing
    def _each(self, trainer: pl.Trainer, what: str, write: Any) -> None:
        """``write(logger)`` for each logger, a failure reported once, never raised."""
        for logger in trainer.loggers:
            try:
                write(logger)
            except Exception as err:  # a logger's failure must not stop training
                if not self._warned:
                    self._warned = True
                    rank_zero_warn(
                        f"HealthMonitor could not write the {what} to {type(logger).__name__}: "
                        f"{type(err).__name__}: {err}"
                    )

    def write_layout(
        self,
        trainer: pl.Trainer,
        prefix: str,
        stats: Sequence[str],
        stages: Sequence[str],
        parameters: bool,
    ) -> None:
        """Write the custom-scalars layout to the TensorBoard loggers (rank zero)."""
        if not trainer.is_global_zero:
            return

        def write(logger: Any) -> None:
            if not isinstance(logger, TensorBoardLogger):
                return
            add = getattr(logger.experiment, "add_custom_scalars", None)
            if add is not None:
                lead = _prefixed(logger, "")
                add(layout(prefix, stats, stages, parameters, lead))

        self._each(trainer, "custom-scalars layout", write)

    def add(self, report: StatsReport, weights: set[str]) -> None:
        """Keep the chosen statistics of a training report as one column."""
        column: dict[str, tuple[tuple[str, ...], np.ndarray]] = {}
        for stat in self.stats:
            if stat in PARAMETER_STATS:
                rows = tuple(n for n, f in report.parameters.items() if n in weights and stat in f)
                values = np.array([report.parameters[n][stat] for n in rows], dtype=np.float64)
                column[stat] = rows, values
            elif stat in report.stats:
                column[stat] = report.modules, np.asarray(report.stats[stat], dtype=np.float64)
        self._steps.append(report.step)
        self._columns.append(column)
        self._seen += 1

    def due(self, fired: bool) -> bool:
        """Whether to draw now: the first logged step, every ``every``, or a rule fired."""
        return bool(self._columns) and (fired or self._seen == 1 or self._seen % self.every == 0)

    def images(self, findings: Sequence[HealthEvent]) -> dict[str, np.ndarray]:
        """The heat map of each chosen statistic, ``{tag: (H, W, 3) uint8}``."""
        images = {}
        loose = [e for e in findings if e.module is None]
        footer = "; ".join(f"{e.kind} (step {e.step})" for e in loose)
        for stat in self.stats:
            rows: dict[str, int] = {}
            for column in self._columns:
                for name in column.get(stat, ((), None))[0]:
                    rows.setdefault(name, len(rows))
            if not rows:
                continue
            values = np.full((len(rows), len(self._columns)), np.nan)
            for j, column in enumerate(self._columns):
                if stat in column:
                    names, found = column[stat]
                    values[[rows[n] for n in names], j] = found
            notes: dict[int, list[str]] = {}
            for event in findings:
                if event.module is None:
                    continue
                for name, i in rows.items():
                    if _belongs(name, event):
                        notes.setdefault(i, []).append(_short(event))
            text = {i: "; ".join(parts) for i, parts in notes.items()}
            images[f"health/heatmap/{stat}"] = render(
                values, stat, list(rows), list(self._steps), text, footer
            )
        return images

    def write(
        self, trainer: pl.Trainer, findings: Sequence[HealthEvent], step: int, rules: Sequence[str]
    ) -> None:
        """Draw the heat maps and the findings table for the loggers (rank zero)."""
        if not trainer.is_global_zero or not self._columns:
            return
        wanted = [lg for lg in trainer.loggers if isinstance(lg, (TensorBoardLogger, WandbLogger))]
        if not wanted:
            return
        images = self.images(findings)
        text = table(findings, step, rules)

        def write(logger: Any) -> None:
            if isinstance(logger, TensorBoardLogger):
                writer = logger.experiment
                for tag, image in images.items():
                    writer.add_image(_prefixed(logger, tag), image, step, dataformats="HWC")
                writer.add_text(_prefixed(logger, "health/findings"), text, step)
            elif isinstance(logger, WandbLogger):
                for tag, image in images.items():
                    logger.log_image(key=tag, images=[image], step=step)
                rows = [[e.kind, e.module or "", e.step, e.message] for e in findings]
                logger.log_table(key="health/findings", columns=_COLUMNS, data=rows, step=step)

        self._each(trainer, "health view", write)


def _belongs(row: str, event: HealthEvent) -> bool:
    """Whether a heat-map row (a series, or a parameter) is the finding's layer."""
    module = event.module or ""
    if event.path and row == (f"{module}.{event.path}" if module else event.path):
        return True
    return row == module or row.startswith(module + "/")
