"""Tabular loggers and torch.compile with the monitor on a ResNet."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from realmodels.models import (
    QUIET,
    ImageClassifier,
    StepCapture,
    image_loader,
    resnet_basic,
    stats_of,
)

from lightning_recorder import FeatureStatsMonitor

STATS = ("mean", "std", "min", "max", "abs_mean", "zero_fraction", "nonfinite")


def csv_rows(log_dir: str) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    with open(Path(log_dir) / "metrics.csv") as f:
        for row in csv.DictReader(f):
            values = {k: float(v) for k, v in row.items() if v not in ("", None) and k != "step"}
            rows.setdefault(int(row["step"]), {}).update(values)
    return rows


def fit_csv(tmp_path: Path, monitor: FeatureStatsMonitor) -> tuple[CSVLogger, StepCapture, list]:
    names = ["net.conv1", "net.fc"]
    reference = StepCapture(names)
    logger = CSVLogger(tmp_path, name="csv")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        pl.Trainer(
            **QUIET, logger=logger, max_steps=2, log_every_n_steps=2, callbacks=[monitor, reference]
        ).fit(ImageClassifier(resnet_basic()), image_loader(n=8))
    return logger, reference, caught


# ------------------------------------------------------------------ 9. tabular loggers
def test_csv_logger_gets_correct_scalars_and_one_message(tmp_path: Path) -> None:
    monitor = FeatureStatsMonitor(["net.conv1", "net.fc"])
    logger, reference, caught = fit_csv(tmp_path, monitor)
    messages = [str(w.message) for w in caught if "histograms" in str(w.message)]
    assert len(messages) == 1 and "CSVLogger" in messages[0]
    row = csv_rows(logger.log_dir)[1]
    for name in ("net.conv1", "net.fc"):
        expected = stats_of(reference.outputs[1][name])
        for stat in STATS:
            # CSV holds Python's repr of the float: only the monitor's float32 summation
            # (documented within about 1e-6 relative) separates it from the direct value
            torch.testing.assert_close(
                torch.tensor(row[monitor.tag("train", name, stat)], dtype=torch.float64),
                torch.tensor(expected[stat], dtype=torch.float64),
                rtol=1e-5,
                atol=1e-6,
            )


def test_csv_logger_message_grammar(tmp_path: Path) -> None:
    _, _, caught = fit_csv(tmp_path, FeatureStatsMonitor(["net.fc"]))
    messages = [str(w.message) for w in caught if "histograms" in str(w.message)]
    assert any("CSVLogger gets the scalar statistics" in m for m in messages), messages


def test_per_logger_stats_keep_csv_readable(tmp_path: Path) -> None:
    # `logger_stats={logger class name: stats}`; other loggers get `stats`
    monitor = FeatureStatsMonitor(
        ["net.conv1", "net.fc"], logger_stats={"CSVLogger": ["mean", "std"]}
    )
    logger, _, _ = fit_csv(tmp_path, monitor)
    columns = {
        k for row in csv_rows(logger.log_dir).values() for k in row if k.startswith("stats/")
    }
    assert {c.rsplit("/", 1)[1] for c in columns} == {"mean", "std"}


# ------------------------------------------------------------------ 10. torch.compile
def compiled_run(root: Path, monitored: bool) -> tuple[int, dict[int, float]]:
    """Fit 2 steps (the second logged) with ``net`` compiled (eager backend: dynamo only)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = ImageClassifier(resnet_basic())
    model.net.compile(backend="eager")
    reference = StepCapture([])
    callbacks: list[pl.Callback] = [reference]
    if monitored:
        callbacks.insert(0, FeatureStatsMonitor(["net.layer1", "net.fc"], clone=True))
    pl.Trainer(
        **QUIET,
        logger=TensorBoardLogger(root, name=f"compiled_{monitored}"),
        max_steps=2,
        log_every_n_steps=2,
        callbacks=callbacks,
    ).fit(model, image_loader(n=8))
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return graphs, reference.losses


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, tuple[int, dict[int, float]]]:
    root = tmp_path_factory.mktemp("compiled")
    return {flag: compiled_run(root, flag) for flag in (False, True)}


def test_compiled_monitored_loss_equals_unmonitored(compiled: dict) -> None:
    (plain_graphs, plain), (_, monitored) = compiled[False], compiled[True]
    assert plain_graphs == 1 and len(plain) == 2
    # Identical graphs on identical data: the losses agree to float32 rounding of one kernel
    # choice; the monitor's hooks only read (clone=True) and must not change the math.
    torch.testing.assert_close(
        torch.tensor(list(monitored.values())),
        torch.tensor(list(plain.values())),
        rtol=1e-6,
        atol=1e-7,
    )


def test_compiled_monitored_network_compiles_once(compiled: dict) -> None:
    graphs, _ = compiled[True]
    assert graphs == 1
