"""A two-process tensor-parallel run (CPU, gloo): ``ModelParallelStrategy(1, 2)``.

Usage: ``python tp_script.py OUT_DIR``. The first linear layer is column-parallel with
``use_local_output=False``, so its recorded output is a ``DTensor`` sharded on the last dimension
(each rank holds 8 of the 16 features); the second is row-parallel. Both ranks see the same
batches (one data-parallel replica). Rank 0 writes TensorBoard events under
``OUT_DIR/tp/version_0``; each rank saves the record ``RecorderCallback`` gave it at the last step
to ``OUT_DIR/record{RANK}.pt`` (as the full tensor and as its local shard).
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
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, TensorDataset

from helpers.dist_exit import end_process_group
from lightning_recorder import FeatureStatsMonitor, RecorderCallback

STEPS = 2


def data() -> torch.Tensor:
    return torch.randn(4 * STEPS, 8, generator=torch.Generator().manual_seed(2))


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = net()
        self.seen: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        mesh = self.device_mesh["tensor_parallel"]
        parallelize_module(
            self.net,
            mesh,
            {
                "0": ColwiseParallel(use_local_output=False),
                "1": RowwiseParallel(input_layouts=Shard(-1)),
            },
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self(batch[0])
        record = RecorderCallback.of(self).get_record_data("first")
        self.seen = {"full": record.full_tensor().detach(), "local": record.to_local().detach()}
        return out.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)  # the model stays as built

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(data()), batch_size=4)


def main(out: Path) -> None:
    warnings.filterwarnings("ignore")
    model = Net()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
        max_steps=STEPS,
        callbacks=[
            FeatureStatsMonitor(["net.0"], every_n_steps=1, bins=4),
            RecorderCallback({"first": {"type": "ModuleOutputs", "source": "net.0"}}),
        ],
        logger=TensorBoardLogger(out, name="tp", version=0),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,  # tensor parallel: both ranks take the same batches
    )
    trainer.fit(model)
    torch.save(model.seen, out / f"record{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_process_group()  # before the interpreter exits (helpers/dist_exit.py)
