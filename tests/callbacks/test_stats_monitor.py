"""FeatureStatsMonitor on a real Trainer, read back from TensorBoard event files."""

from __future__ import annotations

import csv
import doctest
import math
import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.benchmarks import load_benchmark
from helpers.device_checks import deterministic_algorithms
from helpers.docs import DOCS, python_blocks, run_page
from helpers.models import (
    QUIET,
    ProbeNet,
    assert_counts_up_to_edges,
    events,
    features,
    loader,
    reference_stats,
    scalars,
)
from lightning.pytorch.callbacks import BaseFinetuning, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.tensorboard import SummaryWriter

import lightning_recorder.callbacks.stats_monitor as monitor_module
from lightning_recorder import FeatureStatsMonitor, RecorderCallback
from lightning_recorder import TensorBoardLogger as RecorderTensorBoardLogger
from lightning_recorder._core.hooks import live_hooks
from lightning_recorder.errors import RecorderConfigError, RecordModifiedError, UnknownSourceError
from lightning_recorder.stats._state import WIDTH

STATS = ("mean", "std", "min", "max", "abs_mean", "zero_fraction", "nonfinite")
MODULES = ("probe", "body.0", "body.1", "body.2")
PARAMS = ("body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias")


def approx(value: float) -> Any:
    return pytest.approx(value, rel=2e-6, abs=1e-6)  # TensorBoard stores float32


class Reference(pl.Callback):
    """Plain torch hooks: every module output and parameter change of every training step."""

    def __init__(self, modules: tuple[str, ...], params: tuple[str, ...]) -> None:
        self.modules, self.params = modules, params
        self.outputs: dict[int, dict[str, list[torch.Tensor]]] = {}
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.grads: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        self.hooks: dict[int, int] = {}  # forward hooks on `probe` during each training step
        self._handles: list[Any] = []
        self._step = 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        named = dict(pl_module.named_modules())
        for name in self.modules:
            self._handles.append(named[name].register_forward_hook(self._hook(name)))

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            if module.training:
                self.outputs.setdefault(self._step, {}).setdefault(name, []).append(
                    output.detach().clone()
                )

        return hook

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._step = trainer.fit_loop.epoch_loop._batches_that_stepped

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, opt: Any) -> None:
        named = dict(pl_module.named_parameters())
        self.before[self._step] = {n: named[n].detach().clone() for n in self.params}
        self.grads[self._step] = {
            n: named[n].grad.detach().clone() for n in self.params if named[n].grad is not None
        }

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        named = dict(pl_module.named_parameters())
        self.after[self._step] = {n: named[n].detach().clone() for n in self.params}
        self.hooks[self._step] = len(pl_module.probe._forward_hooks)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for handle in self._handles:
            handle.remove()


