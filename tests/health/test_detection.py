"""Each rule of HealthMonitor fires on a real training run built to show its problem, by a
known step, and a healthy run fires nothing.

Every run: a Trainer on the CPU, a TensorBoard logger in ``tmp_path``, a
:class:`FeatureStatsMonitor` logging every step and a :class:`HealthMonitor` with the default
rules at their default thresholds. A rule over a window (dead units, saturation: 5 logged steps)
or with patience (update ratio: 3) cannot fire before that many logged steps; the steps below
are the first at which it can.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.health_models import Net, data
from helpers.models import QUIET
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_recorder import (
    FeatureStatsMonitor,
    HealthEvent,
    HealthMonitor,
    HealthRule,
    RuleInput,
)


class Classifier(pl.LightningModule):
    """A classifier around ``body``, trained with plain SGD (or Adam)."""

    def __init__(self, body: nn.Module, lr: float, optimizer: str = "sgd") -> None:
        super().__init__()
        self.body, self.lr, self.optimizer_name = body, lr, optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.body(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loader(n: int = 320, offset: float = 0.0, seed: int = 0) -> DataLoader:
    """16 standard normal features (plus ``offset``: unnormalised data), 4 learnable classes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = x[:, :4].argmax(1)
    return DataLoader(TensorDataset(x + offset, y), batch_size=16, shuffle=False)


class Spy(HealthRule):
    """Says nothing; keeps what each check saw (proof that the rules ran on real input)."""

    name = "spy"

    def __init__(self) -> None:
        self.seen: list[RuleInput] = []

    def check(self, seen: RuleInput) -> list[HealthEvent]:
        self.seen.append(seen)
        return []


def run(
    model: pl.LightningModule,
    tmp_path: Path,
    sources: Sequence[type[nn.Module]],
    steps: int,
    train: DataLoader | None = None,
    spy: Spy | None = None,
) -> HealthMonitor:
    stats = FeatureStatsMonitor(list(sources), every_n_steps=1, histograms=False)
    rules = HealthMonitor.default_rules() + ([spy] if spy is not None else [])
    monitor = HealthMonitor(rules=rules, evidence_max_bytes=0)
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    trainer = pl.Trainer(
        **QUIET, max_steps=steps, logger=logger, callbacks=[stats, monitor], log_every_n_steps=1
    )
    trainer.fit(model, train if train is not None else loader())
    return monitor


def first(events: Sequence[HealthEvent], kind: str) -> HealthEvent:
    found = [e for e in events if e.kind == kind]
    assert found, f"{kind} did not fire; the events were {[(e.kind, e.step) for e in events]}"
    return found[0]


def quiet(events: Sequence[HealthEvent], *kinds: str) -> None:
    loud = [(e.kind, e.module, e.step) for e in events if e.kind in kinds]
    assert not loud, loud


def mlp(activation: type[nn.Module], width: int = 32) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), activation(), nn.Linear(width, 4)
    )


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)


# ---------------------------------------------------------------------------- problems
def test_dying_relu_from_negative_biases(tmp_path: Path) -> None:
    """A bad initialisation: the second hidden layer's biases at -10 keep its ReLU at 0."""
    body = mlp(nn.ReLU)
    nn.init.constant_(body[2].bias, -10.0)
    monitor = run(Classifier(body, lr=0.05), tmp_path, [nn.Linear, nn.ReLU], steps=8)
    event = first(monitor.events, "dead_units")
    assert event.step <= 4  # five logged steps (0-4): the window
    assert (event.module, event.path) == ("body.3", "output")
    assert event.details["count"] == event.details["units"] == 32
    assert "`body.3` (ReLU) has 32 of 32 units dead (100 %)" in event.message
    # the first ReLU is alive, and nothing here saturates, explodes or spikes
    assert [e.module for e in monitor.events if e.kind == "dead_units"] == ["body.3"]
    quiet(monitor.events, "saturation", "exploding_gradients", "loss_spike", "nonfinite")
    # the dead layer starves the weights around it: their updates are zero (a consequence)
    assert {e.module for e in monitor.events if e.kind == "update_ratio"} <= {
        "body.0", "body.2", "body.4",
    }  # fmt: skip


