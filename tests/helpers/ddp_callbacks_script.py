"""A two-process DDP run (CPU, gloo) with FeatureStatsMonitor and RecorderCallback.

Usage: ``python ddp_callbacks_script.py OUT_DIR``. Lightning's DDP launcher starts the second
process. Rank 0 writes TensorBoard events under ``OUT_DIR/ddp/version_0``; each rank saves what
it saw to ``OUT_DIR/rank{RANK}.pt``: its module outputs and gradient norms at logged steps, and
how many times each recorded module fired in each training step.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from helpers.dist_exit import end_process_group
from helpers.models import QUIET, ProbeNet, features
from lightning_recorder import FeatureStatsMonitor, RecorderCallback

PARAMS = ("body.0.weight", "body.2.bias")


def train_data() -> torch.Tensor:
    x = features(32, seed=5)
    x[9, 0] = math.nan  # rank 1, step 1
    x[10, 1] = math.inf  # rank 0, step 1
    x[12] = 0.0
    x[9:16:2] += 3.0  # rank 1 differs from rank 0 in step 1
    return x


def val_data() -> torch.Tensor:
    return features(16, offset=50.0, seed=6) * torch.arange(1, 17).unsqueeze(1)


class DdpNet(ProbeNet):
    """Rank ``r`` takes rows ``r, r + 2, r + 4, …`` in order: step ``k`` covers rows 8k..8k+7."""

    def _loader(self, x: torch.Tensor) -> DataLoader:
        data = TensorDataset(x)
        sampler = DistributedSampler(data, num_replicas=2, rank=self.global_rank, shuffle=False)
        return DataLoader(data, batch_size=4, sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        return self._loader(train_data())

    def val_dataloader(self) -> DataLoader:
        return self._loader(val_data())


class Seen(pl.Callback):
    """Per rank: module outputs and gradient norms at logged steps, calls per module per step."""

    def __init__(self) -> None:
        self.outputs: dict[int, dict[str, torch.Tensor]] = {}
        self.grad_norms: dict[int, dict[str, float]] = {}
        self.calls: list[dict[str, int]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, opt: Any) -> None:
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        named = dict(pl_module.named_parameters())
        self.grad_norms[step] = {n: named[n].grad.norm().item() for n in PARAMS}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        recorder = RecorderCallback.of(trainer).get_recorder("all")
        self.calls.append({name: len(s) for name, s in recorder.streams.items()})
        if (step + 1) % 2 == 0:
            self.outputs[step] = {
                name: s.get_record_data().detach().clone() for name, s in recorder.streams.items()
            }


def main(out_dir: Path) -> None:
    warnings.filterwarnings("ignore")
    seen = Seen()
    callbacks: list[pl.Callback] = [
        FeatureStatsMonitor(["probe", "body.*"], every_n_steps=2, bins=8),
        RecorderCallback({"all": {"type": "ModuleOutputs", "source": "*", "detach": True}}),
        seen,
    ]
    trainer = pl.Trainer(
        **QUIET,
        strategy="ddp",
        devices=2,
        logger=TensorBoardLogger(out_dir, name="ddp", version=0),
        max_epochs=1,
        log_every_n_steps=2,
        num_sanity_val_steps=1,
        use_distributed_sampler=False,
        callbacks=callbacks,
    )
    pl.seed_everything(0, verbose=False)
    trainer.fit(DdpNet())
    result = {"outputs": seen.outputs, "grad_norms": seen.grad_norms, "calls": seen.calls}
    torch.save(result, out_dir / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_process_group()  # before the interpreter exits (helpers/dist_exit.py)
