"""Two-process DDP run of FeatureDistillation on CPU (gloo), launched by test_distill_ddp.py.

Usage: ``python distill_ddp_script.py OUT_DIR``. Lightning starts the second rank by running the
same command again. Each rank saves its student and connector weights, and the connector
gradients of the first step before and after FeatureDistillation averages them, to
``OUT_DIR/rank{RANK}.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy

from helpers.dist_exit import end_process_group
from helpers.distill_models import Student, Teacher, loader
from lightning_recorder import FeatureDistillation


class GradProbe(pl.Callback):
    """Keeps the connector gradient of the first optimizer step."""

    def __init__(self, distill: FeatureDistillation) -> None:
        self.distill = distill
        self.grad: torch.Tensor | None = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, m: Any, optimizer: Any) -> None:
        if self.grad is None:
            self.grad = self.distill.connectors["features.2"].weight.grad.clone()


def main(out_dir: Path) -> None:
    torch.manual_seed(0)
    teacher, student = Teacher(), Student(lr=0.05, optimizer="adam")
    # A different random stream on each rank: the connectors must still start equal.
    torch.manual_seed(int(os.environ.get("LOCAL_RANK", "0")) + 100)
    distill = FeatureDistillation(
        teacher,
        {"features.2": "features.2", "head": "head"},
        loss={"features.2": "mse", "head": "kl"},
    )
    before, after = GradProbe(distill), GradProbe(distill)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=4,
        callbacks=[before, distill, after],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(student, loader(n=64, batch_size=8))
    torch.save(
        {
            "student": {k: v.clone() for k, v in student.state_dict().items()},
            "connector": distill.connectors["features.2"].weight.detach().clone(),
            "local_grad": before.grad,
            "averaged_grad": after.grad,
            "find_unused_parameters": trainer.strategy._ddp_kwargs.get("find_unused_parameters"),
            "patched_after_fit": "training_step" in student.__dict__,
        },
        out_dir / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_process_group()  # before the interpreter exits (helpers/dist_exit.py)
