"""A two-process DDP predict run (CPU, gloo) with ActivationWriter.

Usage: ``python ddp_activations_script.py OUT_DIR``. Lightning's DDP launcher starts the second
process; each rank writes its own shards under ``OUT_DIR/acts``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from helpers.dist_exit import end_process_group
from lightning_recorder.callbacks.activation_writer import ActivationWriter

N = 21  # odd: the ranks get 11 and 10 samples, none repeated


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.body(batch[0])


def data() -> torch.Tensor:
    return torch.randn(N, 5, generator=torch.Generator().manual_seed(3))


def main(out_dir: Path) -> None:
    warnings.filterwarnings("ignore")
    writer = ActivationWriter(["body.1", "body.2"], out_dir / "acts", max_shard_bytes=200)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        callbacks=[writer],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    loader = DataLoader(TensorDataset(data()), batch_size=4)
    trainer.predict(Net(), loader, return_predictions=False)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_process_group()  # before the interpreter exits (helpers/dist_exit.py)
