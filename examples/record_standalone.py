"""Record inside a plain PyTorch training loop (no Lightning): which layers go dead?

Trains a small MLP on scikit-learn's bundled digits for a few epochs. A `RecorderManager`
records every ReLU's output (detached) and the gradient reaching the first layer; after each
epoch the script prints the fraction of dead units per ReLU and the gradient norm.

Run: python examples/record_standalone.py (``--epochs N``: N epochs instead of 5)
"""

from __future__ import annotations

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn

from lightning_recorder import RecorderManager


def main(epochs: int = 5) -> dict[str, float]:
    torch.manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    model = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    manager = RecorderManager(
        {
            "relu": {"type": "ModuleOutputs", "source": nn.ReLU, "detach": True},
            "grad": {"type": "ModuleOutputGrads", "source": "0"},
        }
    )
    manager.initialize(model)
    dead: dict[str, float] = {}
    try:
        print(f"{'epoch':>5} {'loss':>8} {'dead relu 1':>12} {'dead relu 3':>12} {'|grad h1|':>10}")
        for epoch in range(epochs):
            permutation = torch.randperm(len(x))
            for start in range(0, len(x), 128):
                idx = permutation[start : start + 128]
                with manager:  # a fresh buffer each step
                    loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
                    optimizer.zero_grad()
                    loss.backward()
                optimizer.step()
            # The last step's records are still readable after the context.
            relu = manager.get_recorder("relu")
            for name, stream in relu.streams.items():
                activations = stream.get_record_data()
                dead[name] = float((activations.amax(dim=0) == 0).float().mean())
            grad_norm = float(manager.get_recorder("grad").get_record_data().norm())
            print(
                f"{epoch:>5} {loss.item():>8.4f} {dead['1']:>12.3f} {dead['3']:>12.3f} "
                f"{grad_norm:>10.4f}"
            )
    finally:
        manager.release()
    return dead


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=5, help="training epochs (default 5)")
    main(parser.parse_args().epochs)
