"""Tiny teacher and student networks shared by the distillation tests and the DDP script."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

N_CLASSES = 3


def jitter(x: Tensor) -> Tensor:
    """A random augmentation: what deliveries make the teacher and the student share."""
    return x + 0.1 * torch.randn_like(x)


class Teacher(nn.Module):
    """features.0: (N, 8, 8, 8); features.2: (N, 12, 8, 8); head: (N, 3)."""

    def __init__(self, use_jitter: bool = False) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 12, 3, padding=1), nn.ReLU()
        )
        self.head = nn.Linear(12, N_CLASSES)
        self.use_jitter = use_jitter
        self.calls = 0
        self.last_input: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.use_jitter:
            x = jitter(x)
        self.last_input = x
        return self.head(self.features(x).mean(dim=(2, 3)))


class Student(pl.LightningModule):
    """features.0: (N, 4, 8, 8); features.2: (N, 6, 8, 8); head: (N, 3)."""

    def __init__(
        self,
        lr: float = 0.05,
        optimizer: str = "sgd",
        use_jitter: bool = False,
        step_lr: bool = False,
    ) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, padding=1), nn.ReLU()
        )
        self.head = nn.Linear(6, N_CLASSES)
        self.lr = lr
        self.optimizer_name = optimizer
        self.use_jitter = use_jitter
        self.step_lr = step_lr
        self.task_losses: list[float] = []
        self.last_input: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.use_jitter:
            x = jitter(x)
        self.last_input = x
        return self.head(self.features(x).mean(dim=(2, 3)))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.task_losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adam":
            optimizer: torch.optim.Optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.step_lr:
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
            }
        return optimizer


def dataset(n: int = 32, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, N_CLASSES, (n,), generator=g)
    )


def loader(n: int = 32, batch_size: int = 8, seed: int = 0) -> DataLoader:
    return DataLoader(dataset(n, seed), batch_size=batch_size, shuffle=False)


def trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    kwargs.update(overrides)
    return kwargs