def train_data() -> torch.Tensor:
    x = features(24, seed=1)
    x[5, 0] = math.nan  # in batch 1, a logged step
    x[6, 1] = math.inf
    x[7, 3] = -math.inf
    x[4] = 0.0
    return x


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One fit: 2 epochs of 6 steps, statistics every 2 steps, validation on shifted data."""
    root = tmp_path_factory.mktemp("tb")
    monitor = FeatureStatsMonitor(["probe", "body.*"], every_n_steps=2, bins=8)
    reference = Reference(MODULES, PARAMS)
    logger = TensorBoardLogger(root, name="run")
    trainer = pl.Trainer(
        **QUIET,
        logger=logger,
        max_epochs=2,
        log_every_n_steps=2,
        num_sanity_val_steps=2,
        callbacks=[monitor, reference],
    )
    val = features(8, offset=100.0, seed=2)
    trainer.fit(ProbeNet(), loader(train_data()), loader(val))
    return {
        "log_dir": logger.log_dir,
        "scalars": scalars(logger.log_dir),
        "monitor": monitor,
        "reference": reference,
        "val": val,
    }


def test_tags_are_stage_module_statistic(run: dict[str, Any]) -> None:
    ours = {t for t in run["scalars"] if t.startswith("stats/")}
    expected = {f"stats/{s}/{m}/{k}" for s in ("train", "val") for m in MODULES for k in STATS}
    expected |= {
        f"stats/train/{p}/{k}" for p in PARAMS for k in ("norm", "grad_norm", "update_ratio")
    }
    assert ours == expected
    hists = set(events(run["log_dir"]).Tags()["histograms"])
    assert hists == {f"stats/{s}/{m}/histogram" for s in ("train", "val") for m in MODULES}


def test_steps_line_up_with_lightning(run: dict[str, Any]) -> None:
    got = run["scalars"]
    assert sorted(got["train_loss"]) == [1, 3, 5, 7, 9, 11]
    # Every training tag has every logged step (tags do not depend on the step or batch size).
    for tag, series in got.items():
        if tag.startswith("stats/train/"):
            assert sorted(series) == [1, 3, 5, 7, 9, 11], tag
    # Validation: at Lightning's own val steps, after each epoch; nothing from the sanity check.
    assert sorted(got["val_loss"]) == [5, 11]
    for tag, series in got.items():
        if tag.startswith("stats/val/"):
            assert sorted(series) == [5, 11], tag
    assert run["monitor"].logged_steps == 6 and run["monitor"].last_logged_step == 11


def test_hooks_only_on_logged_steps(run: dict[str, Any]) -> None:
    # The reference's own hook, plus the monitor's on the steps it logs (every 2nd).
    assert run["reference"].hooks == {k: 2 if k % 2 else 1 for k in range(12)}


def test_feature_statistics_are_right(run: dict[str, Any]) -> None:
    got, reference = run["scalars"], run["reference"]
    x = train_data()
    for step in (1, 3, 5, 7, 9, 11):
        rows = x[4 * (step % 6) : 4 * (step % 6) + 4]
        expected = reference_stats(rows)
        for stat in STATS:
            assert got[f"stats/train/probe/{stat}"][step] == approx(expected[stat]), (step, stat)
        for module in MODULES[1:]:
            (output,) = reference.outputs[step][module]
            expected = reference_stats(output)
            for stat in STATS:
                assert got[f"stats/train/{module}/{stat}"][step] == approx(expected[stat])
    assert got["stats/train/probe/nonfinite"][1] == 3
    assert got["stats/train/probe/zero_fraction"][1] == approx(4 / 16)


def test_validation_statistics_cover_the_whole_epoch_and_stay_apart(run: dict[str, Any]) -> None:
    got = run["scalars"]
    expected = reference_stats(run["val"])
    for step in (5, 11):
        for stat in STATS:
            assert got[f"stats/val/probe/{stat}"][step] == approx(expected[stat])
    # Validation inputs are near 100, training inputs near 0: no training value comes near.
    assert max(got["stats/train/probe/max"].values()) < 10


def test_parameter_norms_gradient_norms_and_update_ratios(run: dict[str, Any]) -> None:
    got, ref = run["scalars"], run["reference"]
    for step in (1, 3, 5, 7, 9, 11):
        for name in PARAMS:
            before, after = ref.before[step][name], ref.after[step][name]
            assert got[f"stats/train/{name}/norm"][step] == approx(after.norm().item())
            assert got[f"stats/train/{name}/grad_norm"][step] == approx(
                ref.grads[step][name].norm().item()
            )
            ratio = ((after - before).norm() / before.norm()).item()
            assert got[f"stats/train/{name}/update_ratio"][step] == pytest.approx(ratio, rel=1e-4)


def test_histograms(run: dict[str, Any]) -> None:
    acc = events(run["log_dir"])
    series = {e.step: e.histogram_value for e in acc.Histograms("stats/train/probe/histogram")}
    assert sorted(series) == [1, 3, 5, 7, 9, 11]
    rows = train_data()[4:8]
    finite = rows[torch.isfinite(rows)].double()
    h = series[1]
    assert h.num == finite.numel() == 13
    assert (h.min, h.max) == (approx(finite.min().item()), approx(finite.max().item()))
    assert h.sum == approx(finite.sum().item())
    assert sum(h.bucket) == 13 and len(h.bucket) == 9  # 8 bins after an empty leading bucket
    edges = torch.tensor(list(h.bucket_limit), dtype=torch.float64)
    counts = torch.tensor(list(h.bucket[1:]), dtype=torch.float64)
    assert_counts_up_to_edges(counts, rows, edges, torch.float32)
    val = {e.step: e.histogram_value for e in acc.Histograms("stats/val/probe/histogram")}
    assert sorted(val) == [5, 11]
    assert val[5].num == 16  # the first validation batch
    assert val[5].min > 90


def test_float64_model(tmp_path: Path) -> None:
    """Float64 outputs take the float64 bucketing; float64 parameters keep float64 norms."""
    logger = TensorBoardLogger(tmp_path, name="f64")
    monitor = FeatureStatsMonitor(["probe", "body.0"], every_n_steps=1, bins=4)
    reference = Reference(("probe", "body.0"), ("body.0.weight", "body.0.bias"))
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=2, callbacks=[monitor, reference])
    x = features(8, seed=5).double() * 1e3 + 1e9  # a large offset: float64 all the way
    trainer.fit(ProbeNet(lr=1e-12).double(), loader(x))
    got = scalars(logger.log_dir)
    hists = {
        e.step: e.histogram_value
        for e in events(logger.log_dir).Histograms("stats/train/probe/histogram")
    }
    for step in (0, 1):
        rows = x[4 * step : 4 * step + 4]
        assert got["stats/train/probe/std"][step] == approx(rows.std().item())
        edges = torch.linspace(rows.min().item(), rows.max().item(), 5, dtype=torch.float64)
        counts = torch.tensor(list(hists[step].bucket), dtype=torch.float64)
        assert counts[0] == 0.0
        assert_counts_up_to_edges(counts[1:], rows, edges, torch.float64)
        (output,) = reference.outputs[step]["body.0"]
        assert got["stats/train/body.0/mean"][step] == approx(output.mean().item())
        for name in ("body.0.weight", "body.0.bias"):
            before, after = reference.before[step][name], reference.after[step][name]
            assert got[f"stats/train/{name}/norm"][step] == approx(after.norm().item())
            grad = reference.grads[step][name].norm().item()
            assert got[f"stats/train/{name}/grad_norm"][step] == approx(grad)
            ratio = ((after - before).norm() / before.norm()).item()
            assert got[f"stats/train/{name}/update_ratio"][step] == approx(ratio)


class UnfreezeBody0(BaseFinetuning):
    """``body.0`` frozen in the first epoch, then added to the optimizer as a new group."""

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.body[0])

    def finetune_function(
        self, pl_module: pl.LightningModule, epoch: int, optimizer: torch.optim.Optimizer
    ) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.body[0], optimizer, lr=0.05)


def test_parameters_unfrozen_into_a_new_param_group_get_their_gradient_statistics(
    tmp_path: Path,
) -> None:
    logger = TensorBoardLogger(tmp_path, name="unfrozen")
    monitor = FeatureStatsMonitor("body.0", every_n_steps=1, histograms=False)
    reference = Reference(("body.0",), ("body.0.weight",))
    trainer = pl.Trainer(
        **QUIET, logger=logger, max_epochs=2, callbacks=[monitor, UnfreezeBody0(), reference]
    )
    model = ProbeNet()
    model.configure_optimizers = lambda: torch.optim.SGD(  # type: ignore[method-assign]
        [p for p in model.parameters() if p.requires_grad], lr=0.1
    )
    trainer.fit(model, loader(features(8, seed=3)))
    got = scalars(logger.log_dir)
    assert sorted(got["stats/train/body.0.weight/grad_norm"]) == [2, 3]  # the second epoch
    name = "body.0.weight"
    for step in (2, 3):
        before, after = reference.before[step][name], reference.after[step][name]
        grad = reference.grads[step][name].norm().item()
        assert got["stats/train/body.0.weight/grad_norm"][step] == approx(grad)
        ratio = ((after - before).norm() / before.norm()).item()
        assert got["stats/train/body.0.weight/update_ratio"][step] == pytest.approx(ratio, rel=1e-4)


def test_gradient_accumulation_covers_every_micro_batch(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="acc")
    monitor = FeatureStatsMonitor("probe", every_n_steps=1, stats=["mean", "std", "numel"])
    trainer = pl.Trainer(
        **QUIET, logger=logger, max_steps=2, accumulate_grad_batches=2, callbacks=[monitor]
    )
    x = features(16, seed=3)
    trainer.fit(ProbeNet(), loader(x))
    got = scalars(logger.log_dir)
    for step in (0, 1):
        expected = reference_stats(x[8 * step : 8 * step + 8])
        assert got["stats/train/probe/numel"][step] == 32
        assert got["stats/train/probe/mean"][step] == approx(expected["mean"])
        assert got["stats/train/probe/std"][step] == approx(expected["std"])
    hist = events(logger.log_dir).Histograms("stats/train/probe/histogram")
    assert [e.histogram_value.num for e in hist] == [16, 16]  # the last micro-batch


def test_keep_hooks_records_nothing_between_logged_steps(tmp_path: Path) -> None:
    # the hooks stay between logged steps, inactive: neither the steps that are not logged nor
    # the sanity check enter the statistics of the next logged step or evaluation epoch
    logger = TensorBoardLogger(tmp_path, name="kept")
    monitor = FeatureStatsMonitor(
        "probe", every_n_steps=2, keep_hooks=True, stats=["mean", "numel"], bins=8
    )
    trainer = pl.Trainer(
        **QUIET,
        logger=logger,
        max_steps=4,
        val_check_interval=3,
        num_sanity_val_steps=1,
        callbacks=[monitor],
    )
    x, val = features(16, seed=3), features(4, offset=100.0, seed=4)
    trainer.fit(ProbeNet(), loader(x), loader(val))
    got = scalars(logger.log_dir)
    assert got["stats/train/probe/numel"] == {1: 16, 3: 16}  # one batch of 4 x 4 each
    for step in (1, 3):
        assert got["stats/train/probe/mean"][step] == approx(
            reference_stats(x[4 * step :][:4])["mean"]
        )
    assert got["stats/val/probe/numel"] == {2: 16}
    assert got["stats/val/probe/mean"][2] == approx(reference_stats(val)["mean"])
    hist = events(logger.log_dir).Histograms("stats/train/probe/histogram")
    assert [e.histogram_value.num for e in hist] == [16, 16]


def test_histogram_every_n_steps_spaces_out_training_histograms(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="spaced")
    monitor = FeatureStatsMonitor(
        ["probe", "body.0"], every_n_steps=2, histogram_every_n_steps=4, stages=["train", "val"]
    )
    sampled: list[tuple[int, bool]] = []  # (step, whether the outputs were sampled)
    wants = monitor._wants_sample

    def spy() -> bool:
        found = wants()
        if monitor._active == "train":
            sampled.append((monitor._train_step, found))
        return found

    monitor._wants_sample = spy  # type: ignore[method-assign]
    trainer = pl.Trainer(
        **QUIET,
        logger=logger,
        max_steps=8,
        limit_val_batches=2,
        val_check_interval=4,
        callbacks=[monitor],
    )
    x = features(64, seed=5)
    trainer.fit(ProbeNet(), loader(x), loader(features(16, seed=6)))
    got = scalars(logger.log_dir)
    assert sorted(got["stats/train/probe/mean"]) == [1, 3, 5, 7]  # scalars every 2 steps
    acc = events(logger.log_dir)
    for module in ("probe", "body.0"):  # histograms every 4: steps 3 and 7
        assert [e.step for e in acc.Histograms(f"stats/train/{module}/histogram")] == [3, 7]
    hist = {e.step: e.histogram_value for e in acc.Histograms("stats/train/probe/histogram")}
    for step in (3, 7):  # the histogram of that step's batch, as with every logged step
        batch = x[4 * step : 4 * step + 4]  # batches of 4 rows, in order
        assert hist[step].num == batch.numel()
        assert hist[step].sum == pytest.approx(batch.sum().item(), rel=1e-6)
    # the logged steps without a histogram sampled nothing: no staging, no bucket counts
    assert sorted(set(sampled)) == [(1, False), (3, True), (5, False), (7, True)]
    # evaluation histograms are not spaced out: one per validation run
    assert len(acc.Histograms("stats/val/probe/histogram")) == 2


def test_histogram_every_n_steps_must_be_a_multiple_of_the_trainer_cadence(
    tmp_path: Path,
) -> None:
    monitor = FeatureStatsMonitor("probe", histogram_every_n_steps=30)
    logger = TensorBoardLogger(tmp_path, name="cadence")
    trainer = pl.Trainer(
        **QUIET, logger=logger, max_steps=2, log_every_n_steps=20, callbacks=[monitor]
    )
    with pytest.raises(
        RecorderConfigError,
        match=r"multiple of the 20 steps between logged steps \(the Trainer's "
        r"`log_every_n_steps`\), so that every histogram lands on a logged step, but got 30; "
        r"20 or 40 would do",
    ):
        trainer.fit(ProbeNet(), loader(features(16)))
    assert live_hooks() == []
    assert monitor.logged_steps == 0


def test_a_trainer_that_logs_no_training_step_is_not_followed_to_every_step(
    tmp_path: Path,
) -> None:
    # log_every_n_steps=0: Lightning logs no training step, so there is no cadence to follow.
    logger = TensorBoardLogger(tmp_path, name="zero")
    for callback in (
        FeatureStatsMonitor("probe"),
        RecorderCallback({"p": {"type": "ModuleOutputs", "source": "probe"}}, every_n_steps=None),
    ):
        trainer = pl.Trainer(
            **QUIET, logger=logger, max_steps=2, log_every_n_steps=0, callbacks=[callback]
        )
        with pytest.raises(
            RecorderConfigError, match=r"`log_every_n_steps`.* but got 0.*every_n_steps=N"
        ):
            trainer.fit(ProbeNet(), loader(features(8)))
        assert live_hooks() == [] and callback.recorded_steps == 0
    # Validation only, or a cadence of its own: nothing to follow, both run.
    validation_only = FeatureStatsMonitor("probe", stages=["val"])
    own = FeatureStatsMonitor("body.0", every_n_steps=1, stages=["train"])
    trainer = pl.Trainer(
        **QUIET, logger=logger, max_steps=2, log_every_n_steps=0, callbacks=[validation_only, own]
    )
    trainer.fit(ProbeNet(), loader(features(8)), loader(features(4)))
    assert own.logged_steps == 2 and validation_only.logged_steps == 0
    got = scalars(logger.log_dir)
    assert sorted(got["stats/train/body.0/mean"]) == [0, 1] and "stats/val/probe/mean" in got
    # A loop without training (validate) follows no training cadence: the defaults run.
    alone = FeatureStatsMonitor("probe")
    logger = TensorBoardLogger(tmp_path, name="validate")
    trainer = pl.Trainer(**QUIET, logger=logger, log_every_n_steps=0, callbacks=[alone])
    trainer.validate(ProbeNet(), loader(features(4)))
    assert "stats/val/probe/mean" in scalars(logger.log_dir)


def test_other_loggers_get_scalars_and_a_single_warning(tmp_path: Path) -> None:
    csv_logger = CSVLogger(tmp_path, name="csv")
    tb_logger = TensorBoardLogger(tmp_path, name="tb")
    monitor = FeatureStatsMonitor("torch.nn.Linear", every_n_steps=1, parameters=False)
    with pytest.warns(
        UserWarning, match="histograms to TensorBoard and W&B loggers only; CSVLogger gets"
    ) as rec:
        trainer = pl.Trainer(
            **QUIET, logger=[csv_logger, tb_logger], max_steps=2, callbacks=[monitor]
        )
        trainer.fit(ProbeNet(), loader(features(8)))
        trainer.validate(ProbeNet(), loader(features(8)))
    assert sum("W&B loggers only" in str(w.message) for w in rec) == 1
    (message,) = [str(w.message) for w in rec if "W&B loggers only" in str(w.message)]
    assert message.endswith(
        "To silence this warning, leave 'histogram' out of `logger_stats` for CSVLogger "
        "(logger_stats={'CSVLogger': ['mean', 'std', 'min', 'max', 'abs_mean', 'zero_fraction', "
        "'nonfinite']}), which keeps the histograms of any other logger, or pass "
        "histograms=False for none at all."
    )
    with open(Path(csv_logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert {"stats/train/body.0/mean", "stats/train/body.2/nonfinite"} <= set(rows[0])
    assert [r["step"] for r in rows if r["stats/train/body.0/mean"]] == ["0", "1"]
    assert "stats/train/body.0/mean" in scalars(tb_logger.log_dir)


def test_no_logger_and_no_listener_fails_before_the_first_step() -> None:
    model = ProbeNet()
    model.step_hook = lambda *_: pytest.fail("a step ran")
    trainer = pl.Trainer(
        **QUIET, logger=False, max_steps=1, callbacks=[FeatureStatsMonitor("probe")]
    )
    with pytest.raises(
        RecorderConfigError,
        match=r"Expected the Trainer to have a logger .* but it has none \(logger=False\); pass "
        r"a logger such as TensorBoardLogger, or subscribe a listener",
    ):
        trainer.fit(model, loader(features(8)))
    assert live_hooks() == []


@pytest.mark.parametrize("order", ["monitor first", "health first"])
def test_a_listener_needs_no_logger(order: str) -> None:
    """With a listener, a Trainer without a logger is fine: the listener gets the statistics
    (a user's, subscribed before the fit, or HealthMonitor's, subscribed in its setup, before or
    after the monitor's); without one, the monitor still asks for a logger."""
    from lightning_recorder import HealthMonitor, LossSpikeRule

    monitor = FeatureStatsMonitor("probe", every_n_steps=1, stats=("mean", "max"))
    reports: list[Any] = []
    monitor.subscribe(reports.append)
    x, val = features(8), features(4, seed=1)
    pl.Trainer(**QUIET, logger=False, max_steps=2, callbacks=[monitor]).fit(
        ProbeNet(), loader(x), loader(val)
    )
    assert [(r.stage, r.step) for r in reports] == [("train", 0), ("train", 1), ("val", 1)]
    for report, data in zip(reports, (x[:4], x[4:], val), strict=True):
        # the probe is an identity: its statistics are the data's (float64 sums of float32)
        assert report.stat("mean", "probe") == pytest.approx(data.double().mean().item(), rel=1e-9)
        assert report.stat("max", "probe") == data.max().item()
        assert report.histograms is None  # no logger to take histograms for
    assert monitor.logged_steps == 2 and live_hooks() == []

    # HealthMonitor subscribes in its setup, before or after the monitor's
    monitor.unsubscribe(reports.append)
    health = HealthMonitor(rules=[LossSpikeRule()], evidence_max_bytes=0)
    callbacks = [monitor, health] if order == "monitor first" else [health, monitor]
    pl.Trainer(**QUIET, logger=False, max_steps=2, callbacks=callbacks).fit(ProbeNet(), loader(x))
    assert monitor.logged_steps == 4 and monitor._listeners == [] and live_hooks() == []

    # no listener left: a logger is asked for, as before
    with pytest.raises(RecorderConfigError, match="Expected the Trainer to have a logger"):
        pl.Trainer(**QUIET, logger=False, max_steps=2, callbacks=[monitor]).fit(
            ProbeNet(), loader(x)
        )
    assert live_hooks() == []


def test_a_loop_of_none_of_its_stages_needs_no_logger() -> None:
    """`predict` and `test` with the default stages ("train", "val") write nothing: a Trainer
    without a logger (as predict often runs) is not refused there, only where it would log."""
    monitor = FeatureStatsMonitor("probe", every_n_steps=1)
    trainer = pl.Trainer(**QUIET, logger=False, callbacks=[monitor])
    trainer.predict(ProbeNet(), loader(features(8)))
    trainer.test(ProbeNet(), loader(features(8)))
    assert live_hooks() == [] and monitor.recorded_steps == 0
    with pytest.raises(RecorderConfigError, match="Expected the Trainer to have a logger"):
        trainer.validate(ProbeNet(), loader(features(8)))
    assert live_hooks() == []
    tester = FeatureStatsMonitor("probe", stages="test")
    with pytest.raises(RecorderConfigError, match="Expected the Trainer to have a logger"):
        pl.Trainer(**QUIET, logger=False, callbacks=[tester]).test(ProbeNet(), loader(features(8)))


def test_barebones_is_named_in_the_errors() -> None:
    # barebones=True turns logging off and refuses a logger: the error says so, rather than
    # "logger=False; pass a logger" (which Lightning refuses) or a log_every_n_steps never given
    for monitor in (FeatureStatsMonitor("probe"), FeatureStatsMonitor("probe", every_n_steps=1)):
        trainer = pl.Trainer(barebones=True, max_steps=1, callbacks=[monitor])
        with pytest.raises(
            RecorderConfigError,
            match=r"but it runs with barebones=True, which turns logging off .* Run without "
            r"barebones=True, with a logger",
        ):
            trainer.fit(ProbeNet(), loader(features(8)))
        assert live_hooks() == [] and monitor.recorded_steps == 0
    recorder = RecorderCallback(
        {"p": {"type": "ModuleOutputs", "source": "probe"}}, every_n_steps=None
    )
    trainer = pl.Trainer(barebones=True, max_steps=1, callbacks=[recorder])
    with pytest.raises(
        RecorderConfigError,
        match=r"but got 0 \(set by barebones=True, which logs nothing\)\. Pass every_n_steps=N",
    ):
        trainer.fit(ProbeNet(), loader(features(8)))
    assert live_hooks() == []


def test_validate_then_fit_and_test(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="vf")
    monitor = FeatureStatsMonitor(
        [nn.Identity, "body.2"], every_n_steps=1, stages=["train", "val", "test"]
    )
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=2, callbacks=[monitor])
    model, val = ProbeNet(), features(8, offset=5.0)
    trainer.validate(model, loader(val))  # under torch.inference_mode()
    trainer.fit(model, loader(features(8)), loader(val))
    trainer.test(model, loader(features(4, offset=-7.0)))
    got = scalars(logger.log_dir)
    # Standalone validate at step 0; validation at the end of fit at Lightning's val step 1.
    assert sorted(got["val_loss"]) == [0, 1]
    assert got["stats/val/probe/mean"] == {
        0: approx(val.mean().item()),
        1: approx(val.mean().item()),
    }
    assert sorted(got["stats/train/probe/mean"]) == [0, 1]
    assert got["stats/test/probe/mean"] == {2: approx(features(4, offset=-7.0).mean().item())}


