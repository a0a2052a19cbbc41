"""Write a digits CNN's penultimate-layer activations during predict, then fit a linear probe.

1. Train a small CNN on scikit-learn's bundled digits (8x8 images) for a few epochs.
2. Run ``trainer.predict`` over every image with ``ActivationWriter`` recording the penultimate
   layer (the ReLU after the hidden linear layer): sharded safetensors files and their index
   land in ``--out`` (default: a temporary directory, removed at the end).
3. Read them back with ``ActivationDataset``, line the rows up with the labels by their sample
   index, fit scikit-learn's logistic regression on the training images' activations and print
   its accuracy on the held-out ones.

Runs on a laptop CPU in well under a minute; the data ships with scikit-learn.

    python examples/activation_dataset.py --out activations/
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import train_test_split
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_recorder.activations import ActivationDataset
from lightning_recorder.callbacks.activation_writer import ActivationWriter


class DigitsCNN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten()
        )
        self.hidden = nn.Sequential(nn.Linear(16 * 16, 64), nn.ReLU())  # "hidden.1": penultimate
        self.head = nn.Linear(64, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.hidden(self.features(x)))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def main(epochs: int, out: str | None) -> float:
    """Train, write the activations into ``out`` (``None``: a temporary directory, removed at
    the end), fit the probe; return its test accuracy."""
    with contextlib.ExitStack() as stack:
        directory = out
        if directory is None:
            directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="activations_"))
        accuracy = _run(epochs, directory)
    if out is None:
        print("(a temporary directory, now removed: keep the activations with --out DIR)")
    return accuracy


def _run(epochs: int, directory: str) -> float:
    start = time.perf_counter()
    pl.seed_everything(0)
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    train_idx, test_idx = train_test_split(
        list(range(len(labels))), test_size=0.3, random_state=0, stratify=digits.target
    )
    quiet: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
    }
    model = DigitsCNN()
    train = TensorDataset(images[train_idx], labels[train_idx])
    pl.Trainer(**quiet, max_epochs=epochs).fit(model, DataLoader(train, 64, shuffle=True))

    writer = ActivationWriter({"penultimate": "hidden.1"}, directory, max_shard_bytes=64 << 10)
    everything = DataLoader(TensorDataset(images), batch_size=128)  # sample index = image index
    pl.Trainer(**quiet, callbacks=[writer]).predict(model, everything, return_predictions=False)

    dataset = ActivationDataset(directory, "penultimate", stages="predict", runs=writer.run)
    features = dataset.concat().numpy()  # rows in sample-index order: row i is image i
    assert dataset.sample_indices.tolist() == list(range(len(labels)))
    probe = LogisticRegression(max_iter=2000)
    probe.fit(features[train_idx], digits.target[train_idx])
    accuracy = float(probe.score(features[test_idx], digits.target[test_idx]))
    print(
        f"wrote {len(dataset)} rows of {features.shape[1]} activations in "
        f"{writer.writer.shards_written} shards to {directory}"
    )
    print(f"linear probe on the penultimate layer: test accuracy {accuracy:.3f}")
    print(f"done in {time.perf_counter() - start:.1f} s")
    return accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3, help="training epochs of the CNN")
    parser.add_argument(
        "--out",
        default=None,
        help="directory for the activation dataset (default: a temporary one)",
    )
    args = parser.parse_args()
    main(args.epochs, args.out)
