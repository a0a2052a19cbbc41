"""The package on a CUDA device: results against the CPU's, real GPU training runs, and the host
synchronisations that the callbacks add to a training step.

Skipped where no CUDA device is available (hardware, not a failure). Synchronisations are
counted with ``torch.cuda.set_sync_debug_mode("warn")``: every synchronising CUDA call (a
device-to-host copy, ``.item()``, a blocking host-to-device copy, ``nonzero`` …) warns, and each
warning is counted with its Python stack. A step's window runs from the first callback's
``on_train_batch_start`` to the last callback's ``on_train_batch_end``: the forward, backward and
optimizer step and every hook of our callbacks. The same Trainer without our callback is counted
step by step too, so that what Lightning itself synchronises is not charged to the callbacks.
"""

from __future__ import annotations

import traceback
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_recorder import (
    FeatureDistillation,
    FeatureStats,
    FeatureStatsMonitor,
    RecorderManager,
    feature_stats,
    histogram,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


# ---------------------------------------------------------------------------- helpers
class SyncCounter:
    """Counts synchronising CUDA calls between :meth:`begin` and :meth:`end`, with stacks."""

    def __init__(self) -> None:
        self.stacks: list[str] | None = None
        self._catcher: Any = None

    def begin(self) -> None:
        self._catcher = warnings.catch_warnings()
        self._catcher.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show
        self.stacks = []
        torch.cuda.set_sync_debug_mode("warn")

    def _show(self, message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        if self.stacks is not None and "synchroniz" in str(message):
            self.stacks.append("".join(traceback.format_stack()[-12:-2]))

    def end(self) -> list[str]:
        torch.cuda.set_sync_debug_mode(0)
        self._catcher.__exit__(None, None, None)
        stacks, self.stacks = self.stacks or [], None
        return stacks


class _WindowStart(pl.Callback):
    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.counter.begin()


class _WindowEnd(pl.Callback):
    """Closes the window; records ``(global step at its start, stacks)`` per step."""

    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter
        self.steps: list[list[str]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.steps.append(self.counter.end())

    def on_exception(self, *args: Any) -> None:
        if self.counter.stacks is not None:
            self.counter.end()


def _batches(n: int, shape: tuple[int, ...], classes: int, seed: int = 0) -> list[Any]:
    """Batches already on the GPU: the loader then copies nothing from the host."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(shape, generator=g).to(CUDA), torch.randint(0, classes, (shape[0],)).to(CUDA))
        for _ in range(n)
    ]


def _loader(batches: list[Any]) -> DataLoader:
    return DataLoader(batches, batch_size=None)  # each item is a whole batch


def _trainer(tmp_path: Path, steps: int, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = {
        "accelerator": "gpu",
        "devices": 1,
        "max_steps": steps,
        "logger": TensorBoardLogger(str(tmp_path), name="", version=""),
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)


class ConvNet(pl.LightningModule):
    """A tiny CNN whose step returns its loss and does nothing that synchronises."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
        )
        self.head = nn.Linear(2 * width, 4)
        self.spare = nn.Linear(4, 4)  # never called: a monitored module with nothing recorded

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x).mean((2, 3)))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class MLP(pl.LightningModule):
    """Linear layers only: float32 matrix products on the GPU are not TF32 by default, so its
    results are comparable with the CPU's to about 1e-6."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, width), nn.ReLU(), nn.Linear(width, width))
        self.head = nn.Linear(width, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x).relu())

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _teacher_mlp(width: int = 16) -> nn.Module:
    torch.manual_seed(1)
    teacher = nn.Sequential(
        nn.Linear(12, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4)
    )
    return teacher.requires_grad_(False)


class _TeacherCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        net = ConvNet(16)  # twice the student's width: connectors
        self.features, self.head = net.features, net.head

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x).mean((2, 3)))


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def _histogram_tags(logdir: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"histograms": 0})
    events.Reload()
    return events.Tags()["histograms"]


# ---------------------------------------------------------------------------- CUDA vs CPU
def _sample(seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, 41, generator=g) * 3.0 + 1.5
    x[::7, 3] = 0.0
    x[5, 5], x[9, 1], x[17, 2] = float("nan"), float("inf"), float("-inf")
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_feature_stats_cuda_matches_cpu(dtype: torch.dtype) -> None:
    x = _sample().to(dtype)
    on_cpu = feature_stats(x)
    on_gpu = feature_stats(x.to(CUDA))
    assert all(v.device.type == "cuda" for v in on_gpu.values())
    for name, expected in on_cpu.items():
        # Both paths sum in float64 (the CPU in chunks, the GPU in one masked pass): they differ
        # by summation order only, far below 1e-10 relative for 12 300 values; min, max and the
        # counts select or count elements and agree to the last bit within that tolerance.
        torch.testing.assert_close(on_gpu[name].cpu(), expected, rtol=1e-10, atol=1e-12, msg=name)


def test_feature_stats_metric_cuda_matches_cpu() -> None:
    parts = [_sample(seed) for seed in range(3)]
    metrics = {"cpu": FeatureStats(), "cuda": FeatureStats().to(CUDA)}
    for part in parts:
        metrics["cpu"].update(part)
        metrics["cuda"].update(part.to(CUDA))
    on_cpu, on_gpu = metrics["cpu"].compute(), metrics["cuda"].compute()
    for name, expected in on_cpu.items():
        # float64 streaming merges on both devices; order of summation only (see above)
        torch.testing.assert_close(on_gpu[name].cpu(), expected, rtol=1e-10, atol=1e-12, msg=name)


def test_histogram_cuda_matches_cpu() -> None:
    x = _sample()
    counts_cpu, edges_cpu = histogram(x, bins=30)
    counts_gpu, edges_gpu = histogram(x.to(CUDA), bins=30)
    assert counts_gpu.device.type == "cuda"
    # The edges come from the same float64 min and max, by host and by device arithmetic: an ulp
    # or two apart at most.
    torch.testing.assert_close(edges_gpu.cpu(), edges_cpu, rtol=1e-14, atol=1e-14)
    # Every finite value is counted once on both devices ...
    finite = int(torch.isfinite(x).sum())
    assert counts_cpu.sum().item() == finite
    assert counts_gpu.sum().item() == finite
    # ... in the same bucket, except a value within an ulp of an edge (edges computed two ways),
    # which may move to the next one: a count may differ by one.
    torch.testing.assert_close(counts_gpu.cpu(), counts_cpu, rtol=0, atol=1)


def test_recorders_on_cuda_match_cpu() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.Conv2d(6, 4, 3)).double()
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64)
    configs = {
        "conv": {"type": "ModuleOutputs", "source": "0"},
        "last": {"type": "ModuleOutputs", "source": "2"},
        "weights": {"type": "Parameter", "source": "*.weight"},
    }
    records: dict[str, dict[str, Any]] = {}
    for device in ("cpu", "cuda"):
        net = model.to(device)
        manager = RecorderManager(configs)
        manager.initialize(net)
        try:
            with manager:
                out = net(x.to(device))
            records[device] = {
                "conv": manager.get_recorder("conv").get_record_data(),
                "last": manager.get_recorder("last").get_record_data(),
                "out": out.detach(),
                "weights": sorted(manager.get_recorder("weights").streams),
            }
        finally:
            manager.release()
    assert records["cuda"]["conv"].device.type == "cuda"
    assert records["cuda"]["weights"] == records["cpu"]["weights"] == ["0.weight", "2.weight"]
    for key in ("conv", "last", "out"):
        # float64 convolutions: CPU and cuDNN kernels differ by summation order only
        torch.testing.assert_close(
            records["cuda"][key].cpu(), records["cpu"][key], rtol=1e-10, atol=1e-12, msg=key
        )
    # what was recorded is what the module returned, on the device
    torch.testing.assert_close(records["cuda"]["last"], records["cuda"]["out"], rtol=0, atol=0)


# ---------------------------------------------------------------------------- training on a GPU
def _monitor_run(tmp_path: Path, accelerator: str) -> tuple[FeatureStatsMonitor, Path]:
    torch.manual_seed(0)
    model = MLP()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(32, 12, generator=g), torch.randint(0, 4, (32,), generator=g))]
    monitor = FeatureStatsMonitor(["body.0", "body.2", "head"], every_n_steps=1, parameters=True)
    logdir = tmp_path / accelerator
    trainer = _trainer(logdir, 1, [monitor], accelerator=accelerator, log_every_n_steps=1)
    trainer.fit(model, _loader(batches))
    return monitor, logdir


def test_monitor_trains_on_gpu_and_matches_cpu(tmp_path: Path) -> None:
    gpu_monitor, gpu_dir = _monitor_run(tmp_path, "gpu")
    _, cpu_dir = _monitor_run(tmp_path, "cpu")
    assert (gpu_monitor.logged_steps, gpu_monitor.last_logged_step) == (1, 0)
    on_gpu, on_cpu = _scalars(gpu_dir), _scalars(cpu_dir)
    stats = [t for t in on_cpu if t.startswith("stats/")]
    assert "stats/train/body.0/mean" in stats and "stats/train/body.0.weight/update_ratio" in stats
    assert sorted(t for t in on_gpu if t.startswith("stats/")) == sorted(stats)
    for tag in stats:
        (step_gpu, value_gpu), (step_cpu, value_cpu) = on_gpu[tag][0], on_cpu[tag][0]
        assert step_gpu == step_cpu == 0
        # Same weights and data; float32 matrix products (not TF32) and gradients differ by about
        # 1e-6 relative between the devices; TensorBoard stores float32. Update ratios are
        # ratios of small differences: looser.
        rtol = 1e-3 if tag.endswith("update_ratio") else 1e-4
        torch.testing.assert_close(value_gpu, value_cpu, rtol=rtol, atol=1e-5, msg=tag)
    assert sorted(_histogram_tags(gpu_dir)) == sorted(_histogram_tags(cpu_dir))
    assert "stats/train/head/histogram" in _histogram_tags(gpu_dir)


def test_distillation_trains_on_gpu_and_matches_cpu(tmp_path: Path) -> None:
    losses: dict[str, float] = {}
    for accelerator in ("cpu", "gpu"):
        torch.manual_seed(0)
        student = MLP()
        teacher = _teacher_mlp()
        distill = FeatureDistillation(
            teacher, {"body.2": "2", "head": "4"}, loss={"body.2": "mse", "head": "kl"}
        )
        g = torch.Generator().manual_seed(3)
        batches = [(torch.randn(32, 12, generator=g), torch.randint(0, 4, (32,), generator=g))]
        trainer = _trainer(tmp_path / accelerator, 1, [distill], accelerator=accelerator)
        trainer.fit(student, _loader(batches))
        losses[accelerator] = float(trainer.logged_metrics["distill/total"])
        if accelerator == "gpu":
            assert next(teacher.parameters()).device.type == "cuda"
    # same weights and data (equal widths: no connector to initialise); float32 products
    # differ by about 1e-6 relative between the devices
    torch.testing.assert_close(losses["gpu"], losses["cpu"], rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------- synchronisations
STEPS, EVERY = 13, 4  # the monitor logs steps 3, 7 and 11


def _sync_run(tmp_path: Path, callbacks: list[pl.Callback], model: pl.LightningModule) -> list:
    counter = SyncCounter()
    end = _WindowEnd(counter)
    trainer = _trainer(
        tmp_path, STEPS, [_WindowStart(counter), *callbacks, end], log_every_n_steps=EVERY
    )
    batches = _batches(STEPS, (16, 3, 12, 12), 4)
    torch.cuda.synchronize()
    trainer.fit(model, _loader(batches))
    assert len(end.steps) == STEPS
    return end.steps


def _excess(ours: list[list[str]], bare: list[list[str]], step: int) -> int:
    return len(ours[step]) - len(bare[step])


def _report(ours: list[list[str]], step: int) -> str:
    return f"step {step}: {len(ours[step])} syncs\n" + "\n----\n".join(ours[step])


@pytest.fixture(scope="module")
def bare_steps(tmp_path_factory: pytest.TempPathFactory) -> list[list[str]]:
    """The syncs of the plain Trainer, step by step (Lightning's own)."""
    torch.manual_seed(0)
    return _sync_run(tmp_path_factory.mktemp("bare"), [], ConvNet())


def test_monitor_syncs(tmp_path: Path, bare_steps: list[list[str]]) -> None:
    torch.manual_seed(0)
    monitor = FeatureStatsMonitor(
        ["features.0", "features.2", "head", "spare"], every_n_steps=EVERY, parameters=True
    )
    ours = _sync_run(tmp_path, [monitor], ConvNet())
    assert monitor.logged_steps == 3 and monitor.last_logged_step == 11
    logging = {3, 7, 11}
    # Step 0 is left out: what the first CUDA step of a process synchronises (lazy
    # initialisation) depends on what ran before it, here the bare run or not.
    for step in range(1, STEPS):
        if step in logging:
            # histograms, statistics and parameter norms come to the host in one copy
            assert _excess(ours, bare_steps, step) == 1, _report(ours, step)
        else:
            assert _excess(ours, bare_steps, step) == 0, _report(ours, step)


def test_distillation_syncs(tmp_path: Path, bare_steps: list[list[str]]) -> None:
    torch.manual_seed(0)
    distill = FeatureDistillation(
        _TeacherCNN(),
        {"features.0": "features.0", "features.2": "features.2", "head": "head"},
        loss={"features.0": "mse", "features.2": "mse", "head": "kl"},
    )
    ours = _sync_run(tmp_path, [distill], ConvNet())
    connector = distill.connectors["features.2"]  # 16 student channels to 32
    assert all(p.device.type == "cuda" for p in connector.parameters())
    # Step 0 builds the connectors on the host and moves them to the GPU (a host-to-device copy
    # each): set-up, not the step's cost (and see test_monitor_syncs).
    for step in range(1, STEPS):
        assert _excess(ours, bare_steps, step) == 0, _report(ours, step)