def test_checkpoint_resume_continues_counters(tmp_path: Path) -> None:
    def fit(max_steps: int, ckpt: Path | None) -> tuple[FeatureStatsMonitor, dict[str, Any]]:
        monitor = FeatureStatsMonitor("probe", every_n_steps=2)
        logger = TensorBoardLogger(tmp_path, name="ckpt")
        callbacks: list[pl.Callback] = [monitor, ModelCheckpoint(tmp_path, save_last=True)]
        kwargs = {**QUIET, "enable_checkpointing": True}
        trainer = pl.Trainer(**kwargs, logger=logger, max_steps=max_steps, callbacks=callbacks)
        trainer.fit(ProbeNet(), loader(features(64)), ckpt_path=ckpt)
        return monitor, scalars(logger.log_dir)

    first, _ = fit(4, None)
    assert (first.logged_steps, first.last_logged_step) == (2, 3)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["callbacks"][first.state_key]
    assert saved == {"recorded_steps": 2, "logged_steps": 2, "last_logged_step": 3}
    resumed, got = fit(8, tmp_path / "last.ckpt")
    assert (resumed.recorded_steps, resumed.logged_steps, resumed.last_logged_step) == (4, 4, 7)
    assert sorted(got["stats/train/probe/mean"]) == [5, 7]


def test_two_monitors_coexist(tmp_path: Path) -> None:
    a = FeatureStatsMonitor("probe", every_n_steps=1, prefix="a", histograms=False)
    b = FeatureStatsMonitor("probe", every_n_steps=2, prefix="b", histograms=False)
    assert a.state_key != b.state_key
    logger = TensorBoardLogger(tmp_path, name="two")
    pl.Trainer(**QUIET, logger=logger, max_steps=2, callbacks=[a, b]).fit(
        ProbeNet(), loader(features(8))
    )
    got = scalars(logger.log_dir)
    assert sorted(got["a/train/probe/mean"]) == [0, 1] and sorted(got["b/train/probe/mean"]) == [1]
    assert not events(logger.log_dir).Tags()["histograms"]


def test_two_monitors_writing_the_same_tags_are_refused(tmp_path: Path) -> None:
    # Same prefix, stage and module: each would log its points into the other's series.
    a = FeatureStatsMonitor("probe", every_n_steps=2, name="a")
    b = FeatureStatsMonitor(["probe", "body.0"], every_n_steps=3, name="b")
    logger = TensorBoardLogger(tmp_path, name="same")
    model = ProbeNet()
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=2, callbacks=[a, b])
    with pytest.raises(
        RecorderConfigError, match=r"both write 'stats/train/probe/\.\.\.'.*`prefix`"
    ):
        trainer.fit(model, loader(features(8)))
    assert live_hooks() == [] and a._manager is None and b._manager is None
    # Other modules, or other stages, under one prefix: no tag in common, both run.
    a = FeatureStatsMonitor("probe", every_n_steps=2, stages=["train"], name="a")
    c = FeatureStatsMonitor("body.0", every_n_steps=1, stages=["train"])
    d = FeatureStatsMonitor("probe", stages=["val"], name="d")
    e = FeatureStatsMonitor("body.0", stages=["val"], name="e")
    logger = TensorBoardLogger(tmp_path, name="apart")
    pl.Trainer(**QUIET, logger=logger, max_steps=2, callbacks=[a, c, d, e]).fit(
        ProbeNet(), loader(features(8)), loader(features(4))
    )
    got = scalars(logger.log_dir)
    assert sorted(got["stats/train/probe/mean"]) == [1] and sorted(
        got["stats/train/body.0/mean"]
    ) == [0, 1]
    assert "stats/val/probe/mean" in got and "stats/val/body.0/mean" in got


def test_two_monitors_of_nested_modules_writing_the_same_parameter_tags_are_refused(
    tmp_path: Path,
) -> None:
    # "body" holds "body.0": both would log body.0's parameters under one tag.
    a = FeatureStatsMonitor("body", every_n_steps=1, name="a")
    b = FeatureStatsMonitor("body.0", every_n_steps=2, name="b")
    logger = TensorBoardLogger(tmp_path, name="nested")
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=2, callbacks=[a, b])
    with pytest.raises(
        RecorderConfigError,
        match=r"both write 'stats/train/body\.0\.weight/norm' \(parameters \['body\.0\.weight', "
        r"'body\.0\.bias'\].*`parameters=False`",
    ):
        trainer.fit(ProbeNet(), loader(features(8)))
    assert live_hooks() == [] and a._manager is None and b._manager is None
    # Parameters left to one of them: the tags are their own, both run.
    a = FeatureStatsMonitor("body", every_n_steps=1, name="a", histograms=False)
    b = FeatureStatsMonitor("body.0", every_n_steps=2, name="b", parameters=False)
    logger = TensorBoardLogger(tmp_path, name="apart")
    pl.Trainer(**QUIET, logger=logger, max_steps=2, callbacks=[a, b]).fit(
        ProbeNet(), loader(features(8))
    )
    got = scalars(logger.log_dir)
    assert sorted(got["stats/train/body.0.weight/norm"]) == [0, 1]
    assert sorted(got["stats/train/body.0/mean"]) == [1] and sorted(
        got["stats/train/body/mean"]
    ) == [0, 1]


class InPlace(ProbeNet):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))


def test_output_modified_in_place(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="inplace")
    # Records kept (exact histograms) without clone: the in-place change is detected.
    kept = FeatureStatsMonitor("body.0", 1, exact_histograms=True)
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=1, callbacks=[kept])
    with pytest.raises(RecordModifiedError, match=r"modified in place.*Pass clone=True"):
        trainer.fit(InPlace(), loader(features(8)))
    assert live_hooks() == []
    # The default computes the statistics in the hook, before the in-place ReLU.
    default = FeatureStatsMonitor("body.0", every_n_steps=1, parameters=False)
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=1, callbacks=[default])
    trainer.fit(InPlace(), loader(features(8)))
    assert scalars(logger.log_dir)["stats/train/body.0/min"][0] < 0
    monitor = FeatureStatsMonitor("body.0", every_n_steps=1, clone=True, parameters=False)
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=1, callbacks=[monitor])
    trainer.fit(InPlace(), loader(features(8)))
    assert scalars(logger.log_dir)["stats/train/body.0/min"][0] < 0  # before the in-place ReLU


def test_a_module_not_called_logs_nothing(tmp_path: Path) -> None:
    class Spare(ProbeNet):
        def __init__(self) -> None:
            super().__init__()
            self.spare = nn.Linear(2, 2)

    logger = TensorBoardLogger(tmp_path, name="spare")
    monitor = FeatureStatsMonitor(["spare", "probe"], every_n_steps=1)
    pl.Trainer(**QUIET, logger=logger, max_steps=1, callbacks=[monitor]).fit(
        Spare(), loader(features(8))
    )
    got = scalars(logger.log_dir)
    assert not [t for t in got if t.startswith("stats/train/spare/")]
    assert set(t for t in got if "spare." in t) == {
        "stats/train/spare.weight/norm",
        "stats/train/spare.bias/norm",
    }


