"""The package on a CUDA device: recorders against the CPU, real GPU training runs, and the host
synchronisations that the callbacks add to a training step (the statistics engine itself:
``test_engine_cuda.py``).

Skipped where no CUDA device is available (hardware, not a failure). Synchronisations are
counted with ``torch.cuda.set_sync_debug_mode("warn")``: every synchronising CUDA call (a
device-to-host copy, ``.item()``, a blocking host-to-device copy, ``nonzero`` …) warns, and each
warning is counted with its Python stack. A step's window runs from the first callback's
``on_train_batch_start`` to the last callback's ``on_train_batch_end``: the forward, backward and
optimizer step and every hook of our callbacks. The same Trainer without our callback is counted
step by step too, so that what Lightning itself synchronises is not charged to the callbacks.
The monitor's count is taken with the statistics engine compiled (Triton) and eager; the
counting itself is checked on the CPU by ``tests/callbacks/test_device_checks.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import device_checks as checks
from torch import Tensor, nn

from lightning_recorder import FeatureDistillation, FeatureStatsMonitor, RecorderManager

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


# ---------------------------------------------------------------------------- helpers
_loader = checks.loader


def _trainer(tmp_path: Path, steps: int, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    accelerator = kwargs.pop("accelerator", "gpu")
    return checks.trainer(tmp_path, accelerator, steps, callbacks, **kwargs)


ConvNet = checks.ConvNet


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


def test_monitor_trains_on_gpu_and_matches_cpu(mode: str, tmp_path: Path) -> None:
    """The GPU run with the engine compiled and eager; the CPU's reference eager."""
    gpu_monitor, gpu_dir = _monitor_run(tmp_path, "gpu")
    with checks.engine_mode("eager", "cpu"):
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
STEPS = checks.SYNC_STEPS


def _sync_run(tmp_path: Path, callbacks: list[pl.Callback], model: pl.LightningModule) -> list:
    return checks.sync_run(tmp_path, CUDA, callbacks, model)


_excess, _report = checks.excess, checks.report


@pytest.fixture(scope="module")
def bare_steps(tmp_path_factory: pytest.TempPathFactory) -> list[list[str]]:
    """The syncs of the plain Trainer, step by step (Lightning's own)."""
    torch.manual_seed(0)
    return _sync_run(tmp_path_factory.mktemp("bare"), [], ConvNet())


def test_monitor_syncs(mode: str, tmp_path: Path, bare_steps: list[list[str]]) -> None:
    """0 added to a non-logging step; 1 to a logging step (histograms, statistics and parameter
    norms come to the host in one copy), with the engine compiled and eager."""
    checks.check_monitor_syncs(tmp_path, CUDA, bare_steps)


def test_monitor_syncs_with_per_channel_extremes(
    tmp_path: Path, bare_steps: list[list[str]]
) -> None:
    """The same with per-channel extremes tracked (HealthMonitor's dead-unit rules): their
    metric is made on the device in the first logging step, not moved there from the host."""
    checks.check_monitor_syncs(tmp_path, CUDA, bare_steps, channels=True)


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
