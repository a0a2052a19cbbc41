"""The health view, read back from what the loggers wrote: TensorBoard's custom-scalars layout,
the layer-by-step heat maps and the findings table; W&B's image and table; nothing with
``view=False``.

The run: an MLP whose second hidden layer starts with biases of -10, so its ReLU (``body.3``)
is dead from the start and :class:`DeadUnitsRule` fires at step 4 (its window: five logged
steps); every step is logged; the view is redrawn every 3 logged steps over the last 4.
"""

from __future__ import annotations

import io
import json
import math
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers.models import QUIET
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_recorder import DeadUnitsRule, FeatureStatsMonitor, HealthMonitor
from lightning_recorder import TensorBoardLogger as RecorderTensorBoardLogger

LAYERS = ["body.0", "body.1", "body.2", "body.3", "body.4"]  # model order
WEIGHTS = ["body.0.weight", "body.2.weight", "body.4.weight"]
PARAMETERS = ["body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"]
PARAMETERS += ["body.4.weight", "body.4.bias"]
DRAWN = [0, 2, 4, 5]  # the first logged step, every 3rd, the step the rule fired (4)
COLUMNS = [1, 3, 4, 4]  # the logged steps shown at each drawing, at most heatmap_steps=4
TOP, CELL_H, CELL_W = 34, 14, 12  # the heat map's title band and cell size (12 up to 50 steps)
PURPLE, YELLOW = (68, 1, 84), (253, 231, 37)  # the colour map's ends


class DeadNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(
            nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
        )
        nn.init.constant_(self.body[2].bias, -10.0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.body(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def run(
    loggers: list[Logger],
    view: bool = True,
    steps: int = 6,
    logger_stats: dict[str, list[str]] | None = None,
    logged: Sequence[str] | None = None,
) -> tuple[Any, HealthMonitor]:
    # the ReLUs are monitored first: the monitor's own order (by source) is not the model's
    chosen = {} if logged is None else {"stats": logged}
    stats = FeatureStatsMonitor(
        [nn.ReLU, nn.Linear],
        every_n_steps=1,
        histograms=False,
        logger_stats=logger_stats,
        **chosen,
    )
    monitor = HealthMonitor(
        rules=[DeadUnitsRule()], view=view, view_every=3, heatmap_steps=4, evidence_max_bytes=0
    )
    trainer = pl.Trainer(
        **QUIET, max_steps=steps, logger=loggers, callbacks=[stats, monitor], log_every_n_steps=1
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16 * steps, 16, generator=g)
    trainer.fit(DeadNet(), DataLoader(TensorDataset(x, x[:, :4].argmax(1)), batch_size=16))
    assert [(e.kind, e.module, e.step) for e in monitor.events] == [("dead_units", "body.3", 4)]
    return stats, monitor


def accumulator(path: Path) -> EventAccumulator:
    acc = EventAccumulator(str(path), size_guidance={"tensors": 0, "images": 0, "scalars": 0})
    acc.Reload()
    return acc


def pixels(encoded: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(encoded)).convert("RGB")).astype(int)


def colourful(rgb: np.ndarray) -> np.ndarray:
    """The colour map's pixels (text is grey or red, the page white)."""
    return (rgb.max(-1) - rgb.min(-1) > 40) & ~((rgb[..., 0] > 150) & (rgb[..., 1] < 60))


def grid(image: np.ndarray) -> tuple[int, int, int, int]:
    """``(x0, width, rows, cols)`` of the heat map's cells (first row: a layer with no note)."""
    xs = np.flatnonzero(colourful(image[TOP + CELL_H // 2]))
    x0 = int(xs[0])
    width = int(np.argmin(colourful(image[TOP + CELL_H // 2, x0:])))
    column = colourful(image[TOP - 4 :, x0 + CELL_W // 2])
    assert not column[:4].any()  # white between the colour bar and the cells
    height = int(np.argmin(column[4:]))
    assert height % CELL_H == 0 and width % CELL_W == 0, (height, width)
    return x0, width, height // CELL_H, width // CELL_W


def cell(image: np.ndarray, x0: int, row: int, col: int) -> np.ndarray:
    return image[TOP + row * CELL_H + CELL_H // 2, x0 + col * CELL_W + CELL_W // 2]


def red_beside(image: np.ndarray, x0: int, width: int, row: int) -> bool:
    band = image[TOP + row * CELL_H : TOP + (row + 1) * CELL_H, x0 + width + 2 :]
    return bool(((band[..., 0] > 150) & (band[..., 1] < 60) & (band[..., 2] < 60)).any())


@pytest.mark.parametrize(
    ("prefix", "public"),
    [("", False), ("fit", False), ("fit", True)],
    ids=["none", "private", "public"],
)
def test_tensorboard_gets_the_layout_the_heat_maps_and_the_findings(
    prefix: str, public: bool, tmp_path: Path
) -> None:
    # the package's logger makes its prefix public; Lightning's keeps it to itself, and applies
    # it only to what goes through `log_metrics` (the health counters)
    kind = RecorderTensorBoardLogger if public else TensorBoardLogger
    logger = kind(tmp_path, name="run", version=0, prefix=prefix)
    stats, monitor = run([logger])
    lead = f"{prefix}-" if public else ""
    counters_lead = f"{prefix}-" if prefix else ""
    acc = accumulator(tmp_path / "run" / "version_0")
    scalars = acc.Tags()["scalars"]

    # one chart per statistic, whose regular expression matches the tag of every layer
    [config] = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout()
    layout.ParseFromString(config.tensor_proto.string_val[0])
    charts = {
        c.title: {ch.title: list(ch.multiline.tag) for ch in c.chart} for c in layout.category
    }
    # no `layers: val`: the fit does not validate (DeadNet has no validation_step)
    assert list(charts) == ["layers: train", "parameters: train", "health"]
    assert list(charts["layers: train"]) == [f"{s} of every layer (train)" for s in stats.stats]

    def matched(chart: list[str]) -> set[str]:
        return {tag for tag in scalars if any(re.search(regex, tag) for regex in chart)}

    for stat in stats.stats:
        chart = charts["layers: train"][f"{stat} of every layer (train)"]
        assert matched(chart) == {f"{lead}stats/train/{m}/{stat}" for m in LAYERS}, stat
    for stat in ("grad_norm", "update_ratio", "norm"):
        chart = charts["parameters: train"][f"{stat} of every parameter"]
        assert matched(chart) == {f"{lead}stats/train/{p}/{stat}" for p in PARAMETERS}, stat
    [health] = charts["health"].values()
    assert f"{counters_lead}health/rule_events" in matched(health)
    assert f"{counters_lead}health/rule_events" in scalars

    # the heat maps: rows the layers in model order, columns the logged steps shown
    for stat, rows in (("zero_fraction", LAYERS), ("std", LAYERS), ("grad_norm", WEIGHTS)):
        images = acc.Images(f"{lead}health/heatmap/{stat}")
        assert [i.step for i in images] == DRAWN, stat
        for event, columns in zip(images, COLUMNS, strict=True):
            image = pixels(event.encoded_image_string)
            assert image.shape[:2] == (event.height, event.width)
            assert event.height == TOP + CELL_H * len(rows) + 16
            x0, width, n_rows, n_cols = grid(image)
            assert (n_rows, n_cols) == (len(rows), columns), (stat, event.step)
            if stat == "zero_fraction":  # the Linear outputs: never 0; the dead ReLU: always
                for col in range(columns):
                    for row in (0, 2, 4):
                        assert np.abs(cell(image, x0, row, col) - PURPLE).max() <= 3
                    assert np.abs(cell(image, x0, 3, col) - YELLOW).max() <= 3
                    assert np.abs(cell(image, x0, 1, col) - YELLOW).max() > 20  # alive
                # the finding is written beside its layer once it fired, and only there
                fired = event.step >= 4
                assert red_beside(image, x0, width, 3) is fired
                assert not any(red_beside(image, x0, width, r) for r in (0, 1, 2, 4))

    # the findings table: none, then the rule and the module
    texts = acc.Tensors(f"{lead}health/findings/text_summary")
    assert [t.step for t in texts] == DRAWN
    tables = [t.tensor_proto.string_val[0].decode() for t in texts]
    assert tables[0] == "No rule finding in force at step 0 (rules: dead_units)."
    assert tables[2].startswith("**1 finding(s) in force at step 4**")
    assert "| rule | module | since step | finding |" in tables[3]
    assert f"| dead_units | `body.3` | 4 | {monitor.events[0].message} |" in tables[3]
    # the finding's message, under the same public prefix as the table
    events = acc.Tensors(f"{lead}health/events/text_summary")
    assert [t.step for t in events] == [4]
    assert events[0].tensor_proto.string_val[0].decode() == monitor.events[0].message


def test_the_layout_charts_only_the_statistics_the_logger_gets(tmp_path: Path) -> None:
    # `logger_stats` narrows what a TensorBoardLogger gets: no chart for what it never receives
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    run([logger], logger_stats={"TensorBoardLogger": ["zero_fraction", "grad_norm"]})
    acc = accumulator(tmp_path / "run" / "version_0")
    [config] = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout()
    layout.ParseFromString(config.tensor_proto.string_val[0])
    charts = {c.title: [ch.title for ch in c.chart] for c in layout.category}
    assert charts == {
        "layers: train": ["zero_fraction of every layer (train)"],
        "parameters: train": ["grad_norm of every parameter"],
        "health": ["rule findings and non-finite steps"],
    }
    scalars = acc.Tags()["scalars"]
    for category in layout.category:
        for chart in category.chart:
            [regex] = chart.multiline.tag  # every chart has its lines
            assert any(re.search(regex, tag) for tag in scalars), chart.title


class ValidatedNet(DeadNet):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.body(batch[0])


def charts_of(path: Path) -> dict[str, list[str]]:
    """The layout's charts by category, read back by TensorBoard's own reader; each chart of
    the monitor's statistics must match a scalar of the run (no empty chart). The `health`
    counters are logged once something happens: their chart may wait for it."""
    acc = accumulator(path)
    [config] = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout()
    layout.ParseFromString(config.tensor_proto.string_val[0])
    scalars = acc.Tags()["scalars"]
    for category in [c for c in layout.category if c.title != "health"]:
        for chart in category.chart:
            [regex] = chart.multiline.tag
            assert any(re.search(regex, tag) for tag in scalars), (category.title, chart.title)
    return {c.title: [ch.title for ch in c.chart] for c in layout.category}


@pytest.mark.parametrize("health_first", [False, True], ids=["monitor-first", "health-first"])
def test_the_layout_charts_only_what_the_monitor_logs(tmp_path: Path, health_first: bool) -> None:
    """No empty chart: no `parameters: train` for a monitor of modules without parameters
    (ReLUs), whichever callback comes first; `layers: val` only in a fit that validates (a
    validation_step, a val dataloader, limit_val_batches > 0)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    data = DataLoader(TensorDataset(x, x[:, :4].argmax(1)), batch_size=16)
    val = DataLoader(TensorDataset(x[:16], x[:16, :4].argmax(1)), batch_size=16)
    cases: list[tuple[str, Any, dict[str, Any], list[str]]] = [
        ("relu", DeadNet(), {}, ["layers: train", "health"]),
        (
            "relu-val",
            ValidatedNet(),
            {"val_dataloaders": val},
            ["layers: train", "layers: val", "health"],
        ),
        ("relu-no-val", ValidatedNet(), {"val_dataloaders": val}, ["layers: train", "health"]),
    ]
    for name, model, loaders, expected in cases:
        stats = FeatureStatsMonitor(nn.ReLU, every_n_steps=1, histograms=False, stats=["mean"])
        health = HealthMonitor(rules=[DeadUnitsRule()], evidence_max_bytes=0)
        logger = TensorBoardLogger(tmp_path, name=name, version=0)
        limit = {"limit_val_batches": 0} if name == "relu-no-val" else {}
        trainer = pl.Trainer(
            **QUIET,
            max_steps=4,
            logger=logger,
            log_every_n_steps=1,
            callbacks=[health, stats] if health_first else [stats, health],
            **limit,
        )
        trainer.fit(model, data, **loaders)
        charts = charts_of(tmp_path / name / "version_0")
        assert list(charts) == expected, name
    # a monitor of the Linear layers logs their parameters: the charts are there
    stats = FeatureStatsMonitor(nn.Linear, every_n_steps=1, histograms=False, stats=["mean"])
    health = HealthMonitor(rules=[DeadUnitsRule()], evidence_max_bytes=0)
    logger = TensorBoardLogger(tmp_path, name="linear", version=0)
    pl.Trainer(
        **QUIET,
        max_steps=4,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[health, stats] if health_first else [stats, health],
    ).fit(DeadNet(), data)
    charts = charts_of(tmp_path / "linear" / "version_0")
    assert list(charts) == ["layers: train", "parameters: train", "health"]


def test_a_statistic_the_monitor_does_not_log_draws_no_heat_map(tmp_path: Path) -> None:
    """The docs promise it: with the monitor's `stats` narrowed to leave `std` out, the default
    heat maps (zero_fraction, std, grad_norm) are drawn but for `std`."""
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    run([logger], logged=["mean", "zero_fraction"])
    images = accumulator(tmp_path / "run" / "version_0").Tags()["images"]
    assert sorted(images) == ["health/heatmap/grad_norm", "health/heatmap/zero_fraction"]


def test_the_last_drawing_comes_at_the_end_of_training(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    run([logger], steps=8)  # drawn at 0, 2, 4 and 5 (as above), and at the end: 7
    acc = accumulator(tmp_path / "run" / "version_0")
    assert [i.step for i in acc.Images("health/heatmap/std")] == [*DRAWN, 7]
    assert [t.step for t in acc.Tensors("health/findings/text_summary")] == [*DRAWN, 7]


def test_view_false_draws_nothing_and_the_rules_still_report(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    run([logger], view=False)
    acc = accumulator(tmp_path / "run" / "version_0")
    assert acc.Tags()["images"] == []
    assert "custom_scalars__config__" not in acc.Tags()["tensors"]
    assert "health/findings/text_summary" not in acc.Tags()["tensors"]
    assert [t.step for t in acc.Tensors("health/events/text_summary")] == [4]


@pytest.mark.parametrize("view", [True, False])
def test_a_view_no_logger_can_show_is_warned_about_once(tmp_path: Path, view: bool) -> None:
    """Only a CSVLogger (Lightning's default without tensorboard): the view would be drawn for
    nobody, which one warning says, naming ``view=False``; with it, or a TensorBoardLogger
    beside, nothing is said."""
    from lightning.pytorch.loggers import CSVLogger

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run([CSVLogger(tmp_path / "csv")], view=view)
    said = [str(w.message) for w in seen if "health view" in str(w.message)]
    assert len(said) == view
    assert all("CSVLogger gets the scalars only" in m and "view=False" in m for m in said)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run([CSVLogger(tmp_path / "csv"), TensorBoardLogger(tmp_path, name="run", version=0)])
    assert not [w for w in seen if "health view" in str(w.message)]


def test_wandb_gets_the_heat_maps_and_the_findings_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = pytest.importorskip("wandb")
    from helpers.wandb_records import wait_for_history
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="lr-test")
    try:
        run([logger])
    finally:
        wandb.finish()
    # W&B's service process may write the last records after `finish` returns: wait for them
    rows = wait_for_history(
        tmp_path, lambda rows: len([r for r in rows if "health/findings/_type" in r]) >= len(DRAWN)
    )
    for stat, n_rows in (("zero_fraction", 5), ("std", 5), ("grad_norm", 3)):
        key = f"health/heatmap/{stat}"
        images = [r for r in rows if f"{key}/_type" in r]
        assert len(images) == len(DRAWN), stat
        assert all(r[f"{key}/_type"] == "images/separated" for r in images)
        assert all(r[f"{key}/height"] == TOP + CELL_H * n_rows + 16 for r in images)
    tables = [r for r in rows if "health/findings/_type" in r]
    assert len(tables) == len(DRAWN)
    assert all(r["health/findings/_type"] == "table-file" for r in tables)
    assert [r["health/findings/nrows"] for r in tables] == [0, 0, 1, 1]
    (files,) = tmp_path.glob("wandb/offline-run-*/files")
    last = json.loads((files / tables[-1]["health/findings/path"]).read_text())
    assert last["columns"] == ["rule", "module", "since step", "finding"]
    [[rule, module, since, message]] = last["data"]
    assert (rule, module, since) == ("dead_units", "body.3", 4)
    assert message.startswith("`body.3` (ReLU) has 32 of 32 units dead (100 %)")


def test_wandb_without_pillow_gets_the_findings_table_and_one_warning_at_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """W&B makes its images with Pillow, which W&B does not install: every drawing failed on
    the first heat map, mid-training, and took the findings table down with it. Now one warning
    when the run starts names Pillow and the table is written at every drawing."""
    wandb = pytest.importorskip("wandb")
    from helpers.wandb_records import wait_for_history
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="lr-test")
    for name in ("PIL", "PIL.Image", "PIL.ImageDraw", "PIL.ImageFont"):
        monkeypatch.setitem(sys.modules, name, None)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run([logger])
    finally:
        wandb.finish()
    said = [str(w.message) for w in caught if "Pillow" in str(w.message)]
    assert len(said) == 1 and "`pip install pillow`" in said[0], said
    assert said[0].startswith("Expected Pillow to be installed for HealthMonitor's heat maps")
    assert not [w for w in caught if "could not write" in str(w.message)]
    rows = wait_for_history(
        tmp_path, lambda rows: len([r for r in rows if "health/findings/_type" in r]) >= len(DRAWN)
    )
    tables = [r for r in rows if "health/findings/_type" in r]
    assert [r["health/findings/nrows"] for r in tables] == [0, 0, 1, 1]
    assert not [key for r in rows for key in r if key.startswith("health/heatmap/")]


def test_tensorboard_without_pillow_gets_the_findings_table_and_one_warning_at_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The heat maps are encoded with Pillow, which TensorBoard 2.11 and 2.12 do not install:
    every drawing failed ("could not write the health view"), mid-training. Now one warning when
    the run starts names Pillow and the extra, and the findings table is written at every
    drawing, no image."""
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    for name in ("PIL", "PIL.Image", "PIL.ImageDraw", "PIL.ImageFont"):
        monkeypatch.setitem(sys.modules, name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run([logger])
    said = [str(w.message) for w in caught if "Pillow" in str(w.message)]
    assert len(said) == 1, said
    assert said[0].startswith("Expected Pillow to be installed for HealthMonitor's heat maps in ")
    assert "TensorBoard" in said[0] and "`pip install pillow`" in said[0]
    assert not [w for w in caught if "could not write" in str(w.message)]
    acc = accumulator(tmp_path / "run" / "version_0")
    assert acc.Tags()["images"] == []
    texts = acc.Tensors("health/findings/text_summary")
    assert [t.step for t in texts] == DRAWN


@pytest.mark.parametrize("stat", ["max", "grad_norm", "zero_fraction"])
def test_an_infinite_value_is_drawn_at_its_end_of_the_scale_and_nan_as_missing(stat: str) -> None:
    from lightning_recorder.callbacks._health_heatmap import (
        _LEVELS,
        _MISSING,
        _indices,
        _normalised,
        scale_of,
    )

    values = np.array([[0.25, 0.5, math.inf, -math.inf, math.nan]])
    cells = _indices(_normalised(values, scale_of(stat))[0])[0]
    assert list(cells[2:]) == [_LEVELS - 1, 0, _MISSING]  # top, bottom, grey


def test_a_narrow_map_is_wide_enough_for_its_whole_title() -> None:
    from lightning_recorder.callbacks._health_heatmap import _font, _glyphs, render_indexed

    if _font() is None:
        pytest.fail("the heat maps' font is missing: Pillow's default font should be there")
    for stat in ("zero_fraction", "grad_norm", "mean"):
        image = render_indexed(np.ones((1, 1)), stat, ["a"], [0])
        kind = {"zero_fraction": "0 to 1", "grad_norm": "log scale", "mean": "linear scale"}[stat]
        text = f"{stat}: rows are layers in model order, columns logged steps ({kind})"
        assert image.shape[1] >= 4 + _glyphs(text, 10_000).shape[1], stat


@pytest.mark.parametrize("columns", [2, 4, 8, 20])
def test_the_first_and_last_step_are_written_under_the_map_however_few_its_columns(
    columns: int,
) -> None:
    from lightning_recorder.callbacks._health_heatmap import render_indexed

    def steps_band(steps: list[int]) -> np.ndarray:
        image = render_indexed(np.ones((1, len(steps))), "std", ["a"], steps)
        return image[-16:]  # under the cells: the steps (no footer)

    steps = list(range(10, 10 + columns))
    band = steps_band(steps)
    # another first step, another last step: other text under the map
    assert not np.array_equal(band, steps_band([11, *steps[1:]]))
    assert not np.array_equal(band, steps_band([*steps[:-1], 99]))


def _scale_band(image: np.ndarray, rows: Sequence[str]) -> np.ndarray:
    """The text beside the colour bar (rows 17 to 31, right of the bar), as palette indices."""
    from lightning_recorder.callbacks._health_heatmap import _MAX_LABEL, _text_width

    label_w = min(_MAX_LABEL, max(_text_width(r) for r in rows)) + 8
    return image[17 : 17 + CELL_H, label_w + 126 :]


def _written(text: str, width: int) -> np.ndarray:
    """``text`` as the heat map writes it, on white, ``width`` pixels wide."""
    from lightning_recorder.callbacks._health_heatmap import _TEXT_BASE, _WHITE, _glyphs

    levels = _glyphs(text, 10_000)
    band = np.full((CELL_H, width), _WHITE, dtype=np.uint8)
    band[:, : levels.shape[1]] = np.where(levels > 0, levels + (_TEXT_BASE - 1), _WHITE)
    return band


@pytest.mark.parametrize("stat", ["std", "mean", "zero_fraction"])
def test_a_map_whose_cells_are_all_missing_says_it_has_no_values(stat: str) -> None:
    """Every cell grey (no value, or NaN): the scale's text says there is none, where it read
    ``0 … 0`` (``0 … 1`` on the fixed scale); a map with one value keeps its scale's ends."""
    from lightning_recorder.callbacks._health_heatmap import _font, render_indexed

    if _font() is None:
        pytest.fail("the heat maps' font is missing: Pillow's default font should be there")
    rows = ["layer.0", "layer.1"]
    band = _scale_band(render_indexed(np.full((2, 3), np.nan), stat, rows, [1, 2, 3]), rows)
    assert np.array_equal(band, _written("no values in this map", band.shape[1]))
    one = np.full((2, 3), np.nan)
    one[1, 2] = 0.5
    band = _scale_band(render_indexed(one, stat, rows, [1, 2, 3]), rows)
    ends = "0 … 1" if stat == "zero_fraction" else "0.5 … 0.5"
    assert np.array_equal(band, _written(ends, band.shape[1]))