def _fit_warned(
    tmp_path: Path, model: pl.LightningModule, module: str, exact: bool, warning: str
) -> tuple[list[str], dict[str, dict[int, float]]]:
    """Three logged steps of a monitor on ``module`` and ``probe``: the warnings that contain
    ``warning``, and the scalars written."""
    logger = TensorBoardLogger(tmp_path, name=module)
    monitor = FeatureStatsMonitor(
        [module, "probe"], every_n_steps=1, parameters=False, exact_histograms=exact
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pl.Trainer(**QUIET, logger=logger, max_steps=3, callbacks=[monitor]).fit(
            model, loader(features(8))
        )
    told = [str(w.message) for w in caught if warning in str(w.message)]
    return told, scalars(logger.log_dir)


class _Spectrum(nn.Module):
    """An FFT layer: a complex output, alone or next to a real one."""

    def __init__(self, both: bool) -> None:
        super().__init__()
        self.both = both

    def forward(self, x: torch.Tensor) -> Any:
        z = torch.fft.rfft(x, dim=-1)
        return (z.abs(), z) if self.both else z


class _SpectrumNet(ProbeNet):
    def __init__(self, both: bool) -> None:
        super().__init__()
        self.spectrum = _Spectrum(both)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.spectrum(x)
        return super().forward(x)


@pytest.mark.parametrize("exact", [False, True])  # statistics in the hook / of kept records
@pytest.mark.parametrize("both", [False, True])  # a complex output / (real, complex)
def test_a_complex_output_is_left_out_with_one_warning(
    tmp_path: Path, both: bool, exact: bool
) -> None:
    """No statistic is defined for complex values: they are left out, and the monitor says so
    once per module (naming it and the way to monitor a real view), not silently; a real tensor
    next to them, and every other module, are logged as usual."""
    told, got = _fit_warned(tmp_path, _SpectrumNet(both), "spectrum", exact, "is complex")
    assert len(told) == 1, told
    assert "an output of 'spectrum' is complex (torch.complex64) and is left out" in told[0]
    assert "torch.view_as_real(z)" in told[0] and "Reported once per module" in told[0]
    assert got["stats/train/probe/mean"].keys() == {0, 1, 2}
    if both:  # the magnitude is the module's only real tensor: never negative
        assert got["stats/train/spectrum/min"].keys() == {0, 1, 2}
        assert min(got["stats/train/spectrum/min"].values()) >= 0.0
    else:
        assert not [t for t in got if t.startswith("stats/train/spectrum/")]


class _PaddedEncoder(pl.LightningModule):
    """A batch-first TransformerEncoder with a padding mask: in evaluation, torch's fast path
    runs its layers on nested tensors (the padded tokens dropped), which the layers return."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(8, 1)
        self.seen: list[torch.Tensor] = []  # the first layer's outputs in validation
        self.enc.layers[0].register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if not self.training:
            self.seen.append(torch.cat(out.detach().unbind()) if out.is_nested else out)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x, src_key_padding_mask=pad)).mean()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(*batch)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self(*batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_nested_outputs_of_a_transformer_fast_path_are_the_values_they_hold(
    tmp_path: Path,
) -> None:
    """Validation of a transformer with a padding mask hands the monitor nested tensors (the
    unpadded tokens): their statistics are those of the tokens they hold (the forward hook
    crashed in torch's reshape before)."""
    torch.manual_seed(0)
    x = torch.randn(8, 5, 8)
    pad = torch.zeros(8, 5, dtype=torch.bool)
    pad[:, 3:] = True
    pad[::2, 3] = False  # ragged: 3 or 4 tokens per sequence, left-aligned
    data = DataLoader(TensorDataset(x, pad), batch_size=4)
    logger = TensorBoardLogger(tmp_path, name="enc")
    monitor = FeatureStatsMonitor(["enc.layers.0"], every_n_steps=1, stages=("train", "val"))
    model = _PaddedEncoder()
    pl.Trainer(
        **QUIET, logger=logger, max_steps=2, callbacks=[monitor], num_sanity_val_steps=0
    ).fit(model, data, data)
    assert model.seen and all(t.shape[-1] == 8 for t in model.seen)
    assert sum(t.shape[0] for t in model.seen) == int((~pad).sum())  # the fast path ran
    want = reference_stats(torch.cat(model.seen))
    got = scalars(logger.log_dir)
    for stat in ("mean", "std", "min", "max"):
        (value,) = got[f"stats/val/enc.layers.0/{stat}"].values()
        assert value == pytest.approx(want[stat], rel=1e-5, abs=1e-6), stat


class _SparseEmbedding(pl.LightningModule):
    """A recommendation-style model: an embedding with sparse gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.head(self.emb(batch[0])).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class _Grads(pl.Callback):
    def __init__(self) -> None:
        self.norms: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, opt: Any) -> None:
        grad = pl_module.emb.weight.grad
        self.norms[trainer.global_step] = grad.to_dense().norm().item()


def test_sparse_gradients_have_their_norms_and_update_ratios(tmp_path: Path) -> None:
    """nn.Embedding(sparse=True) has sparse gradients: their norms (of the summed values) are
    logged as a dense gradient's would be (the foreach norm has no sparse kernel: the monitor
    crashed at the first logged step)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (24, 5))
    ids[:, 0] = 7  # a row every sample looks up: repeated indices in each sparse gradient
    logger = TensorBoardLogger(tmp_path, name="emb")
    grads = _Grads()
    monitor = FeatureStatsMonitor(["emb", "head"], every_n_steps=1)
    pl.Trainer(**QUIET, logger=logger, max_steps=3, callbacks=[grads, monitor]).fit(
        _SparseEmbedding(), loader(ids, batch_size=8)
    )
    got = scalars(logger.log_dir)
    assert got["stats/train/emb.weight/grad_norm"].keys() == {0, 1, 2}
    for step, norm in grads.norms.items():
        assert got["stats/train/emb.weight/grad_norm"][step] == approx(norm)
        assert 0.0 < got["stats/train/emb.weight/update_ratio"][step] < 1.0


class _LBFGSNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = batch[0]
        return (self.lin(x).squeeze(-1) - x.sum(1)).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4)


class _StepEnds(pl.Callback):
    """The weight before and after each whole step, and the gradient of the closure's last call."""

    def __init__(self) -> None:
        self.before: dict[int, torch.Tensor] = {}
        self.after: dict[int, torch.Tensor] = {}
        self.grads: dict[int, float] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *_: Any) -> None:
        self.before[trainer.global_step] = pl_module.lin.weight.detach().double().clone()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, opt: Any) -> None:
        self.grads[trainer.global_step] = pl_module.lin.weight.grad.double().norm().item()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *_: Any) -> None:
        self.after[trainer.global_step - 1] = pl_module.lin.weight.detach().double().clone()


class _PostHooks(pl.Callback):
    """The optimizer's step post-hooks at each training batch start."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.counts.append(len(trainer.optimizers[0]._optimizer_step_post_hooks))


def test_lbfgs_update_ratio_covers_the_whole_step(tmp_path: Path) -> None:
    """LBFGS calls its closure several times in one step, and Lightning calls
    on_before_optimizer_step after each: the update ratio was that of the last call only."""
    torch.manual_seed(0)
    logger = TensorBoardLogger(tmp_path, name="lbfgs")
    ends = _StepEnds()
    monitor = FeatureStatsMonitor(["lin"], every_n_steps=1)
    model = _LBFGSNet()
    held = _PostHooks()
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=3, callbacks=[ends, monitor, held])
    trainer.fit(model, loader(torch.randn(24, 4), batch_size=8))
    got = scalars(logger.log_dir)
    assert got["stats/train/lin.weight/update_ratio"].keys() == {0, 1, 2}
    for step, before in ends.before.items():
        ratio = ((ends.after[step] - before).norm() / before.norm()).item()
        assert got["stats/train/lin.weight/update_ratio"][step] == approx(ratio)
        assert got["stats/train/lin.weight/grad_norm"][step] == approx(ends.grads[step])
    # the step post-hooks are held in logged batches only, and removed with the monitor
    assert held.counts == [0, 0, 0]  # at each batch start, after the last logged batch ended
    assert not trainer.optimizers[0]._optimizer_step_post_hooks


class _ZeroBias(pl.LightningModule):
    """``Linear(4, 1)`` whose bias starts at 0, as ``nn.init.zeros_`` leaves a bias."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        nn.init.zeros_(self.lin.bias)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = batch[0]
        return (self.lin(x).squeeze(-1) - x.sum(1)).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Values(pl.Callback):
    """Every parameter's value at each training batch start and end (float64)."""

    def __init__(self) -> None:
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    @staticmethod
    def _values(pl_module: pl.LightningModule) -> dict[str, torch.Tensor]:
        return {n: p.detach().double().clone() for n, p in pl_module.named_parameters()}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *_: Any) -> None:
        self.before[trainer.global_step] = self._values(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *_: Any) -> None:
        self.after[trainer.global_step - 1] = self._values(pl_module)


