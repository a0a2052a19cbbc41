"""FeatureStatsMonitor with Lightning as people use it: several optimizers, several evaluation
dataloaders, sparse outputs, and the engine compiled in the background during a real fit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.models import QUIET, loader, scalars
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from lightning_recorder import FeatureStatsMonitor
from lightning_recorder.stats import _engine as engine

ROOT = Path(__file__).resolve().parents[2]


# --- several optimizers: Lightning's GAN pattern --------------------------------------------


class GAN(pl.LightningModule):
    """Lightning's manual-optimization GAN pattern: ``zero_grad`` before each backward, the
    discriminator stepped before the generator; a spy records each step's gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
        self.discriminator = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 1))
        self.seen: dict[int, dict[str, tuple[float, torch.Tensor]]] = {}

    def _record(self, module: nn.Module, prefix: str) -> None:
        step = self.trainer.fit_loop.epoch_loop._batches_that_stepped
        found = self.seen.setdefault(step, {})
        for name, p in module.named_parameters():
            assert p.grad is not None
            found[f"{prefix}.{name}"] = (p.grad.norm().item(), p.detach().clone())

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        noise = torch.randn(real.shape[0], 4)
        fake = self.generator(noise)
        # discriminator: real vs fake (the generator's output detached)
        d_loss = (
            nn.functional.softplus(-self.discriminator(real)).mean()
            + nn.functional.softplus(self.discriminator(fake.detach())).mean()
        )
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        self._record(self.discriminator, "discriminator")
        opt_d.step()
        # generator: fool the discriminator
        g_loss = nn.functional.softplus(-self.discriminator(self.generator(noise))).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        self._record(self.generator, "generator")
        opt_g.step()

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.SGD(self.generator.parameters(), lr=0.1, momentum=0.5),
            torch.optim.SGD(self.discriminator.parameters(), lr=0.1, momentum=0.5),
        )


def test_gan_gradients_are_those_of_each_parameters_own_optimizer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GAN()
    monitor = FeatureStatsMonitor(["generator.0", "discriminator.0"], every_n_steps=1)
    logger = TensorBoardLogger(tmp_path, name="gan")
    data = torch.randn(40, 6) * 2 + 1
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=8, callbacks=[monitor])
    trainer.fit(model, loader(data, batch_size=8))
    logged = scalars(logger.log_dir)
    # manual optimization with two optimizers: Lightning counts a step per optimizer step
    steps = sorted(logged["stats/train/generator.0.weight/grad_norm"])
    assert len(steps) >= 3
    for name in ("generator.0.weight", "discriminator.0.weight", "discriminator.0.bias"):
        grads = logged[f"stats/train/{name}/grad_norm"]
        ratios = logged[f"stats/train/{name}/update_ratio"]
        for step, value in grads.items():
            norm, before = model.seen[step][name]
            assert value == pytest.approx(norm, rel=1e-5), (name, step)
            if step + 1 in model.seen:  # the value after this step: the next one's before
                after = model.seen[step + 1][name][1]
                ratio = (after - before).norm() / (before.norm() + 1e-12)
                assert ratios[step] == pytest.approx(ratio.item(), rel=1e-4), (name, step)
        # the generator's gradient of its own step, not the one left from the last batch
        assert len(set(grads.values())) == len(grads)


# --- several evaluation dataloaders ------------------------------------------------------------


