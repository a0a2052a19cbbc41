"""A two-process DDP run (CPU, gloo) of FeatureStatsMonitor where the ranks hold unequal numbers
of rows: in every training step and in both validation dataloaders.

Usage: ``python ddp_uneven_stats_script.py OUT_DIR``. Lightning's DDP launcher starts the second
process. Each rank reads its own rows (:func:`train_rows`, :func:`val_rows`) in order; rank 0
writes TensorBoard events under ``OUT_DIR/ddp/version_0``.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from helpers.dist_exit import end_process_group
from helpers.models import QUIET, ProbeNet, features

BINS = 8


def train_rows(rank: int) -> torch.Tensor:
    """Rank 0: 6 rows (batches of 4 and 2), rank 1: 5 rows (4 and 1), on other scales; NaN,
    inf and zeros on both."""
    x = features(11, seed=5)
    x[1, 0] = math.nan
    x[7, 2] = math.inf
    x[9] = 0.0
    x[5, :2] = 0.0
    x[6:] = 3.0 * x[6:] + 2.0
    return x[:6] if rank == 0 else x[6:]


def val_rows(loader: int, rank: int) -> torch.Tensor:
    """Loader 0: 9 rows on rank 0 (three batches), 4 on rank 1 (one); loader 1: 2 and 11."""
    x = features(13, offset=10.0 * (loader + 1), seed=7 + loader)
    x[3, 1] = -math.inf
    cut = 9 if loader == 0 else 2
    return x[:cut] if rank == 0 else x[cut:]


class Net(ProbeNet):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(train_rows(self.global_rank)), batch_size=4)

    def val_dataloader(self) -> list[DataLoader]:
        return [
            DataLoader(TensorDataset(val_rows(k, self.global_rank)), batch_size=4) for k in (0, 1)
        ]

    def validation_step(
        self, batch: list[torch.Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self(batch[0])


def main(out_dir: Path) -> None:
    warnings.filterwarnings("ignore")
    from lightning_recorder import FeatureStatsMonitor

    trainer = pl.Trainer(
        **QUIET,
        strategy="ddp",
        devices=2,
        logger=TensorBoardLogger(out_dir, name="ddp", version=0),
        max_epochs=1,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        callbacks=[FeatureStatsMonitor("probe", every_n_steps=1, bins=BINS)],
    )
    trainer.fit(Net())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_process_group()  # before the interpreter exits (helpers/dist_exit.py)