def test_update_ratio_of_a_parameter_whose_norm_before_the_step_is_0_is_not_logged(
    tmp_path: Path,
) -> None:
    """``||Δp|| / (||p|| + 1e-12)`` of a bias initialised to 0 came out near 1e10 at the first
    step, which meant nothing and wrecked the chart's scale: it is undefined, and left out (of
    every logger and of the listeners' reports) while ``norm`` and ``grad_norm`` are logged."""
    torch.manual_seed(0)
    tensorboard = TensorBoardLogger(tmp_path, name="zero", version=0)
    table = CSVLogger(tmp_path, name="zero_csv", version=0)
    reference = _Values()
    monitor = FeatureStatsMonitor(["lin"], every_n_steps=1, histograms=False)
    reports: list[Any] = []
    monitor.subscribe(reports.append)
    pl.Trainer(
        **QUIET, logger=[tensorboard, table], max_steps=2, callbacks=[reference, monitor]
    ).fit(_ZeroBias(), loader(features(8, seed=2)))
    got = scalars(tensorboard.log_dir)
    assert got["stats/train/lin.bias/norm"].keys() == {0, 1}
    assert got["stats/train/lin.bias/grad_norm"].keys() == {0, 1}
    assert got["stats/train/lin.bias/update_ratio"].keys() == {1}  # not at step 0
    assert got["stats/train/lin.weight/update_ratio"].keys() == {0, 1}
    for step, name in ((0, "lin.weight"), (1, "lin.weight"), (1, "lin.bias")):
        before, after = reference.before[step][name], reference.after[step][name]
        ratio = ((after - before).norm() / before.norm()).item()
        # float32 norms of float32 values against float64 ones, stored as float32
        tag = f"stats/train/{name}/update_ratio"
        assert got[tag][step] == pytest.approx(ratio, rel=1e-5)
    assert [sorted(r.parameters["lin.bias"]) for r in reports] == [
        ["grad_norm", "norm"],
        ["grad_norm", "norm", "update_ratio"],
    ]
    with open(Path(table.log_dir) / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    ratios = {
        int(row["step"]): row["stats/train/lin.bias/update_ratio"]
        for row in rows
        if row.get("stats/train/lin.bias/norm")
    }
    assert ratios[0] == "" and float(ratios[1]) == pytest.approx(got[tag][1], rel=1e-6)


class _PerSampleGrads(pl.LightningModule):
    """Per-sample gradients (torch.func.vmap of grad of functional_call), as DP-SGD takes them:
    the monitor's hooks run inside the transforms, on one sample's view of each output."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x = batch[0]
        params = {k: v.detach() for k, v in self.net.named_parameters()}

        def loss(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(self.net, p, (xi[None],)).square().sum()

        grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
        for name, param in self.net.named_parameters():
            param.grad = grads[name].mean(0)
        optimizer = self.optimizers()
        optimizer.step()  # type: ignore[union-attr]
        optimizer.zero_grad()  # type: ignore[union-attr]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_outputs_inside_vmap_and_grad_are_the_whole_batch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.randn(16, 4)
    model = _PerSampleGrads()
    logger = TensorBoardLogger(tmp_path, name="vmap")
    monitor = FeatureStatsMonitor(["net.0", "net.1"], every_n_steps=1, parameters=False)
    pl.Trainer(**QUIET, logger=logger, max_steps=2, callbacks=[monitor]).fit(
        model, loader(x, batch_size=8)
    )
    got = scalars(logger.log_dir)
    with torch.no_grad():
        for step in (0, 1):
            hidden = model.net[0](x[8 * step : 8 * step + 8])
            for name, value in (("net.0", hidden), ("net.1", torch.tanh(hidden))):
                want = reference_stats(value)
                for stat in STATS:
                    assert got[f"stats/train/{name}/{stat}"][step] == approx(want[stat]), stat


class _PackedLSTM(pl.LightningModule):
    """An LSTM on packed sequences of different lengths: its output is ``(PackedSequence,
    (h, c))``, whose packing metadata (batch sizes, orders) are integer tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 3, batch_first=True)
        self.head = nn.Linear(3, 1)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(
            batch[0], torch.tensor([5, 4, 2, 1]), batch_first=True
        )
        out, (h, c) = self.lstm(packed)
        self.seen = [out.data.detach(), h.detach(), c.detach()]
        return self.head(h[-1]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_packed_sequence_contributes_its_data_not_its_layout(tmp_path: Path) -> None:
    """The statistics of an LSTM on packed sequences are those of its values (the packed data,
    h and c), not of the packing's batch sizes and orders (which were pooled with them: a
    ``max`` of 4, the largest batch size)."""
    torch.manual_seed(0)
    logger = TensorBoardLogger(tmp_path, name="packed")
    monitor = FeatureStatsMonitor(["lstm"], every_n_steps=1, parameters=False)
    model = _PackedLSTM()
    pl.Trainer(**QUIET, logger=logger, max_steps=1, callbacks=[monitor]).fit(
        model, loader(torch.randn(4, 5, 4) + 10.0)
    )
    want = reference_stats(torch.cat([t.reshape(-1) for t in model.seen]))
    got = scalars(logger.log_dir)
    for stat in ("mean", "std", "min", "max"):
        assert got[f"stats/train/lstm/{stat}"][0] == pytest.approx(want[stat], rel=1e-5), stat


class _Opaque:
    """An output of a class of its own: nothing the monitor can look inside."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


class _OpaqueNet(ProbeNet):
    def __init__(self) -> None:
        super().__init__()
        self.opaque = nn.Linear(4, 4)
        self.opaque.register_forward_hook(lambda m, a, out: _Opaque(out))  # the output replaced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.opaque(x).hidden)


@pytest.mark.parametrize("exact", [False, True])  # statistics in the hook / of kept records
def test_an_output_without_a_tensor_is_reported_once(tmp_path: Path, exact: bool) -> None:
    """A module whose output holds no tensor the monitor can find is not logged, and the
    monitor says so once (it was silent), naming the module and what it can read."""
    told, got = _fit_warned(tmp_path, _OpaqueNet(), "opaque", exact, "holds no tensor")
    assert len(told) == 1, told
    assert "an output of 'opaque' holds no tensor the monitor can read (got _Opaque;" in told[0]
    assert not [t for t in got if t.startswith("stats/train/opaque/")]
    assert got["stats/train/probe/mean"].keys() == {0, 1, 2}


def test_unknown_source_fails_at_start(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="unknown")
    trainer = pl.Trainer(
        **QUIET, logger=logger, max_steps=1, callbacks=[FeatureStatsMonitor(["probe", "bdy.*"])]
    )
    with pytest.raises(UnknownSourceError, match=r"'bdy.\*' matches no module.*Closest"):
        trainer.fit(ProbeNet(), loader(features(8)))
    assert live_hooks() == []


def test_module_types_the_model_lacks_are_left_out(tmp_path: Path) -> None:
    """One list of types serves any network (the health docs' list, on an MLP without
    convolutions or tanh): the types present are monitored, the others left out."""
    logger = TensorBoardLogger(tmp_path, name="types")
    monitor = FeatureStatsMonitor(
        [nn.Conv2d, nn.Linear, "torch.nn.ReLU", nn.Tanh], every_n_steps=1, parameters=False
    )
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=2, callbacks=[monitor])
    trainer.fit(ProbeNet(), loader(features(8)))
    got = scalars(logger.log_dir)
    monitored = {tag.split("/")[2] for tag in got if tag.startswith("stats/train/")}
    assert monitored == {"body.0", "body.1", "body.2"}
    assert got["stats/train/body.1/mean"].keys() == {0, 1}
    assert live_hooks() == []


@pytest.mark.parametrize(
    ("sources", "match"),
    [
        # none of several types: one error naming them all and the types present
        (
            [nn.Conv2d, nn.Tanh],
            r"no module of any of the types of `sources` \(Conv2d, Tanh\).*"
            r"Types present: .*Linear",
        ),
        ([nn.Conv2d], r"No module of type Conv2d in the model\. Types present: .*Linear"),
        # a bare class name that is not torch.nn's may be a typo: it must match
        ([nn.Linear, "Conv2D"], r"No module named 'Conv2D', nor of a class named 'Conv2D'"),
        # names and patterns must match, whatever else does
        ([nn.Linear, "bdy.*"], r"'bdy.\*' matches no module"),
    ],
)
def test_sources_that_must_match(tmp_path: Path, sources: list[Any], match: str) -> None:
    logger = TensorBoardLogger(tmp_path, name="strict")
    trainer = pl.Trainer(
        **QUIET, logger=logger, max_steps=1, callbacks=[FeatureStatsMonitor(sources)]
    )
    with pytest.raises(UnknownSourceError, match=match):
        trainer.fit(ProbeNet(), loader(features(8)))
    assert live_hooks() == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sources": []}, "Expected `sources` of FeatureStatsMonitor"),
        ({"sources": [""]}, "Expected each of `sources`"),
        ({"sources": [3]}, "Expected each of `sources`"),
        ({"stats": ["mean", "median"]}, "hold only 'mean'.*but got 'median'"),
        ({"bins": 0}, "`bins` of FeatureStatsMonitor to be a positive int"),
        ({"histograms": "yes"}, "`histograms` of FeatureStatsMonitor to be a bool"),
        ({"clone": "yes"}, "`clone` of FeatureStatsMonitor to be a bool"),
        ({"parameters": 1}, "`parameters` of FeatureStatsMonitor to be a bool"),
        ({"prefix": "stats/"}, "`prefix` .* without a leading, trailing or doubled '/'"),
        ({"prefix": "/stats"}, "`prefix` .* without a leading, trailing or doubled '/'"),
        ({"prefix": "probe//stats"}, r"doubled '/' .* but got 'probe//stats'"),
        ({"prefix": ""}, "`prefix` .* non-empty str"),
        ({"histogram_sample": 2**24 + 1}, r"at most 2\*\*24 .*exact_histograms=True"),
        ({"histogram_sample": 0}, "`histogram_sample` of FeatureStatsMonitor to be a positive"),
        ({"every_n_steps": -1}, "`every_n_steps` of FeatureStatsMonitor"),
        ({"stages": ["training"]}, "`stages` of FeatureStatsMonitor to hold only"),
        (
            {"stages": ["val"], "histogram_every_n_steps": 100},
            r"`histogram_every_n_steps` of FeatureStatsMonitor to be None without 'train'",
        ),
        (
            {"stages": ["val"], "parameters": "body.*.weight"},
            r"`stages` of FeatureStatsMonitor to hold 'train' with `parameters` 'body\.\*\.weight'",
        ),
        ({"sources": {"source": "probe", "path": "x..y"}}, r"single dots.*'x\.\.y'.*empty item"),
        ({"sources": {"source": "probe", "path": "0."}}, r"single dots.*'0\.'.*empty item"),
    ],
)
def test_argument_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(RecorderConfigError, match=match):
        FeatureStatsMonitor(**{"sources": "probe", **kwargs})


def test_docstring_example() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = doctest.testmod(monitor_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_docs_page_examples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert python_blocks(DOCS / "feature_stats_monitor.md")
    run_page(DOCS / "feature_stats_monitor.md")


class _PlainWriter(SummaryWriter):
    """A writer from another module: the monitor falls back to ``add_scalar`` per tag."""


class _PlainLogger(RecorderTensorBoardLogger):
    """The package's logger (its prefix public) with a writer of another make."""

    plain: SummaryWriter | None = None

    @property
    def experiment(self) -> SummaryWriter:
        if self.plain is None:
            self.plain = _PlainWriter(log_dir=self.log_dir)
        return self.plain


def test_one_event_per_step_equals_one_write_per_tag(tmp_path: Path) -> None:
    fast = RecorderTensorBoardLogger(tmp_path, name="fast", prefix="p")
    plain = _PlainLogger(tmp_path, name="plain", prefix="p")
    monitor = FeatureStatsMonitor("probe", every_n_steps=1, bins=4, parameters=False)
    pl.Trainer(**QUIET, logger=[fast, plain], max_steps=2, callbacks=[monitor]).fit(
        ProbeNet(), loader(features(8))
    )
    one, many = scalars(fast.log_dir), scalars(plain.log_dir)
    assert {t for t in one if "stats" in t} == {f"p-stats/train/probe/{s}" for s in STATS}
    assert {t: one[t] for t in one if "stats" in t} == {t: many[t] for t in many if "stats" in t}
    tag = "p-stats/train/probe/histogram"
    h1, h2 = events(fast.log_dir).Histograms(tag), events(plain.log_dir).Histograms(tag)
    assert [e.step for e in h1] == [0, 1]
    assert [(e.step, e.histogram_value) for e in h1] == [(e.step, e.histogram_value) for e in h2]


def test_benchmark_quick_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        bench = load_benchmark("bench_callbacks")
        argv = ["--quick", "--default-malloc", "--json", str(tmp_path / "bench.json")]
        result = bench.main(argv)  # the default malloc: this process goes on testing
    finally:
        torch.set_num_threads(threads)
    if cpus is not None:  # timed on one of this process's CPUs, and every CPU given back
        assert result["one_cpu"] in cpus and os.sched_getaffinity(0) == cpus
    with bench.one_cpu(False) as cpu:
        assert cpu is None
    out = capsys.readouterr().out
    rows = ("| amortised |", "| non-logging step |", "| logging step |", "| peak RSS")
    for row in (
        *rows,
        "| logging step, `histograms=False` |",
        "| amortised, `histograms=False` |",
        "| amortised, histograms every other logged step |",
        "| step, a callback that does",
        "| amortised, the same monitor again (identical: the noise) |",
        "| non-logging step, the same monitor again (identical: the noise) |",
    ):
        assert row in out
    assert "| amortised, `lightning_recorder.TensorBoardLogger` (" in out
    assert "amortised excess by kind of step" in out
    split = result["amortised_split"]
    assert set(split) == {"logging steps", "steps after them", "other steps"}
    assert all(abs(v) < 1.0 for v in split.values())  # fractions of the baseline's time
    measures = {"amortised", "non-logging step", "logging step"}
    configs = {"monitor", "scalars only", bench.SPACED, "empty callback", bench.RECORDER_LOGGER}
    configs.add(bench.TWIN)
    for clock in result["ratio"].values():
        assert set(clock) == configs  # each vs the baseline
        assert all(set(by) == measures and min(by.values()) > 0 for by in clock.values())
    assert result["ms"]["wall"]["monitor"]["logging step"] > 0
    # a quick run measures the ratio, it does not judge it (that is the benchmark's table, and
    # RSS depends on the allocator and the machine): any sane positive ratio will do here
    assert 0.5 < result["rss_ratio"] < 2.0
    assert (tmp_path / "bench.json").exists() and result["malloc_pinned"] is False


def test_benchmark_idle_quick_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        bench = load_benchmark("bench_callbacks")
        argv = ["--idle", "--quick", "--default-malloc", "--json", str(tmp_path / "idle.json")]
        result = bench.main(argv)
    finally:
        torch.set_num_threads(threads)
    if cpus is not None:
        assert os.sched_getaffinity(0) == cpus  # every CPU given back
    out = capsys.readouterr().out
    assert "Steps that log nothing" in out and "| configuration | per-step ratio, wall |" in out
    configs = set(bench.IDLE_CONFIGS) - {"baseline"}
    assert bench.NOOP_HOOKS in configs and len(configs) == 5
    for name in configs:
        assert f"| {name} | **" in out
    for figures in (result["per_step"], result["of_means"]):
        for clock in ("wall", "cpu"):
            assert set(figures[clock]) == configs
            assert all(0.5 < v < 2.0 for v in figures[clock].values())  # sane ratios, not judged
    assert result["repeats"] == 1 and result["malloc_pinned"] is False
    assert (tmp_path / "idle.json").exists()


def test_benchmark_idle_monitors_never_log(tmp_path: Path) -> None:
    """The ``--idle`` monitors never log and are attached as usual; the second one's per-step
    hooks do nothing (otherwise the split would compare the wrong things)."""

    class Probe(pl.Callback):
        def __init__(self, monitor: FeatureStatsMonitor) -> None:
            self.monitor, self.attached = monitor, list[bool]()

        def on_train_batch_end(self, *args: Any) -> None:
            self.attached.append(self.monitor._manager is not None)

    bench = load_benchmark("bench_callbacks")
    for name, hooks_run in (("monitor, never logging", True), (bench.NOOP_HOOKS, False)):
        trainer = bench._trainer(
            bench.IDLE_CONFIGS[name], 3, str(tmp_path), "idle", bench._StepTimer()
        )
        monitor = next(c for c in trainer.callbacks if isinstance(c, FeatureStatsMonitor))
        probe = Probe(monitor)
        trainer.callbacks.append(probe)
        trainer.fit(bench.DigitsCNN(), bench._loader(3, 8))
        assert probe.attached == [True, True, True]
        assert monitor.logged_steps == 0 and monitor.every_n_steps == bench.NEVER
        # the batch start records the step (steps 0, 1, 2) only where the hooks run
        assert monitor._train_step == (2 if hooks_run else 0)


def test_benchmark_models_train_side_by_side(tmp_path: Path) -> None:
    """``--model``: a benchmark model of bench_logging trains in turns with every module
    monitored, the defaults with either logger, the baseline and the twin (a few steps here:
    the full run is the benchmark's)."""
    bench = load_benchmark("bench_callbacks")
    for model, batch, size in (("mlp64", 128, 64), ("resnet18", 16, 3 * 32 * 32)):
        module, data, sources = bench.workload(model, 3, 999)  # its own batch size
        x, labels = next(iter(data))
        assert x.shape[0] == labels.shape[0] == batch and x[0].numel() == size
        assert sources == "net.*"
        assert len(data) >= 3 and module.net(x).shape == (batch, 10)
        again = next(iter(bench.workload(model, 3, 999)[1]))[0]
        assert torch.equal(x, again)  # the same data in every configuration
    names = list(bench.MODEL_CONFIGS)
    timers = bench._side_by_side(names, 4, 0, str(tmp_path), model="mlp64")
    assert set(timers) == {"monitor", "baseline", bench.RECORDER_LOGGER, bench.TWIN}
    assert all(len(t.wall) == 3 and min(t.wall) > 0 for t in timers.values())


def test_benchmark_table_of_a_benchmark_model_has_its_rows_only() -> None:
    bench = load_benchmark("bench_callbacks")
    keys = ("amortised", "non-logging step", "logging step")
    names = [n for n in bench.MODEL_CONFIGS if n != "baseline"]
    ratio = {n: dict.fromkeys(keys, 1.25) for n in names}
    result = {
        "ratio": {"wall": ratio, "cpu": ratio},
        "ratio_range": {"wall": {n: dict.fromkeys(keys, (1.0, 1.5)) for n in names}},
        "ms": {"wall": {n: dict.fromkeys(keys, 50.0) for n in ["baseline", *names]}},
        "rss_kib": None,
        "rss_steps": 2000,
    }
    out = bench.table(result)
    assert "| amortised | 50.00 | 50.00 | **1.250** (1.00–1.50) | 1.250 | <= 1.01 |" in out
    assert "the same monitor again" in out and "`lightning_recorder.TensorBoardLogger`" in out
    assert "histograms=False" not in out and "does nothing" not in out
    assert "peak RSS" not in out  # a benchmark model has no memory run
    assert out.count("\n") == 1 + 3 + 2 + 2  # header, the monitor, the twin, the other logger
    with pytest.raises(SystemExit):
        bench.main(["--idle", "--model", "mlp64"])  # --idle times the digits CNN only


# ------------------------------------------------------------------ loggers: W&B, tabular
def test_numpy_histogram_has_the_buckets_written_to_tensorboard() -> None:
    import numpy as np

    from lightning_recorder.callbacks._tensorboard import numpy_histogram
    from lightning_recorder.stats import histogram_raw_kwargs

    x = torch.arange(10.0)  # edges 0, 2.25, 4.5, 6.75, 9: no value on an inner edge
    kwargs = histogram_raw_kwargs(x, bins=4)
    assert kwargs is not None
    counts, edges = numpy_histogram(kwargs)
    want_counts, want_edges = np.histogram(x.numpy(), bins=4)
    np.testing.assert_array_equal(counts, want_counts)  # integer counts: exact
    # edges: the same linspace in float32 (monitor) and float64 (numpy)
    np.testing.assert_allclose(edges, want_edges, rtol=1e-6, atol=0)
    assert counts.sum() == kwargs["num"] == 10
    with pytest.raises(ValueError, match="bins \\+ 1 bucket limits"):
        numpy_histogram({**kwargs, "bucket_counts": kwargs["bucket_counts"][1:]})


def test_histogram_loggers_and_message_for_several_loggers(tmp_path: Path) -> None:
    from lightning_recorder.callbacks._tensorboard import histogram_loggers

    csv_logger, tb_logger = CSVLogger(tmp_path, name="csv"), TensorBoardLogger(tmp_path)
    assert histogram_loggers([csv_logger, tb_logger]) == ([tb_logger], [csv_logger])
    other = CSVLogger(tmp_path, name="csv2")
    monitor = FeatureStatsMonitor("probe", every_n_steps=1, parameters=False)
    with pytest.warns(UserWarning, match="loggers only; CSVLogger and CSVLogger get the") as rec:
        trainer = pl.Trainer(**QUIET, logger=[csv_logger, other], max_steps=1, callbacks=[monitor])
        trainer.fit(ProbeNet(), loader(features(8)))
    assert sum("W&B loggers only" in str(w.message) for w in rec) == 1


@pytest.mark.parametrize("per_logger", [None, {"TensorBoardLogger": ["mean", "histogram"]}])
def test_fast_dev_run_gives_no_logger_warning_and_still_reports(
    tmp_path: Path, recwarn: pytest.WarningsRecorder, per_logger: dict[str, list[str]] | None
) -> None:
    # fast_dev_run swaps every logger for Lightning's DummyLogger ("Logging and checkpointing is
    # suppressed"): it is no logger of the user's to warn about, nor to check `logger_stats`
    # against; the listeners still get the batch's statistics.
    monitor = FeatureStatsMonitor("probe", every_n_steps=1, logger_stats=per_logger)
    reports: list[Any] = []
    monitor.subscribe(reports.append)
    logger = TensorBoardLogger(tmp_path, name="fdr")
    trainer = pl.Trainer(**QUIET, logger=logger, fast_dev_run=True, callbacks=[monitor])
    trainer.fit(ProbeNet(), loader(features(8)))
    assert type(trainer.logger).__name__ == "DummyLogger"
    assert [str(w.message) for w in recwarn if "histograms" in str(w.message)] == []
    assert [r.step for r in reports] == [0] and monitor.logged_steps == 1
    assert not (tmp_path / "fdr").exists()  # nothing written


def _columns(log_dir: str) -> set[str]:
    with open(Path(log_dir) / "metrics.csv") as f:
        return {k for row in csv.DictReader(f) for k, v in row.items() if v and "/" in k}


def test_logger_stats_selects_per_logger(tmp_path: Path) -> None:
    csv_logger = CSVLogger(tmp_path, name="csv")
    tb_logger = TensorBoardLogger(tmp_path, name="tb")
    monitor = FeatureStatsMonitor(
        ["probe", "body.0"],
        every_n_steps=1,
        logger_stats={
            "CSVLogger": ["mean", "grad_norm"],
            "TensorBoardLogger": ["max", "histogram"],
        },
    )
    trainer = pl.Trainer(**QUIET, logger=[csv_logger, tb_logger], max_steps=2, callbacks=[monitor])
    trainer.fit(ProbeNet(), loader(features(8)))
    assert _columns(csv_logger.log_dir) == {
        "stats/train/probe/mean",
        "stats/train/body.0/mean",
        "stats/train/body.0.weight/grad_norm",
        "stats/train/body.0.bias/grad_norm",
    }
    tb = scalars(tb_logger.log_dir)
    assert {t.rsplit("/", 1)[1] for t in tb if t.startswith("stats/")} == {"max"}
    hist = events(tb_logger.log_dir).Histograms("stats/train/probe/histogram")
    assert len(hist) == 2


def test_no_histogram_warning_for_a_logger_whose_logger_stats_leave_histograms_out(
    tmp_path: Path, recwarn: pytest.WarningsRecorder
) -> None:
    # the docs' example: the CSV file readable, the histograms in TensorBoard
    csv_logger = CSVLogger(tmp_path, name="csv")
    tb_logger = TensorBoardLogger(tmp_path, name="tb")
    monitor = FeatureStatsMonitor(
        "probe",
        every_n_steps=1,
        logger_stats={
            "CSVLogger": ["mean", "std"],
            "TensorBoardLogger": ["mean", "std", "histogram"],
        },
    )
    trainer = pl.Trainer(**QUIET, logger=[tb_logger, csv_logger], max_steps=2, callbacks=[monitor])
    trainer.fit(ProbeNet(), loader(features(8)))
    assert [str(w.message) for w in recwarn if "histograms" in str(w.message)] == []
    assert len(events(tb_logger.log_dir).Histograms("stats/train/probe/histogram")) == 2
    assert _columns(csv_logger.log_dir) == {"stats/train/probe/mean", "stats/train/probe/std"}


def test_histogram_warning_suggests_the_logger_stats_entry_without_histogram(
    tmp_path: Path,
) -> None:
    csv_logger = CSVLogger(tmp_path, name="csv")
    monitor = FeatureStatsMonitor(
        "body.0", every_n_steps=1, logger_stats={"CSVLogger": ["histogram", "norm", "mean"]}
    )
    with pytest.warns(
        UserWarning,
        match=r"CSVLogger gets the scalar statistics\. To silence this warning, leave 'histogram' "
        r"out of `logger_stats` for CSVLogger \(logger_stats=\{'CSVLogger': \['mean', 'norm'\]\}\)",
    ):
        trainer = pl.Trainer(**QUIET, logger=csv_logger, max_steps=1, callbacks=[monitor])
        trainer.fit(ProbeNet(), loader(features(8)))


def test_histogram_warning_of_a_monitor_without_train_suggests_no_parameter_statistics(
    tmp_path: Path,
) -> None:
    # parameter statistics are training statistics: the suggested entry must be one the
    # monitor accepts
    monitor = FeatureStatsMonitor("body.0", stages=["val"], stats=["mean", "std"])
    with pytest.warns(UserWarning, match=r"\(logger_stats=\{'CSVLogger': \['mean', 'std'\]\}\)"):
        trainer = pl.Trainer(
            **QUIET, logger=CSVLogger(tmp_path, name="csv"), max_steps=1, callbacks=[monitor]
        )
        trainer.fit(ProbeNet(), loader(features(8)), loader(features(4)))
    FeatureStatsMonitor(
        "body.0", stages=["val"], stats=["mean", "std"], logger_stats={"CSVLogger": ["mean", "std"]}
    )


def test_logger_stats_without_histogram_writes_none(tmp_path: Path) -> None:
    tb_logger = TensorBoardLogger(tmp_path, name="tb")
    monitor = FeatureStatsMonitor(
        "probe", every_n_steps=1, logger_stats={"TensorBoardLogger": ["mean"]}
    )
    trainer = pl.Trainer(**QUIET, logger=tb_logger, max_steps=1, callbacks=[monitor])
    trainer.fit(ProbeNet(), loader(features(8)))
    assert events(tb_logger.log_dir).Tags()["histograms"] == []
    assert "stats/train/probe/mean" in scalars(tb_logger.log_dir)


@pytest.mark.parametrize(
    ("logger_stats", "match"),
    [
        ([("CSVLogger", ["mean"])], "`logger_stats` .* to be a mapping"),
        ({"CSVLogger": ["median"]}, r"`logger_stats\['CSVLogger'\]`.*but got 'median'"),
        ({"CSVLogger": 3}, "map logger class names to lists of statistics"),
    ],
)
def test_logger_stats_errors(logger_stats: Any, match: str) -> None:
    with pytest.raises(RecorderConfigError, match=match):
        FeatureStatsMonitor("probe", logger_stats=logger_stats)


@pytest.mark.parametrize(
    ("kwargs", "wanted"),
    [
        ({"histograms": False}, "histogram"),
        ({"parameters": False}, "norm"),
        ({"stages": ["val"]}, "grad_norm"),  # parameter statistics are training statistics
    ],
)
def test_logger_stats_cannot_ask_for_what_the_monitor_does_not_compute(
    kwargs: dict[str, Any], wanted: str
) -> None:
    # histograms=False writes no histogram, parameters=False (or no train stage) no norm: asking
    # a logger for one is an error, not a wish left unmet without a word
    with pytest.raises(
        RecorderConfigError, match=rf"`logger_stats\['TensorBoardLogger'\]`.*but got '{wanted}'"
    ):
        FeatureStatsMonitor("probe", logger_stats={"TensorBoardLogger": ["mean", wanted]}, **kwargs)
    FeatureStatsMonitor("probe", logger_stats={"TensorBoardLogger": ["mean"]}, **kwargs)


def test_logger_stats_key_must_name_a_logger_of_the_trainer(tmp_path: Path) -> None:
    monitor = FeatureStatsMonitor("probe", logger_stats={"CSVLoger": ["mean"]})
    trainer = pl.Trainer(**QUIET, logger=CSVLogger(tmp_path), max_steps=1, callbacks=[monitor])
    with pytest.raises(
        RecorderConfigError, match=r"'CSVLoger'.*Closest logger classes: 'CSVLogger'"
    ):
        trainer.fit(ProbeNet(), loader(features(8)))
    assert live_hooks() == []


def test_parameters_by_pattern_and_regex(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="p")
    monitor = FeatureStatsMonitor(
        "body", every_n_steps=1, histograms=False, parameters=["body.*.weight", r"re:body\.2\.b.*"]
    )
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=1, callbacks=[monitor])
    trainer.fit(ProbeNet(), loader(features(8)))
    got = {t.split("/")[2] for t in scalars(logger.log_dir) if t.endswith("/norm")}
    assert got == {"body.0.weight", "body.2.weight", "body.2.bias"}


