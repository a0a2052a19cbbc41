"""Distillation at scale on two CPU processes (gloo): a sharded student and a sharded teacher.

Usage: ``python fsdp_distill_script.py OUT_DIR``. Lightning's launcher starts the second process.
Three fits run one after the other in the same two processes, each with a new student, a new
:class:`FeatureDistillation` and a new ``Trainer(strategy=ModelParallelStrategy(...))``; each
fit trains :data:`STEPS_PER_FIT` epochs of one optimizer step each and saves a checkpoint at the
end of each epoch (the same path, overwritten), so the last one holds the end of the fit:

1. a fresh teacher sharded by the callback (``shard_teacher=True``); the checkpoint is sharded
   (``save_distributed_checkpoint=True``, a directory ``OUT_DIR/ckpt/sharded``);
2. resumed from that directory; a fresh teacher sharded by a policy of the user's own (a
   callable: ``fully_shard`` on the teacher only); the checkpoint is one file with the full
   state dicts (``save_distributed_checkpoint=False``, ``OUT_DIR/ckpt/full.ckpt``);
3. resumed from that file, with the teacher of fit 2, already sharded (used as it is), and
   ``log_validation=True``: validation after every epoch runs the sharded teacher too (not
   Lightning's sanity check, which never runs the teacher).

Rank 0 logs to TensorBoard under ``OUT_DIR/fit{i}/version_0``. Each rank writes
``OUT_DIR/rank{r}.pt``: per fit, the global step at the start and at the end, the connectors'
weights at the end, the connectors' weights before the first optimizer step of fit 1 (their
initial values), and what a forward hook saw on the teacher in every step (grad mode, whether the
outputs carry a graph, the local shard shape of a teacher weight, whether any teacher parameter
got a gradient).

Rank ``r`` reads rows ``r, r + 2, …`` of :func:`data` (its own ``DistributedSampler``, no
shuffling): every step covers the eight rows across the two ranks. With one step per epoch
every step sees the same rows, so the resumed steps' data do not depend on how Lightning resumes
a plain dataloader from a checkpoint saved in ``on_train_epoch_end`` (which its loops count as
the middle of the epoch).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from helpers.dist_exit import end_process_group
from lightning_recorder import FeatureDistillation

LR = 0.1
MOMENTUM = 0.9
STEPS_PER_FIT = 2
FITS = 3
PAIRS = {"body.0": "0", "body.2": "2"}
WEIGHTS = {"body.0": 0.5, "body.2": 0.25}


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def body(width: int = 16, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4))


def teacher() -> nn.Sequential:
    return body(width=32, seed=3)


class Student(pl.LightningModule):
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
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def train_dataloader(self) -> DataLoader:
        dataset = TensorDataset(*data())
        sampler = DistributedSampler(dataset, num_replicas=2, rank=self.global_rank, shuffle=False)
        return DataLoader(dataset, batch_size=4, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()


class TeacherProbe(pl.Callback):
    """What the teacher did in each training step, seen from outside the package."""

    def __init__(self, teacher: nn.Module, distill: FeatureDistillation) -> None:
        self.teacher, self.distill = teacher, distill
        self.calls: list[dict[str, Any]] = []
        self.val_calls: list[dict[str, Any]] = []
        self.validating = False
        self.steps: list[dict[str, Any]] = []
        self.initial: dict[str, torch.Tensor] | None = None
        self.start_step = -1
        for name in ("0", "2"):
            teacher.get_submodule(name).register_forward_hook(self._seen)

    def _seen(self, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        (self.val_calls if self.validating else self.calls).append(
            {
                "grad_enabled": torch.is_grad_enabled(),
                "requires_grad": out.requires_grad,
                "has_graph": out.grad_fn is not None,
            }
        )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_step = trainer.global_step

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.validating = True

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.validating = False

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, opt: Any) -> None:
        if self.initial is None:
            self.initial = {
                k: v.detach().clone()
                for k, v in self.distill.connectors["body.0"].state_dict().items()
            }

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        weight = self.teacher.get_submodule("0").weight
        self.steps.append(
            {
                "calls": self.calls,
                "dtensor": isinstance(weight, DTensor),
                "local_shape": list(weight.to_local().shape) if isinstance(weight, DTensor) else [],
                "any_grad": any(p.grad is not None for p in self.teacher.parameters()),
                "any_requires_grad": any(p.requires_grad for p in self.teacher.parameters()),
            }
        )
        self.calls = []


def root_only(module: nn.Module, mesh: Any) -> None:
    """A sharding policy of the user's own: one FSDP unit for the whole teacher."""
    fully_shard(module, mesh=mesh)


def fit(out: Path, index: int, net_teacher: nn.Module, shard: Any, resume: Path | None) -> dict:
    last = index == FITS - 1  # the last fit also distils on validation batches
    distill = FeatureDistillation(
        net_teacher, PAIRS, loss="mse", weight=WEIGHTS, shard_teacher=shard, log_validation=last
    )
    probe = TeacherProbe(net_teacher, distill)
    sharded = index == 0
    callbacks: list[pl.Callback] = [distill, probe]
    if not last:  # saved at the end of every epoch; the last one stays
        name = "sharded" if sharded else "full"
        checkpoint = ModelCheckpoint(out / "ckpt", name, enable_version_counter=False)
        checkpoint.FILE_EXTENSION = "" if sharded else ".ckpt"  # a directory, or one file
        callbacks.append(checkpoint)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=sharded
        ),
        max_steps=STEPS_PER_FIT * (index + 1),
        callbacks=callbacks,
        enable_checkpointing=not last,
        limit_val_batches=1.0 if last else 0,
        num_sanity_val_steps=2 if last else 0,
        logger=TensorBoardLogger(out, name=f"fit{index}", version=0),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(Student(), ckpt_path=resume)
    return {
        "start_step": probe.start_step,
        "end_step": trainer.global_step,
        "connectors": {
            pair: {k: v.detach().clone() for k, v in module.state_dict().items()}
            for pair, module in distill.connectors.items()
        },
        "initial": probe.initial,
        "steps": probe.steps,
        "val_calls": probe.val_calls,
        "rank": trainer.global_rank,
    }


def main(out: Path) -> None:
    warnings.filterwarnings("ignore")
    second = teacher()
    runs = [
        fit(out, 0, teacher(), True, None),
        fit(out, 1, second, root_only, out / "ckpt" / "sharded"),
        fit(out, 2, second, False, out / "ckpt" / "full.ckpt"),
    ]
    torch.save(runs, out / f"rank{runs[0]['rank']}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_process_group()  # before the interpreter exits (helpers/dist_exit.py)
