"""Two tensor-parallel processes (CPU, gloo) with ``HealthMonitor(localize="always")``.

Usage: ``python tp_health_script.py OUT_DIR POLICY RANK`` (``HealthMonitor``'s
``on_nonfinite``; the rank whose shard gets the NaN).
The model of :mod:`helpers.tp_script`: ``net.0`` column-parallel with ``use_local_output=False``
(its output a ``DTensor`` sharded on the features, 8 of 16 on each rank), ``net.1`` row-parallel.
At batch 1, ``net.0`` puts one NaN in its output at ``[0, 0]`` of ``RANK``'s shard; the
row-parallel ``net.1`` then spreads it to both ranks (its output's all-reduce). Each rank saves
its events to ``OUT_DIR/rank{RANK}.pt``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from helpers.dist_exit import end_process_group
from helpers.tp_script import data
from lightning_recorder import HealthMonitor


class Poisoned(nn.Linear):
    """A linear layer whose output gets one NaN, in ``rank``'s shard, while ``poison`` is set."""

    poison = False
    rank = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.poison:
            assert isinstance(out, DTensor)
            local = out.to_local().clone()
            if out.device_mesh.get_local_rank() == self.rank:
                local[0, 0] = float("nan")
            out = DTensor.from_local(local, out.device_mesh, out.placements)
        return out


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(Poisoned(8, 16), nn.Linear(16, 4))

    def configure_model(self) -> None:
        parallelize_module(
            self.net,
            self.device_mesh["tensor_parallel"],
            {
                "0": ColwiseParallel(use_local_output=False),
                "1": RowwiseParallel(input_layouts=Shard(-1)),
            },
        )

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.net[0].poison = batch_idx == 1
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(data()), batch_size=2)


def main(out: Path, policy: str, rank: int) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    monitor = HealthMonitor(policy, localize="always", evidence_dir=out / "health")  # type: ignore[arg-type]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
        max_steps=2,
        callbacks=[monitor],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,  # tensor parallel: both ranks take the same batches
    )
    model = Net()
    model.net[0].rank = rank
    trainer.fit(model)
    torch.save([e.to_dict() for e in monitor.events], out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
    end_process_group()  # before the interpreter exits (helpers/dist_exit.py)