@pytest.mark.parametrize(
    ("parameters", "match"),
    [
        (
            ["body.2.weight"],
            r"^`parameters` of FeatureStatsMonitor selects among the parameters of the monitored "
            r"modules, but 'body\.2\.weight' is a parameter of 'body\.2', which is not monitored\. "
            r"Add 'body\.2' to `sources` to get its statistics, or leave 'body\.2\.weight' out of "
            r"`parameters`\.$",
        ),
        (
            ["body.0.*", "body.2.*"],
            r"modules, but the pattern 'body\.2\.\*' matches only parameters of modules that are "
            r"not monitored: 'body\.2\.weight', 'body\.2\.bias' \(of 'body\.2'\)\. Add "
            r"'body\.2' to `sources` to get their statistics, or leave 'body\.2\.\*' out of "
            r"`parameters`\.$",
        ),
        (  # a name the model does not have: closest names, as before
            ["body.0.wieght"],
            r"of the monitored modules: No parameter named 'body\.0\.wieght' in the model\. "
            r"Closest parameter names: 'body\.0\.weight'",
        ),
    ],
)
def test_parameters_outside_the_monitored_modules_are_named(
    tmp_path: Path, parameters: list[str], match: str
) -> None:
    monitor = FeatureStatsMonitor("body.0", every_n_steps=1, parameters=parameters)
    logger = TensorBoardLogger(tmp_path, name="p")
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=1, callbacks=[monitor])
    with pytest.raises(UnknownSourceError, match=match):
        trainer.fit(ProbeNet(), loader(features(8)))
    assert live_hooks() == []


