"""Two DDP processes (CPU, gloo) tracking the channels of a module that only rank 1 calls.

Usage: ``python ddp_channels_script.py OUT_DIR``. Every rank saves the outputs of ``probe`` and
``gate`` it made in each step to ``OUT_DIR/rank{RANK}.pt``; rank 0 adds the channel extremes of
the monitor's reports.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from helpers.dist_exit import end_process_group
from helpers.models import QUIET, features
from lightning_recorder import FeatureStatsMonitor


class GatedNet(pl.LightningModule):
    """``probe`` on every rank; ``gate`` (a Tanh, no parameters) on rank 1 only."""

    def __init__(self) -> None:
        super().__init__()
        self.probe = nn.Identity()
        self.gate = nn.Tanh()
        self.head = nn.Linear(4, 2)
        self.seen: list[dict[str, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.probe(x)
        outputs = {"probe": h.detach().clone()}
        if self.global_rank == 1:
            h = self.gate(h)
            outputs["gate"] = h.detach().clone()
        self.seen.append(outputs)
        return self.head(h)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).square().mean()

    def train_dataloader(self) -> DataLoader:
        data = TensorDataset(features(16, seed=3) * 2.0)
        sampler = DistributedSampler(data, num_replicas=2, rank=self.global_rank, shuffle=False)
        return DataLoader(data, batch_size=4, sampler=sampler)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def track(name: str, module: nn.Module) -> bool:
    return name == "gate"  # one tracked module: its channel count alone crosses the ranks


def main(out_dir: Path) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    reports: list[Any] = []
    monitor = FeatureStatsMonitor(["probe", "gate"], every_n_steps=1, histograms=False)
    monitor.subscribe(reports.append)
    monitor.track_channels(track)
    trainer = pl.Trainer(
        **QUIET,
        strategy="ddp",
        devices=2,
        logger=CSVLogger(out_dir, name="csv", version=0),
        max_steps=2,
        use_distributed_sampler=False,
        callbacks=[monitor],
    )
    model = GatedNet()
    trainer.fit(model)
    channels = [{k: v.copy() for k, v in r.channels.items()} for r in reports]
    result = {"seen": model.seen, "channels": channels}
    torch.save(result, out_dir / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1]))
    finally:
        end_process_group()  # before the interpreter exits (helpers/dist_exit.py)
