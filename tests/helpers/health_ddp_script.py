"""Two DDP processes (CPU, gloo) with ``HealthMonitor("skip")``; only rank 1's batch is bad.
A rule that records its checks shows where the rules run.

Usage: ``python health_ddp_script.py OUT_DIR [LOCALIZE [POLICY [full-disk]]]``
(``HealthMonitor``'s ``localize``, ``"replay"`` by default, and ``on_nonfinite``, ``"skip"``;
``full-disk``: ``evidence_checkpoint=True`` on a disk that fills up while rank zero writes it).
Lightning's DDP launcher starts the second process. Rank ``r`` takes samples ``r, r + 2, …`` in
order (its own ``DistributedSampler``), so that batch 1 of rank 1 alone carries :class:`Trap`'s
marker. Each rank saves its events and its parameters after every batch to
``OUT_DIR/rank{RANK}.pt``, and the names of its threads at exit to ``OUT_DIR/threads{RANK}.txt``.
"""

from __future__ import annotations

import errno
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.fabric.plugins.io.torch_io as torch_io
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from helpers.dist_exit import end_process_group, record_threads_at_exit
from helpers.health_models import Net, data
from helpers.models import QUIET
from lightning_recorder import HealthEvent, HealthMonitor, HealthRule, RuleInput

BATCH = 4


class DdpNet(Net):
    def __init__(self) -> None:
        super().__init__("trapped")

    def train_dataloader(self) -> DataLoader:
        # global batch k holds samples 8k..8k+7; rank 1's batch 1 holds 9, 11, 13, 15
        x, y = data("trapped", 32, batch_size=1).dataset.tensors  # type: ignore[attr-defined]
        x = x.clone()
        x[9] = 1000.0  # the marker: rank 1, batch 1
        dataset = TensorDataset(x, y)
        sampler = DistributedSampler(dataset, num_replicas=2, rank=self.global_rank, shuffle=False)
        return DataLoader(dataset, batch_size=BATCH, sampler=sampler)


class Checks(HealthRule):
    """Keeps the steps it was checked at; finds something on ``body.1`` at step 0."""

    name = "checks"
    needs_statistics = False

    def __init__(self) -> None:
        self.steps: list[int] = []

    def check(self, seen: RuleInput) -> list[HealthEvent]:
        self.steps.append(seen.step)
        return [self.event(seen, "body.1", "checked")] if seen.step == 0 else []


class Params(pl.Callback):
    def __init__(self) -> None:
        self.after: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self.after.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})


def _full_disk(checkpoint: dict[str, Any], filepath: Any) -> None:
    """Lightning's write of a checkpoint file on a disk that fills up once a part is written."""
    Path(filepath).write_bytes(b"\0" * 64)
    raise OSError(errno.ENOSPC, "No space left on device", str(filepath))


def main(out_dir: Path, localize: str = "replay", policy: str = "skip", disk: str = "") -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if disk == "full-disk":
        torch_io._atomic_save = _full_disk  # type: ignore[assignment]
    checks = Checks()  # the rules run on global rank zero only
    monitor = HealthMonitor(
        policy,  # type: ignore[arg-type]
        localize=False if localize == "False" else localize,  # type: ignore[arg-type]
        rules=[checks],
        evidence_dir=out_dir / "health",
        evidence_checkpoint=disk == "full-disk",
    )
    params = Params()
    trainer = pl.Trainer(
        **QUIET,
        strategy="ddp",
        devices=2,
        logger=False,
        max_steps=3,
        log_every_n_steps=1,
        use_distributed_sampler=False,
        callbacks=[monitor, params],
    )
    pl.seed_everything(0, verbose=False)
    trainer.fit(DdpNet())
    result = {
        "events": [e.to_dict() for e in monitor.events],
        "params": params.after,
        "checks": checks.steps,
    }
    torch.save(result, out_dir / f"rank{trainer.global_rank}.pt")
    record_threads_at_exit(out_dir / f"threads{trainer.global_rank}.txt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
    end_process_group()  # before the interpreter exits (helpers/dist_exit.py)