def test_class_name_source(tmp_path: Path) -> None:
    class Scale(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * x

    model = ProbeNet()
    model.probe = Scale()
    logger = TensorBoardLogger(tmp_path, name="c")
    monitor = FeatureStatsMonitor("Scale", every_n_steps=1, histograms=False)
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=1, callbacks=[monitor])
    x = features(8)
    trainer.fit(model, loader(x))
    assert scalars(logger.log_dir)["stats/train/probe/max"][0] == approx(2 * x[:4].max().item())


def test_write_wandb_logs_histograms_from_the_same_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    # wandb is not installed here, so a stand-in module and a stand-in logger (log_metrics
    # only) exercise the call; the conversion itself is tested on its own above.
    import sys
    import types

    import numpy as np

    from lightning_recorder.callbacks._tensorboard import write_wandb
    from lightning_recorder.stats import histogram_raw_kwargs

    class Histogram:
        def __init__(self, np_histogram: tuple[Any, Any]) -> None:
            self.counts, self.edges = np_histogram

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(Histogram=Histogram))
    logged: list[tuple[dict[str, Any], int]] = []

    class Logger:
        def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
            logged.append((metrics, step))

    kwargs = histogram_raw_kwargs(torch.tensor([0.0, 1.0, 1.0, 3.0]), bins=3)
    assert kwargs is not None
    write_wandb(Logger(), {"a/mean": 1.25}, {"a/histogram": kwargs}, 7)  # type: ignore[arg-type]
    ((metrics, step),) = logged
    assert step == 7 and metrics["a/mean"] == 1.25
    hist = metrics["a/histogram"]
    np.testing.assert_array_equal(hist.counts, [1.0, 2.0, 1.0])
    np.testing.assert_array_equal(hist.edges, kwargs["bucket_limits"])


# --- statistics in the hook: long steps, approximate histograms, parameter buffers ----------


class LongStep(pl.LightningModule):
    """A cell called ``calls`` times in one training step (an RNN unrolled by hand)."""

    def __init__(self, calls: int) -> None:
        super().__init__()
        self.cell = nn.Linear(64, 64)
        self.calls = calls
        self.held: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        h = batch[0]
        for _ in range(self.calls):
            h = torch.tanh(self.cell(h))
        monitor = FeatureStatsMonitor.of(self.trainer)
        self.held.append(monitor._held_bytes())
        return h.square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit_long_step(
    tmp_path: Path, exact: bool, calls: int = 4000
) -> tuple[LongStep, FeatureStatsMonitor, list[warnings.WarningMessage]]:
    torch.manual_seed(0)
    model = LongStep(calls)
    monitor = FeatureStatsMonitor(
        "cell",
        every_n_steps=1,
        stats=("mean", "numel"),
        exact_histograms=exact,
        histogram_sample=4096,  # each output (16 x 64) is sampled whole, then thinned
    )
    logger = TensorBoardLogger(tmp_path, name=f"long{exact}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pl.Trainer(**QUIET, logger=logger, max_steps=1, callbacks=[monitor]).fit(
            model, loader(torch.randn(16, 64), batch_size=16)
        )
    return model, monitor, caught


def test_long_step_holds_bounded_memory(tmp_path: Path) -> None:
    model, monitor, _ = fit_long_step(tmp_path, exact=False)
    records = 4000 * 16 * 64 * 4  # what keeping every output would hold: 16 MiB
    # small outputs copied until 2**19 elements, then reduced to packed states (merged every 64
    # rows), and at most four sample rows of histogram_sample elements kept for the module:
    # independent of the number of calls
    bound = (4 * monitor.histogram_sample + 2**19) * 4 + 65 * WIDTH * 8
    assert model.held[0] <= bound
    assert model.held[0] < records / 2
    logged = scalars(Path(tmp_path) / "longFalse" / "version_0")
    assert logged["stats/train/cell/numel"][0] == 4000 * 16 * 64
    hist = events(Path(tmp_path) / "longFalse" / "version_0").Histograms(
        "stats/train/cell/histogram"
    )
    # the sampled counts are scaled to the exact number of finite values
    assert sum(hist[0].histogram_value.bucket) == pytest.approx(4000 * 16 * 64, rel=1e-9)


def test_long_step_with_kept_records_warns_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(monitor_module, "_RECORDS_WARN_BYTES", 2**19)
    model, _, caught = fit_long_step(tmp_path, exact=True, calls=200)
    assert model.held[0] >= 200 * 16 * 64 * 4  # every output kept until the step ends
    ours = [w for w in caught if "MiB of records in one batch" in str(w.message)]
    assert len(ours) == 1


class Wide(pl.LightningModule):
    """One output of 2**18 elements per step: sampled, not copied whole, for the histogram."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(16, 1024)
        self.outputs: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out = self.wide(batch[0])
        self.outputs.append(out.detach().clone())
        return torch.relu_(out).mean()  # in place on the monitored output

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("exact", [False, True])
def test_large_output_histogram_sampled_or_exact(tmp_path: Path, exact: bool) -> None:
    torch.manual_seed(0)
    model = Wide()
    monitor = FeatureStatsMonitor(
        "wide", every_n_steps=1, parameters=False, clone=exact, exact_histograms=exact
    )
    logger = TensorBoardLogger(tmp_path, name="wide")
    data = torch.randn(256, 16)
    pl.Trainer(**QUIET, logger=logger, max_steps=1, callbacks=[monitor]).fit(
        model, loader(data, batch_size=256)
    )
    (event,) = events(logger.log_dir).Histograms("stats/train/wide/histogram")
    hist = event.histogram_value
    x = model.outputs[0].reshape(-1).double()
    # range, count and sums describe every element, exactly (float32 data, float64 sums)
    assert (hist.min, hist.max, hist.num) == (x.min().item(), x.max().item(), x.numel())
    assert hist.sum == pytest.approx(x.sum().item(), rel=1e-6, abs=1e-3)
    edges = torch.tensor(list(hist.bucket_limit), dtype=torch.float64)
    expected = torch.histogram(x, edges).hist / x.numel()
    got = torch.tensor(list(hist.bucket[1:]), dtype=torch.float64) / x.numel()
    if exact:
        # float32 bucket arithmetic: a value within rounding of an edge may move one bucket
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    else:
        # a strided sample of 2**18 / 17 = 15,420 values: each fraction has a standard error
        # of at most 0.5 / sqrt(15420) = 0.004; 0.015 is 3.7 of them
        torch.testing.assert_close(got, expected, rtol=0, atol=1.5e-2)
        assert got.sum().item() == pytest.approx(1.0, rel=1e-9)
    scalars_logged = scalars(logger.log_dir)
    assert scalars_logged["stats/train/wide/min"][0] == pytest.approx(x.min().item())  # pre-ReLU


class Positions(pl.LightningModule):
    """A module whose output is int64 ids beyond 2**24, where float32 holds only even ones."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 1)
        self.ids = nn.Identity()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.ids(torch.arange(2**25 + 1, 2**25 + 33).repeat(len(batch[0]), 1))
        return self.body(batch[0]).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("exact", [False, True])
def test_integer_outputs_are_bucketed_in_float64(tmp_path: Path, exact: bool) -> None:
    monitor = FeatureStatsMonitor(
        "ids", every_n_steps=1, bins=8, parameters=False, exact_histograms=exact
    )
    logger = TensorBoardLogger(tmp_path, name="ids")
    pl.Trainer(**QUIET, logger=logger, max_steps=1, callbacks=[monitor]).fit(
        Positions(), loader(torch.randn(4, 4), batch_size=4)
    )
    (event,) = events(logger.log_dir).Histograms("stats/train/ids/histogram")
    # 32 consecutive ids, 4 rows: 4 ids of each of 8 buckets per row, as torch.histogram has it
    ids = torch.arange(2**25 + 1, 2**25 + 33, dtype=torch.float64).repeat(4)
    assert list(event.histogram_value.bucket[1:]) == torch.histogram(ids, 8).hist.tolist()
    assert list(event.histogram_value.bucket[1:]) == [16.0] * 8


