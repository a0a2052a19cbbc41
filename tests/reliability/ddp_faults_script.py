"""Two CPU processes under DDP with the package's callbacks: uneven last batches, a failing rank.

Usage: ``python ddp_faults_script.py OUT_DIR MODE`` with MODE ``uneven`` (a full run: 10 rows,
each rank gets 5, so its second batch holds one row) or ``fail`` (rank 1 raises in its second
``training_step``; rank 0's gradient all-reduce then fails when rank 1 ends its process group,
at the latest at the process group's timeout). Each rank saves what it saw and what was left
installed to ``OUT_DIR/rank{RANK}.pt``, and the names of its threads at exit to
``OUT_DIR/threads{RANK}.txt``; rank 0 logs to ``OUT_DIR/ddp/version_0/metrics.csv``.
"""

from __future__ import annotations

import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from helpers.dist_exit import end_process_group, record_threads_at_exit
from helpers.models import QUIET, ProbeNet, features
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_recorder import FeatureDistillation, FeatureStatsMonitor, RecorderCallback
from lightning_recorder._core.hooks import live_hooks
from lightning_recorder._core.patching import active_patches


def train_data() -> torch.Tensor:
    return features(10, seed=7)


class Boom(Exception):
    """The injected fault."""


class Net(ProbeNet):
    """Rank ``r`` takes rows ``r, r + 2, …``: batches [r, r+2, r+4, r+6] and [8 + r]."""

    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail = fail

    def train_dataloader(self) -> DataLoader:
        data = TensorDataset(train_data())
        sampler = DistributedSampler(data, num_replicas=2, rank=self.global_rank, shuffle=False)
        return DataLoader(data, batch_size=4, sampler=sampler)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.fail and self.global_rank == 1 and batch_idx == 1:
            raise Boom("rank 1 fails")
        return super().training_step(batch, batch_idx)


class Batches(pl.Callback):
    def __init__(self) -> None:
        self.seen: dict[int, torch.Tensor] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, i: int) -> None:
        self.seen[trainer.global_step] = batch[0].clone()


def hooks_in(*models: nn.Module) -> list[str]:
    left = []
    for model in models:
        for name, module in model.named_modules():
            for kind in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
                if getattr(module, kind):
                    left.append(f"{name}.{kind}")
        for name, param in model.named_parameters():
            if param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None):
                left.append(name)
    return left


def main(out_dir: Path, mode: str) -> None:
    warnings.filterwarnings("ignore")
    torch.manual_seed(1)
    teacher = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    batches = Batches()
    callbacks: list[pl.Callback] = [
        FeatureStatsMonitor(
            "probe", every_n_steps=1, stats=("mean", "min", "max"), histograms=False
        ),
        RecorderCallback({"feat": {"type": "ModuleOutputs", "source": "body.0", "detach": True}}),
        FeatureDistillation(teacher, {"body.0": "0"}),
        batches,
    ]
    trainer = pl.Trainer(
        **QUIET,
        # With a failing rank the other waits in the all-reduce at most until this timeout; it also
        # bounds the start-up rendezvous, so it must cover a slow start of the second process.
        strategy=DDPStrategy(timeout=timedelta(seconds=90 if mode == "fail" else 600)),
        devices=2,
        logger=CSVLogger(out_dir, name="ddp", version=0),
        max_epochs=1,
        log_every_n_steps=1,
        use_distributed_sampler=False,
        callbacks=callbacks,
    )
    pl.seed_everything(0, verbose=False)
    model = Net(fail=mode == "fail")
    status = "ok"
    try:
        trainer.fit(model)
    except BaseException as err:  # recorded for the test
        status = f"{type(err).__name__}: {err}"[:300]
    result = {
        "status": status,
        "live_hooks": live_hooks(),
        "patches": active_patches(),
        "module_hooks": hooks_in(model, teacher),
        "teacher_requires_grad": all(p.requires_grad for p in teacher.parameters()),
        "batches": batches.seen,
    }
    torch.save(result, out_dir / f"rank{trainer.global_rank}.pt")
    record_threads_at_exit(out_dir / f"threads{trainer.global_rank}.txt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
    # before the interpreter exits, after a failed fit too (helpers/dist_exit.py): the rank that
    # failed ends its own process group without waiting for the other
    end_process_group()
