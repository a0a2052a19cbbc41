"""Distil a CNN teacher into a smaller student on scikit-learn's bundled digits (8x8 images).

1. Train a teacher CNN.
2. Train a smaller student twice, with the same seed, data and epochs: once plainly, once with
   ``FeatureDistillation`` (FitNets-style MSE on the last feature map through a learned 1x1
   connector, plus Hinton's KL on the logits).
3. Print the three test accuracies.

Runs on a laptop CPU in well under a minute; the data ships with scikit-learn.

    python examples/distill_digits.py
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_recorder import FeatureDistillation, KLDivLoss


class Classifier(pl.LightningModule):
    """A CNN: ``body`` (feature maps, N x C x 4 x 4) then ``head`` (logits)."""

    def __init__(self, width: int, lr: float = 3e-3) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * width * 16, 10)
        self.lr = lr

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x).flatten(1))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_acc", (self(x).argmax(1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def digits(train_size: int | None, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The digits as (N, 1, 8, 8) floats in [0, 1]; a stratified 30 % test split."""
    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.3, random_state=seed, stratify=labels
    )
    if train_size is not None:
        x_train, y_train = x_train[:train_size], y_train[:train_size]

    def to_tensors(x: Any, y: Any) -> TensorDataset:
        x_t = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
        return TensorDataset(x_t, torch.tensor(y, dtype=torch.long))

    return to_tensors(x_train, y_train), to_tensors(x_test, y_test)


def train(
    model: Classifier,
    train_set: TensorDataset,
    epochs: int,
    seed: int,
    callbacks: list[pl.Callback] | None = None,
) -> None:
    pl.seed_everything(seed, verbose=False)
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks or [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(train_set, batch_size=64, shuffle=True))


def accuracy(model: Classifier, test_set: TensorDataset) -> float:
    model.eval()
    x, y = test_set.tensors
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def main(
    teacher_epochs: int = 15,
    student_epochs: int = 15,
    train_size: int | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Train teacher, plain student and distilled student; return their test accuracies."""
    train_set, test_set = digits(train_size, seed)
    start = time.perf_counter()

    pl.seed_everything(seed, verbose=False)
    teacher = Classifier(width=32)
    train(teacher, train_set, teacher_epochs, seed)

    pl.seed_everything(seed, verbose=False)
    plain = Classifier(width=4)
    distilled = Classifier(width=4)
    distilled.load_state_dict(plain.state_dict())  # the same initial student
    train(plain, train_set, student_epochs, seed)
    distill = FeatureDistillation(
        teacher,
        {"body": "body", "head": "head"},  # (N, 8, 4, 4) -> (N, 64, 4, 4) and logits
        loss={"body": "mse", "head": KLDivLoss(temperature=4.0)},
    )
    train(distilled, train_set, student_epochs, seed, callbacks=[distill])

    results = {
        "teacher": accuracy(teacher, test_set),
        "student": accuracy(plain, test_set),
        "student + FeatureDistillation": accuracy(distilled, test_set),
    }
    seconds = time.perf_counter() - start
    n_params = {
        "teacher": sum(p.numel() for p in teacher.parameters()),
        "student": sum(p.numel() for p in plain.parameters()),
    }
    print(f"\ndigits: {len(train_set)} training images, {len(test_set)} test images")
    print(f"teacher {n_params['teacher']:,} parameters, student {n_params['student']:,}")
    print(f"{'model':<32}{'test accuracy':>14}")
    for name, value in results.items():
        print(f"{name:<32}{value:>14.4f}")
    print(f"({seconds:.1f} s)")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--teacher-epochs", type=int, default=15)
    parser.add_argument("--student-epochs", type=int, default=15)
    parser.add_argument("--train-size", type=int, default=0, help="0: the whole training split")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(args.teacher_epochs, args.student_epochs, args.train_size or None, args.seed)
