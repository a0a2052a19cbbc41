"""Find the sick layers of a network at a glance: HealthMonitor's rules and its view in TensorBoard.

Trains a small network on scikit-learn's bundled 8x8 digits (no download) with two callbacks,
:class:`~lightning_recorder.FeatureStatsMonitor` (the statistics) and
:class:`~lightning_recorder.HealthMonitor` (the rules on them, and the health view). Two of its
three branches are sick on purpose: ``dead`` is a ReLU layer whose biases start far below zero,
so that none of its units ever fires, and ``saturated`` a tanh layer whose biases start at +5, so
that its units sit at +1, where tanh is flat and passes almost no gradient. The third, ``healthy``,
learns the digits on its own. The rules name both sick layers; the script prints what they
found. The logs go to the directory given with ``--out`` (each run in its own ``version_N``
folder), to look at in TensorBoard::

    python examples/health_view.py --out lightning_logs
    tensorboard --logdir lightning_logs

and open the Custom Scalars tab (one chart per statistic, every layer on it), the Images tab
(the layer-by-step heat maps) and the Text tab (the findings). Without ``--out`` the logs go to
a temporary directory, removed at the end. Other options: ``--max-epochs``, ``--every-n-steps``.
Needs ``pip install "lightning-recorder[examples]"``.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_recorder import FeatureStatsMonitor, HealthEvent, HealthMonitor

SOURCES = ["trunk.*", "healthy.*", "dead.*", "saturated.*", "head"]


class SickNet(pl.LightningModule):
    """A shared first layer, three branches side by side (one healthy, one dead, one saturated),
    and a classifier over the three."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.trunk = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
        self.healthy = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
        self.dead = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
        self.saturated = nn.Sequential(nn.Linear(64, 32), nn.Tanh())
        self.head = nn.Linear(96, 10)
        with torch.no_grad():
            self.dead[0].bias.fill_(-20.0)  # every unit starts (and stays) below zero
            self.saturated[0].bias.fill_(5.0)  # every unit starts (and stays) near +1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x.flatten(1))
        return self.head(torch.cat([self.healthy(h), self.dead(h), self.saturated(h)], dim=1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(dim=1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def digits_loaders(batch_size: int = 32, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """Train and validation loaders over scikit-learn's digits (80 % / 20 %, pixels in [0, 1])."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    train, val = order[:cut], order[cut:]
    return (
        DataLoader(TensorDataset(x[train], y[train]), batch_size=batch_size, shuffle=True),
        DataLoader(TensorDataset(x[val], y[val]), batch_size=512),
    )


def train(out: str | Path, max_epochs: int, every_n_steps: int) -> tuple[Path, HealthMonitor]:
    """Fit :class:`SickNet` with both monitors, logging to ``out/version_N``; return that run's
    directory and the health monitor."""
    pl.seed_everything(0)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    train_loader, val_loader = digits_loaders()
    logger = TensorBoardLogger(out, name="")
    # Every Linear, ReLU and Tanh: the heat maps show them in model order.
    stats = FeatureStatsMonitor(SOURCES, every_n_steps=every_n_steps)
    health = HealthMonitor(view_every=5)
    trainer = pl.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        logger=logger,
        callbacks=[stats, health],
        log_every_n_steps=every_n_steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(SickNet(), train_loader, val_loader)
    return Path(logger.log_dir), health


def describe(event: HealthEvent) -> str:
    """One finding in one line: step, rule, module, message."""
    return f"step {event.step:>4}  {event.kind:<20} {event.module or '-':<12} {event.message}"


def main(argv: Sequence[str] | None = None) -> list[HealthEvent]:
    """Train and print the findings; return them (see ``--help``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        default=None,
        help="directory for the TensorBoard logs, kept (default: a temporary one, removed)",
    )
    parser.add_argument("--max-epochs", type=int, default=4)
    parser.add_argument("--every-n-steps", type=int, default=5)
    args = parser.parse_args(argv)

    with contextlib.ExitStack() as stack:
        out = args.out or stack.enter_context(tempfile.TemporaryDirectory(prefix="health_view_"))
        log_dir, health = train(out, args.max_epochs, args.every_n_steps)
        print(f"\n{len(health.events)} rule finding(s) fired; in force at the end:")
        for event in health.findings.values():
            print(describe(event))
        if args.out:
            print(f"\nTensorBoard logs: {log_dir}")
            print(f"View them with:   tensorboard --logdir {args.out}")
            print("(tabs Custom Scalars, Images and Text)")
        else:
            print("\nTensorBoard logs in a temporary directory, removed at the end: keep them")
            print("with --out DIR, then view them with: tensorboard --logdir DIR")
    return list(health.events)


if __name__ == "__main__":
    main()
