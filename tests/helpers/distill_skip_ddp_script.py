"""FeatureDistillation beside ``HealthMonitor("skip")`` (listed first) under DDP (CPU, gloo), and
the same training in one process on the whole batches.

Usage: ``python distill_skip_ddp_script.py OUT_DIR``. Lightning's DDP launcher starts the second
process. Global batch ``k`` holds rows ``8k..8k+7``: rank ``r`` takes rows ``8k+4r..8k+4r+3``
(one process: all eight); row 14, on rank 1 in batch 1, holds a NaN, so step 1 is skipped.
Each rank saves the student's and the connector's weights after every batch to
``OUT_DIR/rank{RANK}.pt``; :func:`train` run with ``world=1`` returns the same in one process.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers.dist_exit import end_process_group
from helpers.distill_models import Student, Teacher, dataset
from lightning_recorder import FeatureDistillation, HealthMonitor


class Weights(pl.Callback):
    """The student's and the connector's weights after every batch."""

    def __init__(self, distill: FeatureDistillation) -> None:
        self.distill = distill
        self.after: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        weights = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        weights["connector"] = self.distill.connectors["features.2"].weight.detach().clone()
        self.after.append(weights)


class Net(Student):
    def __init__(self, world: int) -> None:
        super().__init__(lr=0.05, optimizer="adam")
        self.world = world

    def train_dataloader(self) -> DataLoader:
        x, y = dataset(32).tensors
        x = x.clone()
        x[14, 0, 0, 0] = math.nan
        if self.world == 1:
            return DataLoader(TensorDataset(x, y), batch_size=8)
        r = self.global_rank
        rows = torch.cat([torch.arange(8 * k + 4 * r, 8 * k + 4 * r + 4) for k in range(4)])
        return DataLoader(TensorDataset(x[rows], y[rows]), batch_size=4)


def train(out_dir: Path, world: int) -> tuple[int, list[dict[str, torch.Tensor]]]:
    """Three steps on ``world`` processes; the rank and its weights after every batch."""
    torch.manual_seed(0)
    teacher = Teacher()
    torch.manual_seed(1)
    connector = nn.Conv2d(6, 12, 1, bias=False)
    distill = FeatureDistillation(
        teacher,
        {"features.2": "features.2", "head": "head"},
        loss={"features.2": "mse", "head": "kl"},
        connectors={"features.2": connector, "head": "identity"},
    )
    weights = Weights(distill)
    monitor = HealthMonitor("skip", evidence_dir=out_dir / "health")
    torch.manual_seed(2)
    model = Net(world)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        max_steps=3,
        callbacks=[monitor, distill, weights],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model)
    return trainer.global_rank, weights.after


def main(out_dir: Path) -> None:
    warnings.filterwarnings("ignore")
    rank, after = train(out_dir, world=2)
    torch.save(after, out_dir / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_process_group()  # before the interpreter exits (helpers/dist_exit.py)