def test_parameter_buffers_are_allocated_once_on_the_cpu(tmp_path: Path) -> None:
    monitor = FeatureStatsMonitor("body.*", every_n_steps=1, histograms=False)
    seen: list[dict[str, int]] = []

    class Spy(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            params = monitor._params
            assert params is not None
            seen.append({n: t.data_ptr() for n, t in params._before.items()})

    logger = TensorBoardLogger(tmp_path, name="buffers")
    pl.Trainer(**QUIET, logger=logger, max_steps=3, callbacks=[monitor, Spy()]).fit(
        ProbeNet(), loader(features(12))
    )
    assert len(seen) == 3 and seen[0] and seen[0] == seen[1] == seen[2]
    ratios = scalars(logger.log_dir)["stats/train/body.0.weight/update_ratio"]
    assert sorted(ratios) == [0, 1, 2] and all(0 < r < 1 for r in ratios.values())


def test_parameter_copies_off_the_cpu_are_freed_after_each_logged_step() -> None:
    """On an accelerator (here the meta device) the copies taken before the optimizer step of a
    logged step are freed once its norms are taken: nothing is held between logged steps."""
    from lightning_recorder.callbacks._parameter_stats import ParameterStats

    weight = nn.Parameter(torch.ones(3, 4, device="meta"))
    weight.grad = torch.ones(3, 4, device="meta")
    stats = ParameterStats({"w": weight}, sharded=False)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    stats.before_step(optimizer)
    assert stats._before["w"].device.type == "meta"
    optimizer.step()  # a step that updates: no flag of a skipped step among the values
    stepped, found = stats.tensors()
    assert stepped == ["w"] and len(found) == 4
    assert not stats._before


class CountedName(str):
    """A parameter name that counts the comparisons made with it."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        CountedName.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_parameter_steps_are_noted_in_time_linear_in_the_parameters() -> None:
    """The parameters stepped in a logged step are noted with a lookup each, not by scanning
    those noted before: a model with thousands of parameter tensors paid a time quadratic in
    their number on every logged step (about 0.6 s a step for 10,000 tensors)."""
    from lightning_recorder.callbacks._parameter_stats import ParameterStats

    params = {CountedName(f"layers.{k}.weight"): nn.Parameter(torch.ones(1)) for k in range(400)}
    for param in params.values():
        param.grad = torch.ones(1)
    stats = ParameterStats(dict(params), sharded=False)
    CountedName.compared = 0
    optimizer = torch.optim.SGD(params.values(), lr=0.1)
    stats.before_step(optimizer)
    assert CountedName.compared < 4 * len(params)  # a scan made 400 * 399 / 2 comparisons
    optimizer.step()  # a step that updates: no flag of a skipped step among the values
    stepped, found = stats.tensors()
    assert stepped == list(params) and len(found) == 4 * len(params)


class CountedPrefixes(str):
    """A parameter name that counts the module names it is tested against as a prefix."""

    checked = 0

    def startswith(self, prefix: str | tuple[str, ...], *args: Any) -> bool:
        CountedPrefixes.checked += len(prefix) if isinstance(prefix, tuple) else 1
        return str.startswith(self, prefix, *args)


class Layers(pl.LightningModule):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(n)])
        self.head = nn.Linear(2, 1)  # not monitored

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch[0]
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_the_parameters_of_the_monitored_modules_are_found_in_time_linear_in_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each parameter's name was tested against every monitored module's name, a time
    quadratic in the size of the model when a pattern monitors every layer (2.2 s at the start
    of a run for 16,000 layers); a lookup per dot of the name now finds its modules."""
    canonical = monitor_module.canonical_name
    monkeypatch.setattr(monitor_module, "canonical_name", lambda n: CountedPrefixes(canonical(n)))
    CountedPrefixes.checked = 0
    monitor = FeatureStatsMonitor("layers.*", every_n_steps=1, histograms=False)
    reports: list[Any] = []
    monitor.subscribe(reports.append)
    pl.Trainer(**QUIET, logger=CSVLogger(tmp_path), max_steps=1, callbacks=[monitor]).fit(
        Layers(200), loader(features(4, 2)[:, :2])
    )
    assert CountedPrefixes.checked < 4 * 402  # every name against every module: 402 * 200
    expected = [f"layers.{k}.{kind}" for k in range(200) for kind in ("weight", "bias")]
    assert list(reports[0].parameters) == expected


@pytest.mark.parametrize("deterministic", [False, True])
def test_under_deterministic_algorithms_the_run_waits_for_the_engine_at_its_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, deterministic: bool
) -> None:
    """The engine's kernels run eagerly until its background compile is done, then compiled,
    and the two differ in the last bits: with Trainer(deterministic=True) two runs of one script
    logged histograms that differed with how soon the compile ended. There the run waits for it
    when it starts (before any step; never inside one); elsewhere it does not wait."""
    calls: list[bool] = []
    warm_up = monitor_module.warm_up

    def recorded(*args: Any, wait: bool = False, **kwargs: Any) -> None:
        calls.append(wait)
        warm_up(*args, wait=wait, **kwargs)

    monkeypatch.setattr(monitor_module, "warm_up", recorded)
    monitor = FeatureStatsMonitor(["body.0"], every_n_steps=1, histograms=False)
    with deterministic_algorithms():  # Lightning leaves the flags it sets: restored after
        trainer = pl.Trainer(
            **QUIET,
            logger=CSVLogger(tmp_path),
            max_steps=1,
            callbacks=[monitor],
            deterministic=deterministic,
        )
        trainer.fit(ProbeNet(), loader(features(4)))
    assert calls == [deterministic]


class Pair(nn.Module):
    """Returns two tensors of different scale: a mixed statistic would match neither."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.lin(x)
        return a, 10.0 * a.square() + 3.0


class PairNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.m = Pair()
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        a, b = self.m(batch[0])
        self.seen.append((a.detach().clone(), b.detach().clone()))
        return a.mean() + b.mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("exact", [False, True])
def test_paths_into_a_tuple_output_are_two_series(tmp_path: Path, exact: bool) -> None:
    torch.manual_seed(0)
    model = PairNet()
    sources = [{"source": "m", "path": 0}, {"source": "m", "path": 1}]
    monitor = FeatureStatsMonitor(
        sources,
        every_n_steps=1,
        parameters=False,
        clone=exact,
        stats=("mean", "max", "numel"),
        exact_histograms=exact,
    )
    logger = TensorBoardLogger(tmp_path, name="pair")
    pl.Trainer(**QUIET, logger=logger, max_steps=2, callbacks=[monitor]).fit(
        model, loader(features(16), batch_size=8)
    )
    logged = scalars(logger.log_dir)
    assert monitor.tag("train", "m/0", "mean") == "stats/train/m/0/mean"
    assert "stats/train/m/mean" not in logged
    for step, (a, b) in enumerate(model.seen):
        for key, tensor in (("m/0", a), ("m/1", b)):
            want = reference_stats(tensor)
            # float32 sums of 48 values and TensorBoard's float32 storage: 1e-5 relative
            for stat in ("mean", "max", "numel"):
                got = logged[f"stats/train/{key}/{stat}"][step]
                assert got == pytest.approx(want[stat], rel=1e-5, abs=1e-6), (key, stat)
    hists = events(logger.log_dir).Tags()["histograms"]
    assert sorted(hists) == ["stats/train/m/0/histogram", "stats/train/m/1/histogram"]


def test_source_dict_with_an_unknown_key_is_rejected() -> None:
    with pytest.raises(RecorderConfigError, match=r"`sources`.*'source' and 'path'.*'paht'"):
        FeatureStatsMonitor([{"source": "m", "paht": 0}])
    with pytest.raises(RecorderConfigError, match=r"`sources`.*'source' key"):
        FeatureStatsMonitor({"path": 0})


def test_logging_benchmark_quick_run(capsys: pytest.CaptureFixture[str]) -> None:
    """``benchmarks/bench_logging.py --quick``: every table, every row, positive ratios (a quick
    run measures, it does not judge)."""
    threads = torch.get_num_threads()
    try:
        bench = load_benchmark("bench_logging")
        report = bench.main(["--quick", "--models", "a"])
    finally:
        torch.set_num_threads(threads)
    assert set(report) == {"kernels", "parameters", "layer", "trainer"}
    assert report["kernels"][0].startswith("(engine: ")
    assert len(report["kernels"]) == 4 + 2  # a Gaussian and a ReLU tensor of 2**16
    (cnn,) = report["trainer"][4:]
    cells = [c.strip() for c in cnn.strip("|").split("|")]
    assert cells[0] == "(a) CNN (digits-sized)" and len(cells) == 8
    ratios = [float(c.split()[0]) for c in cells[1:7]]
    assert all(r > 0 for r in ratios)
    assert "floor: one read of each output" in capsys.readouterr().out


class SmallAndLarge(pl.LightningModule):
    """Outputs of both kinds in one step: ``large`` (2**15 elements, reduced in its hook),
    ``small`` (320, copied and reduced with the others at the end of the batch) and, with
    ``mixed``, a module called once with each kind (its two states merged)."""

    def __init__(self, mixed: bool) -> None:
        super().__init__()
        self.names = ("large", "small", "mixed") if mixed else ("large", "small")
        self.large = nn.Linear(8, 256)
        self.small = nn.Linear(8, 10)
        self.mixed = nn.Linear(8, 256)
        self.outputs: dict[str, list[torch.Tensor]] = {}
        for name in self.names:
            getattr(self, name).register_forward_hook(self._keep(name))

    def _keep(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            self.outputs.setdefault(name, []).append(out.detach().clone())

        return hook

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch[0]
        loss = self.large(x).relu().mean() + self.small(x[:32]).mean()
        if "mixed" in self.names:
            loss = loss + self.mixed(x).sum() + self.mixed(x[:1]).sum()  # 2**15, then 256
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("mixed", [False, True])
def test_small_and_large_outputs_in_one_step(tmp_path: Path, mixed: bool) -> None:
    torch.manual_seed(3)
    model = SmallAndLarge(mixed)
    monitor = FeatureStatsMonitor(list(model.names), every_n_steps=1, parameters=False)
    logger = TensorBoardLogger(tmp_path, name="kinds")
    pl.Trainer(**QUIET, logger=logger, max_steps=1, callbacks=[monitor]).fit(
        model, loader(torch.randn(128, 8) * 3 + 1, batch_size=128)
    )
    got = scalars(logger.log_dir)
    for name in model.names:
        expected = reference_stats(torch.cat([o.reshape(-1) for o in model.outputs[name]]))
        for stat in ("mean", "std", "min", "max", "abs_mean", "zero_fraction"):
            assert got[f"stats/train/{name}/{stat}"][0] == approx(expected[stat]), (name, stat)
    acc = events(logger.log_dir)
    nums = {
        name: acc.Histograms(f"stats/train/{name}/histogram")[0].histogram_value.num
        for name in model.names
    }
    expected_nums = {"large": 128 * 256, "small": 320, "mixed": 128 * 256 + 256}
    assert nums == {name: expected_nums[name] for name in model.names}


class SumLinear(pl.LightningModule):
    """``Linear(4, 1)`` trained on the sum of its outputs: the gradients are the inputs' sum
    (weight) and the batch size (bias)."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        self.lin = nn.Linear(4, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.lin(batch).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3, fused=self.fused)


@pytest.mark.parametrize("fused", [False, True])
def test_grad_norm_under_fp16_amp_is_unscaled_also_for_a_fused_optimizer(
    tmp_path: Path, fused: bool
) -> None:
    """A fused optimizer unscales the gradients inside its step, so Lightning leaves them
    scaled before it: the logged gradient norms are still those of the unscaled gradients."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    precision = pl.plugins.precision.MixedPrecision("16-mixed", "cpu", scaler=scaler)
    logger = TensorBoardLogger(tmp_path, name="amp")
    monitor = FeatureStatsMonitor(["lin"], every_n_steps=1, histograms=False)
    trainer = pl.Trainer(
        **QUIET, logger=logger, max_steps=1, plugins=[precision], callbacks=[monitor]
    )
    x = features(8, seed=3)
    trainer.fit(SumLinear(fused), DataLoader(x, batch_size=8))
    got = scalars(logger.log_dir)
    weight = x.half().double().sum(0).norm().item()  # autocast multiplies in float16
    assert got["stats/train/lin.weight/grad_norm"][0] == pytest.approx(weight, rel=5e-3)
    assert got["stats/train/lin.bias/grad_norm"][0] == pytest.approx(8.0, rel=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_steps_the_fp16_grad_scaler_skips_log_no_update_ratio(tmp_path: Path, fused: bool) -> None:
    """While the grad scaler calibrates it skips the first optimizer steps (never calling the
    optimizer's step, or, for a fused optimizer, calling it with its found_inf flag set): no
    parameter moves, and the update ratio of 0 logged for them described no update. Those steps
    log no update ratio; the gradient norms and norms are logged, and the steps that update
    log their ratio as before."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14)  # 2 steps skipped: 2**12 fits
    precision = pl.plugins.precision.MixedPrecision("16-mixed", "cpu", scaler=scaler)
    logger = TensorBoardLogger(tmp_path, name="amp")
    values = _Values()
    monitor = FeatureStatsMonitor(["lin"], every_n_steps=1, histograms=False)
    trainer = pl.Trainer(
        **QUIET, logger=logger, max_steps=5, plugins=[precision], callbacks=[values, monitor]
    )
    trainer.fit(SumLinear(fused), DataLoader(features(40, seed=3), batch_size=8))
    moved = [
        s
        for s in range(5)
        if not values.after[s]["lin.weight"].equal(values.before[s]["lin.weight"])
    ]
    assert moved == [2, 3, 4] and scaler.get_scale() == 2.0**12
    got = scalars(logger.log_dir)
    for name in ("lin.weight", "lin.bias"):
        assert got[f"stats/train/{name}/norm"].keys() == {0, 1, 2, 3, 4}
        assert got[f"stats/train/{name}/grad_norm"].keys() == {0, 1, 2, 3, 4}
        assert got[f"stats/train/{name}/update_ratio"].keys() == set(moved)
        for step in moved:
            before, after = values.before[step][name], values.after[step][name]
            ratio = ((after - before).norm() / before.norm()).item()
            # float32 norms against float64 ones, stored as float32
            tag = f"stats/train/{name}/update_ratio"
            assert got[tag][step] == pytest.approx(ratio, rel=1e-5)
