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
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_warn

from .._core.checks import installed
from ._health_event import HealthEvent
from ._health_heatmap import PALETTE, png, render_indexed
from ._health_rules import percent
from ._lightning import prefixed_tag
from ._stats_options import ALL, stats_for
from ._stats_report import StatsReport
from ._tensorboard import histogram_loggers, summary_class

__all__ = ["PARAMETER_STATS", "HealthView", "layout", "table"]

PARAMETER_STATS = ("grad_norm", "update_ratio", "norm")
_COLUMNS = ["rule", "module", "since step", "finding"]


def layout(
    prefix: str,
    stats: Sequence[str],
    stages: Sequence[str],
    parameters: bool,
    lead: str = "",
    allowed: frozenset[str] = ALL,
) -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars layout: ``{category: {chart title: ["Multiline", [regex]]}}``.

    ``lead`` is the logger's public prefix with its join character, before every tag the
    callbacks write themselves (:func:`._lightning.logger_prefix`). Without one, the health
    counters' chart takes any leading ``<prefix>-``: they reach the logger through
    ``log_metrics``, which adds a prefix Lightning's loggers keep private.

    ``allowed`` is what the logger gets of the monitor's statistics (its ``logger_stats``
    entry): a chart per statistic it gets, none for the others, which it never receives.
    """
    head = re.escape(lead)
    stats = [stat for stat in stats if stat in allowed]
    parameter_stats = [stat for stat in PARAMETER_STATS if parameters and stat in allowed]
    found: dict[str, dict[str, list[Any]]] = {}
    for stage in stages:
        if stage not in ("train", "val", "test"):
            continue
        suffix = r"(/dataloader_idx_\d+)?" if stage != "train" else ""
        where = rf"^{head}{re.escape(prefix)}/{stage}/.+/"
        if stats:
            found[f"layers: {stage}"] = {
                f"{stat} of every layer ({stage})": ["Multiline", [f"{where}{stat}{suffix}$"]]
                for stat in stats
            }
        if stage == "train" and parameter_stats:
            found["parameters: train"] = {
                f"{stat} of every parameter": ["Multiline", [f"{where}{stat}$"]]
                for stat in parameter_stats
            }
    # the counters go through `log_metrics`, where a logger adds even a prefix it keeps private
    counters = "health/(rule_events|nonfinite_steps|skipped_steps|amp_skipped_steps)$"
    found["health"] = {
        "rule findings and non-finite steps": [
            "Multiline",
            [rf"^{head}{counters}" if lead else rf"^([^/]*-)?{counters}"],
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
        self._unshown_warned = False
        self._pillow_warned = False
        self.start()

    def start(self, logged: Sequence[str] | None = None) -> None:
        """Start a run whose monitor logs the statistics ``logged`` (``None``: every one); a
        statistic it does not log draws no heat map."""
        self._logged = None if logged is None else frozenset(logged)
        self._steps: deque[int] = deque(maxlen=self.steps)
        self._columns: deque[dict[str, tuple[tuple[str, ...], np.ndarray]]] = deque(
            maxlen=self.steps
        )
        self._seen = 0
        self._warned = False

    def warn_unshown(self, trainer: pl.Trainer) -> None:
        """Warn once (rank zero) when the Trainer has loggers and none of them can show the
        view (TensorBoard and W&B can): it would be drawn for nobody."""
        able, others = histogram_loggers(trainer.loggers)
        if able or not others or self._unshown_warned:
            return
        self._unshown_warned = True
        names = [type(lg).__name__ for lg in others]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        rank_zero_warn(
            f"HealthMonitor draws its health view (custom scalars, heat maps, findings table) "
            f"for TensorBoard and W&B loggers only, and the Trainer has none: {listed} "
            f"{'gets' if len(names) == 1 else 'get'} the scalars only. To silence "
            "this warning, pass view=False, or add a TensorBoardLogger to see the view."
        )

    def warn_no_pillow(self, trainer: pl.Trainer) -> None:
        """Warn once (rank zero), when the run starts, that the TensorBoard and W&B loggers get
        no heat map: their images are encoded with Pillow, which is not installed (the findings
        table and the messages still go)."""
        kinds = [
            name
            for kind, name in ((TensorBoardLogger, "TensorBoard"), (WandbLogger, "W&B"))
            if any(isinstance(lg, kind) for lg in trainer.loggers)
        ]
        if not kinds or _has_pillow() or self._pillow_warned:
            return
        self._pillow_warned = True
        rank_zero_warn(
            f"Expected Pillow to be installed for HealthMonitor's heat maps in "
            f"{' and '.join(kinds)} but it is not: the images are encoded with Pillow, so the "
            "loggers get the findings table and no heat map. To see them, `pip install pillow` "
            "(the package's `tensorboard` extra installs it); to silence this warning, pass "
            "view=False."
        )

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
        logger_stats: Mapping[str, frozenset[str]],
    ) -> None:
        """Write the custom-scalars layout to the TensorBoard loggers (rank zero), each with
        the charts of the statistics it gets (``logger_stats``, as the monitor validated it)."""
        if not trainer.is_global_zero:
            return

        def write(logger: Any) -> None:
            if not isinstance(logger, TensorBoardLogger):
                return
            add = getattr(logger.experiment, "add_custom_scalars", None)
            if add is not None:
                lead = prefixed_tag(logger, "")
                allowed = stats_for(logger_stats, logger)
                add(layout(prefix, stats, stages, parameters, lead, allowed))

        self._each(trainer, "custom-scalars layout", write)

    def add(self, report: StatsReport, weights: set[str]) -> None:
        """Keep the chosen statistics of a training report as one column."""
        column: dict[str, tuple[tuple[str, ...], np.ndarray]] = {}
        last = self._columns[-1] if self._columns else {}
        for stat in self.stats:
            if stat in PARAMETER_STATS:
                rows = tuple(n for n, f in report.parameters.items() if n in weights and stat in f)
                values = np.array([report.parameters[n][stat] for n in rows], dtype=np.float64)
            elif stat in report.stats and (self._logged is None or stat in self._logged):
                rows = report.modules
                values = np.array(report.stats[stat], dtype=np.float64)
            else:
                continue
            before = last.get(stat)
            if before is not None and before[0] == rows:
                rows = before[0]  # the same rows as before: one object, found by identity
            column[stat] = rows, values
        self._steps.append(report.step)
        self._columns.append(column)
        self._seen += 1

    def due(self, fired: bool) -> bool:
        """Whether to draw now: the first logged step, every ``every``, or a rule fired."""
        return bool(self._columns) and (fired or self._seen == 1 or self._seen % self.every == 0)

    def _matrix(self, stat: str) -> tuple[dict[str, int], np.ndarray]:
        """The rows (name: index) and values (rows x kept steps) of ``stat``."""
        kept = [column.get(stat) for column in self._columns]
        first = next((c for c in kept if c is not None), None)
        if first is not None and all(c is not None and c[0] is first[0] for c in kept):
            # the usual case: the same rows at every step
            rows = {name: i for i, name in enumerate(first[0])}
            return rows, np.stack([c[1] for c in kept if c is not None], axis=1)
        rows = {}
        for c in kept:
            for name in c[0] if c is not None else ():
                rows.setdefault(name, len(rows))
        values = np.full((len(rows), len(kept)), np.nan)
        for j, c in enumerate(kept):
            if c is not None:
                values[[rows[n] for n in c[0]], j] = c[1]
        return rows, values

    def indexed(self, findings: Sequence[HealthEvent]) -> dict[str, np.ndarray]:
        """The heat maps as ``{tag: (H, W) uint8}`` indices into
        :data:`._health_heatmap.PALETTE`."""
        images = {}
        loose = [e for e in findings if e.module is None]
        footer = "; ".join(f"{e.kind} (step {e.step})" for e in loose)
        for stat in self.stats:
            rows, values = self._matrix(stat)
            if not rows:
                continue
            notes: dict[int, list[str]] = {}
            for event in findings:
                if event.module is None:
                    continue
                for name, i in rows.items():
                    if _belongs(name, event):
                        notes.setdefault(i, []).append(_short(event))
            text = {i: "; ".join(parts) for i, parts in notes.items()}
            images[f"health/heatmap/{stat}"] = render_indexed(
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
        indexed = self.indexed(findings)
        text = table(findings, step, rules)

        def write(logger: Any) -> None:
            if isinstance(logger, TensorBoardLogger):
                writer = logger.experiment
                writer.add_text(prefixed_tag(logger, "health/findings"), text, step)
                if _has_pillow():  # the images are encoded with it (warned when the run started)
                    images = {prefixed_tag(logger, t): i for t, i in indexed.items()}
                    _add_images(writer, images, step)
            elif isinstance(logger, WandbLogger):
                rows = [[e.kind, e.module or "", e.step, e.message] for e in findings]
                logger.log_table(key="health/findings", columns=_COLUMNS, data=rows, step=step)
                if not _has_pillow():  # W&B's images need it (warned when the run started)
                    return
                for tag, image in indexed.items():
                    logger.log_image(key=tag, images=[PALETTE[image]], step=step)

        self._each(trainer, "health view", write)


def _has_pillow() -> bool:
    """Whether Pillow can be imported (the heat maps are encoded with it)."""
    return installed("PIL")


def _add_images(writer: Any, images: dict[str, np.ndarray], step: int) -> None:
    """Write heat maps (palette indices) to a ``SummaryWriter``: as one event of palette PNGs
    through its public ``file_writer`` (TensorBoard's ``Summary`` message, as
    :func:`._tensorboard.write_tensorboard` does), or through ``add_image`` for writers of
    other makes (which encode an RGB copy themselves, several times slower)."""
    summary_type = summary_class(writer)
    file_writer = None if summary_type is None else getattr(writer, "file_writer", None)
    if file_writer is None:
        for tag, image in images.items():
            writer.add_image(tag, PALETTE[image], step, dataformats="HWC")
        return
    values = []
    for tag, image in images.items():
        encoded = summary_type.Image(
            height=image.shape[0],
            width=image.shape[1],
            colorspace=3,
            encoded_image_string=png(image),
        )
        values.append(summary_type.Value(tag=tag, image=encoded))
    file_writer.add_summary(summary_type(value=values), step)


def _belongs(row: str, event: HealthEvent) -> bool:
    """Whether a heat-map row (a series, or a parameter) is the finding's layer."""
    module = event.module or ""
    if event.path and row == (f"{module}.{event.path}" if module else event.path):
        return True
    return row == module or row.startswith(module + "/")