class TwoLoaders(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 5), nn.ReLU())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.body(batch[0]).mean()

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.body(batch[0])

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.body(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the body stays as it is


def linear_out(model: TwoLoaders, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.body[0](x)


@pytest.mark.parametrize("pool", [False, True])
def test_each_dataloader_is_a_series_of_its_own(tmp_path: Path, pool: bool) -> None:
    torch.manual_seed(0)
    model = TwoLoaders()
    near, far = torch.randn(12, 3), torch.randn(8, 3) * 5 + 30
    monitor = FeatureStatsMonitor("body.0", stages=("val", "test"), pool_dataloaders=pool)
    logger = TensorBoardLogger(tmp_path, name=f"pool{pool}")
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=2, callbacks=[monitor])
    trainer.fit(model, loader(torch.randn(8, 3)), [loader(near, 4), loader(far, 4)])
    trainer.test(model, [loader(near, 4), loader(far, 4)])
    logged = scalars(logger.log_dir)
    for stage in ("val", "test"):
        if pool:
            both = linear_out(model, torch.cat([near, far]))
            (mean,) = logged[f"stats/{stage}/body.0/mean"].values()
            assert mean == pytest.approx(both.double().mean().item(), rel=1e-5)
            assert not any("dataloader_idx" in tag for tag in logged)
            continue
        for k, data in enumerate((near, far)):
            out = linear_out(model, data).double()
            tag = f"stats/{stage}/body.0/{{}}/dataloader_idx_{k}"
            (mean,) = logged[tag.format("mean")].values()
            (std,) = logged[tag.format("std")].values()
            assert mean == pytest.approx(out.mean().item(), rel=1e-5)
            assert std == pytest.approx(out.std().item(), rel=1e-5)
        assert f"stats/{stage}/body.0/mean" not in logged
    if not pool:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(logger.log_dir, size_guidance={"histograms": 0})
        events.Reload()
        tags = events.Tags()["histograms"]
        assert "stats/val/body.0/histogram/dataloader_idx_1" in tags
        (hist,) = events.Histograms("stats/test/body.0/histogram/dataloader_idx_1")
        assert hist.histogram_value.min == pytest.approx(linear_out(model, far[:4]).min().item())


# --- sparse outputs ---------------------------------------------------------------------------


class Sparse(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 1.0, x, 0.0).to_sparse()


class SparseNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.sparse = Sparse()
        self.head = nn.Linear(4, 1)
        self.outputs: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out = self.sparse(batch[0])
        self.outputs.append(out.to_dense())
        return self.head(out.to_dense()).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_sparse_output_counts_its_implicit_zeros(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = SparseNet()
    monitor = FeatureStatsMonitor("sparse", every_n_steps=1, stats=("mean", "zero_fraction"))
    logger = TensorBoardLogger(tmp_path, name="sparse")
    pl.Trainer(**QUIET, logger=logger, max_steps=2, callbacks=[monitor]).fit(
        model, loader(torch.randn(16, 4), 8)
    )
    logged = scalars(logger.log_dir)
    for step, dense in enumerate(model.outputs):
        assert logged["stats/train/sparse/mean"][step] == pytest.approx(dense.mean().item())
        zeros = (dense == 0).double().mean().item()
        assert logged["stats/train/sparse/zero_fraction"][step] == pytest.approx(zeros)


# --- the engine during a real fit ----------------------------------------------------------------


class Wide(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 4096), nn.ReLU(), nn.Linear(4096, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.body(batch[0]).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.slow
def test_compiled_in_the_background_never_inside_a_training_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fit starts compiling (and building the CPU kernel) at attach, in a thread; steps run
    eagerly until they are ready and by them afterwards, and no step waits for a compile."""
    monkeypatch.setenv("LIGHTNING_RECORDER_COMPILE", "1")
    engine.reset_compiled()
    started = []
    compile_thread = engine._COMPILER

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            started.append(compile_thread.status())

    def model_and_data() -> tuple[Wide, Any]:
        torch.manual_seed(0)
        return Wide(), loader(torch.randn(48, 16), 16)

    monitor = FeatureStatsMonitor("body.*", every_n_steps=1)
    logger = TensorBoardLogger(tmp_path, name="compiled")
    trainer = pl.Trainer(**QUIET, logger=logger, max_steps=3, callbacks=[monitor, Spy()])
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*computes feature statistics eagerly")
            trainer.fit(*model_and_data())
        engine.warm_up("cpu", [torch.float32], wait=True)
        # on the CPU, float32 states run in the CPU kernel (built in the same thread)
        assert "CPU kernel loaded" in engine.compile_status()
        # a second fit runs the CPU kernel and the compiled graphs from its first logged step
        second = TensorBoardLogger(tmp_path, name="compiled2")
        pl.Trainer(**QUIET, logger=second, max_steps=3, callbacks=[monitor]).fit(*model_and_data())
    finally:
        monkeypatch.undo()
        engine.reset_compiled()
    assert started and all(not s.startswith("failed") for s in started)
    first, again = scalars(logger.log_dir), scalars(second.log_dir)
    for tag in ("stats/train/body.0/mean", "stats/train/body.1/zero_fraction"):
        for step in (0, 1, 2):  # the same model and data: eager and compiled agree
            assert first[tag][step] == pytest.approx(again[tag][step], rel=1e-6), tag


NO_HOME = textwrap.dedent(
    """
    import os, torch, lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from torch import nn
    from lightning_recorder import FeatureStatsMonitor

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 300), nn.ReLU())
        def training_step(self, batch, batch_idx):
            return self.body(batch[0]).mean()
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8)), 16)
    pl.Trainer(max_steps=2, logger=CSVLogger(os.environ["LOGS"]), enable_progress_bar=False,
               enable_checkpointing=False, enable_model_summary=False,
               callbacks=[FeatureStatsMonitor("body.*", every_n_steps=1)]).fit(Net(), data)
    """
)


def test_without_home_nothing_is_written_into_the_working_directory(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "XDG_CACHE_HOME")}
    env.update(PYTHONPATH=str(ROOT), LOGS=str(tmp_path / "logs"))
    subprocess.run([sys.executable, "-c", NO_HOME], cwd=work, env=env, check=True, timeout=600)
    assert list(work.iterdir()) == []
    assert (tmp_path / "logs").is_dir()


# --- reports for listeners ---------------------------------------------------------------------


class Dying(pl.LightningModule):
    """A ReLU whose third unit never fires (its bias is very negative) and a tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.act = nn.ReLU()
        self.conv = nn.Conv2d(1, 2, 3)
        self.squash = nn.Tanh()
        with torch.no_grad():
            self.lin.bias[2] = -100.0
        self.outputs: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = batch[0]
        hidden = self.act(self.lin(x))
        image = self.squash(self.conv(x[:, :1, None, None].expand(-1, 1, 5, 5) * 3))
        self.outputs.append({"act": hidden.detach(), "squash": image.detach()})
        return hidden.mean() + image.mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_listeners_get_every_statistic_and_the_tracked_channels(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Dying()
    monitor = FeatureStatsMonitor(["act", "squash", "lin"], every_n_steps=2, stats=("mean",))
    reports: list[Any] = []
    monitor.subscribe(reports.append)
    monitor.subscribe(reports.append)  # once only
    monitor.track_channels(lambda name, module: isinstance(module, (nn.ReLU, nn.Tanh)))
    logger = TensorBoardLogger(tmp_path, name="reports")
    pl.Trainer(**QUIET, logger=logger, max_steps=4, callbacks=[monitor]).fit(
        model, loader(torch.randn(16, 3), 4)
    )
    assert [r.step for r in reports] == [1, 3] and all(r.stage == "train" for r in reports)
    report = reports[0]
    assert report.modules == ("act", "squash", "lin")
    act = model.outputs[1]["act"].double()
    assert report.stat("zero_fraction", "act") == pytest.approx((act == 0).double().mean().item())
    assert report.stat("std", "act") == pytest.approx(act.std().item(), rel=1e-9)
    assert set(report.channels) == {"act", "squash"}
    low, high, _ = report.channels["act"]
    assert high.tolist() == pytest.approx(act.amax(0).tolist()) and high[2] == 0.0
    squash = model.outputs[1]["squash"].double()
    assert report.channels["squash"].shape == (3, 2)
    assert low.tolist() == pytest.approx(act.amin(0).tolist())
    assert report.channels["squash"][2].tolist() == pytest.approx(
        squash.abs().amin((0, 2, 3)).tolist()
    )
    assert set(report.parameters["lin.weight"]) == {"norm", "grad_norm", "update_ratio"}
    assert report.histograms is not None and report.histograms.shape[0] == 3
    logged = scalars(logger.log_dir)
    assert "stats/train/act/std" not in logged  # listeners see more than the loggers
    with pytest.raises(Exception, match="Expected a callable"):
        monitor.subscribe(3)  # type: ignore[arg-type]
    monitor.unsubscribe(reports.append)
    assert monitor._listeners == []


def test_a_path_into_a_tensor_output_says_to_leave_the_path_out(tmp_path: Path) -> None:
    """A `path` given for a module that returns a plain tensor (an HF layer that no longer
    returns a tuple) fails naming the recorded value and what would work, and leaves no hook."""
    from helpers.models import ProbeNet, features

    from lightning_recorder import RecorderConfigError

    model = ProbeNet()
    monitor = FeatureStatsMonitor([{"source": "body.0", "path": 0}], every_n_steps=1)
    logger = TensorBoardLogger(tmp_path, name="path", version=0)
    trainer = pl.Trainer(**QUIET, max_steps=1, logger=logger, callbacks=[monitor])
    with pytest.raises(RecorderConfigError) as caught:
        trainer.fit(model, loader(features(8)))
    message = str(caught.value)
    assert "`path` item 0 does not exist in the recorded value, which is a Tensor" in message
    assert "leave `path` out to take the whole output" in message
    assert not any(m._forward_hooks for m in model.modules())


def test_channels_are_tracked_on_training_steps_only(tmp_path: Path) -> None:
    """The per-channel extremes are kept on logged training steps (an evaluation report has
    none), so a monitor without "train" in `stages` refuses `track_channels` at the call, where
    it did nothing without a word; a HealthMonitor beside such a monitor does not ask it."""
    from helpers.models import ProbeNet, features

    from lightning_recorder import DeadUnitsRule, HealthMonitor, RecorderConfigError

    monitor = FeatureStatsMonitor("body.1", every_n_steps=1, stats=("mean",), histograms=False)
    reports: list[Any] = []
    monitor.subscribe(reports.append)
    monitor.track_channels(lambda name, module: True)
    logger = TensorBoardLogger(tmp_path, name="channels", version=0)
    trainer = pl.Trainer(
        **QUIET, logger=logger, max_epochs=1, num_sanity_val_steps=0, callbacks=[monitor]
    )
    trainer.fit(ProbeNet(), loader(features(8)), loader(features(8, seed=1)))
    assert [(r.stage, r.step) for r in reports] == [("train", 0), ("train", 1), ("val", 1)]
    assert [r.channels["body.1"].shape for r in reports[:2]] == [(3, 8), (3, 8)]
    assert reports[2].channels == {}

    val_only = FeatureStatsMonitor("body.1", stages="val", histograms=False)
    with pytest.raises(
        RecorderConfigError,
        match=r"Expected `stages` of FeatureStatsMonitor\(\['body.1'\]\) to hold 'train' for "
        r"track_channels, .* but got stages=\['val'\], where none would be kept\. Add 'train'",
    ):
        val_only.track_channels(lambda name, module: True)
    assert val_only._selectors == []
    # HealthMonitor's DeadUnitsRule tracks channels: with a monitor of validation only, the fit
    # runs (its rules warn that they read no training statistics)
    health = HealthMonitor(rules=[DeadUnitsRule()], evidence_max_bytes=0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pl.Trainer(
            **QUIET,
            logger=logger,
            max_epochs=1,
            num_sanity_val_steps=0,
            callbacks=[val_only, health],
        ).fit(ProbeNet(), loader(features(8)), loader(features(8, seed=1)))
    assert any("monitors none (stages=('val',))" in str(w.message) for w in record)
    assert val_only._selectors == [] and health.events == []