def test_saturated_tanh_from_large_inputs_and_weights(tmp_path: Path) -> None:
    """Unnormalised inputs (an offset of 20) into weights five times the default scale: most
    tanh units sit at ±1 for every input."""
    body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    with torch.no_grad():
        body[0].weight.mul_(5.0)
    monitor = run(Classifier(body, lr=0.05), tmp_path, [nn.Linear, nn.Tanh], 8, loader(offset=20.0))
    event = first(monitor.events, "saturation")
    assert event.step <= 4 and event.module == "body.1"
    assert event.details["fraction"] >= 0.5
    assert "(Tanh) has" in event.message and "beyond ±0.99" in event.message
    quiet(monitor.events, "dead_units", "exploding_gradients", "loss_spike", "nonfinite")


def test_vanishing_gradients_in_a_deep_plain_sigmoid_network(tmp_path: Path) -> None:
    """Twenty Linear + Sigmoid layers initialised small (std 0.1), no normalisation, no skips."""
    layers: list[nn.Module] = []
    for _ in range(20):
        linear = nn.Linear(16, 16)
        nn.init.normal_(linear.weight, std=0.1)
        nn.init.zeros_(linear.bias)
        layers += [linear, nn.Sigmoid()]
    body = nn.Sequential(*layers, nn.Linear(16, 4))
    monitor = run(Classifier(body, lr=0.05), tmp_path, [nn.Linear, nn.Sigmoid], steps=3)
    event = first(monitor.events, "vanishing_gradients")
    assert event.step == 0  # AutoTrainer's rule: on first sight
    assert (event.module, event.path) == ("body.0", "weight")
    assert (event.details["first"], event.details["last"]) == ("body.0.weight", "body.40.weight")
    assert event.details["ratio"] < 1e-10
    quiet(monitor.events, "dead_units", "saturation", "exploding_gradients", "loss_spike")


def test_learning_rate_too_high(tmp_path: Path) -> None:
    """Plain SGD at a learning rate of 10: every layer moves by more than its own norm per
    step, and the loss jumps."""
    body = nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )
    monitor = run(Classifier(body, lr=10.0), tmp_path, [nn.Linear, nn.Tanh], steps=8)
    fast = [e for e in monitor.events if e.kind == "update_ratio"]
    assert fast and all(e.step == 2 for e in fast[:3])  # patience: 3 logged steps (0-2)
    assert {e.module for e in fast if e.step == 2} == {"body.0", "body.2", "body.4"}
    assert all(e.details["side"] == "high" and e.details["ratio"] > 0.1 for e in fast[:3])
    spike = first(monitor.events, "loss_spike")
    assert spike.step <= 5
    assert spike.details["loss"] >= 3 * spike.details["mean"]
    quiet(monitor.events, "dead_units", "nonfinite")


# ---------------------------------------------------------------------------- healthy runs
@pytest.mark.parametrize("arch", ["mlp", "resnet"])
def test_a_healthy_run_fires_nothing(arch: str, tmp_path: Path) -> None:
    """40 steps of a well-initialised MLP (ReLU and Tanh) and of a small ResNet (BatchNorm,
    ReLU(inplace=True), residual blocks) at a sensible learning rate: no rule fires."""
    spy = Spy()
    if arch == "mlp":
        model: pl.LightningModule = Classifier(mlp(nn.Tanh), lr=0.003, optimizer="adam")
        monitor = run(model, tmp_path, [nn.Linear, nn.ReLU, nn.Tanh], steps=40, spy=spy)
        judged = {"body.1", "body.3"}  # the ReLU and the Tanh
    else:
        model = Net("resnet", lr=0.02)
        sources = [nn.Conv2d, nn.ReLU, nn.Linear]
        monitor = run(model, tmp_path, sources, steps=40, train=data("resnet", 160, 8), spy=spy)
        judged = {"body.2", "body.3.relu", "body.4.relu"}
    assert monitor.events == [], [e.message for e in monitor.events]
    assert monitor.counters["rule_events"] == 0 and monitor.findings == {}
    # the rules did look: at every step, with the channels of every activation they judge,
    # the gradients of every layer and every step's loss
    assert [seen.step for seen in spy.seen] == list(range(40))
    for seen in spy.seen:
        assert seen.report is not None and set(seen.report.channels) == judged
        assert all("grad_norm" in f for n, f in seen.report.parameters.items() if "weight" in n)
        assert seen.loss_steps.tolist() == [seen.step]
