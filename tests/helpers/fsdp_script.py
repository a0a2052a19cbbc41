"""A two-process FSDP2 run (CPU, gloo): ``ModelParallelStrategy`` with ``fully_shard``.

Usage: ``python fsdp_script.py OUT_DIR``. Lightning's launcher starts the second process. Rank 0
writes TensorBoard events under ``OUT_DIR/fsdp/version_0`` with :class:`FeatureStatsMonitor`
(outputs, parameter norms, gradient norms, update ratios) and, with ``--distill``, the terms of a
:class:`FeatureDistillation` whose student is sharded.

Rank ``r`` reads rows ``r, r + 2, …`` (its own ``DistributedSampler``, no shuffling), so step
``k`` covers rows ``8k .. 8k + 7`` of :func:`data` across the two ranks: the test recomputes every
logged value with the same model unsharded on those rows.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from helpers.dist_exit import end_process_group
from lightning_recorder import FeatureDistillation, FeatureStatsMonitor

LR = 0.1
STEPS = 2
MONITORED = ("body.0", "body.2")


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8 * STEPS, 8, generator=g), torch.randn(8 * STEPS, 4, generator=g)


def body(width: int = 16, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4))


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = body()

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.body:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.body, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self) -> DataLoader:
        dataset = TensorDataset(*data())
        sampler = DistributedSampler(dataset, num_replicas=2, rank=self.global_rank, shuffle=False)
        return DataLoader(dataset, batch_size=4, sampler=sampler)


def main(out: Path, distill: bool) -> None:
    warnings.filterwarnings("ignore")
    callbacks: list[pl.Callback] = [
        FeatureStatsMonitor(list(MONITORED), every_n_steps=1, parameters=True, histograms=False)
    ]
    if distill:
        teacher = body(width=32, seed=3)
        callbacks.append(
            FeatureDistillation(teacher, pairs={"body.2": "2"}, loss="mse", weight=0.5)
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=STEPS,
        callbacks=callbacks,
        logger=TensorBoardLogger(out, name="fsdp", version=0),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
    )
    trainer.fit(Net())
    (out / f"done{trainer.global_rank}").write_text("ok")


if __name__ == "__main__":
    main(Path(sys.argv[1]), "--distill" in sys.argv[2:])
    end_process_group()  # before the interpreter exits (helpers/dist_exit.py)
